"""The kvlab header of a cache file as a JSON document: strict parsing, its schema, and its fields' agreement.

The header is the JSON text a cache file keeps under ``__metadata__.kvlab``
(:mod:`kvlab.files.format` puts it there beside its sha256, and checks it against the
tensors). ``header.schema.json`` describes its fields; :func:`validate_header` checks a parsed
header against the schema, reports jsonschema's first error in kvlab's words (the field, what
it holds, what it must hold), then checks what a schema cannot say: the fields against each
other. Why the schema is checked with a few fast paths: ``docs/cache-file-format.md``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from kvlab.errors import CacheFileError

FORMAT = "kvlab-kv-cache"
FORMAT_VERSION = 2
#: Layers a header may list (header.schema.json's maxItems): a bound on the time its checks take.
MAX_LAYERS = 1024
#: What the header's ``tensors`` must hold: ``kvlab.files.format.tensor_names`` always starts with these two.
TENSORS_RULE = "tensors must map exactly layers.0.keys, layers.0.values, ... to their xxh3-128 digests"


def header_error(path: Path, msg: str) -> CacheFileError:
    """The refusal of a bad kvlab header: the file, then what is wrong."""
    return CacheFileError(f"{path}: kvlab header: {msg}")


class _Bad(Exception):
    pass


def _loads(text: str, what: str):
    """Strict JSON: no duplicate keys, no NaN or infinities, no constants JSON lacks."""

    def pairs(items):
        d = {}
        for k, v in items:
            if k in d:
                raise _Bad(f"{what} has the key {k!r} twice")
            d[k] = v
        return d

    def constant(c):
        raise _Bad(f"{what} contains {c}, which is not JSON")

    def number(s):
        x = float(s)
        if x != x or x in (float("inf"), float("-inf")):
            raise _Bad(f"{what} contains the number {s[:20]}, outside the float range")
        return x

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number)
    except _Bad:
        raise
    except json.JSONDecodeError as e:
        raise _Bad(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _Bad(f"{what} is nested too deeply to be a cache header") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise _Bad(f"{what} is not valid JSON: {e}") from None


def parse_header(text: str, path: Path):
    """The kvlab header's JSON text, parsed strictly (:func:`_loads`); a bad text is a :class:`CacheFileError`."""
    try:
        return _loads(text, "the kvlab header")
    except _Bad as e:
        raise CacheFileError(f"{path}: {e}") from None


def brief(x, limit: int = 80) -> str:
    """``x`` as JSON (a string as its repr), cut to ``limit`` characters."""
    s = json.dumps(x, default=str) if not isinstance(x, str) else repr(x)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def listed(names, limit: int = 6) -> str:
    """The first ``limit`` of ``names``, joined, and how many there are in all when more."""
    names = list(names)
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


@functools.cache
def header_schema() -> dict:
    """The JSON Schema of a kvlab header (``kvlab/files/header.schema.json``)."""
    return json.loads(resources.files("kvlab.files").joinpath("header.schema.json").read_text("utf-8"))


def _import_jsonschema():
    if "jsonschema" in sys.modules or "rfc3987_syntax" in sys.modules:
        import jsonschema

        return jsonschema
    # jsonschema imports rfc3987_syntax where it is installed (Jupyter's extras install it),
    # for its "iri" format, and that builds a Lark parser on import, which costs more than
    # everything else a cache read does (docs/cache-file-format.md). kvlab checks no formats, so
    # the import is held back while jsonschema loads (it then only lacks the "iri" format
    # checker) and allowed after.
    sys.modules["rfc3987_syntax"] = None
    try:
        import jsonschema
    finally:
        del sys.modules["rfc3987_syntax"]
    return jsonschema


