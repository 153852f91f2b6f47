"""What ``kvlab inspect`` finds: a cache file's verified header and its save's leftovers, or a folder's files.

The command prints these results (:mod:`kvlab.cli`); nothing here prints. A file is checked
as :func:`kvlab.files.format.verify_file` checks it, or, with a model, read here and loaded
into the model by :func:`load_into`; a folder lists each cache file with what is wrong with it,
the temporaries of kvlab saves that died (:func:`kvlab.atomic.stale_temporaries`) and the
files the safetensors library began and never renamed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvlab.atomic import stale_temporaries, temporary_of
from kvlab.errors import CacheFileError, FingerprintMismatch
from kvlab.files.format import is_library_temporary, read_header, stray_library_temporaries, verify_file
from kvlab.files.io import load_cache
from kvlab.models import sources
from kvlab.models.loaded import LoadedModel

#: Suffixes of a file that is meant to be a cache file: listed with its problem even when it is none.
CACHE_SUFFIXES = (".kvcache", ".safetensors")


@dataclass(frozen=True)
class Entry:
    """One entry of a save's private temporary folder."""

    name: str
    size: int
    library_temporary: bool  # named as the safetensors library names its own temporary


@dataclass(frozen=True)
class Leftover:
    """A file or folder that a write left behind.

    Attributes
    ----------
    path : Path
    size : int
        Bytes: a file's size, or the sum over a folder's files (links not followed); 0 if gone.
    mtime : float or None
        When it last changed; ``None`` if it was removed meanwhile.
    is_folder : bool
        A folder (a save's private temporary folder), not a link to one.
    inside : list of Entry or None
        A folder's entries, by name; ``None`` for a file or a folder that cannot be listed.
    """

    path: Path
    size: int
    mtime: float | None
    is_folder: bool
    inside: list[Entry] | None

    @property
    def writer(self) -> tuple[str, int] | None:
        """``(target name, writer's process id)`` of a kvlab temporary, else ``None``."""
        return temporary_of(self.path)


def leftover_bytes(p: Path) -> int:
    """Bytes a leftover holds: a file's size, or the sum over a folder's files (links not followed)."""
    try:
        if not p.is_dir() or p.is_symlink():
            return p.lstat().st_size
        total = 0
        for root, _, names in os.walk(p):
            for n in names:
                total += os.lstat(os.path.join(root, n)).st_size
        return total
    except OSError:  # removed meanwhile (a save of the same file)
        return 0


def leftover(p: Path) -> Leftover:
    """What ``p``, left behind by a write, is and holds."""
    try:
        mtime = p.lstat().st_mtime
    except OSError:  # removed meanwhile
        mtime = None
    is_folder = p.is_dir() and not p.is_symlink()
    inside = None
    if is_folder:
        try:
            names = sorted(p.iterdir())
        except OSError:
            names = None
        if names is not None:
            inside = [Entry(q.name, leftover_bytes(q), is_library_temporary(q)) for q in names]
    return Leftover(p, leftover_bytes(p), mtime, is_folder, inside)


@dataclass(frozen=True)
class FileInspection:
    """A cache file, its verified kvlab header, and the temporaries of its saves that died.

    Attributes
    ----------
    path : Path
    size : int
        Bytes.
    header : dict or None
        The kvlab header (:func:`kvlab.files.format.read_header`); ``None`` for a safetensors
        file without one.
    leftovers : list of Leftover
        Temporaries of saves of this file whose process is gone.
    """

    path: Path
    size: int
    header: dict | None
    leftovers: list[Leftover]


def inspect_file(path: Path, *, verify: bool = True) -> FileInspection:
    """Read a cache file's header and check the file; ``verify`` also checks every tensor digest.

    Pass ``verify=False`` when the file is then loaded (:func:`load_into`), which checks the
    digests itself: the file is read once.

    Raises
    ------
    CacheFileError
        The file is missing, not a cache file, corrupt or tampered with.
    """
    path = Path(path)
    header = verify_file(path) if verify else read_header(path)
    size = path.stat().st_size
    leftovers = [leftover(t) for t in stale_temporaries(path.parent, path.name)] if header is not None else []
    return FileInspection(path, size, header, leftovers)


