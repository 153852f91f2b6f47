"""Reading probes behind a cache: kvlab's one path from a cache and some texts to what the model says next.

:func:`read_probes` reads many probes behind one cache in one forward pass, and decodes
their greedy continuations together, without copying the cache per probe or per token:

* The past is copied once per call, into per-layer buffers with room after it for every
  token the call adds (:class:`ProbeCache`); new keys and values are written into that
  room in place. ``DynamicLayer.update`` would instead build a new tensor with
  ``torch.cat`` in every forward pass: the whole past copied again for each decoded token.
* The probes are packed one after another into one sequence of batch 1 behind the shared
  past, each at the positions it would have alone (``T .. T + L_i - 1`` behind a cache of
  ``T`` tokens), under a mask that lets each token see the past and the earlier tokens of
  its own probe only (:func:`visible`). A right-padded batch of ``B`` rows would need the
  past ``B`` times over: attention reads keys ``[batch, kv_heads, T, head_dim]``.
* A continuation (an answer) is scored by teacher forcing: its tokens follow the probe's
  in the same forward pass, and the distributions at all of them are read at once.
* A draft (a guess of the greedy continuation, e.g. the joined prefill's) is checked the
  same way: where the model's argmax agrees with it, no decoding step is needed.

The caller's cache is only read, never written: its tensors and lengths are the same after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.cache.fragments import tokenize
from kvlab.errors import MergeError
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import CONDITIONAL_ROPE_TYPES, check_positions, layer_ropes, layer_types

#: Query tokens per forward pass (probes, continuations and drafts of one group of probes). Bounds
#: the mask (``[tokens, T + tokens]`` floats) and the rows of logits read at once; more groups cost
#: more, smaller forward passes, never another copy of the past.
MAX_TOKENS = 1024

#: What a slot after the past holds, for :func:`visible`: the probe or a greedy token (seen by
#: every later token of its probe), a continuation or a draft token (seen by later tokens of the
#: same kind only), or nothing any more (a rejected draft token).
PROBE, CONTINUATION, DRAFT, DEAD = 0, 1, 2, -1


@dataclass(frozen=True, eq=False)
class ProbeRead:
    """What the model reads behind a cache after one probe.

    Attributes
    ----------
    probe : str
    log_probs : torch.Tensor
        ``[vocab]`` float64 log-probabilities of the token after the probe.
    greedy : list of int
        The greedy continuation's token ids (the first is the argmax of ``log_probs``' logits).
    continuation : torch.Tensor or None
        ``[C]`` int64 token ids scored after the probe by teacher forcing.
    continuation_log_probs : torch.Tensor or None
        ``[C, vocab]`` float64: row ``j`` is the distribution of the token at continuation
        position ``j``, given the probe and ``continuation[:j]``. Row 0 is ``log_probs``.
    """

    probe: str
    log_probs: torch.Tensor
    greedy: list[int]
    continuation: torch.Tensor | None = None
    continuation_log_probs: torch.Tensor | None = None

    @property
    def token_log_probs(self) -> torch.Tensor:
        """``[C]`` float64 log-probability of each continuation token; ``-token_log_probs.sum()`` is its NLL in nats."""
        if self.continuation is None:
            raise MergeError("this probe was read without a continuation")
        rows = self.continuation_log_probs
        return rows.gather(-1, self.continuation.to(rows.device)[:, None])[:, 0]


class ProbeLayer(CacheLayerMixin):
    """One layer's past, copied once, with room after it that new keys/values are written into.

    Stands in for the caller's layer during a read. ``update`` copies the new tokens into
    the room (the past is not copied again) and returns views of every slot written so
    far; :func:`visible`'s mask says which of them each token attends to.

    Parameters
    ----------
    layer : CacheLayerMixin
        The caller's layer: keys/values ``[1, kv_heads, kept, head_dim]`` holding positions
        ``seen - kept .. seen - 1`` (a sliding layer keeps its last ``window - 1``). Only read.
    room : int
        Slots after the past.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, layer: CacheLayerMixin, room: int):
        super().__init__()
        k, v = layer.keys, layer.values
        self.kept, self.seen = k.shape[-2], layer.get_seq_length()
        self.is_sliding = bool(getattr(layer, "is_sliding", False))
        self.window = getattr(layer, "sliding_window", None) if self.is_sliding else None
        self.keys = k.new_empty((1, k.shape[1], self.kept + room, k.shape[3]))
        self.values = v.new_empty((1, v.shape[1], self.kept + room, v.shape[3]))
        # The one copy of the past in a read: every probe and decoded token attends to these slots.
        self.keys[:, :, : self.kept] = k
        self.values[:, :, : self.kept] = v
        self.fill = self.kept
        self.device, self.is_initialized = k.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated in __init__, from the caller's layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[1, kv_heads, n, head_dim]`` new keys/values after the last slot; return all slots written."""
        n = key_states.shape[-2]
        if self.fill + n > self.keys.shape[-2]:
            raise MergeError(f"a probe read overflows its room: {self.fill + n} > {self.keys.shape[-2]} slots")
        self.keys[:, :, self.fill : self.fill + n] = key_states
        self.values[:, :, self.fill : self.fill + n] = value_states
        self.fill += n
        return self.keys[:, :, : self.fill], self.values[:, :, : self.fill]

    def rewind(self) -> None:
        """Forget the slots written after the past: the next group of probes writes over them."""
        self.fill = self.kept

    def past_positions(self) -> torch.Tensor:
        """``[kept]`` positions of the past's slots."""
        return torch.arange(self.seen - self.kept, self.seen, device=self.device)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.fill + query_length, 0  # not used: read_probes hands the model its own 4-D masks

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class ProbeCache(Cache):
    """The caller's cache as :class:`ProbeLayer` s: its past copied once, with ``room`` slots after it."""

    def __init__(self, cache: DynamicCache, room: int):
        super().__init__(layers=[ProbeLayer(layer, room) for layer in cache.layers])

    def rewind(self) -> None:
        for layer in self.layers:
            layer.rewind()


