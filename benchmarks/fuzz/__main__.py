"""Fuzz kvlab's cache-file reader with mutated real cache files, and print what escaped.

    nice -n 15 .venv/bin/python -m benchmarks.fuzz --seconds 600 [--out runs/fuzz] [--seed 0]
        [--real-share 0.1 | --tiny-only] [--inputs N] [--replay FILE.json|FILE.kvcache ...]

(from the repository root). The run happens in a worker process watched by this one: a worker
that crashes, or stops writing inputs for a minute (a native hang), leaves its current input as
an escape and is restarted for the time left. What is fuzzed and the contract: :mod:`benchmarks.fuzz`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.fuzz.contract import CPU_LIMIT_S, HANG_S, MEM_FACTOR, MEM_FLOOR, WORST, Escape
from benchmarks.fuzz.run import fuzz, replay, save_reproducer
from benchmarks.fuzz.seeds import real_seeds, tiny_seeds

REPO = Path(__file__).resolve().parents[2]


def supervise(args, argv: list[str]) -> int:
    """Run the fuzzer in a worker; a worker that dies or hangs leaves its input as an escape."""
    out = Path(args.out)
    work = Path(args.work)
    deadline = time.monotonic() + args.seconds
    status = 0
    crashes = 0
    while True:
        left = deadline - time.monotonic()
        if left < 5:
            break
        cmd = [sys.executable, "-m", __spec__.parent, "--worker", "--seconds", str(int(left))]
        cmd += ["--seed", str(args.seed + crashes)]
        cmd += argv
        (work / "input.kvcache").unlink(missing_ok=True)
        (work / "input.json").unlink(missing_ok=True)
        proc = subprocess.Popen(cmd)
        while proc.poll() is None:
            time.sleep(1)
            beat = work / "input.kvcache"
            if beat.exists() and time.time() - beat.stat().st_mtime > HANG_S * 3:
                proc.kill()  # a native hang: SIGALRM cannot interrupt it
        if proc.returncode == 0:
            break
        if proc.returncode in (1, 3):  # escapes reported, or a failure of the fuzzer's own
            status = proc.returncode
            break
        crashes += 1
        kind = "hang" if proc.returncode == -signal.SIGKILL else "crash"
        print(f"ESCAPE worker {kind} (exit {proc.returncode}); its input is kept in {out / 'escapes'}", flush=True)
        if (work / "input.json").exists():
            recipe = json.loads((work / "input.json").read_text())
            save_reproducer(
                out,
                (work / "input.kvcache").read_bytes(),
                recipe,
                Escape("worker", kind, f"exit {proc.returncode}"),
            )
        status = 1
        if crashes > 20:
            break
    return status


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--inputs", type=int, default=None, help="stop after this many inputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "runs" / "fuzz"))
    ap.add_argument("--real-share", type=float, default=0.1, help="share of inputs made from SmolLM2 / Gemma 3 files")
    ap.add_argument("--tiny-only", action="store_true", help="no real models (fast start, smaller files)")
    ap.add_argument("--replay", nargs="+", type=Path, help="recheck stored reproducers (FILE.json or FILE.kvcache)")
    ap.add_argument("--work", default=None, help="scratch folder for the inputs (default: in /dev/shm where it exists)")
    ap.add_argument("--outcomes", type=int, default=25, help="print the N commonest outcomes (0: none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-process", action="store_true", help="no watching process (a crash ends the run)")
    args = ap.parse_args()
    passed = [a for a in ("--tiny-only",) if getattr(args, a[2:].replace("-", "_"))]
    shm = Path("/dev/shm")
    args.work = args.work or str(shm / f"kvlab-fuzz-{os.getpid()}" if shm.is_dir() else Path(args.out) / "work")
    passed += ["--out", args.out, "--work", args.work, "--real-share", str(args.real_share)]
    passed += ["--outcomes", str(args.outcomes)]
    if args.inputs is not None:
        passed += ["--inputs", str(args.inputs)]
    if not args.worker and not args.in_process and not args.replay:
        try:
            return supervise(args, passed)
        finally:
            shutil.rmtree(args.work, ignore_errors=True)
    torch.manual_seed(0)
    out = Path(args.out)
    t = time.perf_counter()
    seeds = tiny_seeds(out / "seeds") + ([] if args.tiny_only else real_seeds(out / "seeds"))
    print(
        f"seeds: {', '.join(f'{s.name} ({len(s.data) / 1e3:.0f} kB)' for s in seeds)}; "
        f"ready in {time.perf_counter() - t:.1f} s",
        flush=True,
    )
    if args.replay:
        return replay(args.replay, seeds, Path(args.work))
    load = os.getloadavg()
    report = fuzz(
        seeds,
        work=Path(args.work),
        out=out,
        inputs=args.inputs,
        seconds=args.seconds,
        seed=args.seed,
        real_share=0 if args.tiny_only else args.real_share,
        log=lambda s: print(s, flush=True),
        progress=300,
    )
    load_end = os.getloadavg()
    print(
        f"fuzz: {report.inputs} inputs in {report.seconds:.0f} s, {report.rate:.0f} inputs/s, "
        f"{sum(c for c, _, _ in report.escapes.values())} escapes ({len(report.escapes)} kinds); "
        f"load average {load[0]:.2f} at the start, {load_end[0]:.2f} at the end; {time.strftime('%F %T')}"
    )
    print(f"slowest input: {WORST.get('cpu_target')} on {json.dumps(WORST.get('cpu_input'))[:400]}")
    print(
        f"worst input: {WORST['cpu_s']:.3f} s CPU in one target (limit {CPU_LIMIT_S}), peak RSS growth "
        f"{WORST['rss_mib']:.1f} MiB (limit {MEM_FLOOR >> 20} MiB + {MEM_FACTOR}x the file)"
        + f"; at most {WORST['rss_share']:.0%} of its limit used (a {WORST['rss_size'] / 1e3:.0f} kB input)"
    )
    if args.outcomes:
        print(f"what load_cache(strict=False, allow_unverified=True) made of them ({len(report.outcomes)} kinds):")
        for what, count in report.outcomes.most_common(args.outcomes):
            print(f"  {count:>7}  {what}")
    for sig, (count, esc, where) in report.escapes.items():
        print(f"  {count:>6} x {sig}\n           {esc.detail[:200]}\n           reproducer {where}")
    return 1 if report.escapes else 0


if __name__ == "__main__":
    sys.exit(main())
