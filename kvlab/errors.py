"""kvlab's own exception types.

Every refusal kvlab makes is one of these, so callers can catch ``KvlabError`` and
know that nothing was mutated and nothing half-built was returned.
"""


class KvlabError(Exception):
    """Base class of every error kvlab raises on purpose."""


class ModelError(KvlabError):
    """A model name is unknown, or its files are not installed (the message says how to install them)."""


class UnsupportedModelError(ModelError):
    """A model kvlab cannot treat: no rotary embedding, encoder-only, not a causal LM, or a rope it cannot read.

    Raised when the model is loaded or wrapped, before any weight is read or any cache built.
    """


class MergeError(KvlabError):
    """Fragments cannot be merged as asked: incompatible geometry, no source, or a refused strategy."""


class CompactError(MergeError):
    """A compaction cannot run as asked: a keep list of the wrong shape, order or range, or an unknown convention."""


class PositionError(MergeError):
    """A position lies outside what the model's rotary schedule supports."""


class UnsupportedRopeError(MergeError):
    """The model's rotary schedule does not compose, so a cached key cannot be re-rotated exactly."""


class FingerprintMismatch(KvlabError):
    """A cache file was made by another model (weights, tokenizer, dtype, geometry ...) than the reader.

    ``differences`` lists each differing strict field as a ``kvlab.Difference``
    (empty when the file carries no fingerprint at all).
    """

    def __init__(self, message: str, differences=()):
        super().__init__(message)
        self.differences = list(differences)


class CacheFileError(KvlabError):
    """A cache file cannot be read or written: missing, corrupt, truncated, tampered, or not a kvlab cache."""


class PeerError(KvlabError):
    """A peer engine (llama.cpp) is missing, cannot load a file, refuses an operation, or cannot be mapped to a kvlab model."""


class KernelMissing(KvlabError):
    """The ``kvlab`` Jupyter kernelspec is not installed in this environment (``make setup`` installs it)."""


class RecordError(KvlabError):
    """A finding cannot be recorded (value not a number, bad interval) or a notebook's records cannot be read."""


class ReportError(KvlabError):
    """A report was asked for something that does not exist."""


class StatsError(KvlabError):
    """A statistic cannot be computed from what was given (empty, NaN, mismatched lengths)."""


class StudyError(KvlabError):
    """A study file is unreadable or asks for something its notebook does not take; nothing was run."""


class EvalSetError(KvlabError):
    """An evaluation set cannot be built or read as asked (sizes, missing template, bad passages)."""


class AuditTargetError(KvlabError):
    """What ``kvlab certify --merge/--shift/--store`` was asked to audit cannot be audited as given.

    A ``MODULE:NAME`` that does not import or name nothing, a signature the contract does not
    allow (``inspect.signature``), a store without ``save``/``load``, or a call that returned
    something other than a ``transformers.DynamicCache``. A target that raises while it is
    checked is not this error: its exception becomes a failing line of the certificate.
    """


class CacheFileWarning(UserWarning):
    """A cache file was loaded without full verification (``strict=False`` or ``allow_unverified=True``)."""


class DesignError(StudyError):
    """A study's pre-registered design is missing, unreadable, uncommitted, or committed after its rows."""
