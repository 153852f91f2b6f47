"""A GGUF conversion's tokenizer must split a fixed sentence as the file's own tokenizer does (llama.cpp's ids).

transformers 4.x converts Gemma 3's GGUF tokenizer without its merges (``The keeper`` becomes
``The, ke, ep, er``); kvlab refuses such a model by name rather than read it with other token ids.
"""

from __future__ import annotations

import pytest

from kvlab.errors import ModelError
from kvlab.models.gguf import GGUF_MODELS, TOKENIZER_PROBE, check_tokenizer


class _Splits:
    """A stand-in tokenizer returning ``ids`` for any text."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, text, add_special_tokens=True):
        assert text == TOKENIZER_PROBE and add_special_tokens is False
        return {"input_ids": self.ids}


@pytest.mark.parametrize("name", sorted(GGUF_MODELS))
def test_a_tokenizer_that_splits_the_probe_otherwise_is_refused_by_name(name):
    spec = GGUF_MODELS[name]
    assert spec.probe_ids, f"{name} has no probe ids: its conversion's tokenizer is never checked"
    check_tokenizer(spec, _Splits(spec.probe_ids))  # the file's own split passes
    for wrong in (spec.probe_ids[:-1], (spec.probe_ids[0] + 1, *spec.probe_ids[1:]), (1, *spec.probe_ids)):
        with pytest.raises(ModelError, match=rf"{name}: transformers .* splits .* into {len(wrong)} tokens"):
            check_tokenizer(spec, _Splits(wrong))


@pytest.mark.real
def test_the_catalogues_converted_tokenizers_split_the_probe_as_llama_cpp_does(smollm2):
    # Loading ran the check; here the split is read again, independently of the stored ids' source.
    import llama_cpp

    from kvlab.peers.mapping import gguf_path

    engine = llama_cpp.Llama(str(gguf_path("smollm2-135m")), vocab_only=True, verbose=False)
    want = engine.tokenize(TOKENIZER_PROBE.encode(), add_bos=False, special=False)
    assert tuple(want) == GGUF_MODELS["smollm2-135m"].probe_ids
    assert smollm2.tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"] == want
