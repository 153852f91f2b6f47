"""The contract every input is held to, and the targets that read it.

Every input either loads a cache whose every tensor digest verifies (checked here without
kvlab's reader), or raises :class:`kvlab.CacheFileError` (a load may also raise
:class:`kvlab.FingerprintMismatch`) whose message names the file. Never another exception, never
more than ``CPU_LIMIT_S`` of CPU in one target, never a peak RSS growth above ``MEM_FLOOR`` +
``MEM_FACTOR`` x the file's size. :func:`check` runs every target on one file and returns the
breaches (:class:`Escape`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import re
import signal
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

import kvlab
from benchmarks.fuzz.encoding import raw_bytes
from kvlab import cli
from kvlab.errors import CacheFileError, CacheFileWarning, FingerprintMismatch
from kvlab.files.format import read_header, verify_file
from kvlab.files.io import load_cache

#: CPU seconds one target may spend on one input.
CPU_LIMIT_S = 1.0
#: Peak RSS growth allowed while the targets read one input: MEM_FACTOR x its size, plus
#: MEM_FLOOR for what a few reads cost whatever the size (allocator arenas, torch's caches).
MEM_FACTOR = 4
MEM_FLOOR = 16 << 20
#: An in-process hang is cut after this (the watching process kills a native one later).
HANG_S = 20
#: What reads each input, in order.
TARGETS = ("read_header", "verify_file", "load_cache", "load_cache(lenient)", "kvlab inspect")


@dataclasses.dataclass
class Escape:
    """One breach of the contract by one target on one input."""

    target: str
    kind: str  # exception, message, wrong-result, cpu, memory, hang, crash
    detail: str
    where: str = ""  # the innermost kvlab/safetensors frame, for grouping

    @property
    def signature(self) -> str:
        return f"{self.target} | {self.kind} | {self.where or re.sub(r'[0-9]+', 'N', self.detail[:60])}"


class _Hang(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Hang


@contextlib.contextmanager
def alarm():
    """SIGALRM ends a target that runs past HANG_S; torch on one thread, so that the CPU time of
    the process is the targets' own (an idle OpenMP pool spins for a while after a parallel copy,
    which put 0.5 s of CPU on a trivial input). Both are put back afterwards."""
    old, threads = signal.signal(signal.SIGALRM, _on_alarm), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        torch.set_num_threads(threads)


def innermost_frame(tb) -> str:
    """``file:line function`` of a traceback's innermost kvlab or safetensors frame (else its last), to group escapes."""
    frames = [f for f in traceback.extract_tb(tb) if "/kvlab/" in f.filename or "safetensors" in f.filename]
    f = frames[-1] if frames else (traceback.extract_tb(tb)[-1:] or [None])[0]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}" if f else ""


