"""Why does a partial recompute cost a little inside Gemma 3's window? Two hypotheses, one run.

The haystack study found recompute (r = 0.15, ``deviation``) slightly *worse* than rerotate in
answer-span KL on Gemma 3 at 2 fragments of 192 tokens, where the whole merge (about 400 tokens)
lies inside the 512-token window of its sliding layers; at 4 and 8 fragments it was slightly
better. This study reads the same caches again to tell two explanations apart.

Design, named before the run. The haystack study's haystacks (``kvlab.findings.needles``, same
seed and budget, so the same text, needles and codes) at 2 fragments of at most ``tokens``
tokens, its four single-needle depths: one question per cache, four caches per haystack. Every
question is read behind ``rerotate`` and behind recompute at every ratio of ``RATIOS`` under
both policies of ``POLICIES``, and scored against the joined prefill (answer-span KL, the truth's
NLL, exact match of a 5-token greedy answer).

* **H1, a mixed cache.** A partial recompute gives the chosen tokens keys and values computed
  over a cache whose other later-fragment tokens are still the fragment's own: a state that
  neither the fragment's prefill nor the joined prefill produces. It predicts a cost at small r
  under *either* policy, shrinking as r nears r* (about 0.5 here: every token after fragment 0
  recomputed, which is the joined prefill).
* **H2, the selection.** ``deviation`` picks the tokens whose keys moved most; recomputing those
  first could be what costs. It predicts a cost under ``deviation`` and none under
  ``random_later`` (a random draw among the same later tokens) at the same r.

The family, per model, Holm-adjusted, paired over the same questions, cluster bootstrap over
haystacks: ``<policy> r=<r> - rerotate`` in answer-span KL for every policy and ratio (8
comparisons). SmolLM2 (no sliding window, where recompute helped at every count) is the
contrast.

Follow-up, named after that run and before its own (``--selection``): where each selection's
tokens sit. No question is read: for every cache and ratio, the tokens ``deviation``,
``random_later`` and ``fragment_start`` (the first tokens of the later fragment) choose, as a
share of the later fragment's tokens by tenth of its length (first and last tenth), their mean
relative place in it, and the share of the needle's tokens chosen (needles in the later fragment
only). A selection that concentrates where recomputing first costs would show it here; a random
draw spreads evenly (a tenth per tenth).

Second follow-up, named after the selection probe and before its own run (``--policy
fragment_start``): on both models ``deviation`` puts about half of its r = 0.05 budget in the
first tenth of the later fragment, so where it recomputes first does not by itself tell Gemma 3
from SmolLM2. If recomputing the later fragment's start first is what costs on Gemma 3,
``fragment_start`` (nearly all of its r = 0.05 budget there) costs too, at least at small r; if
it does not, ``deviation``'s cost lies in which tokens it ranks first, not in where they sit.
The same caches, ``rerotate`` and ``fragment_start`` at every ratio; the family per model is
``fragment_start r=<r> - rerotate`` in answer-span KL (4 comparisons, Holm).

Third follow-up, named after the second and before its own run (``--policy past_start``): half of
``deviation``'s r = 0.05 budget sits in the later fragment's first tenth, and the start alone does
not cost, so the suspects are its other picks. ``deviation_past_start`` ranks by ``deviation`` but
only past each later fragment's first tenth; ``random_past_start`` draws at random from the same
tokens (both capped at how many there are). If ``deviation``'s cost on Gemma 3 lies in the tokens
it ranks first past the start, ``deviation_past_start`` costs at small r and ``random_past_start``
does not; if it needs the start and those tokens recomputed together, neither costs. The same
caches, ``rerotate`` and both arms at every ratio; the family per model is ``<arm> r=<r> -
rerotate`` in answer-span KL (8 comparisons, Holm), SmolLM2 again the contrast.

Named after that run (on Gemma 3 ``deviation_past_start`` cost at r = 0.05 and 0.15, the random
draw at no ratio) and before its own: the selection probe (``--selection``) adds the two past-start
selections and two classes of token, punctuation alone and the token after a sentence's end
(candidates for tokens whose keys are unlike their neighbours'). The comparisons:
``deviation_past_start - random_past_start`` in each class's share of the chosen tokens, at r =
0.05 and 0.15 (4 per model, Holm). A difference describes what deviation picks; it does not show
that the class is what costs.

Fourth follow-up, named after the probe and before its own run (``--policy place_matched``): on both
models ``deviation_past_start`` sits early in the later fragment (mean place about 0.33 against a
random draw's 0.52) and is no richer than random in either token class, so place just past the
start and the identity of the tokens deviation ranks first are not told apart.
``random_at_deviation_places`` draws at random among the tokens past the start, as many in each
tenth of each later fragment as ``deviation_past_start`` picks there. If it costs on Gemma 3 at
r = 0.05 or 0.15, the place carries the cost; if it does not, the cost lies in which tokens
deviation ranks first. The family per model is ``random_at_deviation_places r=<r> - rerotate`` in
answer-span KL (4 comparisons, Holm).

    .venv/bin/python studies/recompute_window.py --model gemma3-270m [--haystacks 20]
    .venv/bin/python studies/recompute_window.py --model gemma3-270m --markdown   # tables from the committed rows
    .venv/bin/python studies/recompute_window.py --model gemma3-270m --selection [--markdown]
    .venv/bin/python studies/recompute_window.py --model gemma3-270m --policy fragment_start [--markdown]
    .venv/bin/python studies/recompute_window.py --model gemma3-270m --policy past_start [--markdown]
    .venv/bin/python studies/recompute_window.py --model gemma3-270m --policy place_matched [--markdown]

Writes ``results/recompute_window_<model>.csv`` (the haystack study's columns) and ``.json`` (the
run); ``--selection`` writes ``results/recompute_window_selection_<model>.csv`` and ``.json``,
``--policy fragment_start`` ``results/recompute_window_fragment_start_<model>.csv`` and ``.json``,
``--policy past_start`` ``results/recompute_window_past_start_<model>.csv`` and ``.json``, and so on
for each follow-up (``recompute_window_<policy>_<model>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.cache.merge import landing_positions
from kvlab.cache.recompute.select import key_deviation
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.strategies import Rerotate
from kvlab.findings import longctx
from kvlab.findings.haystack_table import CLUSTER, DEPTHS, TEXT
from kvlab.findings.needles import haystack_caches, haystack_rows, needle_span
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser
from kvlab.measure.stats import fmt_ci, mean_ci, paired_family, proportion_ci

RESULTS = Path(__file__).resolve().parents[1] / "results"
COUNT = 2
RATIOS = (0.05, 0.15, 0.3, 0.45)
POLICIES = ("deviation", "random_later")
#: The third follow-up's arms, each a base policy kept past the later fragments' first tenth.
PAST_START = {"deviation_past_start": "deviation", "random_past_start": "random_later"}
#: The selection probe's selections: the two of the run, the first tokens of the later fragment,
#: and the third follow-up's two (added with it).
SELECTIONS = ("deviation", "random_later", "fragment_start", *PAST_START)
#: The follow-up runs (``--policy``) and the arms each reads.
FOLLOW_UPS = {
    "fragment_start": ("fragment_start",),
    "past_start": tuple(PAST_START),
    "place_matched": ("random_at_deviation_places",),
}


@dataclass
class PastStart(Recompute):
    """Recompute whose budget goes only past each later fragment's first tenth.

    ``policy`` ``deviation`` ranks those tokens by key deviation, ``random_later`` draws them at
    random (seeded); the budget is capped at how many there are.
    """

    @staticmethod
    def allowed(decoder) -> torch.Tensor:
        """``[N]`` bool: the tokens past each later fragment's first tenth."""
        allowed = torch.zeros(decoder.total, dtype=torch.bool)
        allowed[decoder.later :] = True
        for f, land in zip(decoder.fragments[1:], decoder.landings[1:], strict=True):
            allowed[land : land + -(-f.length // 10)] = False
        return allowed

    def select_tokens(self, decoder, merged) -> torch.Tensor:
        """``[min(round(ratio * N), allowed)]`` int64 merged positions, ascending, none in a later fragment's start."""
        allowed = self.allowed(decoder)
        if self.policy == "deviation":
            score = key_deviation(decoder, merged, self._check_layer(decoder, merged)).cpu().double()
        else:
            score = torch.rand(decoder.total, generator=torch.Generator().manual_seed(self.seed), dtype=torch.double)
        score[~allowed] = float("-inf")
        k = min(self.budget(decoder.total), int(allowed.sum()))
        return torch.topk(score, k).indices.sort().values


@dataclass
class PlaceMatched(PastStart):
    """A random draw at ``deviation_past_start``'s places: in each tenth of each later fragment, as many
    tokens (drawn at random among those past the start) as ``deviation_past_start`` picks there."""

    def select_tokens(self, decoder, merged) -> torch.Tensor:
        """``[k]`` int64 merged positions, ascending: ``deviation_past_start``'s count per tenth, drawn at random."""
        picks = set(super().select_tokens(decoder, merged).tolist())  # policy "deviation": its own ranking
        allowed = self.allowed(decoder)
        g = torch.Generator().manual_seed(self.seed)
        out = []
        for f, land in zip(decoder.fragments[1:], decoder.landings[1:], strict=True):
            # Token p of this fragment is in tenth (p - land) * 10 // length, as the selection probe places it.
            bins = {}
            for p in range(land, land + f.length):
                bins.setdefault((p - land) * 10 // f.length, []).append(p)
            for span in bins.values():
                here = [p for p in span if allowed[p]]
                want = sum(p in picks for p in span)
                out += [here[i] for i in torch.randperm(len(here), generator=g)[:want].tolist()]
        return torch.tensor(sorted(out), dtype=torch.long)


def label(policy: str, r: float) -> str:
    """An arm's label; ``deviation`` at 0.15 is the haystack study's ``recompute r=0.15``."""
    return f"recompute r={r:g}" if policy == "deviation" else f"{policy} r={r:g}"


def merges(seed: int, policies: tuple[str, ...] = POLICIES) -> dict:
    """``rerotate``, then recompute at every ratio under each policy (the same draw seed)."""
    out = {"rerotate": Rerotate()}
    for policy in policies:
        for r in RATIOS:
            out[label(policy, r)] = recompute(policy, r, seed)
    return out


def recompute(policy: str, r: float, seed: int) -> Recompute:
    """The recompute arm of ``policy`` (one of kvlab's, or a past-start arm) at ratio ``r``."""
    if policy in PAST_START:
        return PastStart(ratio=r, policy=PAST_START[policy], seed=seed)
    if policy == "random_at_deviation_places":
        return PlaceMatched(ratio=r, policy="deviation", seed=seed)
    return Recompute(ratio=r, policy=policy, seed=seed)


def family(rows: list[dict], seed: int = 0, policies: tuple[str, ...] = POLICIES) -> list[dict]:
    """The named comparisons: each arm minus rerotate in answer-span KL, with interval, p and Holm p."""
    comparisons = []
    for policy in policies:
        for r in RATIOS:
            x, y, labels = longctx.pairs(rows, label(policy, r), "rerotate", "span_kl", None, cluster=CLUSTER)
            comparisons.append(({"policy": policy, "ratio": r}, x, y, labels))
    return paired_family(comparisons, seed=seed)


def markdown(rows: list[dict], model: str, seed: int = 0, policies: tuple[str, ...] = POLICIES) -> str:
    """The run's tables and conclusion lines, from its rows (``policies``: the run's recompute selections)."""
    n = len({r["set"] for r in rows})
    q = len({(r["set"], r["question"]) for r in rows})
    tokens = sorted({r["total_tokens"] for r in rows})
    first = sorted({r["first_tokens"] for r in rows})
    r_star = sorted({round(1 - f / t, 2) for f, t in ((r["first_tokens"], r["total_tokens"]) for r in rows)})
    ref = proportion_ci(
        [r["ref_em"] for r in rows if r["strategy"] == "rerotate"],
        clusters=[r["set"] for r in rows if r["strategy"] == "rerotate"],
        seed=seed,
    )
    out = [
        f"**{model}**, {COUNT} fragments, {n} haystacks, {q} questions (merges of {tokens[0]}-{tokens[-1]} tokens, "
        f"fragment 0 of {first[0]}-{first[-1]}; r* {r_star[0]:.2f}-{r_star[-1]:.2f}); the joined prefill's exact "
        f"match {fmt_ci(ref, '.2f')}. Per arm: answer-span KL against the joined prefill (nats/token), exact "
        f"match; then the arm minus rerotate in answer-span KL (paired; Holm over the {len(policies) * len(RATIOS)} "
        "named comparisons):",
        "",
        "| arm | answer-span KL | exact match | minus rerotate | Holm p |",
        "|---|---|---|---|---|",
    ]
    fam = {(f["policy"], f["ratio"]): f for f in family(rows, seed, policies)}

    def arm(name: str) -> tuple[str, str]:
        rs = [r for r in rows if r["strategy"] == name]
        sets = [r["set"] for r in rs]
        kl = mean_ci([r["span_kl"] for r in rs], clusters=sets, seed=seed)
        em = proportion_ci([r["em"] for r in rs], clusters=sets, seed=seed)
        return fmt_ci(kl, ".4f"), fmt_ci(em, ".2f")

    out.append("| rerotate | {} | {} | - | - |".format(*arm("rerotate")))
    for policy in policies:
        for r in RATIOS:
            f = fam[policy, r]
            b = "**" if f["p_holm"] <= 0.05 else ""
            out.append(
                f"| {label(policy, r)} | {' | '.join(arm(label(policy, r)))} | {b}{fmt_ci(f['ci'], '+.4f')}{b} | "
                f"{f['p_holm']:.3f} |"
            )
    costs = {p: [r for r in RATIOS if fam[p, r]["p_holm"] <= 0.05 and fam[p, r]["ci"].mean > 0] for p in policies}
    gains = {p: [r for r in RATIOS if fam[p, r]["p_holm"] <= 0.05 and fam[p, r]["ci"].mean < 0] for p in policies}
    out += [""] + [
        f"* {p}: costs (resolved above rerotate) at r = {', '.join(map(str, costs[p])) or 'none'}; "
        f"gains (resolved below) at r = {', '.join(map(str, gains[p])) or 'none'}"
        for p in policies
    ]
    return "\n".join(out)


def selection_rows(model, h: int, tokens: int, seed: int) -> list[dict]:
    """Where each selection's tokens sit in haystack ``h``'s 2-fragment caches, per policy and ratio."""
    out = []
    for _, _, s, (frags, _) in haystack_caches(model, h, tokens, seed, counts=(COUNT,), depths=DEPTHS):
        lands = landing_positions(frags)
        later, total = lands[1], lands[-1] + frags[-1].length
        q = s.questions[0]
        n0, n1 = needle_span(model, s, frags, q)
        texts = [model.tokenizer.decode([i]) for i in torch.cat([f.token_ids.reshape(-1) for f in frags]).tolist()]
        # The two token classes, by merged position, once per cache.
        punctuation = {p for p, text in enumerate(texts) if _punctuation(text)}
        after_sentence = {p for p in range(1, len(texts)) if texts[p - 1].strip()[-1:] in ".!?"}
        for policy in SELECTIONS:
            for r in RATIOS:
                chosen = recompute(policy, r, seed).select(frags, lands, model)
                chosen = chosen[chosen >= later]  # fragment 0 is exact already: the strategy drops it too
                rel = (chosen.double() - later) / (total - later)
                picked = set(chosen.tolist())
                out.append(
                    {
                        "set": h,
                        "depth": s.facts["depths"][q.subject],
                        "policy": policy,
                        "ratio": r,
                        "later_tokens": total - later,
                        "chosen": len(picked),
                        "first_tenth": float((rel < 0.1).double().mean()) if picked else 0.0,
                        "last_tenth": float((rel >= 0.9).double().mean()) if picked else 0.0,
                        "mean_place": float(rel.mean()) if picked else 0.0,
                        "needle_later": n0 >= later,
                        "needle_chosen": sum(t in picked for t in range(n0, n1)) / (n1 - n0),
                        "punctuation": len(picked & punctuation) / len(picked) if picked else 0.0,
                        "after_sentence": len(picked & after_sentence) / len(picked) if picked else 0.0,
                    }
                )
    return out


def _punctuation(text: str) -> bool:
    """A token of punctuation alone (no letter or digit; whitespace around it allowed)."""
    return bool(text.strip()) and not any(c.isalnum() for c in text)


def selection_markdown(rows: list[dict], model: str, seed: int = 0) -> str:
    """The follow-up's table: per selection and ratio, where its tokens sit (means over caches, cluster intervals)."""
    n = len({r["set"] for r in rows})
    out = [
        f"**{model}**, where each selection's tokens sit in the later fragment ({n} haystacks, "
        f"{len(rows) // (len(SELECTIONS) * len(RATIOS))} caches; a random spread puts 0.10 in each tenth and its "
        "mean place at 0.50; needle share over the caches whose needle is in the later fragment):",
        "",
        "| selection | r | in the first tenth | in the last tenth | mean place (0 first, 1 last) "
        "| share of the needle's tokens chosen | punctuation tokens | tokens after a sentence's end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy in SELECTIONS:
        for r in RATIOS:
            rs = [x for x in rows if x["policy"] == policy and x["ratio"] == r]
            sets = [x["set"] for x in rs]
            cells = [
                fmt_ci(mean_ci([x[m] for x in rs], clusters=sets, seed=seed), ".2f")
                for m in ("first_tenth", "last_tenth", "mean_place")
            ]
            late = [x for x in rs if x["needle_later"]]
            cells.append(
                fmt_ci(mean_ci([x["needle_chosen"] for x in late], clusters=[x["set"] for x in late], seed=seed), ".2f")
            )
            cells += [
                fmt_ci(mean_ci([x[m] for x in rs], clusters=sets, seed=seed), ".2f")
                for m in ("punctuation", "after_sentence")
            ]
            out.append(f"| {policy} | {r:g} | " + " | ".join(cells) + " |")
    out += [
        "",
        "What deviation picks past the start, against a random draw of the same tokens (paired over caches, Holm):",
        "",
    ]
    for f in composition(rows, seed):
        out.append(f"* {f['label']}: {fmt_ci(f['ci'], '+.2f')} (Holm p {f['p_holm']:.3f})")
    return "\n".join(out)


def composition(rows: list[dict], seed: int = 0) -> list[dict]:
    """Named with the third follow-up: ``deviation_past_start - random_past_start`` in each token class's share."""
    comparisons = []
    for r in (0.05, 0.15):
        for m, name in (("punctuation", "punctuation tokens"), ("after_sentence", "tokens after a sentence's end")):
            by = {
                p: {(x["set"], x["depth"]): x[m] for x in rows if x["policy"] == p and x["ratio"] == r}
                for p in PAST_START
            }
            keys = sorted(by["deviation_past_start"])
            a, b = ([by[p][k] for k in keys] for p in PAST_START)
            what = {"label": f"r = {r:g}, deviation_past_start - random_past_start, share of {name}"}
            comparisons.append((what, a, b, [k[0] for k in keys]))
    return paired_family(comparisons, seed=seed)


def main() -> None:
    ap = set_study_parser(__doc__, RESULTS, sets="haystacks", tokens=192)
    ap.add_argument("--selection", action="store_true", help="the follow-up: where each selection's tokens sit")
    ap.add_argument("--policy", choices=tuple(FOLLOW_UPS), help="a later follow-up: read its selections' arms alone")
    args = ap.parse_args()
    policies = FOLLOW_UPS[args.policy] if args.policy else POLICIES
    if args.selection:
        path = args.out / f"recompute_window_selection_{args.model}.csv"
        if args.markdown:
            print(selection_markdown(read_rows(path), args.model, args.seed))
            return
        rows, model = run_set_study(
            "studies/recompute_window.py",
            path,
            args,
            lambda model, h: selection_rows(model, h, args.tokens, args.seed),
            sets="haystacks",
            count=COUNT,
            depths=list(DEPTHS),
            ratios=list(RATIOS),
            selections=list(SELECTIONS),
        )
        print(selection_markdown(rows, model.name, args.seed))
        return
    stem = f"recompute_window_{args.policy}_" if args.policy else "recompute_window_"
    path = args.out / f"{stem}{args.model}.csv"
    if args.markdown:
        print(markdown(read_rows(path, text=TEXT), args.model, args.seed, policies))
        return
    rows, model = run_set_study(
        "studies/recompute_window.py",
        path,
        args,
        lambda model, h: haystack_rows(
            model, h, args.tokens, args.seed, merges(args.seed, policies), counts=(COUNT,), depths=DEPTHS
        ),
        sets="haystacks",
        count=COUNT,
        depths=list(DEPTHS),
        ratios=list(RATIOS),
        policies=list(policies),
    )
    print(markdown(rows, model.name, args.seed, policies))


if __name__ == "__main__":
    main()
