"""``kvlab certify MODEL --merge/--shift/--store/--compact/--press MODULE:NAME``: a store's own code audited on one model.

:func:`audit` resolves every target first (an :class:`~kvlab.errors.AuditTargetError` before any
work when one cannot be audited), then runs each audit and returns one
:class:`~kvlab.measure.certificate.Certificate`: the same lines, bounds, JSON and exit codes as the
model's own certificate, with the transformers version it ran under as its first line.
"""

from __future__ import annotations

import time

from kvlab.cache.compact import POSITIONS
from kvlab.compat import untested
from kvlab.errors import AuditTargetError
from kvlab.files.identity import fingerprint, package_versions
from kvlab.measure.audit.compact import audit_compact
from kvlab.measure.audit.compact_source import CACHE, READERS
from kvlab.measure.audit.merge import LENGTHS, audit_merge
from kvlab.measure.audit.shift import audit_shift
from kvlab.measure.audit.store import audit_store
from kvlab.measure.audit.target import COMPACT, MERGE, PRESS, SHIFT, STORE, resolve
from kvlab.measure.certificate import INFO, Certificate, Line
from kvlab.models.loaded import LoadedModel


def versions_line() -> Line:
    """An information line: the versions the audit ran under (a merge is only as right as the transformers it ran on)."""
    v = package_versions("kvlab", "torch", "transformers")
    # Information, not a failure: CI has not run kvlab's tests on this release (kvlab/data/tested.txt).
    outside = untested()
    said = ", ".join(f"{k} {v[k]}" for k in ("kvlab", "torch", "transformers"))
    return Line(
        "versions",
        "kvlab, torch, transformers",
        f"transformers {v.get('transformers')}" + (" untested" if outside else ""),
        None,
        "",
        INFO,
        said + (f"; untested: {', '.join(outside)}" if outside else ""),
    )


def audit(
    model: LoadedModel,
    *,
    merge=None,
    shift=None,
    store=None,
    compact=None,
    press=None,
    positions: str | None = None,
    reader: str = CACHE,
    lengths: tuple[int, ...] = LENGTHS,
    seed: int = 0,
) -> Certificate:
    """Audit a store's merge, shift and/or store on ``model``.

    Parameters
    ----------
    model : LoadedModel
    merge, shift, store, compact, press : callable, object or str, optional
        The function (object), or ``MODULE:NAME`` to import it from; see
        :mod:`kvlab.measure.audit.target` for the contract each must follow.
    positions : {"kept", "original"}, optional
        Where a compaction's or press's kept keys sit (:mod:`kvlab.cache.compact`); required with
        ``compact`` or ``press``.
    reader : {"cache", "explicit"}
        How the store's reader places the next token after a compaction or press: ``cache``
        (default), from ``get_seq_length()`` as ``generate`` does; ``explicit``, passing
        ``position_ids`` at the declared next position itself (kvpress's pipeline).
    lengths : tuple of int
        Base fragment lengths of the merge's phase line.
    seed : int
        Seed of the random token ids.

    Returns
    -------
    Certificate
        ``target`` names what was audited; ``passed`` is True when no line failed.

    Raises
    ------
    AuditTargetError
        Nothing to audit, a target that cannot be imported, a signature outside the contract, a
        compaction or press without its ``positions``, or a call that returned something other
        than a cache.
    """
    kinds = ((MERGE, merge), (SHIFT, shift), (STORE, store), (COMPACT, compact), (PRESS, press))
    asked = [(kind, x) for kind, x in kinds if x is not None]
    if not asked:
        raise AuditTargetError("nothing to audit: give a merge, a shift, a store, a compaction or a press")
    if (compact is not None or press is not None) and positions not in POSITIONS:
        raise AuditTargetError(
            f"a compaction or press declares where its kept keys sit: positions must be one of {POSITIONS}, "
            f"got {positions!r} (kept: re-rotated to the kept slots; original: their own phase, next token at n)"
        )
    if positions is not None and compact is None and press is None:
        raise AuditTargetError("positions applies to a compaction or a press; none was given")
    if reader not in READERS:
        raise AuditTargetError(f"reader must be one of {READERS}, got {reader!r}")
    if reader != CACHE and compact is None and press is None:
        raise AuditTargetError("reader applies to a compaction or a press; none was given")
    targets = [(kind, resolve(kind, x)) for kind, x in asked]
    t0 = time.perf_counter()
    lines = [versions_line()]
    for kind, target in targets:
        if kind == MERGE:
            got = audit_merge(model, target, lengths=lengths, seed=seed)
        elif kind == SHIFT:
            got = audit_shift(model, target, seed=seed)
        elif kind in (COMPACT, PRESS):
            got = audit_compact(model, target, positions=positions, reader=reader, seed=seed)
        else:
            got = audit_store(model, target, seed=seed)
        if len(targets) > 1:
            got = [Line(x.check, f"{kind}: {x.scope}", x.value, x.bound, x.unit, x.status, x.detail) for x in got]
        lines += got
    name = "; ".join(t.name for _, t in targets)
    return Certificate(model.name, lines, fingerprint(model), time.perf_counter() - t0, target=name)
