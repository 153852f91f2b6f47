"""llama.cpp's state files offered to other models, beside kvlab's fingerprinted cache files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvlab.cache.fragments import prefill
from kvlab.errors import FingerprintMismatch, PeerError
from kvlab.files.io import load_cache, save_cache
from kvlab.measure.metrics import kl_divergence
from kvlab.models.loaded import LoadedModel
from kvlab.peers.engine import LlamaEngine
from kvlab.peers.mapping import engine_for, has_bos, token_ids


@dataclass
class StateLoad:
    """What llama.cpp did when a reader model was given a producer's state file.

    ``accepted``: llama.cpp loaded it; ``said``: llama.cpp's reason when it refused;
    ``kls``: per probe ``KL(p_own || p_foreign)``, the reader behind its own prefill of the
    same tokens against behind the loaded file (empty when refused or vocabularies differ);
    ``flips``: probes whose top-1 token changed.
    """

    file: str  # "state" (llama_state_save_file, a session file) or "seq" (llama_state_seq_save_file)
    reader: str
    reader_desc: str
    accepted: bool
    said: str = ""
    kls: list[float] = field(default_factory=list)
    flips: int = 0

    @property
    def kl_mean(self) -> float | None:
        return float(np.mean(self.kls)) if self.kls else None

    @property
    def kl_max(self) -> float | None:
        return float(max(self.kls)) if self.kls else None


def state_file_study(
    model: LoadedModel, text: str, probes: list[str], readers: dict[str, Path], workdir
) -> list[StateLoad]:
    """Write llama.cpp state files from ``model``'s GGUF and offer them to each reader GGUF.

    Parameters
    ----------
    readers : dict of str to Path
        Reader name to GGUF file (e.g. the producer itself, a requantisation, another model).
    workdir : path
        Where the state files are written.
    """
    workdir = Path(workdir)
    ids = token_ids(model, text, bos=True)
    probe_ids = [token_ids(model, p) for p in probes]
    files = {}
    with engine_for(model, n_ctx=1024, n_seq_max=1) as prod:
        prod.prefill(ids)
        files["state"] = prod.save_state(workdir / "producer.state", ids)
        files["seq"] = prod.save_seq_state(workdir / "producer.seq", ids)
        n_vocab = prod.n_vocab
    out = []
    for name, path in readers.items():
        with LlamaEngine(path, n_ctx=1024, n_seq_max=1) as reader:
            own = None
            if reader.n_vocab == n_vocab:
                reader.prefill(ids)
                own = [reader.read(p) for p in probe_ids]
            for kind, f in files.items():
                reader.clear()
                try:
                    (reader.load_state if kind == "state" else reader.load_seq_state)(f)
                except PeerError as e:
                    out.append(StateLoad(kind, name, reader.info.desc, False, said=str(e).split(": ", 1)[-1]))
                    continue
                row = StateLoad(kind, name, reader.info.desc, True)
                if own is not None:
                    foreign = [reader.read(p) for p in probe_ids]
                    row.kls = [kl_divergence(a, b) for a, b in zip(own, foreign)]
                    row.flips = sum(int(a.argmax()) != int(b.argmax()) for a, b in zip(own, foreign))
                out.append(row)
    return out


def kvlab_refusals(
    model: LoadedModel, text: str, readers: dict[str, LoadedModel], workdir
) -> dict[str, list[str] | None]:
    """kvlab's answer to the same pairs: save a cache file from ``model``, load it into each reader.

    Returns, per reader, the list of differing strict fingerprint fields (``None`` if it loaded).
    """
    path = save_cache(Path(workdir) / "producer.kvcache", prefill(model, text, bos=has_bos(model)), model)
    out = {}
    for name, reader in readers.items():
        try:
            load_cache(path, reader)
            out[name] = None
        except FingerprintMismatch as e:
            out[name] = [d.field for d in e.differences]
    return out