@dataclass
class Slots:
    """Whose each slot written after the past is, in the order written.

    Attributes
    ----------
    pos : torch.Tensor
        ``[n]`` int64 absolute position.
    seq : torch.Tensor
        ``[n]`` int64 index of the probe (in its group).
    kind : torch.Tensor
        ``[n]`` int64: :data:`PROBE`, :data:`CONTINUATION`, :data:`DRAFT` or :data:`DEAD`.
    """

    pos: torch.Tensor
    seq: torch.Tensor
    kind: torch.Tensor

    def add(self, other: Slots) -> None:
        self.pos, self.seq, self.kind = (torch.cat([a, b]) for a, b in zip(self.astuple(), other.astuple()))

    def astuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pos, self.seq, self.kind


def visible(layer: ProbeLayer, slots: Slots, queries: Slots) -> torch.Tensor:
    """``[Q, kept + n]`` bool: which slots each query token attends to on ``layer``.

    A token at position ``p`` of probe ``i`` sees the past and the slots of probe ``i`` at
    positions ``<= p`` that are probe or greedy tokens, or of its own kind (a continuation
    sees its continuation, a draft its draft); on a sliding layer only positions ``> p -
    window``. That is what it would see read alone behind the cache. ``slots`` holds the
    queries' own slots already: a layer writes them before it attends.
    """
    p = queries.pos[:, None]
    own = (slots.seq[None, :] == queries.seq[:, None]) & (slots.pos[None, :] <= p)
    own &= (slots.kind[None, :] == PROBE) | (slots.kind[None, :] == queries.kind[:, None])
    own &= slots.kind[None, :] != DEAD
    past = torch.ones((len(queries.pos), layer.kept), dtype=torch.bool, device=p.device)
    if layer.window is not None:
        past &= layer.past_positions()[None, :] > p - layer.window
        own &= slots.pos[None, :] > p - layer.window
    return torch.cat([past, own], dim=1)