@functools.cache
def _validator():
    jsonschema = _import_jsonschema()
    Draft202012Validator, validators = jsonschema.Draft202012Validator, jsonschema.validators

    # JSON Schema calls 1.0 an integer; a header is written by json.dumps, so a count or a
    # shape written with a fraction, or as true, is not kvlab's.
    types = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool)
    )
    generic = Draft202012Validator.VALIDATORS

    # jsonschema descends into every value, slowly for a header of many token ids or layers
    # (docs/cache-file-format.md). The two keywords below find the first failing element in a
    # loop (a bounded integer or string is checked in plain Python; of equal layers only the
    # first is descended into) and hand only that one to jsonschema, for its error. The first
    # error, all kvlab reports, is the same.
    def items(validator, sub, instance, schema):
        if not isinstance(instance, list) or "prefixItems" in schema:
            yield from generic["items"](validator, sub, instance, schema)
            return
        ok, seen = _predicate(sub), set()
        for i, x in enumerate(instance):
            if ok is not None:
                if ok(x):
                    continue
            else:
                key = json.dumps(x, sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
            yield from validator.descend(x, sub, path=i)

    def additional(validator, sub, instance, schema):
        ok = _predicate(sub)
        if ok is None or not isinstance(instance, dict) or {"properties", "patternProperties"} & set(schema):
            yield from generic["additionalProperties"](validator, sub, instance, schema)
            return
        for k, x in instance.items():
            if not ok(x):
                yield from validator.descend(x, sub, path=k)

    cls = validators.extend(
        Draft202012Validator, validators={"items": items, "additionalProperties": additional}, type_checker=types
    )
    schema = header_schema()
    return cls(_inline_refs(schema, schema["$defs"]))


def _inline_refs(node, defs: dict):
    """``node`` with each ``{"$ref": "#/$defs/x", ...}`` replaced by ``{"allOf": [x], ...}``: a
    reference costs jsonschema a lookup on every use."""
    if isinstance(node, list):
        return [_inline_refs(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    ref = out.pop("$ref", None)
    if ref is None:
        return out
    target = _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
    return {"allOf": [target], **out} if out else target


def _predicate(sub) -> Callable[[object], bool] | None:
    """A plain-Python test equal to schema ``sub`` where it only bounds an integer or a string."""
    if not isinstance(sub, dict):
        return None
    if sub.get("type") == "integer" and set(sub) <= {"type", "minimum", "exclusiveMaximum"}:
        lo, hi = sub.get("minimum", -math.inf), sub.get("exclusiveMaximum", math.inf)
        return lambda x: type(x) is int and lo <= x < hi
    if sub.get("type") == "string" and set(sub) <= {"type", "minLength", "maxLength", "pattern"}:
        lo, hi, rx = sub.get("minLength", 0), sub.get("maxLength", math.inf), re.compile(sub.get("pattern", ""))
        return lambda x: type(x) is str and lo <= len(x) <= hi and rx.search(x) is not None
    return None


_JSON_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))


def _json_type(x) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(x, t)), "array" if isinstance(x, list) else "object")


def _kept(L: dict, length: int) -> int:
    """Tokens a layer of a ``length``-token cache keeps: a sliding window keeps its last ``window - 1``."""
    return min(length, L["window"] - 1) if L["type"] == "sliding_attention" else length


def _expected_kept(L: dict, length) -> int | None:
    """:func:`_kept`, or ``None`` while the fields it needs are themselves wrong."""
    kind, window = L.get("type"), L.get("window")
    if type(length) is not int or length < 1:
        return None
    if kind == "full_attention" and window is None:
        return length
    if kind == "sliding_attention" and type(window) is int and window >= 2:
        return min(length, window - 1)
    return None


#: kvlab's message for the first schema error at each place in the header ("*": any index or
#: tensor name). A window's message depends on its layer's type.
_MESSAGES = {
    "format": "format is {got}, expected 'kvlab-kv-cache'",
    "format_version": "format version {got} is not supported{newer}; this kvlab reads version 2",
    "producer": "producer must be a fingerprint object or null, is a JSON {type}",
    "model_name": "model_name must be a string, is {got}",
    "start": "start must be an integer >= 0 and < 2^53, is {got}",
    "length": "length must be an integer >= 1 and < 2^53, is {got}",
    "dtype": "dtype {got} is not one of float64, float32, float16, bfloat16",
    "layers": "layers must be a non-empty list of at most 1024 layers, is {got}",
    "layers/*": "layer {i} must have exactly keys, kept, type, values, window, has {fields}",
    "layers/*/type": "layer {i} has unknown type {got}",
    "layers/*/window": {
        "sliding_attention": "layer {i} is sliding but its window is {window}",
        "full_attention": "layer {i} is full attention but has a window {window}",
    },
    "layers/*/kept": "layer {i} keeps {got} tokens; a {kind} layer of a {length}-token cache keeps {expect}",
    "layers/*/keys": "layer {i} keys shape {keys} is not [batch, kv_heads, {expect}, head_dim]",
    "layers/*/values": "layer {i} values shape {values} is not [batch, kv_heads, {expect}, head_dim]",
    "token_ids": "token_ids must be null or a list of integers in [0, 2^31), is a JSON {type}",
    "token_ids/*": "token_ids must be null or a list of integers in [0, 2^31); token_ids[{i}] is {got}",
    "text": "text must be null or a string, is a JSON {type}",
    "tensor_digest": "tensor_digest {got} is not supported; this kvlab reads 'xxh3-128'",
    "tensors": TENSORS_RULE,
    "tensors/*": "every tensor digest must be 32 lowercase hex digits; {name} has {got}",
    "content_digest": "content_digest must be 32 lowercase hex digits, is {got}",
}