class PeakRSS:
    """Peak resident memory of this process since the last :meth:`reset` (Linux ``clear_refs``)."""

    def __init__(self):
        try:
            self.reset()
            self.ok = True
        except OSError:
            self.ok = False

    def reset(self) -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self._read("VmRSS")

    def peak(self) -> int:
        return self._read("VmHWM")

    @staticmethod
    def _read(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {key} in /proc/self/status")


def file_digests_ok(path: Path, header: dict) -> bool:
    """XXH3-128 of each tensor's bytes in the file equals the header's (without kvlab's reader)."""
    with safe_open(str(path), "pt") as f:
        names = sorted(f.keys())
        if names != sorted(header["tensors"]):
            return False
        return all(xxhash.xxh3_128_hexdigest(raw_bytes(f.get_tensor(n))) == header["tensors"][n] for n in names)


def fragment_matches_file(path: Path, frag, model) -> str:
    """Why the loaded fragment is not a usable cache of the file's tensors in the model's dtype ('' when it is)."""
    geo = kvlab.fingerprint(model, weights=False)["geometry"]
    layers = frag.cache.layers
    if len(layers) != geo["num_layers"]:
        return f"{len(layers)} layers, the model has {geo['num_layers']}"
    batch = {layer.keys.shape[0] for layer in layers} | {layer.values.shape[0] for layer in layers}
    if len(batch) != 1:
        return f"layers of different batch sizes {sorted(batch)}"
    for i, layer in enumerate(layers):
        window = getattr(layer, "sliding_window", None)
        kept = min(frag.length, window - 1) if layer.is_sliding else frag.length
        want = [next(iter(batch)), geo["kv_heads"], kept, geo["head_dim"]]
        if [list(layer.keys.shape), list(layer.values.shape)] != [want, want] or layer.get_seq_length() != frag.length:
            return f"layer {i} holds {list(layer.keys.shape)} / {list(layer.values.shape)}, a cache of {frag.length} needs {want}"
    with safe_open(str(path), "pt") as f:
        for i, layer in enumerate(frag.cache.layers):
            for w in ("keys", "values"):
                t = f.get_tensor(f"layers.{i}.{w}").to(model.dtype)
                held = getattr(layer, w)
                if held.shape != t.shape or not torch.equal(raw_bytes_t(held), raw_bytes_t(t)):
                    return f"layer {i} {w} differs from the file's tensor"
    return ""


def raw_bytes_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def names_the_file(e: BaseException, path: Path) -> bool:
    msg = str(e)
    return str(path) in msg and len(msg) > len(str(path)) + 10


def outcome(path: Path, result) -> str:
    """What a lenient load made of an input, in a few words: "loaded", or the refusal without its numbers."""
    if not isinstance(result, BaseException):
        return "loaded"
    msg = str(result).replace(str(path), "FILE")
    return type(result).__name__ + ": " + re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", msg))[:70]


def check(
    path: Path, model, *, inspect_model: str | None = None, folder: bool = False, outcomes: Counter | None = None
) -> list[Escape]:
    """Run every target on the file at ``path``; return the breaches of the contract."""
    out: list[Escape] = []
    results: dict[str, object] = {}
    meter = PEAK if PEAK.ok else None
    size = path.stat().st_size
    base = meter.reset() if meter else 0
    # The harness's own heap (hypothesis's example tree) makes a full garbage collection cost
    # up to 0.5 s: it is left to run between inputs, not charged to a target.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for target in TARGETS:
            allowed = (CacheFileError, FingerprintMismatch) if target.startswith("load") else (CacheFileError,)
            cpu = time.process_time()
            wall = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, HANG_S)
            try:
                results[target] = _run(target, path, model, inspect_model)
            except allowed as e:
                results[target] = e
                if not names_the_file(e, path):
                    out.append(Escape(target, "message", f"{type(e).__name__} does not name the file: {str(e)[:300]}"))
            except _Hang:
                results[target] = None
                out.append(Escape(target, "hang", f"still running after {HANG_S} s"))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - anything else is what the fuzzer looks for
                results[target] = e
                where = innermost_frame(e.__traceback__)
                out.append(Escape(target, "exception", f"{type(e).__name__}: {str(e)[:300]}", where))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            spent = time.process_time() - cpu
            if spent > WORST["cpu_s"]:
                WORST.update(cpu_s=spent, cpu_target=target, cpu_input=CURRENT.get("recipe"))
            if spent > CPU_LIMIT_S:
                out.append(Escape(target, "cpu", f"{spent:.2f} s CPU ({time.perf_counter() - wall:.2f} s wall)"))
    finally:
        if collecting:
            gc.enable()
    if meter:
        grew = meter.peak() - base
        WORST["rss_mib"] = max(WORST["rss_mib"], grew / 2**20)
        if grew / (MEM_FLOOR + MEM_FACTOR * size) > WORST["rss_share"]:
            WORST.update(rss_share=grew / (MEM_FLOOR + MEM_FACTOR * size), rss_size=size)
        if grew > MEM_FLOOR + MEM_FACTOR * size:
            out.append(
                Escape("all", "memory", f"peak RSS grew {grew / 2**20:.1f} MiB for a {size / 2**20:.2f} MiB file")
            )
    out += _consistent(path, model, results, inspect_model is not None)
    if outcomes is not None:
        outcomes[outcome(path, results.get("load_cache(lenient)"))] += 1
    if folder:
        out += _check_folder(path.parent)
    return out


