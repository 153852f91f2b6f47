"""kvlab: is a merged or reloaded transformer KV cache still right?

The top level is what a user of the package calls: load a model, prefill fragments, merge or
shift them with a strategy, save and load cache files, certify a model or audit a store's own
merge, and the measures a notebook reads. Nothing else is exported here: cache plumbing
(``kvlab.cache.fragments``), statistics beyond the intervals (``kvlab.measure.stats``), the
evaluation set and findings (``kvlab.findings``), notebooks and studies (``kvlab.lab``,
``kvlab.sweep``) are reached through their modules, ``kvlab.<layer>.<module>``
(``docs/ARCHITECTURE.md``); every exception type is in ``kvlab.errors``. Nothing has a
second import path.
"""

from kvlab.cache.compact import compact
from kvlab.cache.fragments import Fragment, joined_prefill, prefill, tokenize
from kvlab.cache.merge import landing_positions, merge
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.shift import shift_
from kvlab.cache.strategies import Fail, Naive, Reprefill, Rerotate, Strategy, register, strategy_names
from kvlab.errors import (
    AuditTargetError,
    CacheFileError,
    CacheFileWarning,
    CompactError,
    FingerprintMismatch,
    KvlabError,
    MergeError,
    ModelError,
    PeerError,
    PositionError,
    UnsupportedModelError,
    UnsupportedRopeError,
)
from kvlab.files.format import read_header, verify_file
from kvlab.files.identity import STRICT_FIELDS, Difference, fingerprint
from kvlab.files.io import load_cache, save_cache
from kvlab.measure.audit.run import audit
from kvlab.measure.case import Case
from kvlab.measure.certificate import Certificate
from kvlab.measure.certify import certify
from kvlab.measure.fidelity import Fidelity, fidelity
from kvlab.measure.mismatch import MismatchResult, mismatch_kl, variants
from kvlab.measure.probes import ProbeRead, read_probes
from kvlab.measure.stats import CI, mean_ci, paired_diff_ci, proportion_ci
from kvlab.models.catalog import model_names
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import DEFAULT_MODEL, LoadedModel
from kvlab.models.rope import rotate_keys
from kvlab.models.sources import load_gguf_file, load_model, wrap

__all__ = [
    # errors a caller of the functions below catches (every other type: kvlab.errors)
    "KvlabError", "ModelError", "UnsupportedModelError", "UnsupportedRopeError", "MergeError", "PositionError",
    "FingerprintMismatch", "CacheFileError", "CacheFileWarning", "PeerError", "AuditTargetError",
    "CompactError",
    # models: load one, or wrap a live one; its rotary layout
    "DEFAULT_MODEL", "LoadedModel", "load_model", "load_gguf_file", "wrap", "model_names", "layer_ropes",
    "rotate_keys",
    # fragments: text prefilled into a cache
    "Fragment", "prefill", "joined_prefill", "tokenize",
    # strategies (one class each, behind a registry), the merge, the in-place shift
    "Strategy", "Naive", "Fail", "Reprefill", "Rerotate", "Recompute", "register", "strategy_names",
    "merge", "landing_positions", "shift_", "compact",
    # cache files
    "save_cache", "load_cache", "verify_file", "read_header", "fingerprint", "Difference", "STRICT_FIELDS",
    # certificates: kvlab's merge on a model, a store's own merge, shift and files
    "Certificate", "certify", "audit",
    # measures a notebook reads, and their intervals
    "Case", "fidelity", "Fidelity", "mismatch_kl", "MismatchResult", "variants", "read_probes", "ProbeRead",
    "CI", "mean_ci", "paired_diff_ci", "proportion_ci",
]  # fmt: skip
