"""One experiment case: a model, the fragments it merges, both references and the probes read behind them.

``kvlab check``, the explorer, :func:`kvlab.fidelity` and the notebooks all compare merges
of the same fragments against the same two references and read the same probes behind
them. A :class:`Case` holds that set once; the references and the reference's probe
readings are computed the first time they are asked for and then kept, so comparing
many strategies (or a sweep over ratios) prefills and reads each reference once.
"""

from __future__ import annotations

from functools import cached_property

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import Fragment, prefill
from kvlab.cache.merge import landing_positions
from kvlab.measure.probes import ProbeRead, read_probes
from kvlab.measure.references import context_reference, phase_reference
from kvlab.models.loaded import LoadedModel

#: The Skerry Island story: four sentences, each a fragment (the first carries BOS). The
#: notebooks merge them (``texts = None`` in a parameters cell means these), and
#: :data:`DEFAULT_TEXTS` is their first two.
STORY_TEXTS = (
    "The lighthouse keeper on Skerry Island logged every passing ship in a blue ledger, "
    "and in the winter of 1911 he counted forty-two of them.",
    " His daughter Maren later moved the ledger to the harbour museum in Bergen, where it "
    "is kept in a glass case beside the old lamp.",
    " Visitors can still read the last entry, written in pencil: a steamer named Aurora, "
    "bound for Hull with a cargo of timber.",
    " The museum opens at ten every morning except Mondays, and the ledger room is on the second floor.",
)
#: The two-sentence case ``kvlab check`` and the explorer start from.
DEFAULT_TEXTS = list(STORY_TEXTS[:2])
DEFAULT_PROBES = [
    " The ledger is now kept in the city of",
    " The keeper counted ships in a ledger that was coloured",
    " Maren was the keeper's",
]
#: The true answer to each of :data:`DEFAULT_PROBES`, in the story's words (for answer-span scores).
DEFAULT_ANSWERS = ["Bergen", "blue", "daughter"]


