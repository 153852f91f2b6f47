"""The audit of a store's cache files: ``save`` and ``load`` held to what a file on disk must survive.

A store (see :mod:`kvlab.measure.audit.target`) saves a merged cache (past the sliding window where
there is one) into a fresh folder, and each line loads it back after one thing happened to it:

* ``round trip``: nothing; the cache comes back bit for bit;
* ``foreign reader``: read by the int8 round trip of the same weights (same shapes, dtype and
  tensor names, :func:`kvlab.measure.mismatch.variants`, as ``kvlab certify``'s own line): refused;
* ``truncated file``, ``corrupted file``: the largest file cut in half, or 16 of its bytes flipped
  three quarters in: ``load`` raises, never returns a cache (an empty one least of all);
* ``pickle payload``: every file replaced by a pickle that creates a canary file when unpickled;
  ``load`` runs in a child process (forked: the store object and model as they are) and the line
  fails if the canary appears. A store that unpickles what it reads runs whatever the file says.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import clone_cache, joined_prefill
from kvlab.cache.merge import merge
from kvlab.errors import UnsupportedRopeError
from kvlab.measure.audit.lines import Unfit, guarded
from kvlab.measure.audit.target import Store, TargetRaised, expect_cache
from kvlab.measure.certificate import FAIL, NA, PASS, Line
from kvlab.measure.certify import unequal_elements
from kvlab.measure.mismatch import variants
from kvlab.measure.sliding import identity_fragments
from kvlab.measure.tokens import TokenSource
from kvlab.models.loaded import LoadedModel

#: Seconds the child process of the pickle line may take to load before it counts as hung.
CHILD_TIMEOUT = 120

#: Bytes flipped by the corrupted-file line.
FLIPPED = 16


def payload(canary: Path) -> bytes:
    """A pickle (protocol 2 header, written by hand: kvlab imports no pickle module) that, loaded, opens so creates ``canary``.

    What a malicious cache file could do instead; the opcodes are PROTO 2, GLOBAL builtins.open, MARK, two
    unicode strings, TUPLE, REDUCE, STOP.
    """
    return b"\x80\x02cbuiltins\nopen\n(V" + str(canary).encode("raw-unicode-escape") + b"\nVw\ntR."


def audit_store(model: LoadedModel, store: Store, *, seed: int = 0) -> list[Line]:
    """Every line of a store audit on ``model`` (see the module docstring).

    Raises
    ------
    AuditTargetError
        The round trip's ``load`` returned something other than a ``DynamicCache``.
    """
    frags = identity_fragments(model, TokenSource(model, seed))
    try:
        cache = merge(frags, "rerotate", model)
    except UnsupportedRopeError:
        cache = joined_prefill(model, frags).cache
    checks = [
        ("round trip", f"{cache.get_seq_length()} tokens", 0, "elements", lambda: _round_trip(model, store, cache)),
        ("foreign reader", "int8 round trip of the same weights", "refused", "", lambda: _foreign(model, store, cache)),
        (
            "truncated file", "the largest file cut in half", "raised", "",
            lambda: _damaged(model, store, cache, _truncate, "truncated file"),
        ),
        (
            "corrupted file", f"{FLIPPED} bytes of the largest file flipped", "raised", "",
            lambda: _damaged(model, store, cache, _flip, "corrupted file"),
        ),
        ("pickle payload", "every file a pickle that creates a canary", "not run", "", lambda: _pickle(model, store, cache)),
    ]  # fmt: skip
    lines = []
    for check in checks:
        lines += guarded(*check)
    return lines


def _save(model: LoadedModel, store: Store, cache: DynamicCache, folder: Path) -> tuple[Path, list[Path]]:
    """``store.save`` of a copy of ``cache`` to ``folder/cache``; the path and every file the save wrote."""
    path = folder / "cache"
    store.save.call(clone_cache(cache, model.config), str(path), model.model)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise Unfit(f"{store.save.name} wrote no file under {folder}")
    return path, files


def _round_trip(model: LoadedModel, store: Store, cache: DynamicCache) -> list[Line]:
    """Saved and loaded: the same cache, bit for bit."""
    with tempfile.TemporaryDirectory(prefix="kvlab-audit-") as tmp:
        path, files = _save(model, store, cache, Path(tmp))
        got = expect_cache(store.load.call(str(path), model.model), store.load.name, "a file it saved")
        size = sum(p.stat().st_size for p in files)
    n = unequal_elements(got, cache) if len(got.layers) == len(cache.layers) else -1
    detail = f"{len(files)} file(s), {size / 1e6:.2f} MB; " + (
        "bit for bit" if n == 0 else "other layer count" if n < 0 else f"{n} elements or lengths differ"
    )
    return [Line("round trip", f"{cache.get_seq_length()} tokens", n, 0, "elements", PASS if n == 0 else FAIL, detail)]


def _foreign(model: LoadedModel, store: Store, cache: DynamicCache) -> list[Line]:
    """A reader with the same shapes but other weights is refused."""
    scope = "int8 round trip of the same weights"
    if not store.load.takes_model:
        return [
            Line(
                "foreign reader",
                scope,
                "no model",
                "refused",
                "",
                FAIL,
                f"{store.load.name} takes no model, so it cannot tell who reads: a file made by other weights of "
                "the same shapes loads silently, and reads wrong",
            )
        ]
    foreign = variants(model, "int8")
    with tempfile.TemporaryDirectory(prefix="kvlab-audit-") as tmp:
        path, _ = _save(model, store, cache, Path(tmp))
        try:
            got = store.load.call(str(path), foreign.model)
        except TargetRaised as e:
            return [Line("foreign reader", scope, type(e.error).__name__, "refused", "", PASS, e.failure)]
    if isinstance(got, DynamicCache) and got.get_seq_length() == 0:
        why = "returned an empty cache instead of refusing: the reader cannot tell a foreign file from a miss"
        return [Line("foreign reader", scope, "empty cache", "refused", "", FAIL, why)]
    return [
        Line(
            "foreign reader",
            scope,
            "loaded",
            "refused",
            "",
            FAIL,
            f"a file made by {model.name} loaded into other weights of the same shapes, dtype and names",
        )
    ]


def _largest(files: list[Path]) -> Path:
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(files: list[Path]) -> str:
    f = _largest(files)
    size = f.stat().st_size
    os.truncate(f, size // 2)
    return f"{f.name} cut from {size} to {size // 2} bytes"


def _flip(files: list[Path]) -> str:
    f = _largest(files)
    data = bytearray(f.read_bytes())
    at = max(0, min(len(data) - FLIPPED, 3 * len(data) // 4))
    for i in range(at, min(len(data), at + FLIPPED)):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    return f"{f.name}: bytes {at}..{at + FLIPPED - 1} of {len(data)} flipped"


def _damaged(model: LoadedModel, store: Store, cache: DynamicCache, damage, check: str) -> list[Line]:
    """A damaged file is refused: ``load`` raises, and never returns a cache, an empty one least of all."""
    with tempfile.TemporaryDirectory(prefix="kvlab-audit-") as tmp:
        path, files = _save(model, store, cache, Path(tmp))
        what = damage(files)
        try:
            got = store.load.call(str(path), model.model)
        except TargetRaised as e:
            return [Line(check, what, type(e.error).__name__, "raised", "", PASS, e.failure)]
    if not isinstance(got, DynamicCache):
        return [Line(check, what, "returned", "raised", "", FAIL, f"returned a {type(got).__name__}, no error")]
    n = got.get_seq_length()
    if n == 0:
        return [Line(check, what, "empty cache", "raised", "", FAIL, "returned an empty cache (0 tokens), no error")]
    if len(got.layers) == len(cache.layers) and unequal_elements(got, cache) == 0:
        # Nothing wrong came out: the damage missed everything the cache is made of.
        return [Line(check, what, "intact", "raised", "", PASS, "the damage left the loaded cache bit for bit")]
    return [Line(check, what, "returned", "raised", "", FAIL, f"returned a cache of {n} tokens that differs, no error")]


def _child_load(store: Store, path: str, model_module, conn) -> None:
    """In the forked child: one ``load``, what it did sent back; exits without running the parent's handlers."""
    torch.set_num_threads(1)  # the parent's thread pool did not survive the fork
    try:
        got = store.load.call(path, model_module)
        conn.send(f"returned a {type(got).__name__}")
    except TargetRaised as e:
        conn.send(f"raised {e.failure}")
    except BaseException as e:  # noqa: BLE001 -- the child reports, it never crashes the audit
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()
        os._exit(0)


