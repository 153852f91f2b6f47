"""What the certificate's checks are made of: seeded random token ids, fragments prefilled from them, and
the model's position limit no key may reach."""

from __future__ import annotations

import torch

from kvlab.cache.fragments import Fragment, prefill_tokens
from kvlab.models.loaded import LoadedModel


class TokenSource:
    """Seeded random token ids from the middle of the vocabulary (no special tokens)."""

    def __init__(self, model: LoadedModel, seed: int):
        vocab = model.config.get_text_config().vocab_size
        self.low, self.high = min(100, vocab // 4), min(vocab, 20000)
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> torch.Tensor:
        return torch.randint(self.low, self.high, (n,), generator=self.gen)


def position_limit(model: LoadedModel) -> int:
    """The model's ``max_position_embeddings``: no key may sit at or past it."""
    return model.config.get_text_config().max_position_embeddings


def random_fragments(model: LoadedModel, ids: TokenSource, lengths: list[int]) -> list[Fragment]:
    """One fragment of ``n`` fresh token ids from ``ids``, prefilled at position 0, per length ``n``."""
    return [prefill_tokens(model, ids(n)) for n in lengths]
