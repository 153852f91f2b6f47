"""kvlab's benchmarks: each module is a script, run from the repository root as ``python -m benchmarks.NAME``.

What several of them share (a run under each malloc setting, the median timer) is in
:mod:`benchmarks.timing`. Figures and the commands behind them: ``benchmarks/README.md``.
"""
