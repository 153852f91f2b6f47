"""Comparing a notebook's stored outputs with a new run's: printed decimals may differ in their last digit.

A value the notebook prints with ``d`` decimals is rounded from an fp32 computation whose
last bits follow the CPU's kernels (AVX2 or AVX-512, their thread split). Where the value
sits within that noise of a rounding boundary, two CPUs print it one unit apart in the last
place: a bootstrap bound of 0.3173 on one CPU is 0.3174 on another, from the same code and
the same inputs. :func:`same_but_last_digit` accepts exactly that and nothing more; the root
``conftest.py`` applies it to nbval's comparison. Integers (counts, years, token ids) and
every other character must match exactly.
"""

from __future__ import annotations

import re
from decimal import Decimal

#: A decimal written with a point, not part of a longer token (``1.2.3``, ``1.5e-05``, ``v0.3``).
DECIMAL = re.compile(r"(?<![\w.])[+-]?\d+\.\d+(?![\w.])")


def same_but_last_digit(ref: str, test: str) -> bool:
    """Whether ``test`` is ``ref`` with some decimals one unit in their last printed place apart.

    Each decimal pair must have the same number of decimals ``d`` and differ by at most
    ``10**-d``; everything between the decimals must be identical.

    Examples
    --------
    >>> same_but_last_digit("KL 0.1785 [0.0540, 0.3173]", "KL 0.1785 [0.0540, 0.3174]")
    True
    >>> same_but_last_digit("KL 0.3173", "KL 0.3175")  # two units: a real change
    False
    >>> same_but_last_digit("born 1941", "born 1942")  # integers match exactly
    False
    """
    a, b = DECIMAL.split(ref), DECIMAL.split(test)
    x, y = DECIMAL.findall(ref), DECIMAL.findall(test)
    if a != b or len(x) != len(y):
        return False
    return all(_one_unit_apart(u, v) for u, v in zip(x, y))


def _one_unit_apart(u: str, v: str) -> bool:
    if u == v:
        return True
    places = len(u.split(".")[1])
    if places != len(v.split(".")[1]):
        return False
    return abs(Decimal(u) - Decimal(v)) <= Decimal(1).scaleb(-places)
