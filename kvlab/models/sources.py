"""Where a model comes from: a catalogue name, a local Hugging Face folder, a GGUF file, or a live object.

:func:`load_model` is kvlab's public loader. A catalogue name (``kvlab models``) goes to
:mod:`kvlab.models`; anything spelled as a path is read from disk:

* a folder holding ``config.json``, weights (``*.safetensors`` or ``pytorch_model*.bin``) and
  tokenizer files is read in place: nothing is converted or copied. Its fingerprint names
  the folder and carries a digest of those files, so caches of two checkpoints that share
  a folder name never cross;
* a ``.gguf`` file is dequantized once into kvlab's conversion cache, keyed by the file's
  sha256. When the file is one of the catalogue's, it lands in the same folder and loads
  as that catalogue model (same fingerprint as loading it by name).

:func:`wrap` takes a causal LM a user's code already holds (quantised, on an accelerator).

Every model from outside the catalogue is checked before any weight is read
(:func:`check_config`, :func:`check_module` on a meta-device skeleton), and once its weights
are in, before it is handed out, by a one-token rotation self-test (:func:`check_rotation`).
A model kvlab cannot treat raises :class:`~kvlab.errors.UnsupportedModelError` naming the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from kvlab.errors import ModelError, UnsupportedModelError, UnsupportedRopeError
from kvlab.models.catalog import model_names
from kvlab.models.digests import TOKENIZER_FILES
from kvlab.models.gguf import (
    GGUF_MODELS,
    GGUFSpec,
    conversion_dir,
    converted,
    gguf_quantization,
    load_gguf,
    sha256_cached,
    sha256_file,
)
from kvlab.models.loaded import DEFAULT_MODEL, LoadedModel, cache_root, quiet_gguf_reader, quiet_transformers
from kvlab.models.rope import find_rotary_module, layer_ropes, layer_types, rope_problem, rotate_keys
from kvlab.models.tiny import TINY_CONFIGS, build_tiny

#: Files at least this large have their sha256 remembered in the kvlab cache's index.
INDEX_MIN_BYTES = 16 << 20

#: Files of a model folder that decide what it computes, and so enter its digest. Docs,
#: licences and ``generation_config.json`` (sampling defaults) do not change a KV cache.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def looks_like_path(name) -> bool:
    """Whether ``name`` is meant as a path rather than a catalogue name."""
    if isinstance(name, os.PathLike):
        return True
    if not isinstance(name, str) or name in model_names():
        return False
    return os.sep in name or "/" in name or name.startswith(("~", ".")) or name.endswith(".gguf") or Path(name).exists()


def load_model(
    name: str | os.PathLike = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a model by kvlab name, from a local Hugging Face folder, or from a GGUF file, offline.

    Parameters
    ----------
    name : str or path
        ``smollm2-135m`` (default), ``gemma3-270m``, a ``tiny-*`` name (``kvlab models``);
        or a path: a folder with ``config.json``, weights and tokenizer files (read in
        place), or a ``.gguf`` file (dequantized once into the kvlab cache).
    dtype : torch.dtype
        Dtype of the weights, and so of every cache the model produces.
    device : str or torch.device, optional
        Where the weights go (``"cuda"``, ``"mps"``, ``"meta"``, ...); default the CPU.

    Raises
    ------
    ModelError
        Unknown name, missing path, a folder without weights or tokenizer.
    UnsupportedModelError
        A model kvlab cannot treat (see :func:`check_config`, :func:`check_module`),
        raised before the weights are read; or one failing :func:`check_rotation`.
    """
    if looks_like_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise ModelError(
                f"no such model folder or GGUF file: {path} (kvlab reads local files only; it never "
                "downloads from a model hub)"
            )
        with quiet_transformers():
            if path.is_dir():
                loaded = _load_folder(path, dtype)
            elif path.suffix.lower() == ".gguf":
                loaded = load_gguf_file(path, dtype)
            else:
                raise ModelError(
                    f"{path} is a file but not a .gguf; give a GGUF file or a Hugging Face model folder "
                    "(config.json, weights, tokenizer)"
                )
    elif isinstance(name, str) and name in GGUF_MODELS:
        with quiet_transformers():
            loaded = load_gguf(GGUF_MODELS[name], dtype)
    elif isinstance(name, str) and name in TINY_CONFIGS:
        with quiet_transformers():
            model, tokenizer, config = build_tiny(name, dtype)
        loaded = LoadedModel(
            model=model,
            tokenizer=tokenizer,
            name=name,
            config=config,
            source={"name": name, "kind": "tiny", "description": TINY_CONFIGS[name][0]},
        )
    else:
        raise ModelError(
            f"unknown model {name!r}; known models: {', '.join(model_names())}; "
            "or give a path to a Hugging Face model folder or a .gguf file"
        )
    if device is not None:
        loaded.model.to(device)
    if not (loaded.source.get("kind") == "tiny" or loaded.source.get("package")):
        # Outside the catalogue (whose models the tests check), test the rotation before any merge.
        # Decided by the source, not the name: a user's folder may well be called smollm2-135m.
        check_rotation(loaded)
    return loaded


