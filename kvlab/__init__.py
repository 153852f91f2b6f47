"""kvlab: is a merged or reloaded transformer KV cache still right?

The public API, by layer (``docs/ARCHITECTURE.md``). Everything else is reached through its
module, ``kvlab.<layer>.<module>``; nothing has a second import path.
"""

from kvlab.cache.fragments import (
    Fragment,
    clone_cache,
    joined_prefill,
    new_cache,
    prefill,
    prefill_ids,
    prefill_tokens,
    set_length,
    tokenize,
)
from kvlab.cache.merge import landing_positions, merge
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.shift import shift_
from kvlab.cache.strategies import STRATEGIES, Fail, Naive, Reprefill, Rerotate, Strategy, register, strategy_names
from kvlab.errors import (
    AuditTargetError,
    CacheFileError,
    CacheFileWarning,
    EvalSetError,
    FingerprintMismatch,
    KernelMissing,
    KvlabError,
    MergeError,
    ModelError,
    PeerError,
    PositionError,
    RecordError,
    ReportError,
    StatsError,
    StudyError,
    UnsupportedModelError,
    UnsupportedRopeError,
)
from kvlab.files.format import read_header, verify_file
from kvlab.files.identity import STRICT_FIELDS, Difference, fingerprint
from kvlab.files.io import load_cache, save_cache
from kvlab.findings.evalset import EvalSet, Question, generate
from kvlab.findings.qa import ask, passage_fragments
from kvlab.findings.records import read_records, record
from kvlab.lab.kernel import KERNEL_NAME, kernel_name
from kvlab.measure.case import Case, FidelityReference
from kvlab.measure.certificate import Certificate
from kvlab.measure.certify import certify
from kvlab.measure.fidelity import Fidelity, fidelity, merge_seconds, merge_times
from kvlab.measure.mismatch import VARIANT_KINDS, MismatchResult, mismatch_kl, variants
from kvlab.measure.probes import ProbeRead, read_probes
from kvlab.measure.stats import CI, fmt_ci, gap_closed_ci, holm, mean_ci, paired_diff_ci, paired_p, proportion_ci
from kvlab.models.catalog import model_names
from kvlab.models.layout import layer_ropes
from kvlab.models.loaded import DEFAULT_MODEL, LoadedModel
from kvlab.models.rope import rotate_keys
from kvlab.models.sources import load_gguf_file, load_model, wrap
from kvlab.sweep.study import load_study

__all__ = [
    # errors
    "KvlabError", "ModelError", "UnsupportedModelError", "MergeError", "PositionError", "UnsupportedRopeError",
    "FingerprintMismatch", "CacheFileError", "PeerError", "KernelMissing", "RecordError", "ReportError",
    "StatsError", "StudyError", "EvalSetError", "AuditTargetError",
    # models
    "DEFAULT_MODEL", "LoadedModel", "load_model", "load_gguf_file", "wrap", "model_names", "layer_ropes",
    "rotate_keys",
    # caches: fragments, strategies (one class each, behind a registry), merge
    "Fragment", "clone_cache", "joined_prefill", "new_cache", "prefill", "prefill_ids", "prefill_tokens",
    "set_length", "tokenize",
    "STRATEGIES", "Strategy", "register", "strategy_names", "Naive", "Fail", "Reprefill", "Rerotate", "Recompute",
    "landing_positions", "merge", "shift_",
    # cache files
    "STRICT_FIELDS", "Difference", "fingerprint", "CacheFileWarning", "load_cache", "read_header", "save_cache",
    "verify_file",
    # measures
    "Case", "FidelityReference", "Fidelity", "fidelity", "merge_seconds", "merge_times", "ProbeRead", "read_probes",
    "VARIANT_KINDS", "MismatchResult", "mismatch_kl", "variants", "CI", "mean_ci", "paired_diff_ci",
    "proportion_ci", "paired_p", "holm", "gap_closed_ci", "fmt_ci", "Certificate", "certify",
    # findings
    "EvalSet", "Question", "generate", "ask", "passage_fragments", "read_records", "record",
    # lab and sweeps
    "KERNEL_NAME", "kernel_name", "load_study",
]  # fmt: skip
