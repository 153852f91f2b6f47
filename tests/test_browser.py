"""The merge explorer proven in a real browser, end to end.

JupyterLab serves a temporary copy of notebooks/04_merge_explorer.ipynb (outputs and saved
widget state stripped, so everything shown comes from a live kernel); headless Chromium
(Debian's /usr/bin/chromium, driven by Playwright) runs all cells from the Run menu, waits for
the explorer, switches the strategy dropdown from naive to rerotate and reads the max phase
error off the rendered page. Screenshots go to test-artifacts/, and the explorer's picture to
docs/explorer.png for the README.

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

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04_merge_explorer.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
DOCS_PNG = ROOT / "docs" / "explorer.png"
CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
BUDGET_S = 140          # the browser session: page load, all cells, the switch (server start: SERVER_START_S)
SERVER_START_S = 40
STOP_S = 10             # graceful shutdown before the server's process group is killed


# -- a JupyterLab server that touches nothing of the user's ------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stripped_notebook(dest: Path) -> None:
    """Copy the notebook without outputs or saved widget state: the page must show live views."""
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
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
            req = urllib.request.Request(f"{base}/api/shutdown", method="POST", data=b"",
                                         headers={"Authorization": f"token {token}"})
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
    env = dict(os.environ,
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
               PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--ServerApp.allow_root=True", "--ServerApp.terminals_enabled=False",
        f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log_path = tmp_path / "jupyter.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
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
        missing("Playwright for Python is not installed (pip install playwright; its browser "
                    "download is not needed: the test drives Debian's Chromium)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing(f"Chromium not found at {CHROMIUM} (run scripts/install-browser.sh, or apt-get install "
                    "chromium chromium-driver; KVLAB_CHROMIUM names another binary)")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 2400}, timeout=30_000)
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
            arg=f".jp-Cell-outputArea:has({MAX_PHASE}) img", timeout=left_ms(), polling=250)
        before_text, before = _readout(page)
        assert "/ naive" in before_text, before_text
        cell_output.scroll_into_view_if_needed(timeout=left_ms())
        page.screenshot(path=ARTIFACTS / "browser-page-before.png")
        cell_output.screenshot(path=ARTIFACTS / "explorer-before.png", timeout=left_ms())
        srcs_before = set(page.locator(PLOT_IMGS).evaluate_all("els => els.map(e => e.src)"))

        dropdown = page.locator(f"{EXPLORER} .widget-dropdown").filter(
            has=page.locator("label", has_text=re.compile(r"^strategy$")))
        assert dropdown.count() == 1
        select = dropdown.locator("select")
        assert select.input_value() == "naive"
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
            arg=[f"{EXPLORER} {MAX_PHASE}", PLOT_IMGS, sorted(srcs_before)], timeout=left_ms(), polling=250)
        timings["switch to rerotate"] = time.monotonic() - t_switch
        after_text, after = _readout(page)
        blank = page.locator(PLOT_IMGS).evaluate_all(_BLANK_IMGS)
        explorer.scroll_into_view_if_needed(timeout=left_ms())
        page.screenshot(path=ARTIFACTS / "browser-page-after.png")
        explorer.screenshot(path=ARTIFACTS / "explorer-after.png", timeout=left_ms())
        report = (f"before: {before_text}\nafter:  {after_text}\nblank plots after the switch: {blank}\n"
                  + "".join(f"{k}: {v:.1f}s\n" for k, v in timings.items()))
        (ARTIFACTS / "explorer-readout.txt").write_text(report)
        print(report)
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=ARTIFACTS / "browser-failure.png")
        print(f"JupyterLab log (tail):\n{_tail(lab['log'])}")
        raise

    assert before > 0.5, before_text            # naive: radians of phase error (~2.9 on smollm2-135m)
    assert after < 1e-3, after_text             # rerotate: fp32 rounding
    assert before / max(after, 1e-12) > 1e3     # orders of magnitude
    assert not any(blank), f"the explorer drew a blank (all-white) plot {blank}; see test-artifacts/explorer-after.png"
    # The README's picture: the explorer's cell output on naive (controls, readout, both figures,
    # KL table). Refreshed only when asked, so a test run never dirties the work tree.
    if os.environ.get("KVLAB_UPDATE_DOCS") == "1":
        DOCS_PNG.parent.mkdir(exist_ok=True)
        shutil.copyfile(ARTIFACTS / "explorer-before.png", DOCS_PNG)