def wrap(model: torch.nn.Module, tokenizer, name: str | None = None) -> LoadedModel:
    """A causal LM already loaded by the caller's code, as a kvlab model (nothing is copied or changed).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (``...ForCausalLM``) in eval mode, on any device, in any dtype,
        quantised or not.
    tokenizer : transformers tokenizer
        The tokenizer its token ids come from.
    name : str, optional
        A name for tables and cache files; default the config's ``_name_or_path`` or class name.

    Returns
    -------
    LoadedModel
        ``source`` kind ``live``; its fingerprint identifies the weights by their digest.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise UnsupportedModelError(
            f"kvlab.wrap needs a transformers model (a torch module with a .config), got {type(model).__name__}"
        )
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise ModelError(
            f"kvlab.wrap needs the model's tokenizer (callable, with .decode), got {type(tokenizer).__name__}"
        )
    what = name or type(model).__name__
    check_config(config, what)
    if not is_causal_class(type(model).__name__):
        raise UnsupportedModelError(
            f"{what} is a {type(model).__name__}, not a causal LM with a next-token head; wrap the ...ForCausalLM model"
        )
    check_module(model, what)
    if model.training:
        raise ModelError(
            f"{what} is in training mode (dropout active), so its caches are random; call model.eval() "
            "first (kvlab does not change the model it is given)"
        )
    if name is None:
        name = Path(str(getattr(config, "_name_or_path", "") or "")).name or type(model).__name__
    source = {"kind": "live", "name": name, "class": type(model).__name__, "quantization": _quantization(config)}
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=name, config=config, source=source)
    check_rotation(loaded)
    return loaded


# --------------------------------------------------------------------------- checks


def is_causal_class(class_name: str) -> bool:
    """Whether a transformers model class name is a causal LM (one with a next-token head)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ([v] if isinstance(v, str) else v)}
    return class_name in names or class_name.endswith(("ForCausalLM", "LMHeadModel"))


