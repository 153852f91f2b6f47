"""Fuzz kvlab's cache-file reader with mutated real cache files (issue 26); ``python -m benchmarks.fuzz`` runs it.

Each input is a cache file saved by kvlab (:mod:`benchmarks.fuzz.seeds`: tiny models with full
and sliding layers, bf16, a start offset, no tokens, no producer, no kvlab header; and a share
from SmolLM2 and Gemma 3) after a mutation recipe that hypothesis draws
(:mod:`benchmarks.fuzz.recipes`), aimed at one part of the file: the 8-byte header length; the
safetensors header (tensor dtypes, shapes, offsets, names, ``__metadata__``, padding, its JSON
text); the kvlab header (any field's type or value, nesting, size; its sha256 and content digest
kept or re-signed); consistent rewrites that make new valid files (fewer tokens, batch 2, one
layer's batch or dtype, another dtype, a layer dropped, heads reshaped, keys and values swapped,
tensors reordered, NaN and flipped bits under re-signed digests); the tensor bytes; truncations,
insertions and extensions. A recipe is JSON; :mod:`benchmarks.fuzz.build` turns it into bytes
(with :mod:`benchmarks.fuzz.encoding`), and each drawn one is also tried on two other seeds of
its kind (drawing costs more than trying). Each input is read by ``read_header``,
``verify_file``, ``load_cache`` (strict, and ``strict=False, allow_unverified=True``) and
``kvlab inspect`` (stdout UTF-8 and strict, as a terminal's; every 50th with ``--model``, every
20th on its folder).

The contract (:mod:`benchmarks.fuzz.contract`): every input either loads a cache whose every
tensor digest verifies (checked without kvlab's reader: XXH3-128 over the file's tensors, the
loaded tensors against the file's, one batch size, every layer's shape), or raises
:class:`kvlab.CacheFileError` (a load may also raise :class:`kvlab.FingerprintMismatch`) whose
message names the file. Never another exception, never more than 1 s of CPU in one target
(torch on one thread, garbage collection not charged), never a peak RSS growth above
``MEM_FLOOR`` + ``MEM_FACTOR`` x the file's size. Anything else is an escape: printed, and
written to ``OUT/escapes/`` as the input and its recipe; ``--replay`` checks it again
(:mod:`benchmarks.fuzz.run`).

``benchmarks/fuzz/__main__.py`` is the command: a worker process does the fuzzing, watched by
the process started, which keeps the input of a worker that crashes or hangs.
``tests/files/test_fuzz.py`` imports the same modules for its fixed-seed pass and corpus replay.
"""
