"""kvlab sweep: a grid of papermill runs on Dask, recorded as data, resumable, refusing bad studies."""

from __future__ import annotations

import ast
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import papermill as pm
import pytest
import torch

import kvlab
from conftest import study_module
from kvlab.cli import main as cli
from kvlab.errors import StudyError
from kvlab.findings import curve
from kvlab.findings.records import make_record, read_records
from kvlab.findings.rows import read_rows, write_rows
from kvlab.sweep.point import read_points, run_point
from kvlab.sweep.run import plan, run_study
from kvlab.sweep.study import load_study

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sweep_fixture.ipynb"
DEFAULT_TEXT = ast.literal_eval(pm.inspect_notebook(str(FIXTURE))["text"]["default"])


def write_study(folder: Path, body: str, name: str = "study.toml") -> Path:
    path = folder / name
    path.write_text(f'notebook = "{FIXTURE}"\noutput = "{folder / "out"}"\n{body}')
    return path


def direct(model_name: str, offset: int) -> tuple[float, int]:
    """What the fixture notebook records, computed here the same way (one thread, as in the notebook)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = kvlab.load_model(model_name)
        cached = kvlab.prefill(model, DEFAULT_TEXT)
        landed = kvlab.prefill(model, DEFAULT_TEXT, start=offset)
        err = max((a.keys - b.keys).abs().max().item() for a, b in zip(cached.cache.layers, landed.cache.layers))
    finally:
        torch.set_num_threads(threads)
    return make_record("x", err)["value"], cached.length


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grid")
    path = write_study(folder, '[grid]\nmodel_name = ["tiny-llama", "tiny-qwen2"]\noffset = [4, 64]\n')
    study = load_study(path)
    t0 = time.perf_counter()
    result = run_study(study, workers=2, progress=False)
    return path, study, result, time.perf_counter() - t0


def test_grid_table_matches_values_recomputed_directly(grid):
    path, study, result, _ = grid
    assert result.ran == 4 and result.skipped == 0 and not result.failed
    rows = read_csv(study.output / "results.csv")
    assert len(rows) == 8  # 4 points x 2 metrics, one row each
    seen = set()
    for model_name in ("tiny-llama", "tiny-qwen2"):
        digest = kvlab.fingerprint(kvlab.load_model(model_name), weights=True)["weights_sha256"]
        for offset in (4, 64):
            value, length = direct(model_name, offset)
            mine = {r["metric"]: r for r in rows if r["model_name"] == model_name and r["offset"] == str(offset)}
            assert set(mine) == {"phase_error_max", "tokens"}
            assert float(mine["phase_error_max"]["value"]) == value and value > 0
            assert int(mine["phase_error_max"]["n"]) == length and int(mine["tokens"]["value"]) == length
            assert all(r["status"] == "ok" and r["model_weights_sha256"] == digest for r in mine.values())
            seen.add(mine["tokens"]["point"])
            rec = json.loads((study.output / "points" / mine["tokens"]["point"] / "record.json").read_text())
            assert rec["parameters"] == {"model_name": model_name, "offset": offset}
            assert rec["versions"]["torch"] == torch.__version__ and rec["versions"]["transformers"] == "5.24.0"
            assert rec["code"]["git_commit"] and len(rec["code"]["notebook_sha256"]) == 64 and rec["wall_s"] > 0
    assert len(seen) == 4
    # The offset matters: a later landing position is a larger rotation error on both models.
    for model_name in ("tiny-llama", "tiny-qwen2"):
        assert direct(model_name, 64)[0] != direct(model_name, 4)[0]


def test_grid_writes_reports_and_a_summary_page(grid):
    _, study, result, _ = grid
    index = (study.output / "index.html").read_text()
    for rec in result.records:
        folder = study.output / "points" / rec["point"]
        assert (folder / "notebook.html").stat().st_size > 1000
        assert read_records(folder / "notebook.ipynb") and f"points/{rec['point']}/notebook.html" in index
    plots = sorted(p.name for p in (study.output / "plots").glob("*.png"))
    assert plots == [
        "phase_error_max__model_name.png",
        "phase_error_max__offset.png",
        "tokens__model_name.png",
        "tokens__offset.png",
    ]
    assert all(f"plots/{p}" in index for p in plots)
    # No temporary file is left behind.
    assert not [p for p in study.output.rglob("*") if ".tmp" in p.name]


def test_resume_skips_what_is_done_and_force_or_new_code_reruns(grid, capsys):
    path, study, first, _ = grid
    again = run_study(load_study(path), progress=False)  # nothing to run: no cluster starts
    assert again.ran == 0 and again.skipped == 4
    assert [r["wall_s"] for r in again.records] == [r["wall_s"] for r in first.records]
    todo, done = plan(study, study.output, force=True)
    assert len(todo) == 4 and not done
    # A record made by other code does not count as done.
    rec_path = study.output / "points" / first.records[0]["point"] / "record.json"
    saved = rec_path.read_text()
    try:
        rec = json.loads(saved)
        rec["code"]["notebook_sha256"] = "0" * 64
        rec_path.write_text(json.dumps(rec))
        todo, done = plan(study, study.output)
        assert [t["point"] for t in todo] == [first.records[0]["point"]] and len(done) == 3
    finally:
        rec_path.write_text(saved)
    assert cli(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 points (0 to run, 4 done)" in out and out.count("  done  ") == 4


def test_failures_and_lost_workers_are_recorded_and_the_rest_finish(tmp_path, capfd):
    path = write_study(
        tmp_path, "[zip]\noffset = [4, 5, 7]\nfail = [false, true, false]\nkill_worker = [false, false, true]\n"
    )
    assert cli(["sweep", str(path), "--workers", "2"]) == 1
    err = capfd.readouterr().err  # the workers' stderr too
    assert "RuntimeError: failing on purpose at offset 5" in err and "worker lost" in err
    assert "does not end in one of" not in err, "papermill's warning about the temporary notebook name is shown"
    rows = {r["offset"]: r for r in read_csv(tmp_path / "out" / "results.csv") if r["metric"] != "tokens"}
    assert rows["4"]["status"] == "ok" and float(rows["4"]["value"]) == direct("tiny-llama", 4)[0]
    assert rows["5"]["status"] == "failed" and "failing on purpose" in rows["5"]["error"] and rows["5"]["metric"] == ""
    assert rows["7"]["status"] == "failed" and "worker lost" in rows["7"]["error"]
    # The failed point's notebook is kept, as far as it ran, with its HTML.
    failed = tmp_path / "out" / "points" / rows["5"]["point"]
    assert "failing on purpose" in (failed / "notebook.ipynb").read_text() and (failed / "notebook.html").exists()
    assert "Failures" in (tmp_path / "out" / "index.html").read_text()
    # A rerun skips the finished point and retries the failed ones.
    todo, done = plan(load_study(path), tmp_path / "out")
    assert [d["parameters"]["offset"] for d in done] == [4]
    assert sorted(t["parameters"]["offset"] for t in todo) == [5, 7]


def test_a_point_past_its_timeout_is_killed_and_recorded(tmp_path):
    # run_point is what a worker runs; called here directly, the timeout needs no cluster.
    study = load_study(write_study(tmp_path, "timeout = 4\n[parameters]\nsleep_s = 600\n"))
    (task,), _ = plan(study, study.output)
    t0 = time.perf_counter()
    rec = run_point(task)
    assert time.perf_counter() - t0 < 30
    assert rec["status"] == "failed" and rec["error"] == "timed out after 4 s (kernel killed)" and rec["records"] == []
    assert json.loads((Path(task["folder"]) / "record.json").read_text())["error"] == rec["error"]


def test_external_scheduler_and_worker_on_loopback(tmp_path):
    dask = str(Path(sys.executable).parent / "dask")
    sched_file = tmp_path / "scheduler.json"
    procs = [
        subprocess.Popen(
            [
                dask,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(sched_file),
            ],
            stderr=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(sched_file.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        procs.append(
            subprocess.Popen(
                [
                    dask,
                    "worker",
                    address,
                    "--nthreads",
                    "1",
                    "--nworkers",
                    "1",
                    "--no-dashboard",
                    "--memory-limit",
                    "2GiB",
                ],
                stderr=subprocess.DEVNULL,
                cwd=tmp_path,
                env=dict(os.environ),
            )
        )
        path = write_study(tmp_path, "[grid]\noffset = [8]\n")
        result = run_study(load_study(path), scheduler=address, progress=False)
        assert result.ran == 1 and not result.failed
        (row,) = [r for r in read_csv(tmp_path / "out" / "results.csv") if r["metric"] == "phase_error_max"]
        assert float(row["value"]) == direct("tiny-llama", 8)[0]
        # The point ran in the external worker, not in this process or a local cluster.
        from distributed import Client

        with Client(address, timeout=30) as client:
            workers = set(client.scheduler_info()["workers"])
        assert result.records[0]["worker"] in workers and len(workers) == 1
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.parametrize(
    "body, words",
    [
        ("[grid]\noffset = [4]\n", None),  # the valid baseline of the cases below
        ("[grid]\noffset = []\n", "[grid] offset is empty"),
        (
            "[grid]\nofset = [4]\n",
            "[grid] ofset: unknown parameter 'ofset': notebook sweep_fixture.ipynb declares model_name",
        ),
        ('[grid]\noffset = ["4"]\n', "[grid] offset: parameter 'offset' must be int"),
        ("[grid]\noffset = [4.5]\n", "parameter 'offset' must be int"),
        ("[grid]\nfail = [1]\n", "[grid] fail: parameter 'fail' must be bool"),
        ("[parameters]\ntext = 3\n", "[parameters] text: parameter 'text' must be str"),
        ("[grid]\noffset = 4\n", "[grid] offset must be a list of values"),
        ("[zip]\noffset = [4, 5]\nfail = [false]\n", "[zip] lists must have one length"),
        ("seeds = [0, 1]\n", "key 'seeds': unknown parameter 'seed'"),
        ("timeout = -1\n", "key 'timeout' must be a positive number"),
        ("repeats = 0\n", "key 'repeats' must be a positive integer"),
        ("gird = 1\n", "unknown key(s) 'gird'"),
        ("[grid]\noffset = [4, 4]\n", "the grid repeats a point"),
        ("[grid\n", "is not valid TOML"),
    ],
)
def test_bad_studies_are_refused_naming_the_key_and_nothing_runs(tmp_path, capsys, body, words):
    path = write_study(tmp_path, body)
    if words is None:
        assert len(load_study(path).points) == 1
        return
    with pytest.raises(StudyError) as e:
        load_study(path)
    assert words in str(e.value) and isinstance(e.value, kvlab.KvlabError)
    assert cli(["sweep", str(path)]) == 2
    assert "StudyError" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_grid_zip_and_repeats_expand_into_distinct_points(tmp_path):
    path = write_study(
        tmp_path,
        "repeats = 2\n[parameters]\nscale = 2\n[grid]\noffset = [4, 8]\n"
        "[zip]\nfail = [false, true]\nsleep_s = [0, 1]\n",
    )
    study = load_study(path)
    assert study.axes == ["offset", "fail", "sleep_s", "repeat"]
    combos = [(p.parameters["offset"], p.parameters["fail"], p.parameters["sleep_s"], p.repeat) for p in study.points]
    assert combos == [(o, f, s, r) for o in (4, 8) for f, s in ((False, 0), (True, 1)) for r in (0, 1)]
    assert all(p.parameters["scale"] == 2 for p in study.points)  # an int where the default is a float
    assert len({p.folder_name for p in study.points}) == 8
    # The same study read again names its points the same (resume depends on it).
    assert [p.folder_name for p in load_study(path).points] == [p.folder_name for p in study.points]


def test_unknown_notebook_names_the_suite(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('notebook = "01_phase_eror"\n[grid]\nseed = [0]\n')
    with pytest.raises(StudyError, match="key 'notebook': unknown notebook '01_phase_eror'.*01_phase_error"):
        load_study(path)
    path.write_text('notebook = "01_phase_error"\n[grid]\nn_fragments = [3, 4]\n')
    study = load_study(path)  # a suite name resolves to notebooks/
    assert study.notebook.name == "01_phase_error.ipynb" and len(study.points) == 2


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[2] / "studies").glob("*.toml")), ids=lambda p: p.stem
)
def test_shipped_studies_check_against_their_notebooks(path):
    study = load_study(path)
    # A suite notebook, or a study's own notebook beside its TOML (it imports the study's script).
    assert len(study.points) >= 2 and study.notebook.parent.name in ("notebooks", "studies") and study.axes


def test_a_study_notebook_beside_its_toml_runs_its_script(tmp_path):
    # studies/recompute_curve.ipynb imports studies/recompute_curve.py from its own folder; one small point.
    nb = Path(__file__).resolve().parents[2] / "studies" / "recompute_curve.ipynb"
    path, out = tmp_path / "curve.toml", tmp_path / "out"
    path.write_text(
        f'notebook = "{nb}"\noutput = "{out}"\n[parameters]\nratios = [0.1, 0.5]\ntokens = 64\nsets = 2\n'
        f'rows_dir = "{out}"\n[grid]\nmodel_name = ["tiny-llama"]\npolicy = ["deviation"]\n'
    )
    result = run_study(load_study(path), workers=1, progress=False)
    assert not result.failed, result.failed
    got = {r["metric"]: r for r in read_csv(out / "results.csv")}
    value = {m: float(r["value"]) for m, r in got.items()}
    # The curve ends at r* (every token after fragment 0 recomputed: the joined prefill), not at 1.
    assert 0 < value["removed_r0.1"] < value["removed_r0.5"] <= 1 and 0.1 < value["r90"] <= value["r_star"] < 1

    recompute_curve = study_module("recompute_curve")
    rows = read_rows(out / "rows_tiny-llama_deviation.csv")
    stars = curve.r_star(rows)
    assert len(stars) == 2 and value["r_star"] == pytest.approx(sum(stars.values()) / 2, rel=1e-5)
    # The committed rows give back the recorded r90 and its interval (records keep 6 significant digits).
    doc = recompute_curve.summarise(rows, [0.1, 0.5], ["deviation"], 0)
    for field, col in (("mean", "value"), ("lo", "ci_low"), ("hi", "ci_high")):
        assert doc["r90"]["deviation"][field] == pytest.approx(float(got["r90"][col]), rel=1e-5)
    table = recompute_curve.sweep_table(out)
    assert f"| {doc['r90']['deviation']['r_star']:.2f} (" in table
    # The anchor is what the curve ends at: past the last ratio it runs to (r*, 1), not (1, 1) as the
    # first run had it; ratios at or past r* are left out (the curve is 1 from r* on).
    assert curve.crossing([0.1, 0.5], [0.3, 0.6], end=0.7) == pytest.approx(0.5 + 0.3 * 0.2 / 0.4)
    assert curve.crossing([0.1, 0.5], [0.3, 0.6], end=1.0) == pytest.approx(0.5 + 0.3 * 0.5 / 0.4)
    assert curve.crossing([0.1, 0.5, 0.8], [0.3, 0.6, 0.7], end=0.7) == pytest.approx(0.5 + 0.3 * 0.2 / 0.4)


def test_the_naive_dose_study_asks_every_passage_at_every_count_and_keeps_its_rows(tmp_path):
    # studies/naive_dose.ipynb on a tiny model: both axes, two caches a count; the count axis's rows go to a CSV
    # from which the sweep table recomputes every interval.
    nb = Path(__file__).resolve().parents[2] / "studies" / "naive_dose.ipynb"
    path = tmp_path / "dose.toml"
    out = tmp_path / "out"
    path.write_text(
        f'notebook = "{nb}"\noutput = "{out}"\n[parameters]\ncounts = [2, 4]\ntokens = 48\nlengths = [32, 64]\n'
        f'length_count = 3\nsets = 2\nrows_dir = "{out}"\n[grid]\nmodel_name = ["tiny-llama"]\n'
        'axis = ["count", "length"]\n'
    )
    result = run_study(load_study(path), workers=1, progress=False)
    assert not result.failed, result.failed
    got = {(r["axis"], r["metric"]): r for r in read_csv(out / "results.csv")}
    # Every passage's two questions at every count, behind both sets' caches; count 1 is not run.
    assert got["count", "counts_k2"]["n"] == "8" and got["count", "counts_k4"]["n"] == "16"
    assert ("count", "counts_k1") not in got
    assert {f"cells_k4_p{p}" for p in range(4)} | {"offsets_p3", "relative_early", "relative_late"} <= {
        m for a, m in got if a == "count"
    }
    # Order at a fixed offset: passage 1 last of 2 against early of 4, paired by set and question kind.
    assert got["count", "direct_d0"]["n"] == "4"
    assert {("length", "length_32"), ("length", "length_64")} <= set(got)

    naive_dose = study_module("naive_dose")
    rows = naive_dose.read_rows(out / "rows_tiny-llama.csv")
    for k in (2, 4):
        for j in (0, 1):
            asked = {r["answer_passage"] for r in rows if r["n_fragments"] == k and r["set"] == j}
            assert asked == set(range(k))
    # The CSV gives back what the point recorded (records keep 6 significant digits).
    doc = naive_dose.summarise_count(rows)
    assert float(got["count", "cells_k4_p1"]["value"]) == pytest.approx(
        doc["cells"]["k4_p1"]["span_kl"]["diff"]["mean"], rel=1e-5, abs=1e-9
    )
    table = naive_dose.sweep_table(out)
    assert "tiny-llama, count axis" in table and "tiny-llama, length axis" in table
    assert "last of 2 - early of 4" in table and "| 4, passage 3 (" in table


def test_the_gemma_controls_study_reads_every_ablation(tmp_path):
    nb = Path(__file__).resolve().parents[2] / "studies" / "gemma_controls.ipynb"
    path = tmp_path / "controls.toml"
    path.write_text(
        f'notebook = "{nb}"\noutput = "{tmp_path / "out"}"\n[parameters]\nmodel_name = "tiny-gemma3"\nsets = 2\n'
        f'rows_dir = "{tmp_path / "out"}"\n[grid]\ntokens = [24, 48]\n'
    )
    result = run_study(load_study(path), workers=1, progress=False)
    assert not result.failed, result.failed
    got = {(r["tokens"], r["metric"]): float(r["value"]) for r in read_csv(tmp_path / "out" / "results.csv")}
    for t in ("24", "48"):
        # Exact K/V on one layer type removes part of rerotate's gap, never more than all of it; naive's excess
        # over rerotate is ~1e-8 nats on this random tiny model, so its shares may be undefined (NaN), never wrong.
        assert got[t, "share_exact_sliding_only_of_rerotate_gap"] <= 1
        assert got[t, "share_exact_full_only_of_rerotate_gap"] <= 1
        assert not got[t, "share_rerotate_full_only_of_naive_excess"] > 1
        assert got[t, "naive_minus_rerotate_span_kl"] == pytest.approx(
            got[t, "naive_span_kl"] - got[t, "rerotate_span_kl"], abs=1e-3
        )

    # Each point's committed rows give back every interval it recorded (records keep 6 significant digits).
    gemma_controls = study_module("gemma_controls")
    table = gemma_controls.sweep_table(tmp_path / "out")
    rows = [line for line in table.splitlines() if line.startswith("| 24 ") or line.startswith("| 48 ")]
    assert len(rows) == 2 and all(line.endswith("| rows |") for line in rows)
    point = next(p for p in read_points(tmp_path / "out") if p["parameters"]["tokens"] == 48)
    again, from_rows = gemma_controls._recorded(point, tmp_path / "out")
    assert from_rows
    checked = 0
    for r in point["records"]:
        for field in ("value", "ci_low"):
            want = float(r[field]) if r.get(field) is not None else float("nan")
            if r["name"] in again and want == want:  # NaN shares (no excess to remove) stay NaN
                assert float(again[r["name"]][field]) == pytest.approx(want, rel=1e-5, abs=1e-12), r["name"]
                checked += 1
    assert checked > 20


def test_the_finetune_dose_notebook_runs_its_script(tmp_path):
    # studies/finetune_dose.ipynb imports studies/finetune_dose.py; one small point on a tiny model.
    nb = Path(__file__).resolve().parents[2] / "studies" / "finetune_dose.ipynb"
    path, out = tmp_path / "dose.toml", tmp_path / "out"
    path.write_text(
        f'notebook = "{nb}"\noutput = "{tmp_path / "out"}"\n[parameters]\nsteps = [0, 1, 2]\nn_caches = 2\n'
        "passage_tokens = 48\nmax_questions = 2\ncheck_step = 1\n"
        f'rows_dir = "{out}"\n[grid]\nmodel_name = ["tiny-llama"]\n'
    )
    result = run_study(load_study(path), workers=1, progress=False)
    assert not result.failed, result.failed
    got = {r["metric"]: r for r in read_csv(out / "results.csv")}
    value = {m: float(r["value"]) for m, r in got.items()}
    assert value["span_kl_step0"] == 0 and value["kl_step0"] == 0 and value["refused_step0"] == 0  # the producer
    assert value["refused_step1"] == value["refused_step2"] == 1 and value["nested_check"] == 1
    assert 0 < value["span_kl_step1"] and 0 < value["span_kl_step2"]

    # The committed rows give back every interval the point recorded (records keep 6 significant digits).
    finetune_dose = study_module("finetune_dose")
    rows = read_rows(out / "rows_tiny-llama.csv", text=("reader", "kind"))
    assert {(r["reader"], r["cache"]) for r in rows} == {(f"step{k}", c) for k in (0, 1, 2) for c in (0, 1)}
    doc = finetune_dose.step_entries(rows, [0, 1, 2], {0: None, 1: ["x"], 2: ["x"]})
    for k in (1, 2):
        for m, key in (("span_kl", f"span_kl_step{k}"), ("kl", f"kl_step{k}")):
            for field, col in (("mean", "value"), ("lo", "ci_low"), ("hi", "ci_high")):
                assert doc[str(k)][m][field] == pytest.approx(float(got[key][col]), rel=1e-5, abs=1e-12)
    d = doc["2"]["span_kl_minus_previous"]
    assert d["mean"] == pytest.approx(float(got["span_kl_step2_minus_step1"]["value"]), rel=1e-5, abs=1e-12)
    table = finetune_dose.sweep_table(out)
    assert "every interval recomputed from rows_tiny-llama.csv" in table
    # The teeth: one changed score in the CSV changes the table sweep_table prints.
    rows[-1]["span_kl"] += 1.0
    write_rows(out / "rows_tiny-llama.csv", rows)
    assert finetune_dose.sweep_table(out) != table
