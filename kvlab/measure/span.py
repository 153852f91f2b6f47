"""Scoring a whole answer behind a cache, by teacher forcing the true answer after each probe.

A first-token KL reads one distribution per question. For answers whose first token is the
same whatever the answer (every year starts with " 1" in SmolLM2's vocabulary), it sees
nothing: the damage is in the later tokens. Here the true answer is fed after the probe in
the same forward pass (:func:`kvlab.measure.probes.read_probes` with ``continuation=``), so
every answer token's distribution is read at once, behind the merged cache and behind the
joined prefill, and two scores come out per question:

* ``span_kl``: the mean over the answer's tokens of ``KL(p_joined || p_merged)``, in nats
  per token, each position given the probe and the true answer before it;
* ``nll``: the negative log-likelihood of the true answer behind the cache, in nats (and
  ``nll_ref`` behind the joined prefill): how much less likely the truth has become.

Both caches are read with the same probes and answers packed the same way, so a cache that
is the joined prefill bit for bit (``reprefill``) scores ``span_kl`` exactly 0.
"""

from __future__ import annotations

from transformers import DynamicCache

from kvlab.errors import MergeError
from kvlab.measure.case import FidelityReference
from kvlab.measure.metrics import kl_divergence, kl_row
from kvlab.measure.probes import ProbeRead, read_probes
from kvlab.models.loaded import LoadedModel


def answer_continuations(answers: list[str]) -> list[str]:
    """What is fed after each probe: the answer after one space (a probe ends with the answer's lead)."""
    if any(not a.strip() for a in answers):
        raise MergeError("an answer to score is empty")
    return [" " + a.strip() for a in answers]


def span_scores(
    model: LoadedModel,
    cache: DynamicCache,
    reference: FidelityReference,
    probes: list[str],
    answers: list[str],
    *,
    position: int | None = None,
) -> list[dict]:
    """Per probe: the true answer scored behind ``cache`` against the joined prefill ``reference``.

    Parameters
    ----------
    model : LoadedModel
    cache : DynamicCache
        The cache under test (keys/values ``[1, kv_heads, kept, head_dim]``); only read.
    reference : FidelityReference
        The joined prefill of the same tokens; its readings are remembered across calls.
    probes, answers : list of str
        One true answer per probe, e.g. ``"1834"`` (fed as ``" 1834"``).
    position : int, optional
        Where the probes start behind ``cache`` (:func:`kvlab.measure.probes.read_probes`);
        the reference reads its own at its length.

    Returns
    -------
    list of dict
        ``span_kl`` (nats per answer token), ``nll`` and ``nll_ref`` (nats, summed over the
        answer), ``span_tokens`` (the answer's length in tokens), and the first answer token's
        ``kl``, ``top1_ref``, ``top1`` and ``agree`` (:func:`kvlab.measure.metrics.kl_row`, read in
        the same passes: row 0 of the span is the distribution right after the probe).
    """
    if len(answers) != len(probes):
        raise MergeError(f"{len(answers)} answers for {len(probes)} probes")
    conts = answer_continuations(answers)
    want = reference.spans(probes, conts)
    got = read_probes(model, cache, probes, continuation=conts, position=position)
    return [span_row(model, w, g) for w, g in zip(want, got, strict=True)]


def span_row(model: LoadedModel, want: ProbeRead, got: ProbeRead) -> dict:
    """One probe's scores from its reads behind the reference (``want``) and the cache (``got``), both with the answer."""
    n = int(got.continuation.numel())
    return {
        **kl_row(model, got.probe, want.log_probs, got.log_probs),
        "span_kl": kl_divergence(want.continuation_log_probs, got.continuation_log_probs) / n,
        "nll": -float(got.token_log_probs.sum()),
        "nll_ref": -float(want.token_log_probs.sum()),
        "span_tokens": n,
    }
