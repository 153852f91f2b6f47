"""The documentation is executable: every command it shows runs, and its result tables match a run.

The pages are the README, every ``docs/*.md``, ``benchmarks/README.md`` and
``results/README.md``. Commands come from the pages themselves (their ```bash blocks), so a
command added there is run here without anyone editing this file. ``make`` lines are checked
against the Makefile's targets; ``make test`` is CI's own entry point, and the ``kvlab``
commands that ``make report`` runs are shown on a page and run here. ```console and ```text
blocks are examples (paths that are the reader's, placeholders) and are not run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import intervals_not_in, results_section, study_module

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [
    README,
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
    ROOT / "results" / "README.md",
]
KVLAB = [sys.executable, "-m", "kvlab.cli"]
README_MAX_LINES = 200


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _fenced(page: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of a page, in order (an opening fence names its language)."""
    blocks, lang, body = [], None, []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{_rel(page)} ends inside a fenced block"
    return blocks


def _prose(page: Path) -> str:
    """A page without its fenced blocks."""
    out, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


def _blocks(lang: str, pages=PAGES) -> list[tuple[Path, str]]:
    return [(page, text) for page in pages for block_lang, text in _fenced(page) if block_lang == lang]


def page_commands(pages=PAGES) -> list[tuple[Path, str]]:
    """``(page, line)`` for every shell command line of the pages' ```bash blocks (comments stripped)."""
    out = []
    for page, block in _blocks("bash", pages):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append((page, line))
    return out


def _is_kvlab(command: str) -> bool:
    return re.match(r"(\.venv/bin/)?kvlab ", command) is not None


# Each distinct kvlab command runs once, named after the first page that shows it.
KVLAB_COMMANDS: dict[str, Path] = {}
for _page, _command in page_commands():
    if _is_kvlab(_command):
        KVLAB_COMMANDS.setdefault(_command, _page)
MAKE_COMMANDS = [c for _, c in page_commands() if c.startswith("make ")]


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    shown = [c for _, c in page_commands([README])]
    for target in ("report", "test", "lab", "test-fast", "lint"):
        assert f"make {target}" in shown, target
    # Every other page is one link away from the README.
    linked = {(README.parent / t).resolve() for t, _ in _links(README)}
    assert all(p.exists() for p in PAGES)
    assert [_rel(p) for p in PAGES[1:] if p not in linked] == []


def test_pages_show_commands_and_every_line_is_one_we_run():
    assert KVLAB_COMMANDS and "make report" in MAKE_COMMANDS and "make test" in MAKE_COMMANDS
    other = [(_rel(p), c) for p, c in page_commands() if not _is_kvlab(c) and not c.startswith("make ")]
    # Anything else a reader is told to type must be runnable here too; list it explicitly.
    allowed = re.compile(
        r"^(pip install |conda env create |\.venv/bin/python |KVLAB_CACHE=|dask (scheduler|worker) |CI=true bash \.ci/run$)"
    )
    assert [(p, c) for p, c in other if not allowed.match(c)] == []


def test_make_targets_on_the_pages_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    for cmd in MAKE_COMMANDS:
        assert cmd.split()[1] in targets, cmd


