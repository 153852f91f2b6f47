"""llama.cpp as a peer engine: the library itself, imported on first use, its log captured.

The glue talks to llama.cpp through llama-cpp-python's low-level API (ctypes bindings of
``llama.h``): :func:`lib` is that module, imported once, with llama.cpp's logging captured so a
refusal can quote llama.cpp's reason (:func:`said`). ``llama_cpp`` is imported on first use only,
so kvlab itself never needs it; without the ``peers`` extra every entry point raises
:class:`kvlab.PeerError` saying how to install it. This is the only module that imports it: an
engine on a GGUF file is :mod:`kvlab.peers.engine`, a requantisation :mod:`kvlab.peers.quantize`.

Both engines get the *same token ids*: kvlab's tokenizer makes them, llama.cpp is fed ids,
never text, so a difference between the engines is never a tokenisation difference.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import threading
from pathlib import Path

from kvlab.errors import PeerError

INSTALL_HINT = (
    "llama.cpp comparisons need the `peers` extra (llama-cpp-python==0.3.36, which compiles "
    "llama.cpp from source: about 6 minutes on 2 cores): pip install -e '.[peers]'   or: make peers"
)

_LIB = None
_LIB_LOCK = threading.Lock()
# llama.cpp's warnings and errors, kept so a refusal can say what llama.cpp said; nothing is
# printed (notebooks must store no stderr). Info and debug lines are dropped.
_LOG: collections.deque[str] = collections.deque(maxlen=64)
_LOG_CALLBACK = None  # the ctypes callback must outlive every call into llama.cpp
_LAST_LEVEL = [0]


def _on_log(level: int, text: bytes, _user) -> None:
    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line.
    try:
        if level == 5:
            level = _LAST_LEVEL[0]
        _LAST_LEVEL[0] = level
        if level >= 3 and text:
            line = text.decode("utf-8", "replace").strip()
            if line:
                _LOG.append(line)
    except Exception:  # noqa: BLE001 (an exception must never cross back into C)
        pass


def _import_llama_cpp():
    import llama_cpp  # noqa: PLC0415 (optional extra)

    return llama_cpp


def lib():
    """The ``llama_cpp`` module, imported once, with llama.cpp's logging captured, not printed.

    Raises
    ------
    PeerError
        When llama-cpp-python is not installed (the message says how to install it).
    """
    global _LIB, _LOG_CALLBACK
    if _LIB is not None:
        return _LIB
    with _LIB_LOCK:
        if _LIB is None:
            try:
                mod = _import_llama_cpp()
            except ImportError as e:
                raise PeerError(f"{INSTALL_HINT} ({e})") from e
            _LOG_CALLBACK = mod.llama_log_callback(_on_log)
            mod.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            mod.llama_backend_init()
            _LIB = mod
    return _LIB


def loaded():
    """The ``llama_cpp`` module if :func:`lib` has imported it, else ``None`` (nothing is imported)."""
    return _LIB


def available() -> bool:
    """Whether llama-cpp-python is installed (without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def clear_log() -> None:
    """Forget llama.cpp's earlier lines, so that :func:`said` quotes only what the next call logs."""
    _LOG.clear()


def said() -> str:
    """llama.cpp's warning and error lines since the log was last cleared, for an error message."""
    return "; ".join(_LOG) if _LOG else "(llama.cpp logged no reason)"


def check_gguf_file(path) -> Path:
    """``path`` as a Path if it is a readable GGUF file, else :class:`PeerError` naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise PeerError(f"no GGUF file at {path}: the path does not exist")
    if not path.is_file():
        raise PeerError(f"{path} is not a file (a GGUF model file was expected)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise PeerError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    return path
