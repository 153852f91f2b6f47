"""Measures: the two references, ``Case``, K/V and phase errors, KL and fidelity, the mismatch study, statistics."""
