"""What differs between the transformers releases kvlab supports (4.56 to 5.x): its one home.

kvlab's core runs inside a store's own environment, on the store's release, so every place where
two releases spell the same thing differently is answered here and nowhere else
(``tests/test_compat.py`` fails on a version test outside this module):

* the forward pass's cache argument: ``past_key_values`` up to 5.23, ``cache`` from 5.24
  (:func:`forward`);
* the config's rope fields: ``rope_theta``/``rope_scaling`` (and Gemma 3's
  ``rope_local_base_freq``) in 4.x, ``rope_parameters`` (per layer type where a model has types)
  in 5.x (:func:`rope_parameters`);
* where the rotary module lives and what it holds: Gemma 3 keeps a global ``rotary_emb`` and a
  local ``rotary_emb_local`` in 4.x, one module with per-layer-type buffers
  (``sliding_attention_inv_freq``) in 5.x (:func:`rotary_for`);
* the rope initialisers' call (``layer_type=`` exists from 5.0) (:func:`rope_init`);
* the cache layers: how a layer is initialised before its first ``update``
  (``lazy_initialization(key)`` in 4.x, ``(key, value)`` in 5.x) and whether it was
  (:func:`layer_ready`);
* the releases CI has tested (:data:`TESTED`), which every audit's ``versions`` line reads.

A family the installed release does not ship is refused by name (:func:`config_class`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import transformers

from kvlab.errors import ModelError, UnsupportedModelError

#: The installed release, as printed and as a comparable tuple.
TRANSFORMERS = transformers.__version__


def _release(text: str) -> tuple[int, int, int]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return (*parts, 0, 0)[:3]


RELEASE = _release(TRANSFORMERS)

#: transformers 5.24 renamed the forward pass's ``past_key_values`` to ``cache``.
CACHE_ARG = "cache" if RELEASE >= (5, 24, 0) else "past_key_values"

#: The format of a saved model folder: 5.x writes ``tokenizer_class: TokenizersBackend``, a class 4.x
#: lacks, so a GGUF conversion saved by one major release is kept apart from the other's (one model
#: cache serves a 5.x project and a 4.x store's environment side by side).
CONVERSION_FORMAT = f"transformers{RELEASE[0]}"

#: transformers 5 gave rope parameters one field (``config.rope_parameters``) and the rope
#: initialisers a ``layer_type``; 4.x spreads them over ``rope_theta`` and ``rope_scaling``.
ROPE_PARAMETERS = RELEASE >= (5, 0, 0)

#: ``lazy_initialization`` takes ``(key, value)`` from 5.0, ``(key)`` before.
_LAZY_TAKES_VALUE = RELEASE >= (5, 0, 0)

#: From 4.57 a cache layer counts tokens only once initialised (``is_initialized``, set by its first
#: ``update``), so tensors assigned onto a fresh layer read as length 0 and are attended to by no one;
#: in 4.56 a layer reads the length of whatever tensors it holds.
ASSIGNED_LAYERS_READ_EMPTY = RELEASE >= (4, 57, 0)

#: A forward pass on the meta device runs from 5.4, where ``maybe_autocast`` skips the meta device;
#: before, the rotary modules open ``torch.autocast(device_type="meta")``, which torch refuses
#: (read from the wheels: the guard is in 5.4.0's ``utils/generic.py``, not in 5.3.0's).
META_FORWARD = RELEASE >= (5, 4, 0)

#: From 5.5 ``DynamicCache(config=...)`` builds a hybrid's recurrent and convolution layers
#: (``LinearAttentionLayer`` and kin); before, each hybrid has a cache class of its own and only the
#: config says which layers keep state.
HYBRID_CACHE_LAYERS = RELEASE >= (5, 5, 0)

#: From 5.15 transformers caches multi-head latent attention compressed: the KV latent in the keys
#: slot and the one shared rotary key in the values slot (``expand_kv`` builds the heads after the
#: cache). Before, it caches every head's full key ``cat(k_nope, k_rot)`` and its value.
LATENT_MLA_CACHE = RELEASE >= (5, 15, 0)


def _cells() -> tuple[tuple[str, ...], ...]:
    """The release pairs CI tests (``kvlab/data/tested.txt``, one home), each line's pins in order."""
    out = []
    for line in (Path(__file__).parent / "data" / "tested.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(tuple(line.split()))
    return tuple(out)


#: Each CI cell's pins, ``("transformers==4.56.0", "torch==2.7.1", ...)`` (kvlab/data/tested.txt).
CELLS = _cells()


def _tested() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for cell in CELLS:
        for pin in cell[:2]:
            package, version = pin.split("==")
            if version not in out.setdefault(package, []):
                out[package].append(version)
    return {k: tuple(v) for k, v in out.items()}


#: ``{"transformers": (...), "torch": (...)}``: the releases some CI cell tests.
TESTED = _tested()


def untested() -> list[str]:
    """The installed packages whose release is outside :data:`TESTED`, as ``name version``."""
    out = []
    if TRANSFORMERS not in TESTED.get("transformers", ()):
        out.append(f"transformers {TRANSFORMERS}")
    torch_release = torch.__version__.split("+")[0]
    if torch_release not in TESTED.get("torch", ()):
        out.append(f"torch {torch.__version__}")
    return out


def forward(module: torch.nn.Module, cache=None, **kwargs):
    """Call a transformers model with ``cache`` under the argument name the installed release reads.

    A name the release does not know is swallowed by the model's ``**kwargs`` and the cache is
    silently left empty, so no caller spells it.
    """
    if cache is not None:
        kwargs[CACHE_ARG] = cache
    return module(**kwargs)


def generate(module: torch.nn.Module, cache=None, **kwargs):
    """``module.generate(**kwargs)`` continuing ``cache``, under the argument name the release reads."""
    if cache is not None:
        kwargs[CACHE_ARG] = cache
    return module.generate(**kwargs)


def rope_parameters(config) -> dict:
    """The config's rope parameters as 5.x's ``config.rope_parameters`` spells them.

    Returns
    -------
    dict
        ``{rope_type, rope_theta, ...}``, or one such dict per layer type
        (``{"sliding_attention": {...}, "full_attention": {...}}``) for a model whose layer types
        turn at different bases (Gemma 3); empty for a config without rope fields (GPT-J).
    """
    if ROPE_PARAMETERS:
        params = getattr(config, "rope_parameters", None) or {}
        return {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    theta = getattr(config, "rope_theta", None)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    if theta is None and not scaling:
        return {}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    if theta is not None:
        scaling["rope_theta"] = theta
    local = getattr(config, "rope_local_base_freq", None)
    if local is not None:
        # 4.x's Gemma 3: the sliding layers turn at rope_local_base_freq with the default schedule,
        # rope_scaling applies to the global layers only.
        return {"sliding_attention": {"rope_type": "default", "rope_theta": local}, "full_attention": scaling}
    return scaling


def layer_rope_parameters(config, layer_type: str) -> dict:
    """One layer type's rope parameters (see :func:`rope_parameters`); ``{}`` where the config has none."""
    params = rope_parameters(config)
    return dict(params[layer_type]) if isinstance(params.get(layer_type), dict) else params


def rope_config(params: dict) -> dict:
    """Config keyword arguments that give a model the one rope schedule ``params`` (5.x's spelling).

    Parameters
    ----------
    params : dict
        ``{"rope_type": ..., "rope_theta": ..., <the schedule's fields>}``.
    """
    if ROPE_PARAMETERS:
        return {"rope_parameters": dict(params)}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
        scaling = None
    elif scaling.get("rope_type") == "longrope":
        # 4.x's Phi-3 accepts exactly these three fields (the switch length is the config's own
        # original_max_position_embeddings).
        scaling = {"type": "longrope", "short_factor": scaling["short_factor"], "long_factor": scaling["long_factor"]}
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling}


def set_rope(config, params: dict) -> None:
    """Give ``config`` (in place) the single rope schedule ``params``, in the release's own fields."""
    for key, value in rope_config(params).items():
        setattr(config, key, value)


def rotary_for(model: torch.nn.Module, rotary: torch.nn.Module, layer_type: str) -> tuple[torch.nn.Module, str]:
    """The module and buffer prefix that hold ``layer_type``'s frequencies.

    Parameters
    ----------
    model : torch.nn.Module
        The model (a live one or a meta skeleton).
    rotary : torch.nn.Module
        Its shared ``rotary_emb`` module.

    Returns
    -------
    (module, prefix)
        ``getattr(module, prefix + "inv_freq")`` is the layer type's ``[r/2]`` inverse frequencies.
    """
    if hasattr(rotary, f"{layer_type}_inv_freq"):
        return rotary, f"{layer_type}_"
    if layer_type == "sliding_attention":
        local = [m for name, m in model.named_modules() if name.endswith("rotary_emb_local")]
        if local:
            return local[0], ""
    return rotary, ""


def rotary_modules(model: torch.nn.Module, rotary: torch.nn.Module, types: list[str]) -> dict:
    """Per layer type, the rotary module that computes its ``(cos, sin)`` and whether it takes the type.

    Returns
    -------
    dict
        ``{layer_type: (module, takes_type)}``; call it through :func:`rotary_call`.
    """
    takes = "layer_type" in inspect.signature(rotary.forward).parameters
    return {t: (rotary, True) if takes else (rotary_for(model, rotary, t)[0], False) for t in dict.fromkeys(types)}


def rotary_call(entry: tuple, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str):
    """What one entry of :func:`rotary_modules` hands its layers for ``positions`` (``[1, N]``)."""
    module, takes = entry
    return module(hidden, positions, layer_type) if takes else module(hidden, positions)


def layer_cache_arg(layer: torch.nn.Module) -> str | None:
    """The name under which a decoder layer's ``forward`` takes the cache, or ``None`` if it takes none.

    5.24 calls it ``cache``; 4.56 to 5.23 ``past_key_values`` (``past_key_value`` in some families'
    4.x layers); GPT-2-style blocks ``layer_past``.
    """
    params = inspect.signature(layer.forward).parameters
    return next((n for n in ("cache", "past_key_values", "past_key_value", "layer_past") if n in params), None)


def layer_rope_kwargs(layer: torch.nn.Module, layer_type: str, by_type: dict) -> dict:
    """The keyword arguments that hand a decoder layer its rotary embeddings.

    4.x's Gemma 3 layers take both the global and the local embeddings and pick by their own
    type; every other layer takes its own as ``position_embeddings``.
    """
    if "position_embeddings_global" in inspect.signature(layer.forward).parameters:
        full = by_type.get("full_attention", by_type[layer_type])
        return {
            "position_embeddings_global": full,
            "position_embeddings_local": by_type.get("sliding_attention", full),
        }
    return {"position_embeddings": by_type[layer_type]}


def rope_init(rope_type: str, config, device, seq_len: int | None = None, layer_type: str | None = None):
    """``ROPE_INIT_FUNCTIONS[rope_type]`` called as the installed release takes it: ``(inv_freq, scaling)``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415 (slow, on first use)

    fn = ROPE_INIT_FUNCTIONS[rope_type]
    if layer_type is not None and layer_type != "default" and "layer_type" in inspect.signature(fn).parameters:
        return fn(config, device, seq_len=seq_len, layer_type=layer_type)
    return fn(config, device, seq_len=seq_len)


def mla_cache_layout(config) -> tuple[int, int, int, str, int]:
    """What the installed release caches for a multi-head latent attention layer of ``config``.

    Returns
    -------
    (kv_heads, key_dim, value_dim, slot, offset)
        Keys ``[batch, kv_heads, kept, key_dim]``, values ``[..., value_dim]``; the rotary key sits
        in the ``slot`` tensor (``keys`` or ``values``) from dimension ``offset``.
    """
    rope = int(config.qk_rope_head_dim)
    if LATENT_MLA_CACHE:
        return 1, int(config.kv_lora_rank), rope, "values", 0
    nope = int(config.qk_nope_head_dim)
    return int(config.num_attention_heads), nope + rope, int(config.v_head_dim), "keys", nope


def layer_ready(layer) -> bool:
    """Whether a cache layer has been initialised (holds tensors, possibly of length 0)."""
    flag = getattr(layer, "is_initialized", None)
    if flag is not None:
        return bool(flag)
    return getattr(layer, "keys", None) is not None


def mask_query_length(query) -> int:
    """The new tokens' count from a cache layer's ``get_mask_sizes`` argument.

    5.x passes the query length itself; 4.x passes the new tokens' ``cache_position`` (``[q]``).
    """
    return query if isinstance(query, int) else int(query.shape[-1])


def initialize_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Initialise an empty cache layer for tensors like ``keys``/``values`` (``[batch, kv_heads, *, dim]``)."""
    if _LAZY_TAKES_VALUE:
        layer.lazy_initialization(keys, values)
    else:
        layer.lazy_initialization(keys)
        # 4.x sizes both tensors from the keys; a latent cache's values are narrower.
        layer.values = torch.tensor([], dtype=values.dtype, device=values.device)


#: Families whose older releases turn keys inside each attention layer from a sin/cos table, with no
#: rotary module (the class that later releases give them).
_TABLE_ROPE = {"gptj": ("gptj", "GPTJRotaryEmbedding"), "codegen": ("codegen", "CodeGenRotaryEmbedding")}


def family_problem(model_type: str) -> str | None:
    """Why the installed release's build of a family is one kvlab cannot drive, or ``None``.

    GPT-J and CodeGen before their rotary module (added in 5.2x) compute the phase inside each
    attention layer from a sin/cos table: kvlab's float64 twin and selective recompute hand every
    layer its phase through the rotary module, so there would be nothing to hand it to.
    """
    if model_type == "deepseek_v3" and RELEASE < (5, 0, 0):
        return (
            f"deepseek_v3 in transformers {TRANSFORMERS} routes its experts in float32 and adds their outputs into "
            "a float32 buffer, so the model cannot run in float64 (index_add_ refuses the mix); kvlab's float64 "
            "twin, which the phase lines of kvlab certify and of every audit read, cannot be built"
        )
    if model_type in ("llama4", "llama4_text") and RELEASE < (4, 57, 0):
        return (
            f"{model_type} in transformers {TRANSFORMERS} scales each routed token by another token's router score "
            "(the scores are reshaped without their transpose; fixed in 4.57), so a token's output depends on the "
            "tokens that share its forward: kvlab certify's batch floor measured 1.6e-05 nats between probes read "
            "packed and alone (bound 1e-06), and no merge can be judged against such a model"
        )
    if model_type not in _TABLE_ROPE:
        return None
    folder, cls = _TABLE_ROPE[model_type]
    import importlib  # noqa: PLC0415 (a model module, only for these two families)

    module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    if hasattr(module, cls):
        return None
    return (
        f"{model_type} in transformers {TRANSFORMERS} turns its keys inside each attention layer from a sin/cos "
        f"table, with no rotary module ({cls} is not in transformers {TRANSFORMERS}); kvlab's float64 twin and "
        "recompute hand each layer its phase through that module"
    )


#: Layer kinds of 4.x's hybrid configs that hold per-token keys and values.
_ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention", "chunked_attention", "hybrid"}


def state_layers(config) -> dict[str, list[int]]:
    """A hybrid's layers that keep recurrent or convolution state, by kind, as the release builds its cache.

    From 5.5 a hybrid's cache is built through ``DynamicCache(config=...)``, whose layer classes say
    it; before, each hybrid has a cache class of its own and says it only in the config
    (``layers_block_type`` or ``layer_types``). Falcon-H1 runs a mamba mixer beside attention in
    every layer.

    Returns
    -------
    dict
        ``{kind: [layer index, ...]}``; empty for a model whose cache holds only keys and values.
    """
    from transformers import DynamicCache  # noqa: PLC0415 (kept beside the 4.x branch that avoids it)

    if HYBRID_CACHE_LAYERS:
        layers = DynamicCache(config=config).layers
        types = getattr(config, "layer_types", None)
        types = list(types) if types and len(types) == len(layers) else None
        out: dict[str, list[int]] = {}
        for li, layer in enumerate(layers):
            name = type(layer).__name__
            if name not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
                out.setdefault(f"{name} ({types[li]})" if types else name, []).append(li)
        return out
    n = config.num_hidden_layers
    if config.model_type == "falcon_h1":
        return {"mamba (beside attention)": list(range(n))}
    kinds = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None) or []
    out = {}
    for li, kind in enumerate(kinds):
        if kind == "hybrid" and config.model_type == "zamba2":
            kind = "mamba (beside shared attention)"
        if kind not in _ATTENTION_KINDS:
            out.setdefault(str(kind), []).append(li)
    return out