def check_config(config, what: str) -> None:
    """Refuse, from the config alone, a model kvlab cannot treat.

    Encoder-decoder and encoder-only models, configs transformers has no causal-LM class
    for, checkpoints whose weights are for another head, and rope schedules kvlab does not
    know (:func:`kvlab.models.rope.rope_problem`).
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    is_causal_arch = [is_causal_class(a) for a in archs]
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{what} is an encoder-decoder model ({model_type}): its decoder cache attends over an encoder's output, "
            "not over earlier cached fragments; kvlab treats decoder-only causal language models"
        )
    encoder_only = (
        model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_decoder", False)
        and not any(is_causal_arch)
    )
    if encoder_only:
        raise UnsupportedModelError(
            f"{what} is an encoder-only model ({model_type}{', ' + '/'.join(archs) if archs else ''}): every token "
            "attends to every other in both directions, so there is no causal KV cache to reuse or merge"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{what} is not a causal language model: transformers has no causal-LM class for model_type "
            f"{model_type!r}{' (architectures: ' + ', '.join(archs) + ')' if archs else ''}"
        )
    if archs and not any(is_causal_arch):
        raise UnsupportedModelError(
            f"{what} holds weights for {', '.join(archs)}, not a causal LM head; loading it as one would invent "
            "a random head, so kvlab refuses it"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if not params:
        return
    per_type = params if all(isinstance(v, dict) for v in params.values()) else {"default": params}
    for layer_type, p in per_type.items():
        problem = rope_problem(p)
        if problem:
            where = "" if layer_type == "default" else f" ({layer_type} layers)"
            raise UnsupportedModelError(f"{what}{where}: {problem}")


def check_module(model: torch.nn.Module, what: str) -> None:
    """Refuse a model without a rotary embedding kvlab can read (a live model or a meta-device skeleton)."""
    try:
        find_rotary_module(model)
    except UnsupportedRopeError:  # re-raised as a model error, with the model's own story
        raise UnsupportedModelError(_no_rope_reason(model, what)) from None
    try:
        layer_ropes(model)
    except (AttributeError, KeyError, TypeError) as e:
        raise UnsupportedModelError(
            f"{what}: its rotary module {type(find_rotary_module(model)).__name__} does not "
            f"expose the inverse frequencies kvlab reads ({e})"
        ) from None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if len(layer_types(config)) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"{what}: config.layer_types names {len(layer_types(config))} layers, the model "
            f"has {config.num_hidden_layers}"
        )


#: Position the rotation self-test moves a key to (far enough that every frequency pair turns).
PROBE_SHIFT = 37


@torch.inference_mode()
def check_rotation(loaded: LoadedModel) -> float:
    """Check that the model rotates cached keys the way kvlab re-rotates them, at every layer.

    One token prefilled alone attends only to itself, so at every layer its key at position
    ``s`` must be its key at position 0 turned by ``s`` positions, if the model applies RoPE
    as kvlab reads it: pairs ``(i, i + r/2)`` of the first ``rotary_dim`` dims, frequencies
    from the rotary module. Models that pair ``(2i, 2i + 1)`` (Cohere, GLM), leave some layers
    without rope (SmolLM3's NoPE layers) or rotate a separate part of the key (DeepSeek's
    MLA) fail here, where any re-rotation would silently be wrong. Skipped on ``meta``.

    Returns
    -------
    float
        The largest relative error ``max|K_s - R(s) K_0| / max|K_s|`` over layers.

    Raises
    ------
    UnsupportedModelError
        Above 1e-3 (float32/64 weights) or 5e-2 (half precision), naming the layers.
    """
    if loaded.device.type == "meta":
        return 0.0
    limit = getattr(loaded.config.get_text_config(), "max_position_embeddings", None) or PROBE_SHIFT + 1
    shift = min(PROBE_SHIFT, limit - 1)
    ids = loaded.tokenizer(" the", add_special_tokens=False)["input_ids"][:1] or [0]
    ids = torch.tensor(ids, dtype=torch.long)
    at0, at_s = _one_token_cache(loaded, ids, 0), _one_token_cache(loaded, ids, shift)
    tol = 1e-3 if loaded.dtype in (torch.float32, torch.float64) else 5e-2
    errors = []
    for li, rope in enumerate(layer_ropes(loaded.model)):
        k0, ks = at0.layers[li].keys.float(), at_s.layers[li].keys.float()
        want = rotate_keys(k0, rope.inv_freq, shift)
        errors.append(float((ks - want).abs().max() / ks.abs().max().clamp_min(1e-30)))
    bad = [li for li, e in enumerate(errors) if not e <= tol]
    if bad:
        raise UnsupportedModelError(
            f"{loaded.name}: at layer(s) {bad} a key cached at position {shift} is not the same token's key at position 0 "
            f"rotated by {shift} positions the way kvlab rotates (relative error up to {max(errors[li] for li in bad):.2g}, "
            f"allowed {tol:g}). The model applies positions some other way (interleaved rotary pairs, layers without "
            "rope, rope on a separate part of the key), so every re-rotation kvlab made would be silently wrong"
        )
    return max(errors, default=0.0)


def _one_token_cache(loaded: LoadedModel, ids: torch.Tensor, position: int):
    """The cache of ``ids`` (one token) prefilled alone at ``position``, straight through transformers."""
    from transformers import DynamicCache

    cache = DynamicCache(config=loaded.config)
    positions = torch.tensor([[position]], device=loaded.device)
    loaded.model(
        input_ids=ids[None].to(loaded.device), position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
    )
    return cache


def _no_rope_reason(model: torch.nn.Module, what: str) -> str:
    learned = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and any(k in n.split(".")[-1] for k in ("wpe", "position", "pos_emb"))
    ]
    if learned:
        return (
            f"{what} ({type(model).__name__}) has no rotary embedding: it adds learned absolute position "
            f"embeddings ({learned[0]}) to its input, so every cached key and value of every layer depends on the "
            "position it was computed at. A naive merge is wrong there too, and no re-rotation can fix it (the "
            "position is mixed into the hidden state, not a rotation of the key); only a re-prefill is exact. "
            "kvlab treats RoPE models"
        )
    return (
        f"{what} ({type(model).__name__}) has no rotary embedding (positions enter some other way, e.g. ALiBi "
        "biases or none at all); kvlab measures and repairs the RoPE phase of cached keys, so it treats RoPE models only"
    )


def _skeleton(config) -> torch.nn.Module:
    """The model's modules on the meta device: no memory, no weights read, just its structure."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UnsupportedModelError(f"transformers cannot build a causal LM from this config: {e}") from None


