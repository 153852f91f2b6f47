"""One llama.cpp context on a GGUF file, driven by token ids: :class:`LlamaEngine`.

Batches of token ids on numbered sequences, next-token logits, the memory calls that shift and
copy cached sequences, and the context's state files. Every call llama.cpp refuses raises
:class:`kvlab.PeerError` with what llama.cpp logged (:func:`kvlab.peers.llama_cpp.said`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlab.atomic import atomic_path
from kvlab.errors import PeerError
from kvlab.peers.llama_cpp import check_gguf_file, clear_log, lib, loaded, said

#: ggml_type ids (llama_cpp.GGML_TYPE_*) of the KV cache element types offered here. The two
#: block-quantised types store 32 elements per block with one f16 scale: q8_0 in 8-bit, q4_0 in
#: 4-bit integers. llama.cpp shifts a quantised K cache by dequantising to f32, rotating and
#: quantising back (llama.cpp issues 5652 and 9743); a quantised V cache needs flash attention.
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
QUANTISED_KV_TYPES = ("q8_0", "q4_0")


def _kv_type_id(which: str, name: str) -> int:
    if name not in KV_TYPES:
        raise PeerError(f"{which} must be one of {sorted(KV_TYPES)}, got {name!r}")
    return KV_TYPES[name]


@dataclass(frozen=True)
class EngineInfo:
    """What llama.cpp reports about a loaded GGUF model.

    ``desc`` is llama.cpp's one-line description (architecture, size, file type).
    """

    path: str
    arch: str
    desc: str
    n_layer: int
    n_head_kv: int
    n_embd: int
    n_swa: int
    n_vocab: int
    n_ctx_train: int


class LlamaEngine:
    """One GGUF model and one llama.cpp context, driven by token ids.

    Parameters
    ----------
    path : str or Path
        The GGUF file.
    n_ctx : int
        Context size in tokens, shared by all sequences (the cache is unified, as in
        llama.cpp's server, so copying a sequence into another is bookkeeping only).
    n_seq_max : int
        Number of sequence ids the context accepts (one per fragment of a merge).
    n_threads : int, optional
        Threads for decoding (default: torch's thread count).
    kv_type : {"f16", "f32", "q8_0", "q4_0"}
        Element type of the KV cache (K and V); llama.cpp's default is f16.
    type_k, type_v : str, optional
        Element type of the K or the V cache alone, overriding ``kv_type`` (same names).
        llama.cpp refuses a quantised V cache without flash attention (``flash_attn=False``);
        its automatic choice turns flash attention on for it on the CPU.
    swa_full : bool
        Keep every token in sliding-window layers (llama.cpp's library default). The server
        sets it False, keeping only the window, which is what makes it refuse cache reuse.
    n_batch : int
        Tokens per ``llama_decode`` call (longer inputs are split).
    flash_attn : bool, optional
        Force llama.cpp's fused attention kernel on or off (default: llama.cpp decides).

    Notes
    -----
    A sequence's positions must follow on from its current maximum: llama.cpp refuses a
    batch that starts elsewhere. Every call that llama.cpp refuses raises
    :class:`kvlab.PeerError` with what llama.cpp logged.
    """

    def __init__(
        self,
        path,
        *,
        n_ctx: int = 4096,
        n_seq_max: int = 4,
        n_threads: int | None = None,
        kv_type: str = "f16",
        swa_full: bool = True,
        n_batch: int = 512,
        flash_attn: bool | None = None,
        type_k: str | None = None,
        type_v: str | None = None,
    ):
        path = check_gguf_file(path)
        L = lib()
        _kv_type_id("kv_type", kv_type)
        type_k, type_v = type_k or kv_type, type_v or kv_type
        k_id, v_id = _kv_type_id("type_k", type_k), _kv_type_id("type_v", type_v)
        self._model = self._ctx = self._batch = None
        self._shift_pending = False  # a seq_add whose K-shift the next decode applies
        self.path = path
        clear_log()
        mparams = L.llama_model_default_params()
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise PeerError(f"llama.cpp could not load {path}: {said()}")
        self._model = model
        # The loader's warnings (e.g. Gemma's "control-looking token") are not a context's reason.
        clear_log()
        self.vocab = L.llama_model_get_vocab(model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_batch = int(n_batch)
        self.n_threads = int(n_threads or torch.get_num_threads())
        cparams = L.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = int(n_seq_max)
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.kv_unified = True
        cparams.swa_full = bool(swa_full)
        cparams.type_k, cparams.type_v = k_id, v_id
        cparams.no_perf = True
        if flash_attn is not None:  # None keeps llama.cpp's automatic choice
            cparams.flash_attn_type = 1 if flash_attn else 0
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise PeerError(
                f"llama.cpp could not create a context for {path.name} (n_ctx={n_ctx}, "
                f"n_seq_max={n_seq_max}, K cache {type_k}, V cache {type_v}, flash_attn="
                f"{'auto' if flash_attn is None else flash_attn}): {said()}"
            )
        self._ctx = ctx
        self.n_ctx = int(L.llama_n_ctx(ctx))
        self.n_seq_max = int(n_seq_max)
        self.kv_type, self.swa_full = kv_type, bool(swa_full)
        self.type_k, self.type_v = type_k, type_v
        self._mem = L.llama_get_memory(ctx)
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(model, buf, len(buf))
        arch = ctypes.create_string_buffer(64)
        L.llama_model_meta_val_str(model, b"general.architecture", arch, len(arch))
        self.info = EngineInfo(
            path=str(path),
            arch=arch.value.decode(),
            desc=buf.value.decode(),
            n_layer=int(L.llama_model_n_layer(model)),
            n_head_kv=int(L.llama_model_n_head_kv(model)),
            n_embd=int(L.llama_model_n_embd(model)),
            n_swa=int(L.llama_model_n_swa(model)),
            n_vocab=self.n_vocab,
            n_ctx_train=int(L.llama_model_n_ctx_train(model)),
        )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        L = loaded()
        if L is None:
            return
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            L.llama_model_free(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def _live(self):
        if not self._ctx:
            raise PeerError(f"the llama.cpp engine for {self.path.name} is closed")
        return loaded()

    # ------------------------------------------------------------------ sequences
    def clear(self) -> None:
        """Empty the KV cache (all sequences)."""
        self._live().llama_memory_clear(self._mem, True)
        self._shift_pending = False

    def pos_max(self, seq: int = 0) -> int:
        """Largest position held by ``seq`` (-1 when empty)."""
        return int(self._live().llama_memory_seq_pos_max(self._mem, seq))

    def pos_min(self, seq: int = 0) -> int:
        """Smallest position held by ``seq`` (-1 when empty)."""
        return int(self._live().llama_memory_seq_pos_min(self._mem, seq))

    def seq_add(self, seq: int, delta: int, p0: int = -1, p1: int = -1) -> None:
        """Move ``seq``'s tokens in ``[p0, p1)`` by ``delta`` positions (``llama_memory_seq_add``).

        Their keys are rotated by ``delta`` (a K-shift) at the next decode, not now; a refusal
        of that decode names the K cache type (a quantised K cache is dequantised, rotated and
        quantised back).
        """
        self._live().llama_memory_seq_add(self._mem, seq, p0, p1, delta)
        self._shift_pending = self._shift_pending or delta != 0

    def seq_cp(self, src: int, dst: int) -> None:
        """Add sequence ``dst`` to every cell of ``src`` (``llama_memory_seq_cp``; bookkeeping in a unified cache)."""
        self._live().llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop ``seq`` from its cells in ``[p0, p1)`` (``-1``: open end); cells still used by another sequence stay."""
        self._live().llama_memory_seq_rm(self._mem, seq, p0, p1)

    def decode(self, ids, seq: int = 0, start: int | None = None) -> None:
        """Append token ids to sequence ``seq`` at ``start, start+1, ...``.

        Parameters
        ----------
        ids : sequence of int or torch.Tensor
            ``[L]`` token ids (kvlab's tokenizer made them).
        start : int, optional
            Position of the first token; default: right after the sequence's last one.
            The last token's logits are kept (:meth:`log_probs` reads them).
        """
        L = self._live()
        ids = [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if not ids:
            raise PeerError("cannot decode an empty token sequence")
        if not 0 <= seq < self.n_seq_max:
            raise PeerError(f"sequence id {seq} out of range [0, {self.n_seq_max})")
        bad = [t for t in ids if not 0 <= t < self.n_vocab]
        if bad:
            raise PeerError(
                f"token id {bad[0]} is outside llama.cpp's vocabulary of {self.n_vocab} for {self.path.name}"
            )
        pos = self.pos_max(seq) + 1 if start is None else int(start)
        b = self._batch
        for lo in range(0, len(ids), self.n_batch):
            chunk = ids[lo : lo + self.n_batch]
            last_chunk = lo + self.n_batch >= len(ids)
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = pos + lo + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = last_chunk and i == len(chunk) - 1
            b.n_tokens = len(chunk)
            clear_log()
            rc = L.llama_decode(self._ctx, b)
            if rc != 0:
                pending = f", with a K-shift of the {self.type_k} K cache pending" if self._shift_pending else ""
                raise PeerError(
                    f"llama.cpp refused to decode {len(chunk)} tokens on sequence {seq} at position "
                    f"{pos + lo} (llama_decode returned {rc}{pending}): {said()}"
                )
            self._shift_pending = False

    def log_probs(self) -> torch.Tensor:
        """``[n_vocab]`` float64 log-softmax of the logits of the last decoded token."""
        L = self._live()
        ptr = L.llama_get_logits_ith(self._ctx, -1)
        if not ptr:
            raise PeerError("llama.cpp holds no logits: decode something first")
        logits = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64))
        return torch.log_softmax(logits, -1)

    def read(self, ids, seq: int = 0) -> torch.Tensor:
        """Next-token log-probs after ``ids`` read behind what ``seq`` holds; the cache is left as it was.

        Returns
        -------
        torch.Tensor
            ``[n_vocab]`` float64 log-probabilities.
        """
        at = self.pos_max(seq) + 1
        self.decode(ids, seq, at)
        out = self.log_probs()
        self.seq_rm(seq, at, -1)
        return out

    def prefill(self, ids, seq: int = 0) -> None:
        """Empty ``seq`` and decode ``ids`` into it at positions ``0..L-1``."""
        self.seq_rm(seq)
        self.decode(ids, seq, 0)

    def _check_fragments(self, fragments: list) -> None:
        """:class:`PeerError` for a merge this engine cannot hold: none, or more fragments than sequences."""
        self._live()
        if not fragments:
            raise PeerError("nothing to merge: the list of fragments is empty")
        if len(fragments) > self.n_seq_max:
            raise PeerError(
                f"{len(fragments)} fragments need {len(fragments)} sequences; "
                f"this engine was made with n_seq_max={self.n_seq_max}"
            )

    def shift_merge(self, fragments: list) -> int:
        """Merge fragments the way llama.cpp's server reuses cached chunks (``--cache-reuse``).

        Each fragment is decoded alone as its own sequence at positions ``0..L_i-1``; each
        later one is moved behind the earlier ones with ``llama_memory_seq_add`` (which
        marks its keys for a K-shift: a RoPE rotation by the offset, applied at the next
        decode) and copied into sequence 0 with ``llama_memory_seq_cp``.

        Parameters
        ----------
        fragments : list
            ``[L_i]`` token ids per fragment.

        Returns
        -------
        int
            Total tokens now in sequence 0.
        """
        self._check_fragments(fragments)
        self.check_can_shift()
        self.clear()
        for i, ids in enumerate(fragments):
            self.decode(ids, i, 0)
        offset = len(fragments[0])
        for i in range(1, len(fragments)):
            n = len(fragments[i])
            self.seq_add(i, offset, 0, -1)
            self.seq_cp(i, 0)
            self.seq_rm(i)
            offset += n
        return self.pos_max(0) + 1

    def phase_merge(self, fragments: list) -> int:
        """The phase reference inside llama.cpp: each fragment decoded alone at its landing positions.

        Like :meth:`shift_merge` but fragment ``i`` is decoded at ``offset_i..`` directly, so its
        keys are computed at the right phase instead of being rotated there by a K-shift. The
        two differ only by the rounding of the rotation of f16 keys.
        """
        self._check_fragments(fragments)
        self.clear()
        offset = 0
        for i, ids in enumerate(fragments):
            self.decode(ids, i, offset)
            offset += len(ids)
        for i in range(1, len(fragments)):
            self.seq_cp(i, 0)
            self.seq_rm(i)
        return self.pos_max(0) + 1

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenisation of ``text`` (no BOS, special tokens not parsed), to compare with kvlab's."""
        L = self._live()
        raw = text.encode()
        cap = len(raw) + 8
        arr = (ctypes.c_int32 * cap)()
        n = L.llama_tokenize(self.vocab, raw, len(raw), arr, cap, False, False)
        if n < 0:
            raise PeerError(f"llama.cpp needs {-n} token slots for {text[:40]!r}")
        return list(arr[:n])

    def can_shift(self) -> bool:
        return bool(self._live().llama_memory_can_shift(self._mem))

    def check_can_shift(self) -> None:
        """:class:`PeerError` naming the K cache type and layout when llama.cpp cannot shift this cache."""
        if not self.can_shift():
            raise PeerError(
                f"llama.cpp cannot shift the KV cache of {self.path.name} (K cache {self.type_k}, "
                f"swa_full={self.swa_full}: llama_memory_can_shift is false)"
            )

    # ------------------------------------------------------------------ state files
    def save_state(self, path, tokens) -> Path:
        """Write llama.cpp's full state file (a session file: all sequences plus ``tokens``); atomic."""
        return self._write(path, lambda tmp, arr, n: self._live().llama_state_save_file(self._ctx, tmp, arr, n), tokens)

    def save_seq_state(self, path, tokens, seq: int = 0) -> Path:
        """Write one sequence's state file (``llama_state_seq_save_file``); atomic."""
        return self._write(
            path, lambda tmp, arr, n: self._live().llama_state_seq_save_file(self._ctx, tmp, seq, arr, n) > 0, tokens
        )

    def _write(self, path, call, tokens) -> Path:
        path = Path(path)
        toks = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        arr = (ctypes.c_int32 * max(1, len(toks)))(*toks)
        clear_log()
        with atomic_path(path) as tmp:
            if not call(str(tmp).encode(), arr, len(toks)):
                raise PeerError(f"llama.cpp could not write {path}: {said()}")
        return path

    def load_state(self, path, capacity: int = 1 << 16) -> list[int]:
        """Read a full state file into this context; returns the tokens stored with it.

        Raises :class:`PeerError` with llama.cpp's own reason when it refuses the file.
        """
        L = self._live()
        path = _existing(path)
        arr = (ctypes.c_int32 * capacity)()
        n = ctypes.c_size_t(0)
        clear_log()
        if not L.llama_state_load_file(self._ctx, str(path).encode(), arr, capacity, ctypes.byref(n)):
            raise PeerError(f"llama.cpp refused the state file {path.name}: {said()}")
        return list(arr[: n.value])

    def load_seq_state(self, path, seq: int = 0, capacity: int = 1 << 16) -> list[int]:
        """Read a sequence state file into sequence ``seq``; returns its tokens."""
        L = self._live()
        path = _existing(path)
        arr = (ctypes.c_int32 * capacity)()
        n = ctypes.c_size_t(0)
        clear_log()
        if not L.llama_state_seq_load_file(self._ctx, str(path).encode(), seq, arr, capacity, ctypes.byref(n)):
            raise PeerError(f"llama.cpp refused the sequence state file {path.name}: {said()}")
        return list(arr[: n.value])

    def state_bytes(self) -> bytes:
        """The full state in memory (``llama_state_get_data``), e.g. to restore between timed runs."""
        L = self._live()
        size = L.llama_state_get_size(self._ctx)
        buf = (ctypes.c_uint8 * size)()
        L.llama_state_get_data(self._ctx, buf, size)
        return bytes(buf)

    def set_state_bytes(self, data: bytes) -> None:
        L = self._live()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        clear_log()
        if L.llama_state_set_data(self._ctx, buf, len(data)) == 0:
            raise PeerError(f"llama.cpp refused the in-memory state: {said()}")


def _existing(path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise PeerError(f"no state file at {path}")
    return path