def _pickle(model: LoadedModel, store: Store, cache: DynamicCache) -> list[Line]:
    """A file carrying a pickle payload is read without running it (``load`` in a child, a canary file watched)."""
    scope = "every file a pickle that creates a canary"
    if "fork" not in multiprocessing.get_all_start_methods():
        return [Line("pickle payload", scope, None, "not run", "", NA, "needs fork (not on this platform)")]
    with tempfile.TemporaryDirectory(prefix="kvlab-audit-") as tmp, tempfile.TemporaryDirectory() as watch:
        path, files = _save(model, store, cache, Path(tmp))
        canary = Path(watch) / "canary"
        data = payload(canary)
        for f in files:
            f.write_bytes(data)
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_load, args=(store, str(path), model.model, child), daemon=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # forking a threaded process: the child only loads one file
            proc.start()
        child.close()
        proc.join(CHILD_TIMEOUT)
        hung = proc.is_alive()
        if hung:
            proc.kill()
            proc.join()
        said = parent.recv() if parent.poll() else "said nothing"
        ran = canary.exists()
    if ran:
        status, value, detail = (
            FAIL,
            "ran",
            f"load unpickled the file and ran its payload (the canary was created); {said}",
        )
    elif hung:
        status, value, detail = FAIL, "hung", f"load did not return within {CHILD_TIMEOUT} s"
    else:
        status, value, detail = PASS, "not run", f"load {said}"
    return [Line("pickle payload", scope, value, "not run", "", status, detail[:300])]
