"""``ask``: answer an evaluation set's questions behind merged caches, and score them.

The passages of a :class:`kvlab.findings.evalset.EvalSet` are prefilled once as fragments (the
chat template's opening rides on the first), each strategy merges them once, and every
question is read behind each merged cache as a probe. The joined prefill (what
``reprefill`` builds) is the reference: its answers are the ceiling the model reaches, and
agreement with them says whether a merge changed the answer.
"""

from __future__ import annotations

from kvlab.cache.fragments import Fragment, prefill
from kvlab.cache.merge import landing_positions
from kvlab.cache.strategies import Strategy
from kvlab.errors import MergeError
from kvlab.findings.evalset import EvalSet, answer_span, contains, exact_match, normalize, prompt_parts
from kvlab.measure.case import FidelityReference
from kvlab.measure.fidelity import fidelity
from kvlab.measure.references import context_reference
from kvlab.models.loaded import LoadedModel


def passage_fragments(model: LoadedModel, evalset: EvalSet) -> tuple[list[Fragment], list[str]]:
    """Prefill each passage as it appears in the chat-templated prompt; also return the probes.

    Returns
    -------
    fragments : list of Fragment
        One per passage, each prefilled alone from position 0 (keys ``[1, kv_heads, L_i, head_dim]``).
    probes : list of str
        One per question: the question and the template's closing, read behind a merge.
    """
    texts, probes, bos = passage_texts(model, evalset)
    frags = [prefill(model, t, bos=bos and i == 0) for i, t in enumerate(texts)]
    return frags, probes


def passage_texts(model: LoadedModel, evalset: EvalSet) -> tuple[list[str], list[str], bool]:
    """The chat-templated prompt split at passage boundaries, without prefilling it.

    Returns
    -------
    texts : list of str
        One per passage; ``"".join(texts)`` is the whole context, to cache as one text.
    probes : list of str
        One per question (question, template closing, answer lead).
    bos : bool
        Whether the first text needs the tokenizer's BOS (the template does not carry it).
    """
    parts = [prompt_parts(model.tokenizer, evalset.passages, q.text, q.lead) for q in evalset.questions]
    texts = parts[0].fragments
    if any(p.fragments != texts for p in parts):
        raise MergeError("the chat template renders the passages differently per question; they cannot be cached once")
    # Only a prompt without the template's own BOS gets one from the tokenizer.
    bos = model.tokenizer.bos_token is not None and not texts[0].startswith(model.tokenizer.bos_token)
    return texts, [p.probe for p in parts], bos


def ask(
    model: LoadedModel,
    evalset: EvalSet,
    strategies: dict[str, str | Strategy],
    *,
    greedy_tokens: int = 12,
    fragments: list[Fragment] | None = None,
    probes: list[str] | None = None,
    reference: FidelityReference | None = None,
) -> list[dict]:
    """Answer every question behind every strategy's merge; one row per (question, strategy).

    Parameters
    ----------
    model : LoadedModel
    evalset : EvalSet
    strategies : dict
        ``label -> strategy`` (an instance, or a registered name), e.g.
        ``{"recompute r=0.15": kvlab.Recompute(ratio=0.15)}``.
    greedy_tokens : int
        Tokens decoded per answer (the answer span is cut at the first end-of-turn or newline).
    fragments, probes : optional
        From :func:`passage_fragments`, when already at hand.
    reference : FidelityReference, optional
        The joined prefill of ``fragments``, when already at hand.

    Returns
    -------
    list of dict
        ``question``, ``kind``, ``hops``, ``answer_passage``, ``answer_offset`` (slot where the
        passage holding the answer lands), ``strategy``, ``answer`` (the span), ``truth``,
        ``em`` and ``contains`` (against the truth), ``ref_answer``, ``ref_em`` (the joined
        prefill's), ``agree`` (normalised span equals the joined prefill's), ``kl`` (next-token
        KL against the joined prefill, nats), ``top1``, ``span_kl`` (KL per answer token with the
        true answer teacher-forced, nats), ``nll`` and ``nll_ref`` (the true answer's negative
        log-likelihood behind the merge and behind the joined prefill, nats), ``span_tokens``,
        ``merge_s``.
    """
    if greedy_tokens < 1:
        raise MergeError(f"greedy_tokens must be >= 1 to read an answer, got {greedy_tokens}")
    if fragments is None or probes is None:
        fragments, probes = passage_fragments(model, evalset)
    if len(probes) != len(evalset.questions):
        raise MergeError(f"{len(probes)} probes for {len(evalset.questions)} questions")
    if reference is None:
        reference = FidelityReference(model, context_reference(model, fragments))
    lands = landing_positions(fragments)
    rows = []
    for label, strategy in strategies.items():
        fid = fidelity(
            model,
            fragments,
            strategy,
            probes=probes,
            greedy_tokens=greedy_tokens,
            reference=reference,
            answers=[q.answer for q in evalset.questions],
        )
        for q, pr in zip(evalset.questions, fid.probes):
            ans, ref = answer_span(pr["greedy"]), answer_span(pr["greedy_ref"])
            where = q.passages[-1]
            rows.append(
                {
                    "question": q.text,
                    "kind": q.kind,
                    "hops": q.hops,
                    "answer_passage": where,
                    "answer_offset": lands[where],
                    "strategy": label,
                    "answer": ans,
                    "truth": q.answer,
                    "em": exact_match(ans, q.answer),
                    "contains": contains(ans, q.answer),
                    "ref_answer": ref,
                    "ref_em": exact_match(ref, q.answer),
                    "agree": normalize(ans) == normalize(ref),
                    "kl": pr["kl"],
                    "top1": pr["agree"],
                    "span_kl": pr["span_kl"],
                    "nll": pr["nll"],
                    "nll_ref": pr["nll_ref"],
                    "span_tokens": pr["span_tokens"],
                    "merge_s": fid.merge_s,
                }
            )
    return rows
