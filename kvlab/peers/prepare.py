"""Make, ahead of time, the files llama.cpp's side of kvlab derives from a real model's GGUF.

Notebook 06 and the peer tests run llama.cpp on two requantisations of each model's file (a
Q4_0 copy read as a different producer, an F32 copy that separates the engines' arithmetic from
the weights' rounding) and convert the Q4_0 copy for kvlab to load. Made inside a notebook, on
an empty cache, they cost the first run minutes it does not measure; ``kvlab peers --prepare``
(``make prepare-peers``) makes them once, beside ``kvlab models --prepare``, and a later run
finds them kept (``requantize`` and the conversion cache both key on the source's sha256).
"""

from __future__ import annotations

from pathlib import Path

from kvlab.models.gguf import real_model_names
from kvlab.models.loaded import quiet_transformers
from kvlab.models.sources import convert_gguf_file
from kvlab.peers.mapping import gguf_path
from kvlab.peers.quantize import requantize

#: The requantisations notebook 06 and tests/peers run: the reader of another producer, and
#: the F32 copy for the conversion and K-shift checks.
PREPARED_FTYPES = ("Q4_0", "F32")


def prepare(names: list[str] | None = None) -> dict[str, dict[str, Path]]:
    """Requantise each real model's GGUF file to :data:`PREPARED_FTYPES` and convert the Q4_0 copy.

    Parameters
    ----------
    names : list of str, optional
        Catalogue names of real (GGUF) models; default: every one whose package is installed.

    Returns
    -------
    dict
        name -> {ftype: requantised GGUF file, "Q4_0 conversion": kvlab's conversion folder}.

    Raises
    ------
    ModelError
        An unknown or uninstalled model (the message says how to install it).
    PeerError
        llama.cpp missing, or a requantisation it refuses.
    """
    done = {}
    for name in real_model_names(names):
        src = gguf_path(name)
        files = {ftype: requantize(src, ftype) for ftype in PREPARED_FTYPES}
        with quiet_transformers():
            files["Q4_0 conversion"] = convert_gguf_file(files["Q4_0"])
        done[name] = files
    return done


__all__ = ["PREPARED_FTYPES", "prepare"]
