"""`make lab`, as the README says: JupyterLab serves the notebooks, as root too, without the news pop-up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANNOUNCEMENTS = "@jupyterlab/apputils-extension:announcements"


def _get(url: str, seconds: float = 20) -> str:
    # The URL is printed as the server binds; the first connection may come a moment early.
    deadline = time.monotonic() + seconds
    while True:
        try:
            return urllib.request.urlopen(url, timeout=30).read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.slow
def test_make_lab_serves_the_notebooks_without_the_news_popup(tmp_path):
    if not (ROOT / ".venv" / ".kvlab-setup").is_file():
        pytest.skip("make lab needs the project's .venv (make setup)")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), BROWSER="true")
    proc = subprocess.Popen(
        ["make", "-s", "lab", "LAB_ARGS=--no-browser --ServerApp.port=0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # make, jupyter and its children die together below
    )
    seen, url = [], None
    try:
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            seen.append(line)
            m = re.search(r"(http://127\.0\.0\.1:\d+/lab\?token=\w+)", line)
            if m and "is running at" in "".join(seen):
                url = m.group(1)
        assert url, "JupyterLab did not say it is serving:\n" + "".join(seen)[-3000:]
        text = "".join(seen)
        assert "Running as root is not recommended" not in text and "--allow-root" not in text
        page = _get(url)
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S).group(1))
        assert ANNOUNCEMENTS in config["disabledExtensions"]
        assert Path(config["serverRoot"]).resolve() == (ROOT / "notebooks").resolve()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
