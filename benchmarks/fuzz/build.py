"""Building an input: a seed's file with a recipe's edits applied, as bytes."""

from __future__ import annotations

import copy
import hashlib
import json

import torch

from benchmarks.fuzz.encoding import ST_TORCH, encode, inner_text, layout, redigest
from benchmarks.fuzz.seeds import Seed
from kvlab.files.format import content_digest, tensor_names


def _walk(x, path):
    for k in path:
        x = x[k]
    return x


def big_value(kind: str, n: int):
    if kind == "ints":
        return list(range(n))
    if kind == "string":
        return "x" * n
    if kind == "nested":  # a placeholder, written out as n brackets by inner_text (json.dumps would recurse)
        return f"\x00nested {n}\x00"
    if kind == "dicts":
        return {f"k{i}": i for i in range(n)}
    if kind == "lists":
        return [[0] * 4 for _ in range(n)]
    return [0.5] * n


def apply_inner(inner, op):
    """``inner`` after one edit (a new object when the edit replaces the whole header)."""
    kind, path = op[0], list(op[1])
    if kind in ("set", "grow") and not path:
        return copy.deepcopy(op[2]) if kind == "set" else big_value(op[2], 2 ** op[3])
    try:
        if kind == "set":
            _walk(inner, path[:-1])[path[-1]] = copy.deepcopy(op[2])
        elif kind == "del" and path:
            del _walk(inner, path[:-1])[path[-1]]
        elif kind == "add":
            node = _walk(inner, path)
            if isinstance(node, dict):
                node[op[2]] = copy.deepcopy(op[3])
            elif isinstance(node, list):
                node.append(copy.deepcopy(op[3]))
        elif kind == "dup" and path:
            parent = _walk(inner, path[:-1])
            if isinstance(parent, list):
                parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
        elif kind == "grow" and path:
            _walk(inner, path[:-1])[path[-1]] = big_value(op[2], 2 ** op[3])
        elif kind == "bump" and path:
            parent = _walk(inner, path[:-1])
            v = parent[path[-1]]
            if type(v) is int:
                parent[path[-1]] = v + op[2]
    except (KeyError, IndexError, TypeError):
        pass  # the path no longer exists after an earlier edit: nothing to do
    return inner


def apply_text(text: str, op) -> str:
    kind = op[0]
    at = lambda pos: pos * (len(text) + 1) // 10**6  # noqa: E731 - a position in this text
    if kind == "insert":
        i = at(op[1])
        return text[:i] + op[2] + text[i:]
    if kind == "delete":
        i = at(op[1])
        return text[:i] + text[i + op[2] :]
    if kind == "replace":
        return op[1]
    if kind == "wrap":
        return "[" * op[1] + text + "]" * op[1]
    if kind == "dupkey":  # the header's first field once more, at its end: a duplicate key
        first = text[1 : text.find(",")] if text.startswith("{") and "," in text else '"format":0'
        return text[:-1] + "," + first + "}" if text.endswith("}") else text
    return text