def masks(model: LoadedModel, cache: ProbeCache, slots: Slots, queries: Slots):
    """The 4-D attention mask(s) of one forward pass, as the model takes them.

    One ``[1, 1, Q, kept + n]`` mask per kind of layer (same ``kept`` and window): a model with
    one kind gets the tensor, a hybrid one (Gemma 3) a dict by layer type. Additive floats (0
    or the dtype's minimum) for sdpa as for eager attention: handed a boolean mask, torch's
    CPU sdpa converts it in every layer (measured: 9% of a read).
    """
    by_type: dict[str, torch.Tensor] = {}
    kinds: dict[tuple, torch.Tensor] = {}
    for t, layer in zip(layer_types(model.config), cache.layers):
        kind = (layer.kept, layer.window)
        if kind not in kinds:
            seen = visible(layer, slots, queries)[None, None]
            kinds[kind] = torch.zeros(seen.shape, dtype=model.dtype, device=seen.device).masked_fill_(
                ~seen, torch.finfo(model.dtype).min
            )
        if by_type.setdefault(t, kinds[kind]) is not kinds[kind]:
            raise MergeError(f"layers of type {t!r} hold different lengths or windows; one mask cannot serve them")
    return next(iter(kinds.values())) if len(kinds) == 1 else by_type


def groups(lengths: list[int], alone: bool, max_tokens: int) -> list[list[int]]:
    """Probe indices in read order, split so that each forward pass runs at most ``max_tokens`` tokens.

    A probe longer than ``max_tokens`` is read by itself; ``alone`` reads every probe by itself.
    """
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not out or alone or used + n > max_tokens:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def reads_alone(model: LoadedModel) -> bool:
    """Whether each probe needs a forward pass of its own.

    ``longrope`` picks its factor set, and ``dynamic`` its frequencies, from the largest
    position of the forward pass: packed behind a longer probe, a probe would be rotated
    otherwise than read alone.
    """
    return any(r.rope_type in CONDITIONAL_ROPE_TYPES for r in layer_ropes(model.model))


def _ids(model: LoadedModel, text_or_ids) -> torch.Tensor:
    if isinstance(text_or_ids, str):
        return tokenize(model, text_or_ids)
    return torch.as_tensor(text_or_ids, dtype=torch.long).reshape(-1)


