"""pytest helpers for a store's own CI: its merge, shift or store audited on a model, failing with the lines.

Also kvlab's own merge, shift, cache files, compactions and presses behind the same contract
(:func:`rerotate_merge`, :func:`kvlab_shift`, :class:`KvlabStore`, :func:`rerotate_compact`,
:func:`inplace_compact`, :func:`key_norm_press`, :func:`key_norm_rerotation_press`): what passes every
line, to compare a store's with or to use.

.. code-block:: python

    from kvlab.testing import assert_merge_conforms

    def test_merge_conforms():
        assert_merge_conforms(mystore.merge_caches, model="tiny-llama")

Each helper runs :func:`kvlab.measure.audit.run.audit` and raises ``AssertionError`` whose message
is the certificate's failing lines (check, scope, value beside bound, and what was wrong), so a
failing test says which defect it found. It returns the :class:`~kvlab.measure.certificate.Certificate`
when every line passes. Models named here are loaded once per process.
"""

from __future__ import annotations

import functools

from transformers import DynamicCache

from kvlab.cache.compact import KEPT, ORIGINAL, compact, low_key_norms
from kvlab.cache.fragments import Fragment, prefill_ids
from kvlab.cache.merge import merge
from kvlab.cache.shift import shift_
from kvlab.files.io import load_cache, save_cache
from kvlab.measure.audit.run import audit
from kvlab.measure.certificate import Certificate
from kvlab.models.loaded import LoadedModel
from kvlab.models.sources import load_model, wrap
from kvlab.peers.audit import audit_engine, llama_cpp_cache_reuse

#: The model the helpers audit on unless told otherwise: seeded, no files, seconds per audit.
DEFAULT_AUDIT_MODEL = "tiny-llama"


@functools.cache
def _load(name: str) -> LoadedModel:
    return load_model(name)


def _model(model: str | LoadedModel) -> LoadedModel:
    return model if isinstance(model, LoadedModel) else _load(str(model))


def failure_message(cert: Certificate) -> str:
    """The failing lines of ``cert``, one paragraph each, under the name of what was audited."""
    out = [f"{cert.target} does not conform on {cert.model}:"]
    for line in cert.lines:
        if line.failed:
            value, bound = _show(line.value), _show(line.bound)
            out.append(f"  {line.check} ({line.scope}): {value} against {bound} {line.unit}".rstrip())
            if line.detail:
                out.append(f"      {line.detail}")
    return "\n".join(out)


