"""Crash-safe files: every sweep output is written to a temporary name and renamed."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from ..atomic import atomic_write_text


@functools.cache
def _umask() -> int:
    # os.umask can only be read by setting it; done once, on first write, not at import (where
    # it would briefly set a process-wide 0 under other threads of a kernel or Dask worker).
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`kvlab.atomic.atomic_write_text`).

    A reader (or a rerun after Ctrl-C or a killed worker) sees the old file or the new
    one, never a half-written one. Outputs are as readable as any other file the user
    makes (``0666`` less the umask), not ``0600`` as a temporary file is created.
    """
    path = Path(path)
    atomic_write_text(path, text, mode=0o666 & ~_umask())
    return path


def write_json(path, obj) -> Path:
    return write_atomic(path, json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n")


def read_json(path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (then the point is redone)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
