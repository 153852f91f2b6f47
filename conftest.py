"""Loaded by every pytest run in this repository: `make test`, and nbval on a notebook by itself.

``kvlab.findings.records.record`` stores each finding twice: a text line, which nbval compares like any printed
number, and a JSON payload with 6 significant digits for sweeps. fp32 reductions differ in the
5th digit from one process to the next (thread scheduling in the matmul kernels), so the JSON
is left out of nbval's comparison; the same numbers are guarded at the precision the notebook
prints them. It lives in the repository's root conftest, not in tests/conftest.py, so that
`pytest --nbval notebooks/NN.ipynb` alone (the README's way to check one notebook) applies it too.

nbval also compares each text output through :func:`kvlab.lab.rounding.same_but_last_digit`:
a printed decimal one unit apart in its last place (fp32 rounding on another CPU landing on
the other side of a rounding boundary) is the same output; any other difference still fails.

The core's environments (.ci/matrix: kvlab beside a store, without the lab and dev extras) have no
nbval and run no notebook: there is nothing to patch.
"""

import copy
import importlib.util

from kvlab.findings.records import MIME_TYPE
from kvlab.lab.rounding import same_but_last_digit

if importlib.util.find_spec("nbval") is not None:
    import nbval.plugin

    _nbval_init = nbval.plugin.IPyNbFile.__init__

    def _nbval_init_skipping_records(self, *args, **kwargs):
        _nbval_init(self, *args, **kwargs)
        self.skip_compare = tuple(self.skip_compare) + (MIME_TYPE,)

    nbval.plugin.IPyNbFile.__init__ = _nbval_init_skipping_records

    _nbval_compare = nbval.plugin.IPyNbCell.compare_outputs

    def _aligned(cell, test_out, ref_out):
        """``test_out``, with each text that sanitizes to ``ref_out``'s but for last-digit rounding replaced by ``ref_out``'s."""
        if test_out.get("output_type") != ref_out.get("output_type") or test_out.get("name") != ref_out.get("name"):
            return test_out

        def same(ref_text, test_text) -> bool:
            return (
                isinstance(ref_text, str)
                and isinstance(test_text, str)
                and same_but_last_digit(cell.sanitize(ref_text), cell.sanitize(test_text))
            )

        out = copy.deepcopy(test_out)
        if same(ref_out.get("text"), out.get("text")):
            out["text"] = ref_out["text"]
        for mime, value in (out.get("data") or {}).items():
            if same((ref_out.get("data") or {}).get(mime), value):
                out["data"][mime] = ref_out["data"][mime]
        return out

    def _compare_to_last_digit(self, test, ref, skip_compare=None):
        # Most cells match as they are: only a mismatch pays for the copies and the decimal scan.
        if _nbval_compare(self, test, ref, skip_compare):
            return True
        if len(test) != len(ref):
            return False
        return _nbval_compare(self, [_aligned(self, t, r) for t, r in zip(test, ref)], ref, skip_compare)

    nbval.plugin.IPyNbCell.compare_outputs = _compare_to_last_digit
