"""A seeded evaluation set with ground truth: multi-passage questions about invented entities.

No model can know the answers in advance: people, towns and ships are named from seeded
syllables, and years are drawn at random. Each passage states a few facts among neutral
filler sentences (padded to a chosen length), so the evidence lands at many offsets of a
merged cache. Questions need one passage (a person's home town, birth year) or two: a
person's ship is named in one passage and the town that built it in another.

The passages are what a cache-reuse system would store as fragments; a question is read
behind them. :func:`prompt_parts` wraps both in the model's chat template and splits the
rendered text at the passage boundaries, so the merged fragments plus the probe are, token
for token, the joined prompt a re-prefill reads. :func:`answer_span` and
:func:`exact_match` score only the answer, not the template's format tokens.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

from kvlab.errors import EvalSetError

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "gl"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ou", "ei"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "k"]
_TOWN_ENDS = ["holm", "vik", "mar", "dun", "stad", "wick", "ford", "by"]

#: Sentences that carry no fact about any entity; passages are padded with them.
FILLER = [
    "The weather that season was mild, with long evenings and little rain.",
    "Records from the period are incomplete, and some pages were lost to damp.",
    "The road along the coast was widened twice during those years.",
    "Most households kept a small garden behind the house.",
    "Travellers often remarked on the quiet of the main square in the early morning.",
    "Prices at the weekly market rose slowly but steadily.",
    "A new schoolhouse was built near the church, with room for forty pupils.",
    "Winters were long, and the harbour sometimes froze at its edges.",
    "The local newspaper appeared every Thursday and cost very little.",
    "Letters took about a week to reach the capital.",
    "Fishing remained the most common trade along the shore.",
    "The old bridge was repaired with stone from a nearby quarry.",
    "Many of the streets were still unpaved, and carts left deep ruts in spring.",
    "A small library opened in a room above the post office.",
    "Local musicians played at weddings and at the autumn fair.",
    "The council met on the first Monday of each month.",
    "Several families moved inland after a series of poor harvests.",
    "The lighthouse keeper wrote down the wind and the tide every six hours.",
    "Children walked to school along the river path in all weathers.",
    "Timber was floated down the river each spring to the sawmill.",
    "The bakery on the corner opened before dawn every day except Sunday.",
    "Visitors arrived mostly in summer, when the ferry ran twice a day.",
    "A telegraph line reached the district late in the century.",
    "The parish kept careful lists of births, marriages and deaths.",
]


@dataclass(frozen=True)
class Question:
    """One question with its ground truth.

    Attributes
    ----------
    text : str
        The question sentence.
    answer : str
        The short true answer (a name or a number).
    passages : tuple of int
        Indices of the passages needed, in the order the reasoning uses them.
    kind : str
        ``"town"`` or ``"year"`` (one passage) or ``"ship_town"`` (two passages).
    subject : str
        The person asked about.
    lead : str
        The start of the answer sentence, put at the head of the assistant's turn so that a
        small model's next words are the answer itself, not a preamble about it.
    """

    text: str
    answer: str
    passages: tuple[int, ...]
    kind: str
    subject: str
    lead: str

    @property
    def hops(self) -> int:
        return len(self.passages)


@dataclass(frozen=True)
class EvalSet:
    """Passages (the fragments to cache) and the questions over them."""

    passages: list[str]
    questions: list[Question]
    seed: int
    facts: dict = field(default_factory=dict, repr=False)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    ).capitalize()


class Names:
    """Unique invented names (no name is a prefix-free duplicate of another)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def _fresh(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name.lower() not in self.used:
                self.used.add(name.lower())
                return name
        raise EvalSetError("ran out of unique invented names; ask for fewer entities")

    def person(self) -> str:
        return self._fresh(lambda: f"{_word(self.rng, 2)} {_word(self.rng, 2)}")

    def town(self) -> str:
        return self._fresh(lambda: _word(self.rng, 1) + self.rng.choice(_TOWN_ENDS))

    def ship(self) -> str:
        return self._fresh(lambda: _word(self.rng, 3))


def _word_count(text: str) -> int:
    # Without a tokenizer, about 4 tokens for every 3 words of English-like text.
    return round(len(text.split()) * 4 / 3)


def generate_evalset(
    seed: int = 0,
    n_passages: int = 4,
    passage_tokens: int = 128,
    people_per_passage: int = 2,
    count_tokens: Callable[[str], int] | None = None,
) -> EvalSet:
    """Build a seeded set of passages and questions.

    Each passage introduces ``people_per_passage`` people: where each lives and the year of
    birth (asked with one passage), and the ship each owns. The town where that ship was
    built is stated in another passage (asked with two). Filler sentences pad every
    passage up to ``passage_tokens`` (never beyond it, unless its facts alone are longer).

    Parameters
    ----------
    seed : int
        Same seed, same set (names, facts, filler, order).
    n_passages : int
        At least 2 (two-passage questions need a second passage).
    passage_tokens : int
        Target length of each passage, counted by ``count_tokens``.
    people_per_passage : int
    count_tokens : callable, optional
        ``str -> int``; a tokenizer's length for exact lengths. Default: 4/3 per word.

    Returns
    -------
    EvalSet
        ``3 * n_passages * people_per_passage`` questions, shuffled by the seed.
    """
    if n_passages < 2:
        raise EvalSetError(f"n_passages must be >= 2 (two-passage questions need two), got {n_passages}")
    if people_per_passage < 1:
        raise EvalSetError(f"people_per_passage must be >= 1, got {people_per_passage}")
    if passage_tokens < 1:
        raise EvalSetError(f"passage_tokens must be >= 1, got {passage_tokens}")
    count = count_tokens or _word_count
    rng = random.Random(seed)
    names = Names(rng)
    people = [[names.person() for _ in range(people_per_passage)] for _ in range(n_passages)]
    home = {p: names.town() for row in people for p in row}
    born = {p: rng.randint(1780, 1960) for row in people for p in row}
    ship = {p: names.ship() for row in people for p in row}
    builder = {p: names.town() for row in people for p in row}
    # The ship's yard is told in another passage: the next one (cyclic), shifted by a random
    # step so two-passage questions reach both forward and backward in the set.
    yard_passage = {}
    for i, row in enumerate(people):
        for p in row:
            yard_passage[p] = (i + rng.randint(1, n_passages - 1)) % n_passages

    facts_in = [[] for _ in range(n_passages)]
    for i, row in enumerate(people):
        for p in row:
            facts_in[i].append(f"{p} lived in the town of {home[p]}.")
            facts_in[i].append(f"{p} was born in the year {born[p]}.")
            facts_in[i].append(f"{p} owned a ship called the {ship[p]}.")
            facts_in[yard_passage[p]].append(f"The {ship[p]} was built in the town of {builder[p]}.")

    passages = [_pad(facts, rng, passage_tokens, count) for facts in facts_in]
    questions = []
    for i, row in enumerate(people):
        for p in row:
            questions.append(
                Question(f"In which town did {p} live?", home[p], (i,), "town", p, f"{p} lived in the town of")
            )
            questions.append(
                Question(f"In what year was {p} born?", str(born[p]), (i,), "year", p, f"{p} was born in the year")
            )
            questions.append(
                Question(
                    f"In which town was the ship owned by {p} built?",
                    builder[p],
                    (i, yard_passage[p]),
                    "ship_town",
                    p,
                    f"The ship owned by {p} was built in the town of",
                )
            )
    rng.shuffle(questions)
    facts = {"home": home, "born": born, "ship": ship, "builder": builder}
    return EvalSet(passages, questions, seed, facts)


def _pad(facts: list[str], rng: random.Random, target: int, count: Callable[[str], int]) -> str:
    """Facts in a seeded order among filler sentences, as long as fits within ``target``."""
    facts = list(facts)
    rng.shuffle(facts)
    filler = list(FILLER)
    rng.shuffle(filler)
    fill: list[str] = []
    k = 0
    while True:
        candidate = fill + [filler[k % len(filler)]]
        if count(" ".join(_interleave(facts, candidate))) > target:
            break
        fill = candidate
        k += 1
        if k > 10_000:
            raise EvalSetError("filler does not grow the passage; count_tokens must count words")
    return " ".join(_interleave(facts, fill))


def _interleave(facts: list[str], fill: list[str]) -> list[str]:
    """Spread the facts evenly through the filler (a fixed rule, so padding never reorders facts)."""
    out, nf = [], len(facts)
    slots = [round((j + 0.5) * (len(fill) + 1) / nf) for j in range(nf)] if nf else []
    fi = 0
    for j in range(len(fill) + 1):
        while fi < nf and slots[fi] <= j:
            out.append(facts[fi])
            fi += 1
        if j < len(fill):
            out.append(fill[j])
    out.extend(facts[fi:])
    return out


def shipped_passages() -> list[str]:
    """The three hand-written passages in ``kvlab/data/passages.txt``, each ending in a space."""
    text = resources.files("kvlab").joinpath("data/passages.txt").read_text()
    return [p.strip() + " " for p in text.split("\n\n") if p.strip()]


# --- Reading a question through the chat template -------------------------------------------

INSTRUCTION = "Answer with the name or number only."

#: Gemma's published turn format, used when a Gemma tokenizer arrives without its template
#: (the GGUF of gemma3-270m carries none); chosen only when the tokenizer knows its turn tokens.
GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class Prompt:
    """A question split where a cache-reuse system would split it.

    Attributes
    ----------
    fragments : list of str
        One text per passage, to prefill as a fragment each; the first carries the chat
        template's opening (system turn, ``user`` header), later ones start with ``"\\n\\n"``.
    probe : str
        The question, the instruction, the template's closing (the assistant header) and
        the answer's ``lead``: read behind the merged cache.
    template : str
        ``"tokenizer"`` (the tokenizer's own chat template), ``"gemma-turns"``
        (:data:`GEMMA_TURNS`) or ``"plain"`` (no chat tokens known: ``Question: ... Answer:``).
    """

    fragments: list[str]
    probe: str
    template: str


def chat_template(tokenizer) -> tuple[str | None, str]:
    """The template a tokenizer should be read through, and where it came from."""
    own = getattr(tokenizer, "chat_template", None)
    if own:
        return own, "tokenizer"
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        return GEMMA_TURNS, "gemma-turns"
    return None, "plain"


def prompt_parts(
    tokenizer, passages: list[str], question: str, lead: str = "", instruction: str = INSTRUCTION
) -> Prompt:
    """Render passages + question as one user turn and split it at the passage boundaries.

    ``"".join(fragments) + probe`` is exactly the rendered prompt; prefilling the fragment
    texts one after another is therefore the joined prefill of that prompt.

    Parameters
    ----------
    tokenizer
        A Hugging Face tokenizer.
    passages : list of str
        Non-empty, each appearing once in the rendered prompt.
    question : str
    lead : str
        Text the assistant's turn starts with (:attr:`Question.lead`); empty for none.
    """
    if not passages or any(not p.strip() for p in passages):
        raise EvalSetError("prompt_parts needs at least one non-empty passage")
    passages = [p.strip() for p in passages]
    ask = f"\n\nQuestion: {question} {instruction}"
    template, source = chat_template(tokenizer)
    if template is None:
        rendered = "\n\n".join(passages) + ask + "\nAnswer: "
    else:
        content = "\n\n".join(passages) + ask
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], chat_template=template, tokenize=False, add_generation_prompt=True
        )
    ends, at = [], 0
    for i, p in enumerate(passages):
        pos = rendered.find(p, at)
        if pos < 0:
            raise EvalSetError(f"passage {i} does not appear verbatim in the rendered prompt")
        at = pos + len(p)
        ends.append(at)
    # Fragment 0 carries the template's opening; later ones the "\n\n" before their passage.
    fragments = [rendered[start:end] for start, end in zip([0] + ends[:-1], ends)]
    return Prompt(fragments, rendered[at:] + lead, source)


# --- Scoring ------------------------------------------------------------------------------------

_STOP_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<eos>", "\n", ".", ",", ";")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def answer_span(text: str, stop: tuple[str, ...] = _STOP_MARKERS) -> str:
    """The answer in a decoded greedy continuation: up to the first end-of-turn marker, newline or clause end.

    Leading whitespace and newlines are skipped first (a model may open its turn with one).
    """
    text = text.lstrip()
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut].strip()


def normalize(text: str) -> str:
    """Lower case, punctuation and articles removed, whitespace collapsed (SQuAD's rule)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, truth: str) -> bool:
    """Whether the answer span equals the truth after :func:`normalize`.

    A sentence that merely contains the truth does not match; see :func:`contains`.
    """
    return normalize(answer_span(prediction)) == normalize(truth)


def contains(prediction: str, truth: str) -> bool:
    """Whether the normalised truth appears as whole words in the normalised answer span."""
    return f" {normalize(truth)} " in f" {normalize(answer_span(prediction))} "