# --------------------------------------------------------------------------- folders


def folder_files(folder: Path) -> list[Path]:
    """The files of a model folder that enter its digest (config, weights, tokenizer), sorted."""
    found = {folder / "config.json"} if (folder / "config.json").is_file() else set()
    for pattern in WEIGHT_PATTERNS:
        found.update(p for p in folder.glob(pattern) if p.is_file())
    found.update(folder / n for n in TOKENIZER_FILES if (folder / n).is_file())
    return sorted(found)


def folder_digest(folder: Path) -> tuple[str, dict[str, str]]:
    """sha256 over a folder's :func:`folder_files`: one ``name<TAB>sha256`` line each, in name order.

    Each large file's sha256 is remembered by (path, size, mtime) in the kvlab cache, so a
    second load hashes only the small ones.

    Returns
    -------
    digest : str
    files : dict
        File name -> its sha256.
    """
    # Small files (configs, tokenizers, tiny weights) hash faster than the index is read and written.
    files = {
        p.name: sha256_cached(p) if p.stat().st_size >= INDEX_MIN_BYTES else sha256_file(p)
        for p in folder_files(folder)
    }
    h = hashlib.sha256(b"kvlab-folder-v1\n")
    for n in sorted(files):
        h.update(f"{n}\t{files[n]}\n".encode())
    return h.hexdigest(), files