@torch.inference_mode()
def read_probes(
    model: LoadedModel,
    cache: DynamicCache,
    probes: Sequence[str],
    *,
    continuation: Sequence | None = None,
    greedy: int = 0,
    draft: Sequence | None = None,
    max_tokens: int = MAX_TOKENS,
) -> list[ProbeRead]:
    """Read each probe behind ``cache``: the next token's distribution, a greedy continuation, a continuation's scores.

    The probes (in groups of at most ``max_tokens`` tokens) are read in one forward pass
    behind one copy of the past, each at the positions it would take alone, and their
    greedy continuations decoded together, one forward pass per token for all the probes
    still decoding. The result is what reading each probe alone behind a clone of
    ``cache`` gives, to fp32 rounding.

    Parameters
    ----------
    model : LoadedModel
    cache : DynamicCache
        Keys/values ``[1, kv_heads, kept, head_dim]`` per layer, slot ``j`` at position
        ``j`` (a sliding layer keeps its last ``window - 1``). Never modified.
    probes : sequence of str
        Texts read right behind the cache (tokenized without special tokens).
    continuation : sequence, optional
        One per probe: a text (tokenized alone) or ``[C_i]`` token ids, scored after the
        probe by teacher forcing, e.g. a reference answer.
    greedy : int
        Greedy tokens decoded after each probe (``0``: none).
    draft : sequence, optional
        One per probe: token ids the greedy continuation is likely to be (e.g. the joined
        prefill's). Checked in the probes' forward pass; decoding starts after the longest
        prefix the model's own argmax agrees with. The result does not depend on it.
    max_tokens : int
        Query tokens (probe, continuation and draft) per forward pass.

    Returns
    -------
    list of ProbeRead
        One per probe, in order: ``log_probs`` ``[vocab]`` float64, ``greedy`` (``greedy``
        ids) and, with a continuation, its ``[C_i]`` ids and ``[C_i, vocab]`` float64 log-probs.
    """
    if greedy < 0:
        raise MergeError(f"greedy must be >= 0, got {greedy}")
    if max_tokens < 1:
        raise MergeError(f"max_tokens must be >= 1, got {max_tokens}")
    for name, extra in (("continuations", continuation), ("drafts", draft)):
        if extra is not None and len(extra) != len(probes):
            raise MergeError(f"{len(extra)} {name} for {len(probes)} probes")
    if any(layer.keys.shape[0] != 1 for layer in cache.layers):
        raise MergeError("probes are read behind a cache of batch size 1")
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise MergeError(
            f"reading probes needs attention 'sdpa' or 'eager' (it passes its own 4-D masks), not {impl!r}"
        )
    if not probes:
        return []
    ids = [tokenize(model, p) for p in probes]
    conts = [None] * len(probes) if continuation is None else [_ids(model, c) for c in continuation]
    # Only the first greedy - 1 draft tokens can save a step: the last greedy token is never fed back.
    alone = reads_alone(model)
    drafts = [torch.zeros(0, dtype=torch.long)] * len(probes)
    # A draft read alongside would move a conditional schedule's largest position: none for those.
    if draft is not None and greedy > 1 and not alone:
        drafts = [_ids(model, d)[: greedy - 1] for d in draft]
    if any(len(x) == 0 for x in ids) or any(c is not None and len(c) == 0 for c in conts):
        raise MergeError("a probe or continuation has no tokens")
    seen = cache.get_seq_length()
    check_positions(
        model.config,
        seen + max(len(x) + max(greedy - 1, 0 if c is None else len(c)) for x, c in zip(ids, conts)),
        "a probe read",
    )
    # Groups and room do not depend on the drafts: the probes' forward pass is then the same
    # with or without them, bit for bit, so a cache read twice gives the same numbers (KL 0).
    lengths = [len(x) + (0 if c is None else len(c)) for x, c in zip(ids, conts)]
    plan = groups(lengths, alone, max_tokens)
    # Per probe after its own tokens: up to greedy - 1 draft tokens, then as many decoded ones.
    work = ProbeCache(cache, max(sum(lengths[i] + 2 * max(greedy - 1, 0) for i in g) for g in plan))
    out: list[ProbeRead] = [None] * len(probes)  # type: ignore[list-item]
    for g in plan:
        group = _Group(model, work, seen, [ids[i] for i in g], [conts[i] for i in g])
        for i, read in zip(g, group.read(greedy, [drafts[i] for i in g])):
            out[i] = ProbeRead(probes[i], *read)
        work.rewind()
    return out


