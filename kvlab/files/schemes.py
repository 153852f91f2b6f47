"""Which cache-identity scheme would refuse which mismatch: kvlab's fingerprint beside the engines' cache keys.

Engines key their stored KV caches on a few fields and add one each time an issue shows a
mismatch that got through. This module states each scheme's documented fields as the
properties of a producer they can see, and each mismatch kvlab can make as the properties it
changes; a scheme refuses a mismatch when it sees one of them. kvlab's row and llama.cpp's
llama.cpp's requant and architecture cells are measured (notebooks 03 and 06,
``tests/files``); the other cells follow from the documented key fields only, and
:func:`table` says which is which.

The assumption behind every computed row is the silent case: the reader is served under the
producer's model name and path, on the same parallel layout, and a fine-tune or a
requantisation is published as a new revision of the same repository. A scheme that keys on
the token ids (every one of them does) never serves a cache to a reader whose tokenizer turns
the same text into other ids: it misses, which refuses the cache as surely as a check.

Run ``python -m kvlab.files.schemes`` for the Markdown table of ``docs/cache-files.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.errors import KvlabError

#: What about a producer a scheme can see, and a mismatch can change.
PROPERTIES = ("weights", "dtype", "quantization", "revision", "rope", "tokenizer", "architecture", "geometry")


@dataclass(frozen=True)
class Scheme:
    """One engine's cache identity: its key fields, and the producer properties they see.

    Attributes
    ----------
    name : str
    key : str
        The key or the checks, as the engine documents them.
    sees : frozenset of str
        The :data:`PROPERTIES` whose change alters the key (or fails a check).
    measured : bool
        Whether the row was measured by running the engine (else computed from ``key``).
    reference : str
        Where the fields are documented.
    """

    name: str
    key: str
    sees: frozenset
    measured: bool
    reference: str


SCHEMES = (
    Scheme(
        "LMCache, before its dtype field",
        "model_name@world_size@worker_id@chunk_hash",
        frozenset({"tokenizer"}),
        False,
        "LMCache cache-engine key; dtype added after LMCache issue 1856",
    ),
    Scheme(
        "LMCache",
        "model_name@world_size@worker_id@chunk_hash@dtype",
        frozenset({"tokenizer", "dtype"}),
        False,
        "LMCache cache-engine key (issue 1856)",
    ),
    Scheme(
        "vLLM KV offload",
        "model, revision, effective dtype, rope config, block hash of the token ids",
        frozenset({"tokenizer", "revision", "dtype", "rope"}),
        False,
        "vLLM pull requests 49261 (revision), 49438 (effective dtype), 56311 (rope config)",
    ),
    Scheme(
        "SGLang HiCache",
        "served_model_name, hash of the token ids",
        frozenset({"tokenizer"}),
        False,
        "SGLang issue 24758",
    ),
    Scheme(
        "llama.cpp state file",
        "architecture name; per layer: count, K/V types, row sizes",
        frozenset({"architecture", "geometry"}),
        False,
        "llama.cpp's state-file loader; its requant and architecture rows are measured in notebook 06",
    ),
    Scheme(
        "kvlab fingerprint",
        "source, source_sha256, architecture, config_sha256, tokenizer_sha256, dtype, quantization, geometry, "
        "weights_sha256",
        frozenset(PROPERTIES),
        True,
        "kvlab.files.identity.STRICT_FIELDS; notebook 03, tests/files",
    ),
)

#: Each mismatch kvlab can make, and the producer properties it changes. The first four are
#: :func:`kvlab.variants`; ``requant`` is notebook 06's llama.cpp requantisation.
MISMATCHES = {
    "bf16": frozenset({"dtype", "weights"}),
    "fp16": frozenset({"dtype", "weights"}),
    "int8": frozenset({"quantization", "weights"}),
    "finetune": frozenset({"weights", "revision"}),
    "requant": frozenset({"quantization", "weights", "revision"}),
    "rope factor": frozenset({"rope"}),
    "tokenizer": frozenset({"tokenizer"}),
    "architecture": frozenset({"architecture", "geometry", "weights", "tokenizer"}),
    # Another model family that shares the producer's tokenizer (as model families often do):
    # every token-id key then matches, and only a check of the model itself is left.
    "architecture, same tokenizer": frozenset({"architecture", "geometry", "weights"}),
}


def refuses(scheme: Scheme, mismatch: str) -> bool:
    """Whether ``scheme`` keeps a cache made before ``mismatch`` from the reader after it."""
    if mismatch not in MISMATCHES:
        raise KvlabError(f"unknown mismatch {mismatch!r}; known: {', '.join(MISMATCHES)}")
    return bool(scheme.sees & MISMATCHES[mismatch])


def table(kl: dict[str, str] | None = None, mismatches=None) -> str:
    """A Markdown table: a row per mismatch, a column per scheme (``refused`` / ``LOADS``), and its KL.

    Parameters
    ----------
    kl : dict, optional
        mismatch -> what it does to the reader's answers, as text with its source (e.g.
        ``"0.0306 nats (notebook 03)"``); shown in the last column.
    mismatches : iterable of str, optional
        The rows, in order (default: every :data:`MISMATCHES` key).
    """
    kl = kl or {}
    rows = list(mismatches or MISMATCHES)
    head = ["mismatch", *(s.name + (" (measured)" if s.measured else "") for s in SCHEMES), "effect on the reader"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in rows:
        cells = ["refused" if refuses(s, m) else "LOADS" for s in SCHEMES]
        out.append(f"| {m} | " + " | ".join(cells) + f" | {kl.get(m, 'not measured')} |")
    out += [
        "",
        "Measured: kvlab's column (every row: notebook 03, tests/files); llama.cpp's requant and architecture "
        "cells (notebook 06). Every other cell is computed from the scheme's documented key fields, for a reader "
        "served under the producer's name and path, with a fine-tune or requantisation published as a new revision.",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(table())