def load_into(path: Path, model_name: str) -> LoadedModel:
    """Load ``model_name`` and the cache file into it, refusing any fingerprint mismatch; return the model.

    Raises
    ------
    FingerprintMismatch
        The file was made by another model (every field that differs is named).
    """
    model = sources.load_model(model_name)  # looked up on each call, as benchmarks.fuzz replaces it
    load_cache(path, model)
    return model


@dataclass(frozen=True)
class Listed:
    """One file of a folder: its header when intact, else the refusal.

    Attributes
    ----------
    path : Path
    size : int
    header : dict or None
        The kvlab header; ``None`` for a safetensors file without one, or a refused file.
    error : CacheFileError or FingerprintMismatch or None
        Why the file was refused (read, checked, or loaded into the model).
    """

    path: Path
    size: int
    header: dict | None
    error: CacheFileError | FingerprintMismatch | None

    @property
    def intact(self) -> bool:
        """An intact kvlab cache file (and, with a model, one that loads into it)."""
        return self.error is None and self.header is not None

    @property
    def why(self) -> str:
        """The refusal without the file's path, which it starts with."""
        return str(self.error).removeprefix(str(self.path)).removeprefix(": ").strip()


@dataclass(frozen=True)
class FolderInspection:
    """A folder's cache files, and what saves into it left behind.

    Attributes
    ----------
    folder : Path
    model : LoadedModel or None
        The model each cache file was loaded into.
    files : list of Listed
        By name: every file read as a cache file, and every other file named as one.
    others : int
        Files that are not cache files, not listed.
    stale : list of Leftover
        Temporaries of kvlab saves whose process is gone (the next save removes them).
    strays : list of Leftover
        Files the safetensors library began for a kvlab save and never renamed.
    lookalikes : list of Leftover
        Other files named as the library names its temporaries (no kvlab header): not counted.
    """

    folder: Path
    model: LoadedModel | None
    files: list[Listed]
    others: int
    stale: list[Leftover]
    strays: list[Leftover]
    lookalikes: list[Leftover]

    @property
    def intact(self) -> int:
        """How many cache files are intact."""
        return sum(1 for f in self.files if f.intact)

    @property
    def clean(self) -> bool:
        """Every cache file intact, and nothing left over that counts."""
        return self.intact == len(self.files) and not self.stale and not self.strays


def inspect_folder(folder: Path, model_name: str | None = None) -> FolderInspection:
    """Check every file of ``folder`` (loading each into ``model_name``, if given), and list the leftovers."""
    folder = Path(folder)
    model = sources.load_model(model_name) if model_name else None  # looked up on each call (see load_into)
    files, others = [], 0
    for p in sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()):
        try:
            h = read_header(p) if model else verify_file(p)
            if model and h is not None:
                load_cache(p, model)
        except (CacheFileError, FingerprintMismatch) as e:
            # A file that is not a cache at all is not listed, unless its name says it should be one.
            if isinstance(e, CacheFileError) and p.suffix not in CACHE_SUFFIXES and model is None:
                others += 1
                continue
            files.append(Listed(p, p.stat().st_size, None, e))
            continue
        files.append(Listed(p, p.stat().st_size, h, None))
    stale = stale_temporaries(folder)
    strays = stray_library_temporaries(folder)
    lookalikes = [p for p in sorted(folder.iterdir()) if is_library_temporary(p) and p not in strays and p.is_file()]
    return FolderInspection(
        folder,
        model,
        files,
        others,
        [leftover(t) for t in stale],
        [leftover(t) for t in strays],
        [leftover(t) for t in lookalikes],
    )
