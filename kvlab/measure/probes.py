"""Reading probes behind a cache: kvlab's one path from a cache and some texts to what the model says next.

:func:`read_probes` reads many probes behind one cache in one forward pass, and decodes
their greedy continuations together, without copying the cache per probe or per token:

* The past is copied once per call, into per-layer buffers with room after it for every
  token the call adds (:class:`kvlab.measure.room.ProbeCache`); new keys and values are
  written into that room in place. ``DynamicLayer.update`` would instead build a new tensor
  with ``torch.cat`` in every forward pass: the whole past copied again per decoded token.
* The probes are packed one after another into one sequence of batch 1 behind the shared
  past, each at the positions it would have alone (``T .. T + L_i - 1`` behind a cache of
  ``T`` tokens), under a mask that lets each token see the past and the earlier tokens of
  its own probe only (:func:`kvlab.measure.room.visible`). A right-padded batch of ``B``
  rows would need the past ``B`` times over (attention reads ``[batch, kv_heads, T,
  head_dim]`` keys): 188 MB a row behind SmolLM2's 8 x 512 tokens.
* A continuation (an answer) is scored by teacher forcing: its tokens follow the probe's
  in the same forward pass, and the distributions at all of them are read at once.
* A draft (a guess of the greedy continuation, e.g. the joined prefill's) is checked in one
  more pass: where the model's argmax agrees with it, no decoding step is needed.

The caller's cache is only read, never written: its tensors and lengths are the same after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.cache.fragments import tokenize
from kvlab.compat import forward
from kvlab.errors import MergeError
from kvlab.measure.room import CONTINUATION, DEAD, DRAFT, PROBE, ProbeCache, Slots, masks
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import LoadedModel
from kvlab.models.rope import CONDITIONAL_ROPE_TYPES, check_positions

#: Query tokens per forward pass (the probes and continuations of one group of probes). Bounds
#: the mask (``[tokens, T + tokens]`` floats) and the rows of logits read at once; more groups cost
#: more, smaller forward passes, never another copy of the past.
MAX_TOKENS = 1024


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
    position: int | None = None,
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
        prefill's). Checked in one forward pass after the probes'; decoding starts after the
        longest prefix the model's own argmax agrees with. The result does not depend on it.
    max_tokens : int
        Probe and continuation tokens per forward pass.
    position : int, optional
        Position of each probe's first token; by default the cache's length (right behind
        it). Another position reads the probes as if the context ended there: Parallel Context
        Windows (Ratner et al., 2023) places the task right after the longest window rather
        than after all of them, and a cache with slots taken out keeps its tokens' positions.
        Refused on a model with sliding-window layers, whose windows follow the cache's length.

    Returns
    -------
    list of ProbeRead
        One per probe, in order: ``log_probs`` ``[vocab]`` float64, ``greedy`` (``greedy``
        ids) and, with a continuation, its ``[C_i]`` ids and ``[C_i, vocab]`` float64 log-probs.
    """
    _check(model, cache, probes, continuation, draft, greedy, max_tokens, position)
    if not probes:
        return []
    ids = [tokenize(model, p) for p in probes]
    conts = [None] * len(probes) if continuation is None else [_ids(model, c) for c in continuation]
    alone = reads_alone(model)
    drafts = [torch.zeros(0, dtype=torch.long)] * len(probes)
    # Only the first greedy - 1 draft tokens can save a step: the last greedy token is never fed
    # back. A model whose schedule follows the largest position of a pass reads no draft.
    if draft is not None and greedy > 1 and not alone:
        drafts = [_ids(model, d)[: greedy - 1] for d in draft]
    if any(len(x) == 0 for x in ids) or any(c is not None and len(c) == 0 for c in conts):
        raise MergeError("a probe or continuation has no tokens")
    seen = cache.get_seq_length() if position is None else position
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


def _check(model, cache, probes, continuation, draft, greedy: int, max_tokens: int, position: int | None) -> None:
    """Refuse what :func:`read_probes` cannot read, before any work."""
    if position is not None:
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise MergeError(f"position must be an int >= 0, got {position!r}")
        if position != cache.get_seq_length() and any(getattr(la, "is_sliding", False) for la in cache.layers):
            raise MergeError(
                "probes are read at the cache's length on a model with sliding-window layers "
                f"(its windows follow the cache), not at position {position}"
            )
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
    out = forward(
        model.model,
        work,
        input_ids=tokens[None],
        position_ids=queries.pos[None],
        attention_mask=masks(model, work, slots, queries),
        use_cache=True,
        # Only the rows asked for go through the vocabulary projection: for every row, Gemma 3's
        # 262k-token vocabulary costs more than its layers.
        logits_to_keep=keep if keep is not None else 0,
    )
    return out.logits[0]
