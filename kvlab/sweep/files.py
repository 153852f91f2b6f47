"""Crash-safe files: every sweep output is written to a temporary name and renamed."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


_UMASK = os.umask(0)
os.umask(_UMASK)


def write_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    A reader (or a rerun after Ctrl-C or a killed worker) sees the old file or the new
    one, never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs are as readable as any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path, obj) -> Path:
    return write_atomic(path, json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n")


def read_json(path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (then the point is redone)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
