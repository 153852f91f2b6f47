"""The tables ``kvlab peers`` prints: conversion fidelity, then merges side by side."""

from __future__ import annotations

from kvlab.measure.case import DEFAULT_PROBES, DEFAULT_TEXTS
from kvlab.models.loaded import LoadedModel
from kvlab.peers.conversion import conversion_fidelity
from kvlab.peers.merges import format_rows, merge_side_by_side


def peer_table(model: LoadedModel, texts: list[str] | None = None, probes: list[str] | None = None) -> str:
    """The side-by-side tables ``kvlab peers`` prints: conversion fidelity, then merges."""
    conv = conversion_fidelity(model)
    lines = [
        f"kvlab {model.name} (fp32, dequantised) against llama.cpp on {conv.gguf} ({conv.desc})",
        f"conversion: KL(llama.cpp || kvlab) mean {conv.kl_mean:.4f} nats [95% CI {conv.kl_ci[0]:.4f}, "
        f"{conv.kl_ci[1]:.4f}], max {conv.kl_max:.4f}, top-1 agree {conv.top1:.2f}, n={conv.n} prompts; "
        f"llama.cpp on an F32 copy of the file {conv.kl_f32_mean:.2e}; same token ids {conv.same_ids:.2f}",
        "",
        "merges: next-token KL (nats) against each engine's own joined prefill",
    ]
    rows = merge_side_by_side(model, texts or DEFAULT_TEXTS, probes or DEFAULT_PROBES)
    lines.append(format_rows(rows))
    return "\n".join(lines)
