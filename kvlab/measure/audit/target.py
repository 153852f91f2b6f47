"""What an audit checks: a store's merge, shift or store, named ``MODULE:NAME``, its signature, and a safe call.

The contract (``docs/audit.md``), in the shape stores use:

* merge: ``fn(caches)`` or ``fn(caches, model)``: ``caches`` a list of ``transformers.DynamicCache``,
  each a fragment prefilled alone from position 0, in landing order; ``model`` the transformers
  model. Returns one ``DynamicCache`` whose slot ``j`` holds the token at position ``j``.
* shift: ``fn(cache, delta)`` or ``fn(cache, delta, model)``: turns the cache's keys by ``delta``
  positions, in place (returning ``None`` or the cache) or into a new cache it returns.
* store: an object with ``save(cache, path)`` (or ``save(cache, path, model)``) and
  ``load(path)`` (or ``load(path, model)``), the model being the one that reads.
* compact: ``fn(cache, keep)`` or ``fn(cache, keep, model)``: ``cache`` a ``DynamicCache`` prefilled
  from 0 with ``n`` tokens, ``keep`` one ``[batch, kv_heads, k]`` LongTensor of ascending positions
  per layer (other tokens per head). Returns a cache whose layer ``l``, head ``h``, slot ``j`` holds
  token ``keep[l][b, h, j]``, at the positions the store declares (``kept`` or ``original``).
* press: ``fn(model, input_ids)``: ``input_ids`` ``[1, n]``. Returns the cache the store keeps after
  prefilling and compressing (it chooses the tokens; the audit reads them from the values).
* engine merge: ``fn(engine, fragments)``: ``engine`` a :class:`kvlab.peers.engine.LlamaEngine`
  (one llama.cpp context, one sequence per fragment), ``fragments`` the token ids ``[L_i]`` of each
  fragment in landing order. Leaves the merge in sequence 0, as llama.cpp's ``--cache-reuse`` does
  (audited by :mod:`kvlab.peers.audit`, through logits: llama.cpp's cache is not read as tensors).

Foreign code must never take kvlab down: :meth:`Target.call` turns whatever it raises into
:class:`TargetRaised`, which the audit writes as a failing line naming the frame that raised.
What kvlab cannot audit at all (no such module, a signature outside the contract, a result
that is not a cache) is an :class:`~kvlab.errors.AuditTargetError`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from transformers import DynamicCache

from kvlab.errors import AuditTargetError

MERGE, SHIFT, STORE, ENGINE = "merge", "shift", "store", "engine merge"
COMPACT, PRESS = "compact", "press"

#: Per kind, the positional arguments the contract allows, fewest first (the model comes last).
SIGNATURES = {
    MERGE: (("caches",), ("caches", "model")),
    SHIFT: (("cache", "delta"), ("cache", "delta", "model")),
    "save": (("cache", "path"), ("cache", "path", "model")),
    "load": (("path",), ("path", "model")),
    ENGINE: (("engine", "fragments"),),
    COMPACT: (("cache", "keep"), ("cache", "keep", "model")),
    PRESS: (("model", "input_ids"),),
}


class TargetRaised(Exception):
    """The audited code raised: ``failure`` says what and where (never an error of kvlab's own)."""

    def __init__(self, failure: str, error: BaseException):
        super().__init__(failure)
        self.failure = failure
        self.error = error


def describe_failure(error: BaseException, home: str | None = None) -> str:
    """``TypeError: message at file.py:12 in fn``: the exception and the traceback's last frame.

    Where the last frame is not in ``home`` (the target's own file) but one above it is, that
    frame is named too (``called from``), so an error raised inside torch still points at the
    line of the store that made the call.
    """
    frames = traceback.extract_tb(error.__traceback__)
    message = " ".join(str(error).split())  # one line in a table, however the message was laid out
    what = f"{type(error).__name__}: {message[:300]}"
    if not frames:
        return what
    last = frames[-1]
    out = f"{what} at {short_path(last.filename)}:{last.lineno} in {last.name}"
    if home is not None and last.filename != home:
        own = [f for f in frames if f.filename == home]
        if own:
            out += f" (called from {short_path(own[-1].filename)}:{own[-1].lineno} in {own[-1].name})"
    return out


def load_object(spec: str) -> object:
    """The object ``spec`` (``MODULE:NAME``, ``NAME`` may be dotted) names, imported as ``python -m`` would.

    The current folder is put on ``sys.path`` first, as ``python -m`` does, so a store's own
    package imports from its checkout.

    Raises
    ------
    AuditTargetError
        Not ``MODULE:NAME``, a module that does not import (its error quoted), or no such name in it.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise AuditTargetError(f"{spec!r} is not MODULE:NAME (e.g. mystore.cache:merge_caches)")
    module_name, attr = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- any error importing foreign code is the target's, named here
        raise AuditTargetError(
            f"cannot import module {module_name!r} of {spec!r}: {describe_failure(e)} "
            f"(sys.path starts {sys.path[:3]}; set PYTHONPATH or run from the store's checkout)"
        ) from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AuditTargetError(f"module {module_name!r} ({module.__file__}) has no {attr!r}") from None
    return obj


def _arity(fn, kind: str, name: str) -> int:
    """How many of the contract's positional arguments ``fn`` takes (the larger when both bind)."""
    allowed = SIGNATURES[kind]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return len(allowed[-1])  # no signature to read (a builtin): hand it everything the contract offers
    for args in reversed(allowed):
        try:
            sig.bind(*args)
        except TypeError:
            continue
        return len(args)
    shapes = " or ".join(f"({', '.join(a)})" for a in allowed)
    raise AuditTargetError(f"{name} has signature {sig}; the {kind} contract calls it as {shapes}")


def expect_cache(result, name: str, what: str) -> DynamicCache:
    """``result`` if it is a ``DynamicCache``; else an :class:`AuditTargetError` naming what came back."""
    if not isinstance(result, DynamicCache):
        raise AuditTargetError(
            f"{name} returned a {type(result).__module__}.{type(result).__qualname__} from {what}, "
            "not a transformers.DynamicCache"
        )
    return result


@dataclass
class Target:
    """One callable of the audited code, with the number of the contract's arguments it takes.

    Attributes
    ----------
    fn : callable
    name : str
        How lines and errors name it (``merge mystore:merge_caches``).
    kind : str
        ``merge``, ``shift``, ``save``, ``load`` or ``engine merge`` (a key of :data:`SIGNATURES`).
    arity : int
        Positional arguments it is called with: the contract's first ``arity``.
    """

    fn: object
    name: str
    kind: str
    arity: int

    @classmethod
    def of(cls, fn, name: str, kind: str) -> Target:
        if not callable(fn):
            raise AuditTargetError(f"{name} is a {type(fn).__name__}, not a function")
        return cls(fn, name, kind, _arity(fn, kind, name))

    @property
    def takes_model(self) -> bool:
        return self.arity == len(SIGNATURES[self.kind][-1])

    @property
    def home(self) -> str | None:
        """The file the function is defined in (to name its own line in a failure)."""
        try:
            return inspect.getsourcefile(inspect.unwrap(self.fn))
        except (TypeError, OSError):
            return None

    def call(self, *args):
        """Call with the contract's arguments (the last, the model, dropped where it takes none).

        Raises
        ------
        TargetRaised
            Whatever the call raised, :func:`describe_failure` of it as the message.
        """
        try:
            return self.fn(*args[: self.arity])
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- a foreign failure becomes a line, never a crash
            raise TargetRaised(describe_failure(e, self.home), e) from e


@dataclass
class Store:
    """A store's ``save`` and ``load`` (see the module docstring)."""

    name: str
    save: Target
    load: Target

    @classmethod
    def of(cls, obj, name: str) -> Store:
        if inspect.isclass(obj):
            raise AuditTargetError(f"{name} is a class; point at an instance (a store object with save and load)")
        missing = [m for m in ("save", "load") if not callable(getattr(obj, m, None))]
        if missing:
            raise AuditTargetError(
                f"{name} ({type(obj).__name__}) has no callable {' or '.join(missing)}; a store has "
                "save(cache, path[, model]) and load(path[, model])"
            )
        return cls(name, Target.of(obj.save, f"{name}.save", "save"), Target.of(obj.load, f"{name}.load", "load"))


def target_name(kind: str, obj_or_spec) -> str:
    """``merge mystore:merge_caches``: how a target is named in lines, errors and the certificate."""
    if isinstance(obj_or_spec, str):
        return f"{kind} {obj_or_spec}"
    obj = obj_or_spec
    label = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if label is None:  # an instance (a store): the module-level name it has, else its class's
        module = type(obj).__module__
        names = [k for k, v in vars(sys.modules.get(module, object)).items() if v is obj]
        label = names[0] if names else f"<{type(obj).__qualname__} instance>"
    return f"{kind} {module}:{label}"


def resolve(kind: str, obj_or_spec) -> Target | Store:
    """A :class:`Target` (merge, shift, engine merge) or :class:`Store`.

    From an object, a ``MODULE:NAME`` string, or one already resolved.
    """
    if isinstance(obj_or_spec, Store if kind == STORE else Target) and (kind == STORE or obj_or_spec.kind == kind):
        return obj_or_spec
    name = target_name(kind, obj_or_spec)
    obj = load_object(obj_or_spec) if isinstance(obj_or_spec, str) else obj_or_spec
    if kind == STORE:
        return Store.of(obj, name)
    if kind not in (MERGE, SHIFT, ENGINE, COMPACT, PRESS):
        raise AuditTargetError(
            f"unknown audit kind {kind!r}; kvlab audits a merge, a shift, a store, a compaction, a press "
            "or an engine merge"
        )
    return Target.of(obj, name, kind)


def short_path(path: str) -> str:
    """``path`` relative to the current folder where it lies below it (shorter lines)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path
