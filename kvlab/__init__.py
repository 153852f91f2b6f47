"""kvlab: is a merged or reloaded transformer KV cache still right?"""
from .errors import KvlabError, MergeError, ModelError, PositionError, UnsupportedModelError, UnsupportedRopeError
from .models import DEFAULT_MODEL, LoadedModel, model_names
from .sources import load_model, wrap
from .fragments import (Fragment, clone_cache, joined_prefill, new_cache, prefill, prefill_ids, prefill_tokens,
                        set_length, tokenize)
from .strategies import STRATEGIES, Strategy, register, strategy_names
from .merge import landing_positions, merge
from .case import Case
from .fidelity import Fidelity, FidelityReference, fidelity, merge_seconds, merge_times
from . import recompute  # noqa: F401  (registers the "recompute" strategy)
from .rope import layer_ropes, rotate_keys

__all__ = [
    "KvlabError", "MergeError", "ModelError", "PositionError", "UnsupportedModelError", "UnsupportedRopeError",
    "DEFAULT_MODEL", "LoadedModel", "load_model", "model_names", "wrap",
    "Fragment", "clone_cache", "joined_prefill", "new_cache", "prefill", "prefill_ids", "prefill_tokens",
    "set_length", "tokenize",
    "STRATEGIES", "Strategy", "register", "strategy_names",
    "landing_positions", "merge", "layer_ropes", "rotate_keys", "Fidelity", "FidelityReference", "fidelity", "merge_seconds", "merge_times",
    "Case",
]

# Producer identity of cache files (issue 3).
from .errors import CacheFileError, FingerprintMismatch
from .identity import STRICT_FIELDS, Difference, fingerprint
from .cachefile import CacheFileWarning, load_cache, read_header, save_cache, verify_file
from .mismatch import VARIANT_KINDS, MismatchResult, mismatch_kl, variants

__all__ += [
    "CacheFileError", "FingerprintMismatch", "STRICT_FIELDS", "Difference", "fingerprint",
    "CacheFileWarning", "load_cache", "read_header", "save_cache", "verify_file", "VARIANT_KINDS", "MismatchResult", "mismatch_kl", "variants",
]

# Findings as data in executed notebooks (issue 13).
from .records import RecordError, read_records, record

__all__ += ["RecordError", "read_records", "record"]

# Parameter sweeps on Dask (issue 13); the runner lives in kvlab.sweep.
from .sweep.study import StudyError, load_study

__all__ += ["StudyError", "load_study"]

# llama.cpp beside kvlab (issue 15): kvlab.peers imports llama-cpp-python only when used.
from .errors import PeerError
from .models import load_gguf_file

__all__ += ["PeerError", "load_gguf_file"]

# The Jupyter kernel the notebooks run on, and the report (issue 16).
from .errors import KernelMissing
from .kernel import KERNEL_NAME, kernel_name

__all__ += ["KernelMissing", "KERNEL_NAME", "kernel_name"]
# Findings at scale (issue 14): a generated evaluation set, answers behind merges, CIs.
from . import evalset, longctx, qa, stats  # noqa: E402
from .evalset import EvalSet, Question, generate  # noqa: E402
from .qa import ask, passage_fragments  # noqa: E402
from .stats import CI, mean_ci, paired_diff_ci  # noqa: E402

__all__ += ["evalset", "longctx", "qa", "stats", "EvalSet", "Question", "generate", "ask", "passage_fragments",
            "CI", "mean_ci", "paired_diff_ci"]