class _Group:
    """A group of probes read together: one forward pass of their tokens, one of their drafts, then decoding.

    Parameters
    ----------
    model : LoadedModel
    work : ProbeCache
        Rewound: the past only.
    seen : int
        Positions behind the probes (the cache's length).
    ids, conts : list of torch.Tensor
        Per probe, ``[L_i]`` token ids, and ``[C_i]`` continuation ids or ``None``.
    """

    def __init__(self, model: LoadedModel, work: ProbeCache, seen: int, ids: list, conts: list):
        self.model, self.work, self.ids, self.conts = model, work, ids, conts
        self.dev = model.device
        self.next_pos = [seen + len(x) for x in ids]  # where each probe's next greedy token goes
        self.slots = Slots(*(torch.zeros(0, dtype=torch.long, device=self.dev) for _ in range(3)))

    def read(self, greedy: int, drafts: list):
        """Yield ``(log_probs, greedy, continuation, continuation_log_probs)`` per probe.

        ``drafts``: per probe, ``[D_i]`` token ids (``D_i <= greedy - 1``), possibly empty.
        """
        # The probe's last token predicts what follows it; continuation token j predicts j + 1
        # (the last one predicts nothing asked for).
        parts = []
        for i, (x, c) in enumerate(zip(self.ids, self.conts)):
            after = self.next_pos[i]  # the position after the probe, where a continuation starts
            parts.append((x, i, PROBE, after - len(x), [len(x) - 1]))
            if c is not None:
                parts.append((c, i, CONTINUATION, after, range(len(c) - 1)))
        logits, rows = self._forward(parts)
        decoded = [[int(logits[rows[i][0]].argmax())] if greedy else [] for i in range(len(self.ids))]
        if any(len(d) for d in drafts) and greedy > 1:
            self._check_drafts(drafts, decoded, greedy)
        self._decode(decoded, greedy)
        for i, c in enumerate(self.conts):
            lp = torch.log_softmax(logits[rows[i][0]].double(), -1)
            cont = None
            if c is not None:
                cont = torch.log_softmax(logits[rows[i]].double(), -1)  # the probe's row, then C - 1 more
            yield lp, decoded[i], c, cont

    def _forward(self, parts: list) -> tuple[torch.Tensor, dict[int, list[int]]]:
        """Run ``parts`` (``(ids, probe, kind, first position, offsets read)``) in one pass.

        Returns the ``[rows, vocab]`` logits read and, per probe, the indices of its rows in order.
        """
        tokens, pos, seq, kind, keep = [], [], [], [], []
        rows: dict[int, list[int]] = {}
        at = 0
        for ids, i, what, start, read in parts:
            tokens.append(ids)
            pos.append(start + torch.arange(len(ids)))
            seq.append(torch.full((len(ids),), i))
            kind.append(torch.full((len(ids),), what))
            rows.setdefault(i, []).extend(range(sum(map(len, keep)), sum(map(len, keep)) + len(read)))
            keep.append(torch.as_tensor([at + r for r in read], dtype=torch.long))
            at += len(ids)
        queries = Slots(*(torch.cat(t).to(self.dev) for t in (pos, seq, kind)))
        self.slots.add(queries)
        logits = _forward(
            self.model, self.work, self.slots, queries, torch.cat(tokens).to(self.dev), torch.cat(keep).to(self.dev)
        )
        return logits, rows

    def _check_drafts(self, drafts: list, decoded: list[list[int]], greedy: int) -> None:
        """Run the drafts in one pass; extend each greedy text as far as its draft is the greedy text."""
        start = len(self.slots.pos)
        parts = [(d, i, DRAFT, self.next_pos[i], range(len(d))) for i, d in enumerate(drafts) if len(d)]
        logits, rows = self._forward(parts)
        offset = start
        for d, i, *_ in parts:
            # Draft token j predicts greedy token j + 1, if the draft so far is the greedy text.
            for tok, nxt in zip(d.tolist(), logits[rows[i]].argmax(-1).tolist()):
                if len(decoded[i]) == greedy or tok != decoded[i][-1]:
                    break
                decoded[i].append(nxt)
            accepted = len(decoded[i]) - 1
            # The agreed prefix is the greedy text so far, which later tokens of the probe see;
            # the rest of the draft is seen by none.
            self.slots.kind[offset : offset + accepted] = PROBE
            self.slots.kind[offset + accepted : offset + len(d)] = DEAD
            self.next_pos[i] += accepted
            offset += len(d)

    def _decode(self, decoded: list[list[int]], greedy: int) -> None:
        """One token per forward pass for every probe short of ``greedy`` tokens, each at its next position."""
        while active := [i for i, d in enumerate(decoded) if len(d) < greedy]:
            parts = [(torch.tensor([decoded[i][-1]]), i, PROBE, self.next_pos[i], [0]) for i in active]
            logits, rows = self._forward(parts)
            for i in active:
                decoded[i].append(int(logits[rows[i][0]].argmax()))
                self.next_pos[i] += 1


def _forward(model: LoadedModel, work: ProbeCache, slots: Slots, queries: Slots, tokens, keep) -> torch.Tensor:
    """One forward pass of ``[Q]`` ``tokens`` into ``work``: ``[K, vocab]`` logits at positions ``keep`` (all if ``None``)."""
    out = model.model(
        input_ids=tokens[None],
        position_ids=queries.pos[None],
        attention_mask=masks(model, work, slots, queries),
        cache=work,
        use_cache=True,
        # Only the rows asked for go through the vocabulary projection: for every row, Gemma 3's
        # 262k-token vocabulary costs more than its layers.
        logits_to_keep=keep if keep is not None else 0,
    )
    return out.logits[0]