def _show(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _check(model: str | LoadedModel, **target) -> Certificate:
    cert = audit(_model(model), **target)
    if not cert.passed:
        raise AssertionError(failure_message(cert))
    return cert


def assert_merge_conforms(fn, model: str | LoadedModel = DEFAULT_AUDIT_MODEL, **options) -> Certificate:
    """Fail unless ``fn(caches[, model])`` passes every line of a merge audit on ``model``.

    Parameters
    ----------
    fn : callable or str
        The merge, or ``MODULE:NAME``.
    model : str or LoadedModel
        A kvlab model name (``kvlab models``) or a loaded model.
    **options
        Passed to :func:`kvlab.measure.audit.run.audit` (``lengths``, ``seed``).

    Raises
    ------
    AssertionError
        The failing lines. (:class:`~kvlab.errors.AuditTargetError` where ``fn`` breaks the contract.)
    """
    return _check(model, merge=fn, **options)


def assert_shift_conforms(fn, model: str | LoadedModel = DEFAULT_AUDIT_MODEL, **options) -> Certificate:
    """Fail unless ``fn(cache, delta[, model])`` passes every line of a shift audit on ``model``."""
    return _check(model, shift=fn, **options)


def assert_store_conforms(store, model: str | LoadedModel = DEFAULT_AUDIT_MODEL, **options) -> Certificate:
    """Fail unless ``store`` (``save(cache, path[, model])``, ``load(path[, model])``) passes a store audit."""
    return _check(model, store=store, **options)


def assert_compact_conforms(
    fn, model: str | LoadedModel = DEFAULT_AUDIT_MODEL, *, positions: str, **options
) -> Certificate:
    """Fail unless ``fn(cache, keep[, model])`` passes every line of a compaction audit on ``model``.

    Parameters
    ----------
    fn : callable or str
        The compaction, or ``MODULE:NAME``.
    positions : {"kept", "original"}
        Where its kept keys sit: re-rotated to the kept slots (next token at ``kept``), or at their
        own phase (next token at the original length).
    """
    return _check(model, compact=fn, positions=positions, **options)


def assert_press_conforms(
    fn, model: str | LoadedModel = DEFAULT_AUDIT_MODEL, *, positions: str, **options
) -> Certificate:
    """Fail unless ``fn(model, input_ids)`` (a prefill and its compression) passes every line of a press audit."""
    return _check(model, press=fn, positions=positions, **options)


def assert_engine_merge_conforms(
    fn=llama_cpp_cache_reuse, model: str | LoadedModel = "smollm2-135m", **options
) -> Certificate:
    """Fail unless ``fn(engine, fragments)`` passes every line of an engine merge audit (needs the ``peers`` extra).

    Parameters
    ----------
    fn : callable or str
        A merge that drives llama.cpp through :class:`kvlab.peers.engine.LlamaEngine`, or
        ``MODULE:NAME``; default llama.cpp's own cache reuse.
    model : str or LoadedModel
        A model with a GGUF file (``kvlab models``: SmolLM2 or Gemma 3).
    **options
        Passed to :func:`kvlab.peers.audit.audit_engine` (``fragment_sets``, ``seed``).
    """
    cert = audit_engine(_model(model), fn, **options)
    if not cert.passed:
        raise AssertionError(failure_message(cert))
    return cert


# --------------------------------------------------------------------------- kvlab's own, behind the contract


def _bare(model) -> LoadedModel:
    """A transformers model as kvlab's merge and shift read it (no tokenizer: neither reads one)."""
    return LoadedModel(model=model, tokenizer=None, name="audited", config=model.config)


def rerotate_merge(caches: list[DynamicCache], model) -> DynamicCache:
    """kvlab's ``rerotate`` as a store's merge: ``caches`` prefilled from 0, in landing order, merged exactly.

    Parameters
    ----------
    caches : list of DynamicCache
        Keys and values ``[batch, kv_heads, kept, head_dim]`` per layer, each from position 0.
    model : transformers.PreTrainedModel
        The model that made them.

    Returns
    -------
    DynamicCache
        Slot ``j`` holds position ``j``; the inputs are never changed or aliased.
    """
    loaded = _bare(model)
    frags = [
        Fragment(cache=c, token_ids=None, text=None, start=0, model_name=loaded.name, config=model.config)
        for c in caches
    ]
    return merge(frags, "rerotate", loaded)


def kvlab_shift(cache: DynamicCache, delta: int, model) -> None:
    """kvlab's ``shift_`` as a store's shift: ``cache`` (from position 0) turned by ``delta`` positions in place."""
    shift_(cache, delta, _bare(model))


def rerotate_compact(cache: DynamicCache, keep: list, model) -> DynamicCache:
    """kvlab's compaction with ``positions=kept``: the kept keys re-rotated to their slots, the next token at ``kept``.

    Parameters
    ----------
    cache : DynamicCache
        Keys and values ``[batch, kv_heads, n, head_dim]`` per layer, prefilled from 0; never changed.
    keep : list of torch.Tensor
        One ``[batch, kv_heads, k]`` tensor of ascending positions per layer.
    model : transformers.PreTrainedModel
    """
    return compact(cache, keep, _bare(model), positions=KEPT)


def inplace_compact(cache: DynamicCache, keep: list, model) -> DynamicCache:
    """kvlab's compaction with ``positions=original``: every kept key keeps its phase, the next token goes at ``n``."""
    return compact(cache, keep, _bare(model), positions=ORIGINAL)


#: The fraction of each layer's tokens kvlab's example presses keep.
PRESS_RATIO = 0.5


def key_norm_press(model, input_ids) -> DynamicCache:
    """An example press (``positions=original``): prefill, then keep each head's half of tokens with the smallest key norms.

    Parameters
    ----------
    input_ids : torch.Tensor
        ``[1, n]`` token ids, prefilled from 0.
    """
    loaded = _bare(model)
    cache = prefill_ids(loaded, input_ids)
    return compact(cache, low_key_norms(cache, PRESS_RATIO), loaded, positions=ORIGINAL)


def key_norm_rerotation_press(model, input_ids) -> DynamicCache:
    """:func:`key_norm_press` with its kept keys re-rotated to the kept slots (``positions=kept``)."""
    loaded = _bare(model)
    cache = prefill_ids(loaded, input_ids)
    return compact(cache, low_key_norms(cache, PRESS_RATIO), loaded, positions=KEPT)


class KvlabStore:
    """kvlab's cache files as a store: ``save_cache`` / ``load_cache`` against the model handed in.

    Parameters
    ----------
    tokenizer
        The model's tokenizer: it is part of the fingerprint every file carries, so a file is
        refused by a reader with another tokenizer, as by one with other weights.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._wrapped: dict[int, tuple] = {}

    def _loaded(self, model) -> LoadedModel:
        if id(model) not in self._wrapped:  # the model is kept too, so its id is never reused while remembered
            self._wrapped[id(model)] = (model, wrap(model, self.tokenizer, name="audited"))
        return self._wrapped[id(model)][1]

    def save(self, cache: DynamicCache, path, model) -> None:
        save_cache(path, cache, self._loaded(model))

    def load(self, path, model) -> DynamicCache:
        return load_cache(path, self._loaded(model)).cache
