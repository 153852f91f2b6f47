"""The rows of ``kvlab models``: geometry and rope of every model, without converting any."""

from __future__ import annotations

from kvlab.compat import rope_parameters
from kvlab.errors import UnsupportedModelError
from kvlab.models.gguf import GGUF_MODELS, converted_dir
from kvlab.models.layout import layer_types, layout_tags
from kvlab.models.loaded import quiet_transformers
from kvlab.models.tiny import TINY_CONFIGS


def model_names() -> list[str]:
    """Every catalogue name: the real GGUF models, then the tiny seeded ones."""
    return list(GGUF_MODELS) + list(TINY_CONFIGS)


def _rope_summary(config) -> str:
    # GPT-J keeps no rope parameters: its fixed base lives in its sin/cos table.
    params = rope_parameters(config) or {"rope_type": "default", "rope_theta": 10000.0}
    if all(isinstance(v, dict) for v in params.values()):
        s = ", ".join(
            f"{lt.split('_')[0]}:{p.get('rope_type', 'default')} {p.get('rope_theta'):g}" for lt, p in params.items()
        )
    else:
        extra = params.get("partial_rotary_factor")
        s = f"{params.get('rope_type', 'default')} {params.get('rope_theta'):g}"
        s += f" partial {extra:g}" if extra not in (None, 1.0) else ""
    return s + "".join(f", {tag}" for tag in layout_tags(config))


def _row(name: str, config, cached: str) -> dict:
    kinds = sorted(set(layer_types(config)))
    return {
        "name": name,
        "family": config.model_type,
        "layers": config.num_hidden_layers,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "rope": _rope_summary(config)
        + ("" if kinds == ["default"] else f" [{'/'.join(k.split('_')[0] for k in kinds)}]"),
        "cached": cached,
    }


_UNKNOWN = {"family": "?", "layers": "?", "kv_heads": "?", "head_dim": "?"}


def model_rows() -> list[dict]:
    from transformers import AutoConfig  # noqa: PLC0415 - transformers' Auto classes load its model registry, slowly: on first use, not with kvlab

    rows = []
    for name, spec in GGUF_MODELS.items():
        folder = converted_dir(name)
        if folder is not None:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            rows.append(_row(name, config, "yes"))
        else:
            rows.append(
                dict(
                    _UNKNOWN,
                    name=name,
                    family=spec.family,
                    rope=f"(not converted yet; needs {spec.package})",
                    cached="no",
                )
            )
    with quiet_transformers():
        for name, (_, factory) in TINY_CONFIGS.items():
            try:
                rows.append(_row(name, factory(), "built"))
            except UnsupportedModelError as e:
                # A family the installed release does not ship: listed, with the reason.
                rows.append(dict(_UNKNOWN, name=name, rope=f"({e})", cached="no"))
    return rows
