"""kvlab: is a merged or reloaded transformer KV cache still right?"""
from .errors import KvlabError, MergeError, ModelError, PositionError, UnsupportedRopeError
from .models import DEFAULT_MODEL, LoadedModel, load_model, model_names
from .fragments import Fragment, clone_cache, joined_prefill, prefill, prefill_ids, prefill_tokens, tokenize
from .strategies import STRATEGIES, Strategy, register, strategy_names
from .merge import landing_positions, merge
from .rope import layer_ropes, rotate_keys

__all__ = [
    "KvlabError", "MergeError", "ModelError", "PositionError", "UnsupportedRopeError",
    "DEFAULT_MODEL", "LoadedModel", "load_model", "model_names",
    "Fragment", "clone_cache", "joined_prefill", "prefill", "prefill_ids", "prefill_tokens", "tokenize",
    "STRATEGIES", "Strategy", "register", "strategy_names",
    "landing_positions", "merge", "layer_ropes", "rotate_keys",
]