def _schema_problem(error, h) -> str:
    """jsonschema's first error as kvlab's message: the field, what it holds, what it must hold."""
    where, got = list(error.absolute_path), error.instance
    if not where:  # the header itself: not an object, or fields missing or unknown
        if error.validator == "type":
            return f"is a JSON {_json_type(h)}, not an object"
        fields = header_schema()["required"]
        missing = [k for k in fields if k not in h]
        extra = sorted(k for k in h if k not in fields)
        return "; ".join(
            ([f"missing field(s) {', '.join(missing)}"] if missing else [])
            + ([f"unknown field(s) {listed(map(repr, extra))}"] if extra else [])
        )
    key = "/".join("*" if n == 1 else str(k) for n, k in enumerate(where[:3]))
    v = {"got": brief(got), "type": _json_type(got), "newer": ""}
    if len(where) > 1:
        v.update(i=where[1], name=repr(where[1]))
    if where[0] == "format_version" and type(got) is int and got > FORMAT_VERSION:
        v["newer"] = " (written by a newer kvlab)"
    template = _MESSAGES.get(key)
    if where[0] == "layers" and len(where) > 1:
        L, length = h["layers"][where[1]], h.get("length")
        expect = _expected_kept(L, length) if isinstance(L, dict) else None
        v["fields"] = brief(sorted(L)) if isinstance(L, dict) else f"a JSON {_json_type(L)}"
        if isinstance(L, dict):
            v.update({k: brief(L.get(k)) for k in ("window", "keys", "values")}, kind=L.get("type"))
        v.update(length=length, expect="kept" if expect is None else expect)
        if isinstance(template, dict):
            template = template.get(L.get("type"), template["full_attention"])
    if template is None:  # a place the table does not name: still the path and jsonschema's words
        return f"{'/'.join(map(str, where))}: {brief(error.message, 200)}"
    return template.format(**v)


def validate_header(h, path: Path) -> dict:
    """Check a kvlab header against its schema, then its fields against each other.

    The tensor names and the content digest are checked against the container's naming by
    :func:`kvlab.files.format.kvlab_header`, after this.

    Returns
    -------
    dict
        ``h``, unchanged.

    Raises
    ------
    CacheFileError
        Naming the file, the first field that is wrong, what it holds and what it must hold.
    """

    try:
        error = next(_validator().iter_errors(h), None)
        if error is not None:
            raise header_error(path, _schema_problem(error, h))
    except RecursionError:  # a value nested so deeply that jsonschema (or repr) cannot walk it
        raise header_error(path, "a value is nested too deeply to be a cache header") from None
    # What the schema cannot say: the fields' agreement with each other.
    length, layers = h["length"], h["layers"]
    batch = layers[0]["keys"][0]
    for i, L in enumerate(layers):
        expect = _kept(L, length)
        if L["kept"] != expect:
            raise header_error(
                path,
                f"layer {i} keeps {L['kept']} tokens; a {L['type']} layer of a {length}-token cache keeps {expect}",
            )
        for what in ("keys", "values"):
            if L[what][2] != expect:
                raise header_error(
                    path, f"layer {i} {what} shape {L[what]} is not [batch, kv_heads, {expect}, head_dim]"
                )
        if L["keys"][:2] != L["values"][:2]:
            raise header_error(path, f"layer {i}: keys {L['keys']} and values {L['values']} disagree on batch or heads")
        if L["keys"][0] != batch:
            raise header_error(path, f"layer {i} has batch {L['keys'][0]}, layer 0 has {batch}")
    ids = h["token_ids"]
    if ids is not None and len(ids) != length:
        raise header_error(path, f"{len(ids)} token ids for a cache of {length} tokens")
    return h
