"""Findings: the seeded evaluation set, answers behind merges, the long-context study, findings as records."""