def apply_semantic(seed: Seed, tensors: dict, inner, op) -> list[str] | None:
    """A consistent rewrite of tensors and kvlab header; returns a new tensor order, if any."""
    kind = op[0]
    layers = inner.get("layers") if isinstance(inner, dict) else None
    n_layers = len(tensors) // 2
    if kind == "cut":
        length = inner["length"] if isinstance(inner, dict) else tensors["layers.0.keys"].shape[2]
        k = 1 + op[1] * max(length - 1, 1) // 10**6
        for i in range(n_layers):
            L = layers[i] if layers else None
            keep = min(k, L["window"] - 1) if L and L["type"] == "sliding_attention" else k
            for w in ("keys", "values"):
                name = f"layers.{i}.{w}"
                tensors[name] = tensors[name][:, :, -keep:].contiguous() if L else tensors[name][:, :, :keep]
                if L:
                    L["kept"], L[w] = keep, list(tensors[name].shape)
        if isinstance(inner, dict):
            inner["length"] = k
            if inner.get("token_ids"):
                inner["token_ids"] = inner["token_ids"][:k]
    elif kind == "batch":
        for name in list(tensors):
            tensors[name] = tensors[name].repeat(op[1], 1, 1, 1)
        for L in layers or []:
            for w in ("keys", "values"):
                L[w] = [L[w][0] * op[1]] + L[w][1:]
    elif kind == "batch_layer":  # one layer only: a cache no model could attend over
        i = op[1] * n_layers // 10**6
        for w in ("keys", "values"):
            tensors[f"layers.{i}.{w}"] = tensors[f"layers.{i}.{w}"].repeat(op[2], 1, 1, 1)
            if layers:
                layers[i][w] = list(tensors[f"layers.{i}.{w}"].shape)
    elif kind == "retype":
        for name in list(tensors):
            tensors[name] = tensors[name].to(ST_TORCH[op[1]])
        if isinstance(inner, dict):
            inner["dtype"] = str(ST_TORCH[op[1]]).removeprefix("torch.")
    elif kind == "retype_layer":  # one layer in another dtype than the header's and the others'
        i = op[1] * n_layers // 10**6
        for w in ("keys", "values"):
            tensors[f"layers.{i}.{w}"] = tensors[f"layers.{i}.{w}"].to(ST_TORCH[op[2]])
    elif kind == "drop_layer":
        i = op[1] * n_layers // 10**6
        moved = {}
        for j in range(n_layers):
            for w in ("keys", "values"):
                if j != i:
                    moved[f"layers.{j - (j > i)}.{w}"] = tensors[f"layers.{j}.{w}"]
        tensors.clear()
        tensors.update(moved)
        if layers:
            del layers[i]
    elif kind == "heads":
        for name in list(tensors):
            b, h, k, d = tensors[name].shape
            if d % op[1] == 0:
                tensors[name] = tensors[name].reshape(b, h * op[1], k, d // op[1])
        for i, L in enumerate(layers or []):
            for w in ("keys", "values"):
                L[w] = list(tensors[f"layers.{i}.{w}"].shape)
    elif kind == "swap":
        i = op[1] * n_layers // 10**6
        k, v = f"layers.{i}.keys", f"layers.{i}.values"
        tensors[k], tensors[v] = tensors[v], tensors[k]
    elif kind == "reorder":
        order = sorted(tensors)
        r = op[1]
        return order[r % len(order) :] + order[: r % len(order)]
    elif kind == "noise":
        name = sorted(tensors)[op[1] * len(tensors) // 10**6]
        t = tensors[name].contiguous().clone()
        flat = t.view(-1)
        j = op[1] % max(flat.numel(), 1)
        if flat.numel():
            if op[2] == "flip":
                b = flat[j : j + 1].view(torch.uint8)
                b[0] ^= 0x80
            else:
                flat[j] = {"nan": float("nan"), "inf": float("inf"), "zero": -0.0, "denormal": 1e-45}[op[2]]
        tensors[name] = t
    return None


def apply_outer(outer: dict, op) -> None:
    kind = op[0]
    name = op[1] if len(op) > 1 else None
    entry = outer.get(name) if isinstance(name, str) else None
    if kind == "entry_set" and isinstance(entry, dict):
        entry[op[2]] = copy.deepcopy(op[3])
    elif kind == "entry_set" and name == "__metadata__":
        outer[name] = copy.deepcopy(op[3])
    elif kind == "entry_bump" and isinstance(entry, dict) and isinstance(entry.get(op[2]), list) and entry[op[2]]:
        values = entry[op[2]]
        i = op[3] * len(values) // 10**6
        if type(values[i]) is int:
            values[i] += op[4]
    elif kind == "entry_del":
        outer.pop(name, None)
    elif kind == "entry_drop_field" and isinstance(entry, dict):
        entry.pop(op[2], None)
    elif kind in ("entry_rename", "entry_copy") and name in outer:
        value = outer[name] if kind == "entry_copy" else outer.pop(name)
        outer[op[2]] = copy.deepcopy(value)
    elif kind == "meta_set" and isinstance(outer.get("__metadata__"), dict):
        outer["__metadata__"][op[1]] = copy.deepcopy(op[2])
    elif kind == "meta_del" and isinstance(outer.get("__metadata__"), dict):
        outer["__metadata__"].pop(op[1], None)
    elif kind == "meta_replace":
        outer["__metadata__"] = copy.deepcopy(op[1])
    elif kind == "grow":
        n = 2 ** op[2]
        if name == "entries":  # many empty tensors, all at the end of the data
            end = max((e["data_offsets"][1] for e in outer.values() if _entry(e)), default=0)
            for i in range(n):
                outer[f"e{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
        elif name == "dims":
            e = next((e for e in outer.values() if _entry(e)), None)
            if e is not None and isinstance(e.get("shape"), list):
                e["shape"] = e["shape"] + [1] * n
        elif name == "metadata" and isinstance(outer.get("__metadata__"), dict):
            outer["__metadata__"].update({f"m{i}": "v" for i in range(n)})
        elif name == "name":
            k = next((k for k, e in outer.items() if _entry(e)), None)
            if k is not None:
                outer["layers." + "9" * n + ".keys"] = outer.pop(k)


def _entry(e) -> bool:
    return isinstance(e, dict) and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2


def apply_raw(data: bytes, op, header_end: int) -> bytes:
    kind = op[0]
    if kind == "extend":
        n, fill = op[1], op[2]
        tail = {
            "zero": b"\x00" * n,
            "random": hashlib.shake_256(str(n).encode()).digest(n),
            "copy": data[-n:],
            "space": b" " * n,
        }[fill]
        return data + tail
    region = op[1]
    lo, hi = {
        "any": (0, len(data)),
        "length": (0, min(8, len(data))),
        "header": (min(8, len(data)), min(header_end, len(data))),
        "data": (min(header_end, len(data)), len(data)),
        "at8": (8, 8),
        "at_end_of_header": (header_end, header_end),
    }[region]
    at = lo + op[2] * max(hi - lo, 1) // 10**6 if hi > lo else lo
    if kind == "truncate":
        return data[: min(at, len(data))]
    if at >= len(data) and kind != "insert":
        return data
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ op[3]]) + data[at + 1 :]
    if kind == "set":
        b = bytes.fromhex(op[3])
        return data[:at] + b + data[at + len(b) :]
    if kind == "insert":
        return data[:at] + bytes.fromhex(op[3]) + data[at:]
    return data


def build(recipe: dict, seeds: dict[str, Seed]) -> bytes:
    """The bytes of the input a recipe describes."""
    seed = seeds[recipe["seed"]]
    # A JSON round trip copies a header several times faster than copy.deepcopy.
    inner = json.loads(seed.inner_json)
    outer = json.loads(seed.outer_json)
    body = seed.body
    if recipe.get("semantic"):
        tensors = dict(seed.tensors)
        order = None
        for op in recipe["semantic"]:
            order = apply_semantic(seed, tensors, inner, op) or order
        order = [n for n in order or [] if n in tensors]
        entries, body = layout(tensors, order + sorted(set(tensors) - set(order)))
        outer = {**entries, "__metadata__": outer.get("__metadata__", {})}
        if inner is not None:
            redigest(inner, tensors)
    for op in recipe.get("inner", []):
        inner = apply_inner(inner, op)
    if recipe.get("resign") == "digests":  # the content digest follows the edited tensor digests
        try:
            names = tensor_names(len(inner["layers"]))
            inner["content_digest"] = content_digest(names, inner["tensors"])
        except (KeyError, TypeError, AttributeError, ValueError):  # ValueError: a digest that is no string to hash
            pass
    text = None
    if inner is not None:
        try:
            text = inner_text(inner)
        except (ValueError, TypeError, RecursionError):
            text = json.dumps(inner, default=str)
        for op in recipe.get("text", []):
            text = apply_text(text, op)
    for op in recipe.get("outer", []):
        apply_outer(outer, op)
    try:
        data = encode(outer, None, body, resign=recipe.get("resign") != "none", text=text, pad=recipe.get("pad", " "))
    except (ValueError, TypeError, RecursionError):
        data = seed.data
    n = int.from_bytes(data[:8], "little")
    if "length" in recipe:
        size = len(data)
        m = {
            "n-1": n - 1,
            "n+1": n + 1,
            "n+8": n + 8,
            "n-8": n - 8,
            "0": 0,
            "7": 7,
            "size": size,
            "size-8": size - 8,
            "2^63": 2**63,
            "2^64-1": 2**64 - 1,
            "64MiB": 64 << 20,
        }[recipe["length"]]
        data = max(m, 0).to_bytes(8, "little") + data[8:]
    for op in recipe.get("raw", []):
        data = apply_raw(data, op, 8 + n)
    return data
