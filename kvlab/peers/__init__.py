"""kvlab beside other engines on the same GGUF files (the ``peers`` extra: llama-cpp-python).

One module per comparison: :mod:`~kvlab.peers.mapping` (which file, an engine on it),
:mod:`~kvlab.peers.conversion`, :mod:`~kvlab.peers.merges`, :mod:`~kvlab.peers.kshift`,
:mod:`~kvlab.peers.state`, :mod:`~kvlab.peers.summary`, and :mod:`~kvlab.peers.audit` (a merge
that runs inside llama.cpp, audited); :mod:`~kvlab.peers.llama_cpp` is the glue. Importing them
never imports llama-cpp-python; the first call that needs llama.cpp does, and without the extra
it raises :class:`kvlab.PeerError` saying how to install it.
"""
