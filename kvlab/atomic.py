"""Writes that a crash or a concurrent reader never sees half done, and that leave nothing behind.

Every file or folder kvlab writes is made under a temporary name beside its target,
``.<target name>.<pid>.<random>.tmp``, fsynced, then renamed over the target: a reader sees
the old one or the new one, never a mix. A writer killed before the rename leaves its
temporary behind; the name carries the writer's process id, so the next write into the same
folder removes those whose process is gone (:func:`remove_stale`), and ``kvlab inspect``
lists them (:func:`stale_temporaries`).

A library that takes a file name may make files of its own beside it (safetensors writes
``.tmpXXXXXX`` and renames it over the name it was given). Such a writer gets a path inside a
private folder that carries the temporary name (``atomic_path(..., private_folder=True)``), so
whatever it leaves there when killed goes with the folder, under the same rule.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "atomic_dir",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "remove_stale",
    "stale_temporaries",
    "temporary_of",
]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: ``.<target>.<pid>.<8 hex>.tmp``: the one temporary name every kvlab write uses.
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")
#: Names of the temporaries this process has open. A process id is reused, across a container's
#: restarts above all (the same program often gets the same pid), so a temporary carrying this
#: process's own id is live only if this process made it.
_OURS: set[str] = set()


@functools.cache
def _umask() -> int:
    # os.umask can only be read by setting it; done once, on first use, not at import (where it
    # would briefly set a process-wide 0 under other threads of a kernel or Dask worker).
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """Permission bits of a file kvlab writes: ``0666`` less the umask, as any file the user makes."""
    return 0o666 & ~_umask()


def _hold(tmp: Path) -> bool:
    """Record ``tmp`` as this process's before it is created; ``False`` if another write here holds it.

    A write that drew a name another write of this process holds fails to create it, and must
    then leave that write's record in place, or the other's temporary would look stale.
    """
    if tmp.name in _OURS:
        return False
    _OURS.add(tmp.name)
    return True


def temporary_of(path: Path) -> tuple[str, int] | None:
    """``(target name, writer's process id)`` if ``path`` is named as a kvlab temporary, else ``None``."""
    m = _TEMP.match(Path(path).name)
    return (m["target"], int(m["pid"])) if m else None


def _alive(pid: int, name: str) -> bool:
    if pid == os.getpid():
        return name in _OURS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def stale_temporaries(folder: Path, target: str | None = None) -> list[Path]:
    """Temporaries in ``folder`` left by a kvlab write whose process is gone (of ``target`` only, if given).

    A temporary of a live process (a write in progress) is never listed.
    """
    out = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    for p in entries:
        m = _TEMP.match(p.name)
        if m and (target is None or m["target"] == target) and not _alive(int(m["pid"]), p.name):
            out.append(p)
    return sorted(out)


def remove_stale(path: Path) -> list[Path]:
    """Remove the temporaries in ``path``'s folder whose writer died, whatever they were writing; return them.

    The whole folder, not only earlier writes of ``path``: a store that saves every cache under a
    new name would otherwise collect a killed save's leftovers without end.
    """
    path = Path(path)
    gone = []
    for p in stale_temporaries(path.parent):
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            gone.append(p)
        except FileNotFoundError:  # another writer removed it first
            pass
    return gone


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temporary(path: Path) -> Iterator[Path]:
    """A fresh temporary name for a write of ``path``, held as this process's while the write lasts.

    ``path``'s folder is made if need be and the temporaries of dead writers there are removed
    first (:func:`remove_stale`). Nothing is created under the name: the caller does that, exclusively.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # _TEMP
    mine = _hold(tmp)
    try:
        yield tmp
    finally:
        if mine:
            _OURS.discard(tmp.name)


@contextlib.contextmanager
def atomic_path(path: Path, *, mode: int | None = None, private_folder: bool = False) -> Iterator[Path]:
    """A temporary path for a writer that only takes a file name.

    The body writes the whole file to the yielded path; on leaving, it is fsynced, given
    ``mode`` (default :func:`default_mode`), renamed over ``path``, and the folder is fsynced.
    If the body or any of these steps fails, the temporary is removed and ``path`` is left as
    it was. The temporary name is created exclusively (``O_EXCL``), so two writers never share it.

    Parameters
    ----------
    path : Path
        The target.
    mode : int, optional
        Permission bits of the result.
    private_folder : bool
        Yield ``<temporary folder>/<path's name>`` instead of a temporary file beside ``path``;
        the folder is made ``0700`` under the temporary name and removed after the rename. For a
        writer that makes files of its own beside the name it is given: a kill leaves them inside
        the folder, which the next write into the same folder removes with everything in it.

    Yields
    ------
    Path
        Where the body writes the file.
    """
    path = Path(path)
    with _temporary(path) as tmp:
        if private_folder:
            tmp.mkdir(mode=0o700)  # fails if the name exists: exclusive, as O_EXCL is for a file
        out = tmp / path.name if private_folder else tmp
        try:
            os.close(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o600))
            try:
                yield out
                _fsync(out)
                os.chmod(out, default_mode() if mode is None else mode)
                os.replace(out, path)
            except BaseException:
                out.unlink(missing_ok=True)
                raise
        finally:
            if private_folder:
                # Also takes what the body's library left there when it failed.
                shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`), creating the folder if need be."""
    with atomic_path(Path(path), mode=mode) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_path`), creating the folder if need be."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """A temporary folder beside ``path``; on leaving, its files are fsynced and it is renamed to ``path``.

    For a result made of several files (a model conversion). If ``path`` appears meanwhile
    (another process finished the same work first), the temporary is dropped and the existing
    folder kept: both hold the same result. On failure the temporary is removed.
    """
    path = Path(path)
    with _temporary(path) as tmp:
        tmp.mkdir()  # before the try below: a name another writer made is never removed
        try:
            yield tmp
            for p in tmp.rglob("*"):
                if p.is_file():
                    _fsync(p)
            try:
                os.rename(tmp, path)
            except OSError:
                if not path.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
