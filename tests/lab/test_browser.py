"""The merge explorer proven in a real browser, end to end.

JupyterLab serves a temporary copy of notebooks/04_merge_explorer.ipynb (outputs and saved
widget state stripped, so everything shown comes from a live kernel); headless Chromium
(Debian's /usr/bin/chromium, driven by Playwright) runs all cells from the Run menu, waits for
the explorer, switches the strategy dropdown from naive to rerotate and reads the max phase
error off the rendered page. Then it drives the other controls as a user would, on the small
seeded tiny-gemma3 (two layer types, quick to merge): the model dropdown, the recompute
strategy with its policy and ratio, the "add fragment" button and the layer-type choice.
After each change it checks what the page draws: the readout and the KL table's caption name
the new model, strategy, options and fragment count, each figure's image was replaced exactly
once (one redraw per change), and the progress bar is gone once the change is drawn (and was
seen, naming its step, during the slower smollm2 changes). Screenshots go to test-artifacts/,
and the explorer's picture to docs/explorer.png for the README.

Skipped, with the reason, when Playwright or Chromium is missing (in CI, CI=true, it fails instead) (scripts/install-browser.sh
installs Chromium; `make test` runs it). Playwright's own browser download is never used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import missing

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "04_merge_explorer.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
DOCS_PNG = ROOT / "docs" / "explorer.png"
CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BUDGET_S = 200  # the browser session: page load, all cells, the changes (server start: SERVER_START_S)
SERVER_START_S = 40
STOP_S = 10  # graceful shutdown before the server's process group is killed


# -- a JupyterLab server that touches nothing of the user's ------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stripped_notebook(dest: Path) -> None:
    """Copy the notebook without outputs or saved widget state: the page must show live views."""
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if "parameters" in cell["metadata"].get("tags", []):
            # Every change shows its progress bar from its first step: whether a change outlasts
            # the default 0.3 s depends on the machine, and the bar's steps are what is checked.
            src = "".join(cell["source"])
            assert "progress_after = 0.3" in src
            cell["source"] = src.replace("progress_after = 0.3", "progress_after = 0.0")
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    nb["metadata"].pop("widgets", None)
    nb["metadata"].pop("papermill", None)
    dest.write_text(json.dumps(nb, indent=1))


def _write_settings(settings: Path) -> None:
    """Lab settings: no autosave, no news or update checks, every cell rendered (no windowing)."""
    files = {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    }
    for name, value in files.items():
        path = settings / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing or the server already gone
        return []


def _stop_server(proc: subprocess.Popen, base: str, token: str) -> None:
    """Shut down the server and its kernels; kill whatever is left after a bounded wait."""
    kids = _descendants(proc.pid)  # kernels run in sessions of their own: remember them now
    if proc.poll() is None:
        with contextlib.suppress(Exception):
            req = urllib.request.Request(
                f"{base}/api/shutdown", method="POST", data=b"", headers={"Authorization": f"token {token}"}
            )
            urllib.request.urlopen(req, timeout=5).close()
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
    for kid in kids:
        with contextlib.suppress(Exception):
            if kid.is_running():
                kid.kill()
                kid.wait(5)


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1, a free port and a random token, rooted in tmp_path."""
    root, home = tmp_path / "root", tmp_path / "jupyter"
    root.mkdir()
    _stripped_notebook(root / NOTEBOOK.name)
    _write_settings(home / "settings")
    port, token = _free_port(), secrets.token_hex(24)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        IPYTHONDIR=str(home / "ipython"),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.allow_root=True",
        "--ServerApp.terminals_enabled=False",
        f"--LabApp.user_settings_dir={home / 'settings'}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log_path = tmp_path / "jupyter.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{_tail(log_path)}")
            with contextlib.suppress(OSError):
                req = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within {SERVER_START_S}s:\n{_tail(log_path)}")
            time.sleep(0.3)
        yield {"url": f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", "log": log_path}
    finally:
        _stop_server(proc, base, token)


def _tail(path: Path, n: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return "(no log)"


# -- the browser --------------------------------------------------------------------------------


@pytest.fixture
def browser_page(tmp_path):
    """A page in headless Debian Chromium, driven by Playwright; skipped when either is missing (failed in CI)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing(
            "Playwright for Python is not installed (pip install playwright; its browser "
            "download is not needed: the test drives Debian's Chromium)"
        )
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing(
            f"Chromium not found at {CHROMIUM} (run scripts/install-browser.sh, or apt-get install "
            "chromium chromium-driver; KVLAB_CHROMIUM names another binary)"
        )
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 2400},
            timeout=30_000,
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            yield page
        finally:
            with contextlib.suppress(Exception):
                context.close()


# -- the test -----------------------------------------------------------------------------------

MAX_PHASE = ".kvlab-max-phase"
EXPLORER = f".jp-OutputArea-output .widget-vbox:has({MAX_PHASE})"
PLOT_IMGS = f"{EXPLORER} img"  # the plots inside the explorer widget


_RUN_STATE = """() => {
    if (document.querySelector('.jp-Dialog')) return 'dialog';
    if (document.querySelector('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')) return 'error';
    const outs = [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText).join('\\n');
    return /Finding: switching/.test(outs) ? 'done' : null;
}"""


def _wait_kernel_idle(page, timeout_ms: float) -> None:
    page.locator(".jp-StatusBar-Widget").get_by_text(re.compile(r"\| Idle$")).wait_for(timeout=timeout_ms)


def _run_all_cells(page, timeout_ms: float) -> None:
    """Run > Run All Cells, as a reader would."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=timeout_ms)
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click(timeout=timeout_ms)


_BLANK_IMGS = """imgs => imgs.map(img => {
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const ctx = c.getContext('2d');
    ctx.drawImage(img, 0, 0);
    const d = ctx.getImageData(0, 0, c.width, c.height).data;
    for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) return false;
    return true;
})"""


# Counts what the page redraws between two calls of _MONITOR_RESET: src replacements of each
# figure's <img>, rewrites of the KL table, and every progress label seen while the bar showed.
_MONITOR_INSTALL = """sel => {
    const ex = document.querySelector(sel);
    window.__kvlab = {src: {}, table: 0, shown: false, labels: []};
    const bar = ex.querySelector('.kvlab-progress');
    const look = () => {
        if (!bar || getComputedStyle(bar).display === 'none') return;
        window.__kvlab.shown = true;
        const label = bar.querySelector('.kvlab-progress-step');
        const text = label ? label.innerText : '';
        const l = window.__kvlab.labels;
        if (text && l[l.length - 1] !== text) l.push(text);
    };
    new MutationObserver(records => {
        const m = window.__kvlab;
        for (const r of records) {
            const t = r.target;
            if (r.type === 'attributes' && r.attributeName === 'src' && t.tagName === 'IMG') {
                const name = [...t.classList].find(c => c.startsWith('kvlab-plot-')) || 'other';
                m.src[name] = (m.src[name] || 0) + 1;
            }
            if (r.type === 'childList' && t.parentElement && t.parentElement.classList.contains('kvlab-kl-table')) m.table++;
        }
        look();
    }).observe(ex, {subtree: true, childList: true, attributes: true, characterData: true});
    return !!bar;
}"""
_MONITOR_RESET = "() => { Object.assign(window.__kvlab, {src: {}, table: 0, shown: false, labels: []}); }"
_CHANGE_DRAWN = """([sel, pattern, readoutPattern, tables]) => {
    const ex = document.querySelector(sel);
    const m = window.__kvlab;
    const readout = ex.querySelector('.widget-html-content:has(.kvlab-max-phase)');
    const caption = ex.querySelector('.kvlab-kl-table caption');
    const bar = ex.querySelector('.kvlab-progress');
    const imgs = [...ex.querySelectorAll('img')];
    return readout && new RegExp(readoutPattern).test(readout.innerText)
        && caption && new RegExp(pattern).test(caption.innerText)
        && m.src['kvlab-plot-phase'] >= 1 && m.src['kvlab-plot-heatmap'] >= 1 && m.table >= tables
        && getComputedStyle(bar).display === 'none' && imgs.every(e => e.complete && e.naturalWidth > 0);
}"""


def _control(page, kind: str, label: str):
    """The explorer's widget of this kind (dropdown, hslider) whose label reads ``label``."""
    return page.locator(f"{EXPLORER} .widget-{kind}").filter(
        has=page.locator("label", has_text=re.compile(f"^{re.escape(label)}$"))
    )


def _change(
    page, act, expect: str, left_ms, timings: dict, name: str, *, readout: str | None = None, tables: int = 1
) -> dict:
    """Do one change and wait until the page has drawn it: the KL table's caption matches
    ``expect`` and the readout ``readout`` (regexes; the readout defaults to ``expect``), both
    figures were replaced, the progress bar is hidden, and the kernel is idle (so a second
    redraw would have arrived). The table is rewritten ``tables`` times: once for a new merge,
    never for a new view of the same one (its text is the same). Returns what the page redrew."""
    page.evaluate(_MONITOR_RESET)
    t0 = time.monotonic()
    act()
    page.wait_for_function(
        _CHANGE_DRAWN, arg=[EXPLORER, expect, readout or expect, tables], timeout=left_ms(), polling=100
    )
    _wait_kernel_idle(page, left_ms())
    timings[name] = time.monotonic() - t0
    seen = page.evaluate("() => JSON.parse(JSON.stringify(window.__kvlab))")
    caption = page.locator(f"{EXPLORER} .kvlab-kl-table caption").inner_text()
    assert seen["src"] == {"kvlab-plot-phase": 1, "kvlab-plot-heatmap": 1}, f"{name}: figures redrawn {seen['src']}"
    assert seen["table"] == tables, f"{name}: the KL table was rewritten {seen['table']} times, not {tables}"
    assert page.locator(f"{EXPLORER} .kvlab-progress").is_hidden(), f"{name}: the progress bar stayed"
    for label in seen["labels"]:  # "<step> (i/n)": what the kernel was doing, i of n steps
        assert re.fullmatch(r".+ \((\d+)/(\d+)\)", label), f"{name}: progress label {label!r}"
    return {**seen, "caption": caption}


def _kl_column(page) -> list[float]:
    rows = page.locator(f"{EXPLORER} .kvlab-kl-table tr").evaluate_all(
        "rows => rows.slice(1).map(r => r.cells[1].innerText)"
    )
    return [float(x) for x in rows]


def _readout(page) -> tuple[str, float]:
    text = page.locator(f"{EXPLORER} .widget-html-content:has({MAX_PHASE})").inner_text()
    return text, float(page.locator(MAX_PHASE).inner_text())


def test_merge_explorer_in_jupyterlab(browser_page, lab):  # browser first: skip before starting Jupyter
    page = browser_page
    deadline = time.monotonic() + BUDGET_S

    def left_ms() -> float:
        return max(1_000.0, (deadline - time.monotonic()) * 1000)

    timings: dict[str, float] = {}
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        page.goto(lab["url"], timeout=left_ms())
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=left_ms())
        # Run All before the session is connected opens a "Select Kernel" dialog instead of
        # running: wait for the status bar's "| Idle" (it says "| Connecting" before), and if the
        # dialog shows up anyway, accept it and ask again.
        _wait_kernel_idle(page, left_ms())
        _run_all_cells(page, left_ms())
        t_run = time.monotonic()
        retries = 0
        while True:  # until the last code cell prints its finding, or a cell fails
            state = page.evaluate(_RUN_STATE)
            if state == "dialog":
                assert retries < 3, "JupyterLab keeps asking for a kernel"
                retries += 1
                page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click(timeout=left_ms())
                page.locator(".jp-Dialog").wait_for(state="detached", timeout=left_ms())
                _wait_kernel_idle(page, left_ms())
                _run_all_cells(page, left_ms())
            elif state:
                break
            assert time.monotonic() < deadline, f"the notebook did not finish within the {BUDGET_S}s budget"
            time.sleep(0.5)
        timings["run all cells"] = time.monotonic() - t_run
        errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        assert errors.count() == 0, f"a cell failed:\n{errors.first.inner_text()[:2000]}"

        explorer = page.locator(EXPLORER)
        explorer.wait_for(timeout=left_ms())
        assert explorer.count() == 1
        # The explorer's cell output: the widget and its two figures (in its plot area, or, from
        # an explorer that leaves them to matplotlib's inline backend, printed below it).
        cell_output = page.locator(".jp-Cell-outputArea").filter(has=page.locator(MAX_PHASE))
        page.wait_for_function(  # the phase plot and the heatmap, loaded
            """sel => [...document.querySelectorAll(sel)].filter(e => e.complete && e.naturalWidth > 0).length >= 2""",
            arg=f".jp-Cell-outputArea:has({MAX_PHASE}) img",
            timeout=left_ms(),
            polling=250,
        )
        before_text, before = _readout(page)
        assert "/ naive" in before_text, before_text
        cell_output.scroll_into_view_if_needed(timeout=left_ms())
        page.screenshot(path=ARTIFACTS / "browser-page-before.png")
        cell_output.screenshot(path=ARTIFACTS / "explorer-before.png", timeout=left_ms())
        srcs_before = set(page.locator(PLOT_IMGS).evaluate_all("els => els.map(e => e.src)"))

        dropdown = page.locator(f"{EXPLORER} .widget-dropdown").filter(
            has=page.locator("label", has_text=re.compile(r"^strategy$"))
        )
        assert dropdown.count() == 1
        select = dropdown.locator("select")
        assert select.input_value() == "naive"
        assert page.evaluate(_MONITOR_INSTALL, EXPLORER), "the explorer has no progress bar"
        page.evaluate(_MONITOR_RESET)
        t_switch = time.monotonic()
        select.select_option("rerotate", timeout=left_ms())

        # The kernel recomputes, then the readout and both plots in the explorer redraw.
        page.wait_for_function(
            """([sel, imgs, old]) => {
                 const r = document.querySelector(sel);
                 const srcs = [...document.querySelectorAll(imgs)].map(e => e.src);
                 const loaded = [...document.querySelectorAll(imgs)].every(e => e.complete && e.naturalWidth > 0);
                 return r && /\\/ rerotate/.test(r.closest('.widget-html-content').innerText)
                        && srcs.length === 2 && srcs.every(s => !old.includes(s)) && loaded;
               }""",
            arg=[f"{EXPLORER} {MAX_PHASE}", PLOT_IMGS, sorted(srcs_before)],
            timeout=left_ms(),
            polling=250,
        )
        _wait_kernel_idle(page, left_ms())
        timings["switch to rerotate"] = time.monotonic() - t_switch
        after_text, after = _readout(page)
        rerotate_seen = page.evaluate("() => JSON.parse(JSON.stringify(window.__kvlab))")
        blank = page.locator(PLOT_IMGS).evaluate_all(_BLANK_IMGS)
        explorer.scroll_into_view_if_needed(timeout=left_ms())
        page.screenshot(path=ARTIFACTS / "browser-page-after.png")
        explorer.screenshot(path=ARTIFACTS / "explorer-after.png", timeout=left_ms())

        # The new controls, one change each, on tiny-gemma3 (seeded, small, two layer types).
        drawn = {}
        ratio, policy = _control(page, "hslider", "recompute r"), _control(page, "dropdown", "policy")
        layer_type = _control(page, "dropdown", "layer type")
        assert ratio.is_hidden() and policy.is_hidden() and layer_type.is_hidden()  # rerotate, smollm2: one type
        drawn["model"] = _change(
            page,
            lambda: _control(page, "dropdown", "model").locator("select").select_option("tiny-gemma3"),
            r"tiny-gemma3 / rerotate, 2 fragments",
            left_ms,
            timings,
            "model: tiny-gemma3",
        )
        assert layer_type.is_visible()
        drawn["recompute"] = _change(
            page,
            lambda: select.select_option("recompute"),
            r"tiny-gemma3 / recompute \(r=0\.15, policy deviation\), 2 fragments",
            left_ms,
            timings,
            "strategy: recompute",
        )
        assert ratio.is_visible() and policy.is_visible()
        drawn["policy"] = _change(
            page,
            lambda: policy.locator("select").select_option("fragment_start"),
            r"recompute \(r=0\.15, policy fragment_start\), 2 fragments",
            left_ms,
            timings,
            "policy: fragment_start",
        )

        def full_ratio():  # type into the slider's readout, as a user who wants an exact value
            box = ratio.locator(".widget-readout")
            box.click(timeout=left_ms())
            page.keyboard.press("Control+A")
            page.keyboard.type("1")
            page.keyboard.press("Enter")

        drawn["ratio"] = _change(
            page, full_ratio, r"recompute \(r=1, policy fragment_start\), 2 fragments", left_ms, timings, "ratio: 1"
        )
        kl_full = _kl_column(page)
        fragments = page.locator(f"{EXPLORER} textarea")
        assert fragments.count() == 2
        drawn["add"] = _change(
            page,
            lambda: page.locator(f"{EXPLORER} button", has_text="add fragment").click(timeout=left_ms()),
            r"recompute \(r=1, policy fragment_start\), 3 fragments",
            left_ms,
            timings,
            "add fragment",
        )
        assert fragments.count() == 3 and fragments.nth(2).input_value().strip()  # a preset text
        layer = _control(page, "hslider", "layer").locator(".widget-readout")
        assert layer.inner_text() == "0"  # tiny-gemma3's layer 0 slides; its last layer is full
        drawn["layer type"] = _change(
            page,
            lambda: layer_type.locator("select").select_option("full_attention"),
            r"\(r=1, policy fragment_start\), 3 fragments$",
            left_ms,
            timings,
            "layer type: full_attention",
            readout=r"3 fragments: .*over full_attention layers",
            tables=0,
        )
        layer_after = layer.inner_text()
        explorer.scroll_into_view_if_needed(timeout=left_ms())
        explorer.screenshot(path=ARTIFACTS / "explorer-controls.png", timeout=left_ms())
        report = (
            f"before: {before_text}\nafter:  {after_text}\nblank plots after the switch: {blank}\n"
            f"rerotate switch redrew: {rerotate_seen}\n"
            + "".join(f"{k}: {v}\n" for k, v in drawn.items())
            + "".join(f"{k}: {v:.1f}s\n" for k, v in timings.items())
        )
        (ARTIFACTS / "explorer-readout.txt").write_text(report)
        print(report)
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=ARTIFACTS / "browser-failure.png")
        print(f"JupyterLab log (tail):\n{_tail(lab['log'])}")
        raise

    assert before > 0.5, before_text  # naive: radians of phase error (~2.9 on smollm2-135m)
    assert after < 1e-3, after_text  # rerotate: fp32 rounding
    assert before / max(after, 1e-12) > 1e3  # orders of magnitude
    assert not any(blank), f"the explorer drew a blank (all-white) plot {blank}; see test-artifacts/explorer-after.png"
    # One redraw for the switch, and smollm2's merge, KL and figures take long enough (well
    # over the explorer's 0.3 s) that the progress bar showed, naming its steps in order.
    assert rerotate_seen["src"] == {"kvlab-plot-phase": 1, "kvlab-plot-heatmap": 1}, rerotate_seen
    assert rerotate_seen["table"] == 1, rerotate_seen
    assert rerotate_seen["shown"] and rerotate_seen["labels"], f"no progress during the switch: {rerotate_seen}"
    steps = [int(re.search(r"\((\d+)/", label).group(1)) for label in rerotate_seen["labels"]]
    assert steps == sorted(steps) and rerotate_seen["labels"][-1].startswith("drawing the heatmap"), rerotate_seen
    # Loading a model not yet loaded, prefilling and both references: the bar showed too.
    assert drawn["model"]["shown"] and any(
        l.startswith("loading tiny-gemma3") or l.startswith("prefilling") for l in drawn["model"]["labels"]
    ), drawn["model"]
    # Recomputing every token is a full prefill: the table's KL column is 0 to its 4 digits.
    assert kl_full and max(kl_full) == 0.0, kl_full
    assert layer_after == "3", f"layer type full_attention should jump to layer 3, shows {layer_after}"
    # The README's picture: the explorer's cell output on naive (controls, readout, both figures,
    # KL table). Refreshed only when asked, so a test run never dirties the work tree.
    if os.environ.get("KVLAB_UPDATE_DOCS") == "1":
        DOCS_PNG.parent.mkdir(exist_ok=True)
        shutil.copyfile(ARTIFACTS / "explorer-before.png", DOCS_PNG)