class FidelityReference:
    """A reference cache whose probe readings are remembered: each probe is read behind it once.

    Every :func:`kvlab.fidelity` call reads each probe behind the reference (the next-token
    distribution and a greedy continuation). Passing one ``FidelityReference`` (or one
    :class:`Case`, which holds one) to many calls, as a sweep over strategies and ratios
    does, reads each probe once.

    Parameters
    ----------
    model : LoadedModel
    cache : DynamicCache
        The joined prefill, keys/values ``[1, kv_heads, kept, head_dim]``; never modified.
    """

    def __init__(self, model: LoadedModel, cache: DynamicCache):
        self.model, self.cache = model, cache
        self._reads: dict = {}
        self._spans: dict = {}
        self._answered: dict = {}

    def reads(self, probes: list[str], greedy_tokens: int) -> list[ProbeRead]:
        """:func:`kvlab.measure.probes.read_probes` of the reference, remembered; the probes not yet read in one call.

        Returns
        -------
        list of ProbeRead
            Per probe: ``log_probs`` ``[vocab]`` float64 and ``greedy_tokens`` greedy ids.
        """
        missing = list(dict.fromkeys(p for p in probes if self._known(p, greedy_tokens) is None))
        if missing:
            for p, r in zip(missing, read_probes(self.model, self.cache, missing, greedy=greedy_tokens)):
                self._reads[(p, greedy_tokens)] = (r.log_probs, r.greedy)
        return [ProbeRead(p, *self._known(p, greedy_tokens)) for p in probes]

    def spans(self, probes: list[str], continuations: list[str]) -> list[ProbeRead]:
        """``read_probes(..., continuation=continuations)`` of the reference, remembered per call.

        Remembered for the whole list, not per probe: a cache under test is read with the same
        list, packed the same way, so a cache equal to the reference bit for bit scores 0.

        Returns
        -------
        list of ProbeRead
            Per probe: ``continuation_log_probs`` ``[C, vocab]`` float64.
        """
        key = (tuple(probes), tuple(continuations))
        if key not in self._spans:
            self._spans[key] = read_probes(self.model, self.cache, list(probes), continuation=list(continuations))
        return self._spans[key]

    def answered(self, probes: list[str], greedy_tokens: int, continuations: list[str]) -> list[ProbeRead]:
        """``read_probes(..., greedy=greedy_tokens, continuation=continuations)`` of the reference, remembered per call.

        One read gives the greedy continuation and the answer's scores together: the probes are
        run once, not once for each. A cache under test read the same way packs its probes as
        the reference did, so a cache equal to it bit for bit agrees on every token.

        Returns
        -------
        list of ProbeRead
            Per probe: ``log_probs`` ``[vocab]``, ``greedy_tokens`` greedy ids and
            ``continuation_log_probs`` ``[C, vocab]``, float64.
        """
        key = (tuple(probes), greedy_tokens, tuple(continuations))
        if key not in self._answered:
            self._answered[key] = read_probes(
                self.model, self.cache, list(probes), greedy=greedy_tokens, continuation=list(continuations)
            )
        return self._answered[key]

    def read(self, probe: str, greedy_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """One probe's :meth:`reads`: ``[vocab]`` float64 log-probabilities and ``greedy_tokens`` greedy ids."""
        r = self.reads([probe], greedy_tokens)[0]
        return r.log_probs, r.greedy

    def _known(self, probe: str, greedy_tokens: int) -> tuple[torch.Tensor, list[int]] | None:
        # A reading of the same probe with at least as many greedy tokens answers this one: the
        # distribution comes from the first forward pass whatever the length, and a shorter
        # greedy continuation is a prefix of a longer one.
        if (probe, greedy_tokens) not in self._reads:
            longer = [v for (p, n), v in self._reads.items() if p == probe and n >= greedy_tokens]
            if not longer:
                return None
            self._reads[(probe, greedy_tokens)] = (longer[0][0], longer[0][1][:greedy_tokens])
        return self._reads[(probe, greedy_tokens)]


class Case:
    """A model, the fragments it merges, the two references and the probe texts.

    Parameters
    ----------
    model : LoadedModel
    fragments : list of Fragment
        What is merged, in merge order; each holds keys/values ``[1, kv_heads, kept,
        head_dim]`` per layer and the token ids it was computed from.
    probes : list of str
        Texts read behind each merged cache and behind the context reference.
    phase, context : DynamicCache, optional
        The references, when already at hand; otherwise built on first use.

    Attributes
    ----------
    landings : list of int
        Where each fragment lands in the merge (the sum of the lengths before it).
    phase : DynamicCache
        Phase reference (:func:`kvlab.measure.references.phase_reference`): each fragment prefilled
        alone at its landing positions. Right phase, no cross-fragment context.
    context : DynamicCache
        Context reference (:func:`kvlab.measure.references.context_reference`): one prefill of the
        joined tokens.
    reference : FidelityReference
        The context reference with its probe readings remembered.
    context_dists : list of torch.Tensor
        Per probe, the ``[vocab]`` float64 next-token log-probabilities behind ``context``.
    """

    def __init__(
        self,
        model: LoadedModel,
        fragments: list[Fragment],
        probes: list[str] | tuple = (),
        *,
        phase: DynamicCache | None = None,
        context: DynamicCache | None = None,
    ):
        self.model = model
        self.fragments = list(fragments)
        self.probes = list(probes)
        # cached_property reads the instance dict first: given references are simply kept.
        if phase is not None:
            self.__dict__["phase"] = phase
        if context is not None:
            self.__dict__["context"] = context

    @classmethod
    def from_texts(cls, model: LoadedModel, texts: list[str] | None = None, probes: list[str] | None = None) -> Case:
        """Prefill each text as a fragment from position 0 (the first with BOS).

        ``texts`` and ``probes`` default to :data:`DEFAULT_TEXTS` and :data:`DEFAULT_PROBES`,
        the two-sentence case ``kvlab check`` and the explorer start from.
        """
        texts = list(texts or DEFAULT_TEXTS)
        probes = list(DEFAULT_PROBES if probes is None else probes)
        return cls(model, [prefill(model, t, bos=(i == 0)) for i, t in enumerate(texts)], probes)

    @property
    def texts(self) -> list[str | None]:
        return [f.text for f in self.fragments]

    @cached_property
    def landings(self) -> list[int]:
        return landing_positions(self.fragments)

    @cached_property
    def phase(self) -> DynamicCache:
        return phase_reference(self.model, self.fragments)

    @cached_property
    def context(self) -> DynamicCache:
        return context_reference(self.model, self.fragments)

    @cached_property
    def reference(self) -> FidelityReference:
        return FidelityReference(self.model, self.context)

    @property
    def context_dists(self) -> list[torch.Tensor]:
        return [r.log_probs for r in self.reference.reads(self.probes, 0)]

    def describe(self) -> dict:
        """A JSON-ready record of what this case is (for tables and sweep records)."""
        return {
            "model": self.model.name,
            "texts": self.texts,
            "lengths": [f.length for f in self.fragments],
            "landings": self.landings,
            "probes": list(self.probes),
        }

    def __repr__(self) -> str:
        return (
            f"Case(model={self.model.name!r}, fragments={[f.length for f in self.fragments]} tokens, "
            f"probes={len(self.probes)})"
        )