def _run(target: str, path: Path, model, inspect_model):
    if target == "read_header":
        return read_header(path)
    if target == "verify_file":
        return verify_file(path)
    if target == "load_cache":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFileWarning)
            return load_cache(path, model)
    if target == "load_cache(lenient)":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFileWarning)
            return load_cache(path, model, strict=False, allow_unverified=True)
    return run_inspect([str(path)] + (["--model", inspect_model] if inspect_model else []))


@functools.cache
def _parser():
    return cli.parser()  # what cli.main builds on each call (10 ms here), made once


def run_inspect(argv: list[str]) -> tuple[int, str, str]:
    """``kvlab inspect ARGV`` in this process: (exit code, stdout, stderr)."""
    # A terminal's streams as Python sets them up: stdout UTF-8 and strict, so a header that cannot
    # be printed fails here as it would there; stderr with backslashreplace.
    out, err = io.BytesIO(), io.BytesIO()
    o, e = io.TextIOWrapper(out, "utf-8", "strict"), io.TextIOWrapper(err, "utf-8", "backslashreplace")
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = cli.run(_parser().parse_args(["inspect", *argv]))
        o.flush()
        e.flush()
    return rc, out.getvalue().decode(), err.getvalue().decode()


def _consistent(path: Path, model, r: dict, with_model: bool) -> list[Escape]:
    """What each successful result must be, checked without kvlab's reader."""
    out = []
    h, v = r.get("read_header"), r.get("verify_file")
    ok = lambda x: not isinstance(x, BaseException)  # noqa: E731
    if ok(v) and not ok(h):
        out.append(Escape("read_header", "wrong-result", f"refused what verify_file accepts: {h}"))
    if ok(h) and ok(v) and h != v:
        out.append(Escape("verify_file", "wrong-result", "returned another header than read_header"))
    if ok(v) and v is not None and not file_digests_ok(path, v):
        out.append(Escape("verify_file", "wrong-result", "accepted a file whose tensors do not match their digests"))
    for target in ("load_cache", "load_cache(lenient)"):
        frag = r.get(target)
        if frag is None or not ok(frag):
            continue
        if not ok(v):
            out.append(Escape(target, "wrong-result", f"loaded what verify_file refuses: {str(v)[:200]}"))
            continue
        if v is not None and (frag.length != v["length"] or frag.start != v["start"]):
            out.append(Escape(target, "wrong-result", "length or start differ from the header"))
        why = fragment_matches_file(path, frag, model)
        if why:
            out.append(Escape(target, "wrong-result", why))
    rc = r.get("kvlab inspect")
    if ok(rc) and rc is not None:
        code, stdout, stderr = rc
        load = r.get("load_cache")
        # With --model, inspect loads the file, whose fingerprint check comes before the digests'.
        refusals = "CacheFileError|FingerprintMismatch" if with_model else "CacheFileError"
        if not ok(v) or (with_model and v is not None and not ok(load)):
            expect = 2
        else:
            expect = 1 if v is None else 0
        if code != expect:
            out.append(Escape("kvlab inspect", "wrong-result", f"exit {code}, expected {expect}: {stderr[:200]}"))
        elif expect == 2 and not re.match(f"kvlab: ({refusals}): ", stderr):
            out.append(Escape("kvlab inspect", "message", f"stderr {stderr[:200]!r}, expected kvlab: {refusals}: ..."))
    return out


def _check_folder(folder: Path) -> list[Escape]:
    try:
        rc, stdout, stderr = run_inspect([str(folder)])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        return [
            Escape(
                "kvlab inspect FOLDER", "exception", f"{type(e).__name__}: {e}"[:300], innermost_frame(e.__traceback__)
            )
        ]
    if rc not in (0, 1) or stderr:
        return [Escape("kvlab inspect FOLDER", "wrong-result", f"exit {rc}: {stderr[:200]}")]
    return []


PEAK = PeakRSS()
#: The most any input cost: CPU seconds in one target, peak RSS growth, and the largest share of
#: its memory limit an input used (with that input's size).
WORST = {"cpu_s": 0.0, "rss_mib": 0.0, "rss_share": 0.0, "rss_size": 0}
#: The recipe being tried, for WORST.
CURRENT: dict = {}