def _load_folder(folder: Path, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = folder.resolve()
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"{folder}/config.json is not a config transformers can read: {e}") from None
    check_config(config, str(folder))
    check_module(_skeleton(config), str(folder))
    if not any(p.is_file() for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)):
        raise ModelError(f"{folder} has no weights (model.safetensors, model-*.safetensors or pytorch_model*.bin)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(
            f"{folder} has no tokenizer kvlab can load (tokenizer.json, tokenizer.model ...): {e}"
        ) from None
    digest, files = folder_digest(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(f"transformers could not load the weights in {folder}: {e}") from None
    model.eval()
    source = {
        "kind": "folder",
        "name": folder.name,
        "path": str(folder),
        "files_sha256": digest,
        "files": files,
        "quantization": _quantization(model.config),
        # Digests kept for the next process go here, never into the user's folder.
        "fingerprint_dir": str(cache_root() / "folders" / f"{folder.name}-{digest[:16]}"),
    }
    return LoadedModel(model=model, tokenizer=tokenizer, name=folder.name, config=model.config, source=source)


# --------------------------------------------------------------------------- GGUF files


def _quantization(config) -> str:
    """The quantization method a transformers config names (``bitsandbytes``, ``gptq`` ...), or ``none``."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return "none"
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)) if method else "none"


def _catalogue_spec(path: Path, sha: str) -> GGUFSpec | None:
    """The catalogue model whose GGUF is this very file (by size, then sha256), if any."""
    size = path.stat().st_size
    for spec in GGUF_MODELS.values():
        try:
            known = spec.existing(spec)
        except ModelError:
            continue
        if known.is_file() and known.stat().st_size == size and sha256_cached(known) == sha:
            return spec
    return None


def load_gguf_file(path: str | os.PathLike, dtype: torch.dtype = torch.float32, name: str | None = None) -> LoadedModel:
    """Load a GGUF file: dequantized once into kvlab's conversion cache, keyed by its sha256.

    The one GGUF-file loader (``load_model`` sends ``.gguf`` paths here). A file whose bytes are a
    catalogue model's loads as that model, with the same fingerprint as loading it by name.
    Any other file is checked (config, modules) before a weight is read; its fingerprint's
    source names the file and carries its sha256, so two files differing in any byte are
    different producers (a requantisation by :func:`kvlab.peers.requantize`, say). The
    rotation self-test runs in :func:`load_model`.

    Parameters
    ----------
    path : str or path
        The ``.gguf`` file.
    dtype : torch.dtype
        Dtype of the dequantized weights.
    name : str, optional
        kvlab name of the model (default the file's stem); ignored for a catalogue file.

    Raises
    ------
    ModelError
        No such file, or not a GGUF file.
    UnsupportedModelError
        A model kvlab cannot treat.
    """
    return load_gguf(_file_spec(path, name), dtype)


def convert_gguf_file(path: str | os.PathLike, name: str | None = None) -> Path:
    """Convert a GGUF file into kvlab's conversion cache without loading it; its folder.

    What :func:`load_gguf_file` would do first, for a preparation step (``kvlab peers
    --prepare``) that leaves nothing for a notebook or test to pay; the same checks and errors.
    """
    return converted(_file_spec(Path(path), name))


def _file_spec(path: Path, name: str | None) -> GGUFSpec:
    """The spec under which a GGUF file converts and loads, after checking it is one kvlab treats."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    from transformers import AutoConfig

    path = path.resolve()
    sha = sha256_cached(path)
    spec = _catalogue_spec(path, sha)
    if spec is not None:
        # The same bytes as a catalogue model: same conversion folder, same fingerprint.
        return spec
    spec = GGUFSpec(
        name=name or path.stem,
        family="",
        package="",
        module="",
        filename=path.name,
        quantization="",
        install="",
        locate=lambda s: path,
        existing=lambda s: path,
    )
    if (conversion_dir(spec.name, sha) / "kvlab-source.json").is_file():
        # Converted before, so it passed the checks below then; its recorded source says the rest.
        return spec
    quantization = gguf_quantization(path)
    try:
        with quiet_gguf_reader():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UnsupportedModelError(f"transformers cannot read {path} as a model: {e}") from None
    check_config(config, str(path))
    check_module(_skeleton(config), str(path))
    return dataclasses.replace(spec, family=config.model_type, quantization=quantization)
