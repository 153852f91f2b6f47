"""kvlab's benchmarks: each module is a script, run from the repository root as ``python -m benchmarks.NAME``.

What several of them share (a run under each malloc setting, the median timer) is in
:mod:`benchmarks.timing`; the cache-file fuzzer is the package :mod:`benchmarks.fuzz`, which
``tests/files/test_fuzz.py`` imports as well. Figures and the commands behind them:
``benchmarks/README.md``.
"""
