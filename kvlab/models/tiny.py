"""Tiny random-weight models built from seeded configs, with no files at all.

They cover the rotary variants the two real models lack, so that every re-rotation
path is tested against a real forward pass of the matching architecture.
"""

from __future__ import annotations

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvlab.compat import config_class, rope_config

#: 256 byte tokens, then BOS and EOS.
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257
VOCAB_SIZE = 260
TINY_SEED = 1234

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=1024,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=EOS_ID,
)
_GQA = dict(_COMMON, num_key_value_heads=2)
#: Multi-head latent attention: a 16-wide KV latent and an 8-wide decoupled rotary key.
_MLA = dict(_COMMON, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def _llama(rope: dict) -> tf.PretrainedConfig:
    return config_class("LlamaConfig")(**_GQA, **rope_config(rope))


#: name -> (description, config factory). Each factory returns a fresh config.
TINY_CONFIGS = {
    "tiny-llama": ("Llama, default RoPE", lambda: _llama({"rope_type": "default", "rope_theta": 10000.0})),
    "tiny-qwen2": (
        "Qwen2, k/v projection bias",
        lambda: config_class("Qwen2Config")(**_GQA, **rope_config({"rope_type": "default", "rope_theta": 1e6})),
    ),
    "tiny-gemma3": (
        "Gemma 3, hybrid sliding (window 8, base 1e4) / full (base 1e6), k_norm",
        lambda: config_class("Gemma3TextConfig")(
            **dict(_GQA, num_hidden_layers=4),
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "tiny-gptneox": (
        "GPT-NeoX, rotary_pct 0.25 (partial rotary)",
        lambda: config_class("GPTNeoXConfig")(**_COMMON, rotary_pct=0.25),
    ),
    "tiny-phi": (
        "Phi, partial_rotary_factor 0.5",
        lambda: config_class("PhiConfig")(**_GQA, partial_rotary_factor=0.5),
    ),
    "tiny-llama3": (
        "Llama 3 rope scaling",
        lambda: _llama(
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "tiny-yarn": (
        "YaRN (attention_scaling != 1)",
        lambda: _llama(
            {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}
        ),
    ),
    "tiny-longrope": (
        "Phi-3 longrope, switch at 64 positions",
        lambda: config_class("Phi3Config")(
            **_GQA,
            original_max_position_embeddings=64,
            **rope_config(
                {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.05 * i for i in range(8)],
                    "long_factor": [2.0 + 0.5 * i for i in range(8)],
                    "original_max_position_embeddings": 64,
                }
            ),
        ),
    ),
    "tiny-dynamic": (
        "Llama, dynamic NTK rope",
        lambda: _llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "tiny-cohere": ("Cohere, interleaved rotary pairs (2i, 2i+1)", lambda: config_class("CohereConfig")(**_GQA)),
    "tiny-glm": (
        "GLM, interleaved pairs on half the head (partial rotary)",
        lambda: config_class("GlmConfig")(**_GQA, head_dim=16),
    ),
    "tiny-gptj": (
        "GPT-J, interleaved pairs from a sin/cos table, rotary_dim 8 of 16",
        lambda: config_class("GPTJConfig")(
            vocab_size=VOCAB_SIZE,
            n_embd=64,
            n_layer=3,
            n_head=4,
            rotary_dim=8,
            n_positions=1024,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
        ),
    ),
    "tiny-smollm3": (
        "SmolLM3, every fourth layer NoPE",
        lambda: config_class("SmolLM3Config")(**dict(_GQA, num_hidden_layers=4)),
    ),
    "tiny-cohere2": (
        "Cohere 2, interleaved rope on sliding layers (window 8), NoPE global layer",
        lambda: config_class("Cohere2Config")(
            **dict(_GQA, num_hidden_layers=4),
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "tiny-llama4": (
        "Llama 4 text, interleaved complex rope, every fourth layer NoPE (no chunking, no temperature tuning)",
        lambda: config_class("Llama4TextConfig")(
            **dict(_GQA, num_hidden_layers=4),
            head_dim=16,
            num_local_experts=2,
            intermediate_size_mlp=128,
            # Every layer full, said in the config, so the model is the same on every release: 4.x makes
            # the NoPE layers chunked unless told, and 4.56 builds the chunked mask (unused here) on
            # every forward, which needs a chunk size; this one is past max_position_embeddings.
            attention_chunk_size=8192,
            layer_types=["full_attention"] * 4,
            attn_temperature_tuning=False,
        ),
    ),
    "tiny-deepseek-v3": (
        "DeepSeek-V3, multi-head latent attention (latent 16, rotary key 8, de-interleaved)",
        lambda: config_class("DeepseekV3Config")(
            **_MLA,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
        ),
    ),
    "tiny-deepseek-v2": (
        "DeepSeek-V2, multi-head latent attention, interleaved complex rope",
        lambda: config_class("DeepseekV2Config")(
            **_MLA, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32
        ),
    ),
    "tiny-minicpm3": ("MiniCPM3, multi-head latent attention", lambda: config_class("MiniCPM3Config")(**_MLA)),
}


def byte_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per UTF-8 byte) that needs no files."""
    # ByteLevel maps each byte to a printable stand-in; give each stand-in its byte value as id.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab["<bos>"] = BOS_ID
    vocab["<eos>"] = EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>")


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map, which ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tiny(name: str, dtype: torch.dtype = torch.float32):
    """Build a tiny model with seeded random weights.

    Returns
    -------
    (model, tokenizer, config)
    """
    _, factory = TINY_CONFIGS[name]
    config = factory()
    # Seed from the name too, so two families never share weights by accident.
    torch.manual_seed(TINY_SEED + sum(name.encode()))
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, byte_tokenizer(), model.config
