"""Caches: fragments and prefill, merge strategies and their registry, selective recompute, the defects on purpose."""
