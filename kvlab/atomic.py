"""Writes that a crash or a concurrent reader never sees half done.

Every file kvlab writes goes under a temporary name in the target's own folder, is
fsynced, then renamed over the target: a reader sees the old file or the new one, never
a mix, and a writer killed at any point leaves no half-written target behind.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_write_text", "atomic_path", "fsync_dir"]


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating the folder if need be.

    ``mode``: permission bits of the new file (default: ``0600``, as ``mkstemp`` makes it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that only takes a file name.

    The body writes the whole file to the yielded path; on leaving, it is fsynced and
    renamed over ``path`` and the folder is fsynced. If the body or any of these steps
    fails, the temporary file is removed and ``path`` is left as it was. The temporary
    name is created exclusively (``O_EXCL``), so two writers never share it.
    """
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable; a no-op where a directory cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
