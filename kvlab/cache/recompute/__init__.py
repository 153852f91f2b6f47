"""Selective recompute (CacheBlend-style): the ``recompute`` strategy and its steps, one module each."""
