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

from kvlab.compat import META_FORWARD, TRANSFORMERS, load_causal_lm
from kvlab.errors import ModelError, UnsupportedModelError
from kvlab.models.catalog import model_names
from kvlab.models.checks import check_config, check_module, check_rotation, is_causal_class, skeleton
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
    if device is not None and torch.device(device).type == "meta" and not META_FORWARD:
        raise UnsupportedModelError(
            f"a model on the meta device cannot run a forward in transformers {TRANSFORMERS} (its rotary modules open "
            "torch.autocast on the meta device, which torch refuses; transformers skips it from 5.4): load it on a "
            "real device"
        )
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
            # The same refusals as any model, before it is built: a release may build a family
            # differently, or not at all (kvlab.compat).
            check_config(TINY_CONFIGS[name][1](), name)
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
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

    folder = folder.resolve()
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"{folder}/config.json is not a config transformers can read: {e}") from None
    check_config(config, str(folder))
    check_module(skeleton(config), str(folder))
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
        model = load_causal_lm(folder, dtype)
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(f"transformers could not load the weights in {folder}: {e}") from None
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
    different producers (a requantisation by :func:`kvlab.peers.quantize.requantize`, say). The
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
    from transformers import AutoConfig  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

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
    check_module(skeleton(config), str(path))
    return dataclasses.replace(spec, family=config.model_type, quantization=quantization)
