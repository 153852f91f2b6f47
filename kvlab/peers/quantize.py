"""A GGUF file requantised by llama.cpp's own quantiser (``llama_model_quantize``), kept once per source and type.

A copy is another producer of the same weights (a Q4_0 reader) or the same weights without
their rounding (F32): the peer comparisons and notebook 06 read them, and
:mod:`kvlab.peers.prepare` makes them ahead of time.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvlab.atomic import atomic_path
from kvlab.errors import PeerError
from kvlab.models.gguf import sha256_cached
from kvlab.models.loaded import cache_root
from kvlab.peers.llama_cpp import check_gguf_file, clear_log, lib, said

FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}  # llama_ftype values offered here


def requantize(src, ftype: str = "Q4_0", out_dir=None, n_threads: int | None = None) -> Path:
    """Requantise a GGUF file with llama.cpp's ``llama_model_quantize`` (``allow_requantize``).

    The result is kept under ``$KVLAB_CACHE/peers`` (or ``out_dir``) as
    ``<stem>.<ftype>-<sha256 of src, 16 hex>.gguf``, written in a temporary folder there and
    renamed, so a concurrent caller never sees half a file; a later call returns it as is.

    Returns
    -------
    Path
        The requantised GGUF file.
    """
    src = check_gguf_file(src)
    L = lib()
    if ftype not in FTYPES:
        raise PeerError(f"ftype must be one of {sorted(FTYPES)}, got {ftype!r}")
    out_dir = Path(out_dir) if out_dir is not None else cache_root() / "peers"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{src.stem}.{ftype}-{sha256_cached(src)[:16]}.gguf"
    if target.is_file():
        return target
    with atomic_path(target) as tmp:
        params = L.llama_model_quantize_default_params()
        params.ftype = FTYPES[ftype]
        params.allow_requantize = True
        params.nthread = int(n_threads or torch.get_num_threads())
        clear_log()
        rc = L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0 or not tmp.stat().st_size:
            raise PeerError(f"llama_model_quantize failed on {src.name} -> {ftype} (returned {rc}): {said()}")
    return target