def test_make_report_runs_commands_the_pages_show():
    # `make report` is `kvlab models --prepare`, `kvlab peers --prepare` and `kvlab report --out
    # reports`, commands shown on a page and run by test_page_kvlab_command. make runs a prepare
    # once per model (two at once), so a recipe line is covered by a shown line that is the same
    # command with that model among its names.
    dry = subprocess.run(
        ["make", "-n", "-W", ".venv/.kvlab-setup", "report"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    recipe = [l.replace(".venv/bin/", "").split() for l in dry.splitlines() if l.startswith(".venv/bin/kvlab ")]
    shown = [c.replace(".venv/bin/", "").split() for c in KVLAB_COMMANDS]

    def covered(line):
        return any(s[:3] == line[:3] and set(line[3:]) <= set(s[3:]) for s in shown)

    assert len(recipe) >= 4 and all(covered(r) for r in recipe), (recipe, shown)
    assert not covered(["kvlab", "models", "--prepare", "no-such-model"]), "the check has teeth"


@pytest.mark.real
@pytest.mark.parametrize("command", [pytest.param(c, id=f"{_rel(p)}: {c}") for c, p in KVLAB_COMMANDS.items()])
def test_page_kvlab_command(command, tmp_path):
    argv = shlex.split(command)[1:]
    if "--out" in argv:  # write reports into the test's own folder, not the checkout
        argv[argv.index("--out") + 1] = str(tmp_path / "reports")
    elif argv[0] == "report":  # the default is ./reports: keep the checkout clean
        argv += ["--out", str(tmp_path / "reports")]
    if argv[0] == "report" and "--only" not in argv:
        # A report of every notebook runs each one once more; nbval already runs every notebook
        # (and test_every_notebook_runs_on_gemma3 on Gemma 3), so here the command runs as written
        # on its quickest notebook: what is tested is the command, not the notebooks again.
        argv += ["--only", "02_kv_heatmaps"]
    run = subprocess.run(KVLAB + argv, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    if argv[0] == "report":
        index = (tmp_path / "reports" / "index.html").read_text()
        assert "(no finding printed)" not in index


@pytest.mark.real
def test_readme_quickstart_runs(tmp_path):
    quickstart = next(text for page, text in _blocks("python", [README]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-c", quickstart], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert (tmp_path / "memory.kvcache").exists()


# -- links and names ---------------------------------------------------------------------------


def _links(page: Path) -> list[tuple[str, str]]:
    """``(path, anchor)`` of every relative link and image of a page (web links left out)."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", _prose(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_point_at_files_and_headings_that_exist(page):
    for path, anchor in _links(page):
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{_rel(page)} links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"{_rel(page)} links to {path}#{anchor}: no such heading"


def _code_spans(page: Path) -> list[str]:
    """Inline code of the prose and the lines of ```bash blocks."""
    return re.findall(r"`([^`\n]+)`", _prose(page)) + [block for _, block in _blocks("bash", [page])]


# A path into the checkout: under one of its tracked top folders. Placeholders (<stem>, NN_name,
# NAME, globs, elisions) are left out; so are folders that runs create (runs/, reports/).
REPO_PATH = re.compile(r"^(kvlab|tests|notebooks|studies|scripts|docs|benchmarks|results|\.ci)/[\w./-]*$")
PLACEHOLDER = re.compile(r"[<>*]|NN_|NAME|\.\.\.")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_paths_in_code_exist(page):
    missing = []
    for span in _code_spans(page):
        for word in span.split():
            word = word.strip("'\",;:()[]")
            if REPO_PATH.match(word) and not PLACEHOLDER.search(word) and not (ROOT / word).exists():
                missing.append(word)
    assert missing == [], f"{_rel(page)} names paths that do not exist: {missing}"


def _resolve(dotted: str) -> object:
    """The object a dotted ``kvlab.x.y`` name means: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_kvlab_names_in_code_resolve(page):
    # `kvlab.x.y` in the prose must name a module or object that exists (module paths are
    # kvlab.<folder>.<module>; the public API is kvlab.*).
    bad = []
    for span in _code_spans(page):
        for dotted in re.findall(r"(?<![\w./])kvlab(?:\.\w+)+", span):
            try:
                _resolve(dotted)
            except (ImportError, AttributeError) as e:
                bad.append(f"{dotted} ({e})")
    assert bad == [], f"{_rel(page)} names what kvlab does not have: {bad}"


# -- the pages' result tables against a run ------------------------------------------------------


def test_foreign_reader_tables_are_recomputed_from_the_committed_rows(tmp_path):
    # Notebook 03 at full scale (studies/foreign_readers.py) commits one row per reader, cache and
    # question; the page prints the tables recomputed from them, so a reader can redo every interval.
    from kvlab.findings import readers

    page = results_section("## Foreign readers (notebook 03)")
    printed = readers.committed_markdown(ROOT / "results", ("smollm2-135m", "gemma3-270m"))
    assert printed.count("#### ") == 2 and printed.strip() in page, "regenerate: studies/foreign_readers.py --markdown"
    assert intervals_not_in(page, printed) == [], "the prose quotes only the tables' intervals"
    # Teeth: one question's score changed in a copy of the rows changes what is printed.
    for suffix in ("csv", "json"):
        src = readers.committed_path(ROOT / "results", "smollm2-135m", suffix)
        (tmp_path / src.name).write_text(src.read_text())
    csv_ = readers.committed_path(tmp_path, "smollm2-135m")
    lines = csv_.read_text().splitlines()
    head = lines[0].split(",")
    cells = lines[1].split(",")
    cells[head.index("span_kl")] = "0.5"
    csv_.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert readers.committed_markdown(tmp_path, ("smollm2-135m",)).strip() not in page


def _check_block() -> str:
    """The one shown output of a plain ``kvlab check`` (a block, not run, whose first line is the command)."""
    found = [
        text
        for page in PAGES
        for lang, text in _fenced(page)
        if lang != "bash" and re.match(r"\$ kvlab check(\s+#|\s*$)", text.lstrip().splitlines()[0])
    ]
    assert len(found) == 1, len(found)
    return found[0]


# Max |K| or |V| differences below this are fp32 rounding: five orders under naive's phase error.
FP32_ROUNDING = 1e-4


def _rounding(word: str) -> str:
    """A value at fp32 rounding by its exponent alone, as notebooks/sanitize.cfg has nbval compare it."""
    return f"Ne{word.partition('e')[2]}" if float(word) < FP32_ROUNDING else word


@pytest.mark.real
def test_check_output_matches_a_run():
    block = _check_block()
    shown = {
        l.split()[0]: l.split()
        for l in block.splitlines()[1:]
        if l.split() and l.split()[0] in {"naive", "fail", "reprefill", "rerotate", "recompute"}
    }
    run = subprocess.run(KVLAB + ["check", "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    rows = {r["strategy"]: r for r in json.loads(run.stdout)}
    assert set(shown) == set(rows)
    for name, r in rows.items():
        words = shown[name]
        if "refused" in r:
            assert words[1] == "refused:" and " ".join(words[2:]).rstrip(".").rstrip() in r["refused"]
            continue
        # Every column but the last (wall time, which varies from run to run). The digits of a K/V
        # difference at fp32 rounding follow the CPU's kernels, so there only the exponent must
        # match; everything else matches digit for digit.
        want = [
            _rounding(f"{r['max_k_phase']:.3e}"),
            _rounding(f"{r['max_v_phase']:.3e}"),
            str(r["seq_len"]),
            f"{r['kl_mean']:.4f}",
            f"{r['kl_max']:.4f}",
            r["top1_agree"],
        ]
        got = [_rounding(words[1]), _rounding(words[2]), *words[3:7]]
        assert got == want, (name, words, want)


def _stored_text(name: str) -> str:
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


def test_notebook_06_numbers_on_the_page_are_its_stored_outputs():
    # The page's notebook-06 paragraph quotes the stored run, not an earlier one (issue 38, item 4).
    text = _stored_text("06_llama_cpp.ipynb")
    page = results_section("## Beside llama.cpp (notebook 06)")
    conv = re.search(r"n=12: KL mean (\S+) nats \[95% CI (\S+), (\S+)\], max (\S+); top-1 agreement", text)
    assert conv, "notebook 06 no longer prints its conversion line"
    assert f"mean {conv[1]} nats\n  [95% CI {conv[2]}, {conv[3]}], max {conv[4]}" in page
    prompts = [l for l in text.splitlines() if re.match(r"^'.*'\s+\d+\s+\S+\s+\S+\s+'", l)]
    flips = [l for l in prompts if l.endswith("DIFFERS")]
    assert len(prompts) == 12 and f"top-1 agrees on {12 - len(flips)}/12" in page
    for l in flips:
        a, b = re.findall(r"'([^']*)'", l.split("DIFFERS")[0])[-2:]
        assert f"` {a.strip()}`/` {b.strip()}`" in page
    f32 = re.search(r"on the F32 copy: KL mean (\S+) \[(\S+), (\S+)\]", text)
    assert f"agrees to {f32[1]} [{f32[2]}, {f32[3]}]" in page
    rows = {
        ("llama.cpp", "shift"): "shift-merge (`--cache-reuse`)",
        ("llama.cpp", "phase"): "fragment decoded at its landing positions",
        ("kvlab", "naive"): "naive",
        ("kvlab", "rerotate"): "rerotate",
        ("kvlab", "recompute r=0.15"): "recompute r=0.15",
        ("both", "joined"): "llama.cpp joined vs kvlab joined",
    }
    for (engine, method), shown in rows.items():
        m = re.search(
            rf"^{re.escape(engine)}\s+{re.escape(method)}\s+(joined|llama\.cpp joined)\s+(\S+)\s+\[(\S+), (\S+)\]\s+\S+\s+(\S+)$",
            text,
            flags=re.M,
        )
        assert m, (engine, method)
        top1 = round(float(m[5]) * 5)
        assert f"| {engine} | {shown} | {m[2]} [{m[3]}, {m[4]}] | {top1}/5 |" in page, (engine, method)
    corr = re.search(r"correlation (\S+); shift/rerotate mean ratio (\S+)", text)
    assert f"correlate at {corr[1]} (shift/rerotate mean ratio {corr[2]})" in page
    shift = re.search(r"decode: (\S+) nats on the Q4_1 file, (\S+) on its F32 copy", text)
    assert f"off by {shift[1]} on the Q4_1 file and\n  by {shift[2]} on the F32 copy" in page
    req = re.search(r"^state\s+Q4_0 requant\s+loads\s+(\S+)\s+(\S+)\s+(\d)/5", text, flags=re.M)
    assert f"KL {req[1]} nats mean\n  (max {req[2]}, top-1 flips on {req[3]} of 5 probes)" in page


def _text_block(section: str) -> str:
    """The section's first fenced ``text`` block."""
    return section.split("```text\n", 1)[1].split("\n```", 1)[0]


def _quoted_lines_not_stored(section: str, stored: str) -> list[str]:
    """Lines of the section's ``text`` block that are not lines of the stored outputs."""
    have = {line.rstrip() for line in stored.splitlines()}
    return [line for line in _text_block(section).splitlines() if line.rstrip() not in have]


def test_notebook_05_lines_on_the_page_are_its_stored_outputs():
    # The page quoted an earlier, larger run of notebook 05 (493 tokens, every policy resolved):
    # now it quotes the stored run's lines, each checked here, and nbval checks them against a run.
    stored = _stored_text("05_fidelity_vs_cost.ipynb")
    page = results_section("## Recompute policies (notebook 05)")
    block = _text_block(page)
    assert len(block.splitlines()) >= 20 and "Finding:" in block and "family:" in block
    assert "[cost" not in block, "wall-time figures vary by machine; nbval ignores them, so the page leaves them out"
    assert _quoted_lines_not_stored(page, stored) == []
    # Teeth: one changed digit in a quoted line is caught.
    altered = page.replace("0.4154 [", "0.4155 [", 1)
    assert altered != page and _quoted_lines_not_stored(altered, stored) != []


def test_a_quoted_interval_the_table_lacks_is_caught():
    assert intervals_not_in("we saw +0.12 [+0.05, +0.20] here", "| +0.12 [+0.05, +0.20] |") == []
    assert intervals_not_in("we saw +0.12 [+0.05, +0.21] here", "| +0.12 [+0.05, +0.20] |") == ["+0.12 [+0.05, +0.21]"]


def test_the_certificate_table_is_the_committed_certificates():
    # results/README.md's "Certificates" table is typed from results/certify/<model>.json: each
    # measured cell must be what those certificates hold, at the digits the table prints.
    page = results_section("## Certificates")
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:3] for line in page.splitlines() if line.startswith("| ")
    }
    certs = {
        m: json.loads((ROOT / "results" / "certify" / f"{m}.json").read_text()) for m in ("smollm2-135m", "gemma3-270m")
    }

    def values(model, check):
        return [(line["scope"], line["value"]) for line in certs[model]["lines"] if line["check"] == check]

    def by_layer(model, check):
        got = values(model, check)
        if len(got) == 1:
            return f"{got[0][1]:.2f}"
        return ", ".join(f"{scope.split('_')[0]} {v:.2f}" for scope, v in got)

    def floor(model):
        return "; ".join(
            (f"{v:.1e}" if v else "0")
            for v in (values(model, "floor: batch")[0][1], values(model, "floor: threads")[0][1])
        )

    def context(model):
        return " / ".join(f"{v:.3f}" for _, v in values(model, "context error"))

    want = {
        "rotation": by_layer,
        "rerotate phase": by_layer,
        "floor: batch; threads (nats)": lambda m, _: floor(m),
        "context error": lambda m, _: context(m),
    }
    for label, cell in want.items():
        row = next(v for k, v in rows.items() if k.startswith(label))
        for i, model in enumerate(certs):
            assert row[i] == cell(model, label), (label, model, row[i], cell(model, label))
    seconds = [round(certs[m]["seconds"]) for m in certs]
    assert f"SmolLM2 in {seconds[0]} s and Gemma 3 in {seconds[1]} s" in page
    assert all(c["passed"] for c in certs.values()) and page.count("**certified**") == 1


def test_attention_mass_tables_are_recomputed_from_the_committed_rows():
    # The SmolLM2 puzzle's experiment (d): the page prints studies/attention_mass.py --markdown.
    attention_mass = study_module("attention_mass")
    from kvlab.findings.rows import read_rows

    rows = read_rows(ROOT / "results" / "attention_mass_smollm2-135m.csv")
    page = results_section("## Where the question looks")
    assert attention_mass.table(rows) in page, "regenerate: studies/attention_mass.py --markdown"
    assert intervals_not_in(page, attention_mass.table(rows)) == [], "the prose quotes only the table's intervals"
    assert len({r["set"] for r in rows}) == 10 and {r["n_fragments"] for r in rows} == {2, 4, 8}
    # Teeth: one question's mass moved changes what is printed.
    rows[0] = {**rows[0], "first_tokens": rows[0]["first_tokens"] + 0.5}
    assert attention_mass.table(rows) not in page


def test_merge_puzzle_tables_are_recomputed_from_the_committed_rows():
    # The SmolLM2 puzzle's experiments (a)-(c): the page prints studies/merge_puzzle.py --markdown.
    from kvlab.findings import puzzle as study
    from kvlab.findings.rows import read_rows

    rows = read_rows(ROOT / "results" / "merge_puzzle_smollm2-135m.csv")
    page = results_section("## Settling the SmolLM2 puzzle")
    assert study.table(rows) in page, "regenerate: studies/merge_puzzle.py --markdown"
    assert intervals_not_in(page, study.table(rows)) == [], "the prose quotes only the table's intervals"
    # The issue asks for 20 caches per count.
    assert {r["n_fragments"] for r in rows} == {2, 4, 8} and len({r["set"] for r in rows}) == 20
    # Teeth: one question's score changed changes what is printed.
    rows[0] = {**rows[0], "span_kl": rows[0]["span_kl"] + 0.5}
    assert study.table(rows) not in page


def test_long_context_tables_and_prose_are_the_committed_records():
    # The long-context study's section prints studies/long_context_table.py (from each model's
    # JSON) and studies/long_context_strata.py (from the per-question rows); its prose quotes
    # only intervals those tables print.
    from kvlab.findings import strata

    table = study_module("long_context_table")
    page = results_section("## The long-context study")
    printed = []
    for model in ("smollm2-135m", "gemma3-270m"):
        printed.append(table.table(str(ROOT / "results" / f"long_context_{model}.json")))
        printed.append(strata.markdown(model, strata.read_rows(ROOT / "results" / f"long_context_{model}.csv")))
        assert printed[-2] in page, "regenerate: studies/long_context_table.py results/long_context_*.json"
        assert printed[-1] in page, "regenerate: studies/long_context_strata.py"
    missing = intervals_not_in(page, "\n".join(printed))
    assert missing == [], f"the prose quotes intervals no table prints: {missing}"
    # Teeth: an interval typed into the prose by hand is caught.
    typed = page.replace("## The long-context study", "## The long-context study\n\nnaive +0.123 [+0.101, +0.145]")
    assert intervals_not_in(typed, "\n".join(printed)) == ["+0.123 [+0.101, +0.145]"]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_long_context_records_are_what_their_rows_give(model, tmp_path):
    # The tables above print each model's JSON summary; summarised again from the committed
    # per-question rows (studies/long_context.py --resummarize), it prints the same.
    long_context, table = study_module("long_context"), study_module("long_context_table")
    for suffix in ("csv", "json"):
        shutil.copy(ROOT / "results" / f"long_context_{model}.{suffix}", tmp_path)
    long_context.resummarize(tmp_path, model)
    committed = table.table(str(ROOT / "results" / f"long_context_{model}.json"))
    assert table.table(str(tmp_path / f"long_context_{model}.json")) == committed
    # Teeth: one question's score changed in the rows changes what is printed.
    path = tmp_path / f"long_context_{model}.csv"
    lines = path.read_text().splitlines()
    head, cells = lines[0].split(","), lines[1].split(",")
    cells[head.index("span_kl")] = "9.5"
    path.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    long_context.resummarize(tmp_path, model)
    assert table.table(str(tmp_path / f"long_context_{model}.json")) != committed
