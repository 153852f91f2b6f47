"""A fuzzing run in one process: draw recipes, build and check each input, keep what escaped; replay stored ones."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed

from benchmarks.fuzz.build import build
from benchmarks.fuzz.contract import CURRENT, WORST, Escape, alarm, check, innermost_frame
from benchmarks.fuzz.recipes import recipes
from benchmarks.fuzz.seeds import Seed
from kvlab.models import sources


@contextlib.contextmanager
def models_loaded_once(seeds: list[Seed]):
    """``kvlab inspect --model NAME`` loads NAME on every call; here, the seed's model is reused."""
    by_name = {s.model.name: s.model for s in seeds}
    real = sources.load_model

    def load(name, *a, **k):
        return by_name[name] if name in by_name and not a and not k else real(name, *a, **k)

    sources.load_model = load
    try:
        yield
    finally:
        sources.load_model = real


@dataclasses.dataclass
class Report:
    inputs: int = 0
    seconds: float = 0.0
    escapes: dict = dataclasses.field(default_factory=dict)  # signature -> [count, Escape, reproducer]
    harness: dict = dataclasses.field(default_factory=dict)  # recipes the builder could not apply
    outcomes: Counter = dataclasses.field(default_factory=Counter)  # what the lenient load made of the inputs

    def add(self, esc: Escape, reproducer: Path | None) -> bool:
        entry = self.escapes.setdefault(esc.signature, [0, esc, reproducer])
        entry[0] += 1
        return entry[0] == 1

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds else 0.0


def fuzz(
    seeds: list[Seed],
    *,
    work: Path,
    out: Path | None,
    inputs: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    real_share: float = 0.1,
    batch: int = 500,
    also: int = 2,
    log=print,
    progress: float | None = None,
) -> Report:
    """Try mutated inputs until ``inputs`` were tried or ``seconds`` passed; return what escaped."""
    by_name = {s.name: s for s in seeds}
    work.mkdir(parents=True, exist_ok=True)
    path = work / "input.kvcache"
    report = Report()
    with models_loaded_once(seeds), warnings.catch_warnings(), alarm():
        warnings.simplefilter("ignore")
        for s in seeds:  # first reads allocate for good (torch, jsonschema): not an input's doing
            check(s.path, s.model, inspect_model=s.model.name)
            for esc in check(s.path, s.model, inspect_model=s.model.name, folder=True):
                raise RuntimeError(f"the seed {s.name} itself breaks the contract: {esc}")
    WORST.update(cpu_s=0.0, rss_mib=0.0, rss_share=0.0, rss_size=0)
    t0 = time.perf_counter()

    def done() -> bool:
        return (inputs is not None and report.inputs >= inputs) or (
            seconds is not None and time.perf_counter() - t0 > seconds
        )

    def one(drawn):
        # Drawing a recipe costs more than trying it (~15 ms against ~5 here), so each is also
        # tried on ``also`` other seeds of its kind: its edits mean the same in any kvlab header.
        kin = [s.name for s in seeds if s.real == by_name[drawn["seed"]].real and s.name != drawn["seed"]]
        start = int(hashlib.sha256(json.dumps(drawn).encode()).hexdigest(), 16)
        others = [kin[(start + i) % len(kin)] for i in range(min(also, len(kin)))] if kin else []
        for name in [drawn["seed"], *dict.fromkeys(others)]:
            if done():
                return  # the rest of hypothesis's batch: nothing more is tried
            try_one(dict(drawn, seed=name))

    def try_one(recipe):
        try:
            data = build(recipe, by_name)
        except Exception as e:  # noqa: BLE001 - a recipe the builder cannot apply: the fuzzer's bug, not kvlab's
            key = f"{type(e).__name__} at {innermost_frame(e.__traceback__) or traceback.extract_tb(e.__traceback__)[-1].lineno}"
            if key not in report.harness:
                log(f"fuzzer could not build an input ({key}): {e}; recipe {json.dumps(recipe)[:300]}")
            report.harness[key] = report.harness.get(key, 0) + 1
            return
        path.write_bytes(data)
        CURRENT["recipe"] = recipe
        if out is not None:  # what a crash leaves for the watching process
            (work / "input.json").write_text(json.dumps(recipe))
        s = by_name[recipe["seed"]]
        escapes = check(
            path,
            s.model,
            outcomes=report.outcomes,
            inspect_model=s.model.name if report.inputs % 50 == 0 else None,
            folder=report.inputs % 20 == 0,
        )
        report.inputs += 1
        for esc in escapes:
            where = save_reproducer(out, data, recipe, esc) if out is not None else None
            if report.add(esc, where):
                log(
                    f"ESCAPE #{len(report.escapes)} {esc.signature}\n    {esc.detail}\n    recipe {json.dumps(recipe)[:300]}"
                )

    run_seed, last = seed, [t0]
    with models_loaded_once(seeds), warnings.catch_warnings(), alarm():
        warnings.simplefilter("ignore")
        while True:
            runner = settings(
                max_examples=batch,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(hyp_seed(run_seed)(given(recipes(seeds, real_share))(one)))
            runner()
            run_seed += 1
            if progress and time.perf_counter() - last[0] > progress:  # what a run cut short still leaves
                last[0] = time.perf_counter()
                spent = last[0] - t0
                log(
                    f"progress: {report.inputs} inputs in {spent:.0f} s, {report.inputs / spent:.0f} inputs/s, "
                    f"{sum(c for c, _, _ in report.escapes.values())} escapes; load average {os.getloadavg()[0]:.2f}"
                )
            if done() or (inputs is None and seconds is None):
                break
    report.seconds = time.perf_counter() - t0
    return report


def save_reproducer(out: Path, data: bytes, recipe: dict, esc: Escape) -> Path:
    folder = out / "escapes"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(esc.signature.encode()).hexdigest()[:10]
    stem = folder / f"{key}-{hashlib.sha256(data).hexdigest()[:8]}"
    if len(list(folder.glob(f"{key}-*.kvcache"))) >= 3:  # three reproducers per kind of escape are plenty
        return stem.with_suffix(".kvcache")
    stem.with_suffix(".kvcache").write_bytes(data)
    record = {"recipe": recipe, "escape": dataclasses.asdict(esc), "size": len(data), "date": time.strftime("%F %T")}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, ensure_ascii=True) + "\n")
    return stem.with_suffix(".kvcache")


def replay(paths: list[Path], seeds: list[Seed], work: Path) -> int:
    """Rebuild each recipe (FILE.json) or read each input (FILE.kvcache) and check it again."""
    by_name = {s.name: s for s in seeds}
    work.mkdir(parents=True, exist_ok=True)
    bad = 0
    with models_loaded_once(seeds), alarm():
        for p in paths:
            record = json.loads(p.with_suffix(".json").read_text())
            recipe = record.get("recipe", record)
            target = work / p.with_suffix(".kvcache").name
            if p.suffix == ".kvcache":
                target.write_bytes(p.read_bytes())
            else:
                target.write_bytes(build(recipe, by_name))
            escapes = check(target, by_name[recipe["seed"]].model, inspect_model=by_name[recipe["seed"]].model.name)
            bad += bool(escapes)
            print(f"{p.name}: {'; '.join(e.signature + ': ' + e.detail for e in escapes) or 'no escape'}")
    return 1 if bad else 0
