"""The field audit's grid: package x version x transformers x operation x model, grouped by environment.

Each environment is a release pair of transformers and torch with one package's own pin beside
it, built as a store's CI would (``uv pip install -e . PINS``); ``main`` is the project's own
``.venv`` (transformers 5.24.0 and llama-cpp-python 0.3.36). An operation names an adapter of
:mod:`studies.field.adapters` (or kvlab's llama.cpp cache reuse) and the contract it is audited
under.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: The tiny models every press runs on: a plain RoPE, another family (Qwen 2: kvlab builds no tiny
#: Qwen 3), partial rotary, interleaved pairs (Cohere in full, GLM also partial), Gemma 3's two bases
#: and sliding window, YaRN, and dynamic NTK.
TINY = (
    "tiny-llama", "tiny-qwen2", "tiny-phi", "tiny-cohere", "tiny-glm", "tiny-gemma3", "tiny-yarn", "tiny-dynamic",
)  # fmt: skip
REAL = ("smollm2-135m", "gemma3-270m")


@dataclass(frozen=True)
class Env:
    """An environment: ``pins`` as uv installs them (empty: the project's own ``.venv``)."""

    name: str
    pins: tuple[str, ...]

    @property
    def folder(self) -> str:
        """The folder under ``$KVLAB_ENVS``: .ci/matrix's name for the same pins, so one is reused."""
        return "_".join(p.replace("==", "-") for p in self.pins)


@dataclass(frozen=True)
class Operation:
    package: str
    version: str
    name: str
    kind: str  # an audit kind: merge, store, press, engine merge
    target: str | None
    positions: str | None = None
    reader: str | None = None


MEMOS = [
    Operation("MemoryOS", "2.0.33", "merge (_concat_caches)", "merge", "studies.field.adapters.memos:concat"),
    Operation("MemoryOS", "2.0.33", "dump and load", "store", "studies.field.adapters.memos:STORE"),
]
KVPRESS = [
    Operation("kvpress", "0.5.5", "KeyRerotationPress(KnormPress)", "press",
              "studies.field.adapters.kvpress:rerotated_knorm", "kept", "explicit"),
    Operation("kvpress", "0.5.5", "KeyRerotationPress(SnapKVPress)", "press",
              "studies.field.adapters.kvpress:rerotated_snapkv", "kept", "explicit"),
    Operation("kvpress", "0.5.5", "StreamingLLMPress, pipeline", "press",
              "studies.field.adapters.kvpress:streaming_llm", "original", "explicit"),
    Operation("kvpress", "0.5.5", "KnormPress, generate", "press",
              "studies.field.adapters.kvpress:knorm", "original", "cache"),
]  # fmt: skip
TRANSFORMERS_OPS = [
    Operation("transformers", "", "crop, then continue", "press",
              "studies.field.adapters.transformers_ops:crop", "kept", "cache"),
    Operation("transformers", "", "reorder_cache + batch_select_indices", "press",
              "studies.field.adapters.transformers_ops:select", "original", "cache"),
]  # fmt: skip
LLAMA_CPP = [Operation("llama-cpp-python", "0.3.36", "cache reuse (K-shift merge)", "engine merge", None)]

MAIN = Env("main", ())
ENVS = {
    e.name: e
    for e in [
        MAIN,
        Env("memos-4.57.6", ("transformers==4.57.6", "torch==2.13.0", "MemoryOS==2.0.33")),
        Env("memos-4.56.0", ("transformers==4.56.0", "torch==2.7.1", "MemoryOS==2.0.33")),
        Env("kvpress-5.2.0", ("transformers==5.2.0", "torch==2.13.0", "kvpress==0.5.5")),
        Env("kvpress-4.57.6", ("transformers==4.57.6", "torch==2.13.0", "kvpress==0.5.5")),
        Env("transformers-5.25.0", ("transformers==5.25.0", "torch==2.14.1")),
    ]
}


def _slug(*parts: str) -> str:
    keep = "".join(c if c.isalnum() or c in ".-" else "-" for c in "_".join(parts).lower())
    while "--" in keep:
        keep = keep.replace("--", "-")
    return keep.strip("-")


def cells() -> dict[str, list[dict]]:
    """``{environment name: [cell, ...]}``; a cell is a JSON-ready dict with a unique ``id``."""
    plan: dict[str, list[tuple[Operation, str]]] = {name: [] for name in ENVS}
    for env in ("memos-4.57.6", "memos-4.56.0"):
        plan[env] += [(op, m) for op in MEMOS for m in ("tiny-llama", "tiny-gemma3", "smollm2-135m")]
    for env in ("kvpress-5.2.0", "kvpress-4.57.6"):
        plan[env] += [(op, m) for op in KVPRESS for m in TINY + REAL]
    # transformers' own operations on every release the matrix tests (4.57.6 and 5.2.0 beside a store).
    for env in ("memos-4.56.0", "memos-4.57.6", "kvpress-5.2.0", "main", "transformers-5.25.0"):
        models = ("tiny-llama", "tiny-phi", "tiny-gemma3") + (REAL if env == "main" else ())
        plan[env] += [(op, m) for op in TRANSFORMERS_OPS for m in models]
    plan["main"] += [(op, m) for op in LLAMA_CPP for m in REAL]
    out = {}
    for env, pairs in plan.items():
        tf = next((p.split("==")[1] for p in ENVS[env].pins if p.startswith("transformers==")), "5.24.0")
        out[env] = [
            {
                "id": _slug(op.package, op.version or tf, "tf" + tf, op.name, m),
                "env": env,
                "transformers": tf,
                "model": m,
                "operation": op.name,
                **{k: v for k, v in asdict(op).items() if k != "name"},
                "version": op.version or tf,
            }
            for op, m in pairs
        ]
    return out
