"""kvlab beside other engines on the same GGUF files (the ``peers`` extra: llama-cpp-python).

Importing this package never imports llama-cpp-python; the first call that needs llama.cpp
does, and without the extra it raises :class:`kvlab.PeerError` saying how to install it.
"""

from kvlab.peers.compare import (
    CONVERSION_PROBES,
    ConversionFidelity,
    MergeRow,
    StateLoad,
    check_vocab,
    conversion_fidelity,
    engine_for,
    format_rows,
    gguf_path,
    kvlab_log_probs,
    kvlab_refusals,
    merge_side_by_side,
    model_gguf,
    peer_table,
    state_file_study,
    temp_workdir,
)
from kvlab.peers.llama_cpp import INSTALL_HINT, EngineInfo, LlamaEngine, available, check_gguf_file, lib, requantize

__all__ = [
    "CONVERSION_PROBES",
    "ConversionFidelity",
    "MergeRow",
    "StateLoad",
    "check_vocab",
    "conversion_fidelity",
    "engine_for",
    "format_rows",
    "gguf_path",
    "kvlab_log_probs",
    "kvlab_refusals",
    "merge_side_by_side",
    "model_gguf",
    "peer_table",
    "state_file_study",
    "temp_workdir",
    "INSTALL_HINT",
    "EngineInfo",
    "LlamaEngine",
    "available",
    "check_gguf_file",
    "lib",
    "requantize",
]
