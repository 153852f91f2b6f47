"""The certificate as a record: its lines and their statuses, its JSON, and the table ``kvlab certify`` prints.

Every check of :mod:`kvlab.measure.certify` (and of the audits of :mod:`kvlab.measure.audit` and
:mod:`kvlab.peers.audit`) comes back as lines (:class:`Line`); a :class:`Certificate` holds them
with the model's fingerprint and says whether any failed or was refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlab.atomic import atomic_write_text
from kvlab.files.identity import package_versions

#: Version of the certificate's JSON layout.
CERTIFICATE_VERSION = 1

#: A line's status: within its bound, past it, refused by kvlab (so not certified), nothing to measure, information.
PASS, FAIL, REFUSED, NA, INFO = "pass", "FAIL", "REFUSED", "n/a", "info"


@dataclass(frozen=True)
class Line:
    """One measured check of a certificate.

    Attributes
    ----------
    check : str
        What is checked (``rotation``, ``rerotate phase``, ``recompute r=0`` ...).
    scope : str
        What it was measured on (layer type, lengths, offsets).
    value : float, int, str or None
        The measured value (``None`` where nothing could be measured).
    bound : float, int, str or None
        What the value must not exceed (or, for a refusal, the error that must be raised);
        ``None`` on information lines.
    unit : str
    status : str
        ``pass``, ``FAIL``, ``REFUSED`` (kvlab refuses the operation on this model, so the
        check cannot certify it), ``n/a`` or ``info``.
    detail : str
    """

    check: str
    scope: str
    value: float | int | str | None
    bound: float | int | str | None
    unit: str
    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in (FAIL, REFUSED)


@dataclass
class Certificate:
    """Every :class:`Line` measured on one model, with the model's fingerprint.

    Attributes
    ----------
    model : str
    lines : list of Line
    fingerprint : dict
        :func:`kvlab.fingerprint` of the model (weights digest included): what was certified.
    seconds : float
        Wall time of the whole run.
    target : str or None
        What was audited on the model (``merge pkg.mod:fn``, see :mod:`kvlab.measure.audit`);
        ``None`` for the model's own certificate.
    """

    model: str
    lines: list[Line]
    fingerprint: dict
    seconds: float
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    target: str | None = None

    @property
    def passed(self) -> bool:
        return not any(line.failed for line in self.lines)

    def as_dict(self) -> dict:
        return {
            "certificate_version": CERTIFICATE_VERSION,
            "model": self.model,
            **({"target": self.target} if self.target else {}),
            "passed": self.passed,
            "created": self.created,
            "seconds": round(self.seconds, 2),
            "versions": package_versions("kvlab", "torch", "transformers"),
            "threads": torch.get_num_threads(),
            "fingerprint": self.fingerprint,
            "lines": [dataclasses.asdict(line) for line in self.lines],
        }

    def write_json(self, path) -> Path:
        """Write :meth:`as_dict` to ``path`` atomically."""
        return atomic_write_text(Path(path), json.dumps(self.as_dict(), indent=1) + "\n")

    def table(self, verbose: bool = False) -> str:
        head = f"{'check':<22} {'scope':<50} {'value':>20} {'bound':>20} {'unit':<13} status"
        out = [head, "-" * len(head)]
        for line in self.lines:
            out.append(
                f"{line.check:<22} {line.scope[:50]:<50} {_show(line.value):>20} {_show(line.bound):>20} "
                f"{line.unit:<13} {line.status}"
            )
            if line.detail and (verbose or line.status != PASS):
                out.append(f"{'':<23}{line.detail}")
        verdict = "certified" if self.passed else "NOT certified"
        failed = [f"{line.check} ({line.scope})" for line in self.lines if line.failed]
        subject = f"{self.target} on {self.model}" if self.target else self.model
        out.append(
            f"{subject}: {verdict}" + (f"; failing: {', '.join(failed)}" if failed else "") + f" ({self.seconds:.1f} s)"
        )
        return "\n".join(out)


def _show(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)