def load_causal_lm(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(folder)`` on the installed release, every weight on a real device.

    A file may hold one tensor of a tied pair (``safetensors.torch.save_model``, which kvlab's GGUF
    conversions use, keeps one name of each shared tensor: for SmolLM2, ``lm_head.weight``). 5.x ties
    the input embedding from it; 4.x ties the other way and leaves ``embed_tokens`` on the meta device,
    so the pair is tied here from whichever side was read.

    Raises
    ------
    ModelError
        Weights the file did not hold and no tie restores, named (transformers would initialise them at
        random, or leave them on the meta device).
    """
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers' Auto classes load slowly)

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, local_files_only=True, output_loading_info=True
    )
    unread = set(info.get("missing_keys") or ())
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False) and out is not None
    if tied and inp.weight.device.type == "meta":
        # Both names point at the one (unloaded) parameter: read the tensor under whichever name was kept.
        names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is inp.weight or p is out.weight]
        found = _read_tensor(Path(folder), names)
        if found is not None:
            inp.weight = torch.nn.Parameter(found.to(dtype), requires_grad=False)
            out.weight = inp.weight
            unread -= set(names)
    # A weight the file lacks is initialised at random by some releases, left on meta by others: neither loads.
    missing = sorted(unread | {name for name, p in model.named_parameters() if p.device.type == "meta"})
    if missing:
        raise ModelError(
            f"{folder} lacks {len(missing)} weight(s) of its model: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} (transformers {TRANSFORMERS} would leave them unloaded or random)"
        )
    return model.eval()


def _read_tensor(folder: Path, names: list[str]) -> torch.Tensor | None:
    """The first of ``names`` found in ``folder``'s safetensors files, or ``None``."""
    from safetensors import safe_open  # noqa: PLC0415

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def config_class(name: str):
    """``transformers.<name>`` (a config class), or :class:`UnsupportedModelError` naming the release."""
    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):
        raise UnsupportedModelError(f"{name.removesuffix('Config')} is not in transformers {TRANSFORMERS}") from None
