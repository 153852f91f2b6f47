"""Mutation recipes, drawn by hypothesis: JSON-ready edits aimed at one part of a seed's file.

:func:`benchmarks.fuzz.build.build` turns a recipe into the bytes of an input.
"""

from __future__ import annotations

from hypothesis import strategies as st

from benchmarks.fuzz.seeds import Seed

#: What a ``grow`` edit of the kvlab header puts in place of a value (see ``build.big_value``).
SIZE_KINDS = ("ints", "string", "nested", "dicts", "lists", "floats")

BIG_INTS = [0, 1, -1, 2, 3, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 - 1, 2**53, 2**63 - 1, 2**63]
BIG_INTS += [2**64 - 1, 2**64, -(2**63), 10**30, 10**400]
FLOATS = [0.0, -0.0, 1.0, 2.0, 0.5, 1e308, -1e308, 5e-324, 1e16, 27.0]
STRINGS = ["", "F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "I64", "float32", "bfloat16", "int8"]
STRINGS += ["full_attention", "sliding_attention", "layers.0.keys", "layers.0.values", "__metadata__", "kvlab"]
STRINGS += ["kvlab_sha256", "0" * 32, "g" * 32, "A" * 32, "0" * 31 + "\n", "\x00", "\ud800", "é", "\U0001f600"]
STRINGS += ["xxh3-128", "kvlab-kv-cache", "sha256", "tiny-llama", "\u202e", "a\nb"]
SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from(BIG_INTS)
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(FLOATS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(STRINGS)
    | st.text(max_size=12)
)
# Flat rather than st.recursive: drawing a recursive value cost more than reading the input it went into.
KEYS = st.sampled_from(STRINGS) | st.text(max_size=8)
JSON = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=5),
    st.dictionaries(KEYS, SCALARS, max_size=4),
    st.lists(st.lists(SCALARS, max_size=4), max_size=3),
    st.dictionaries(KEYS, st.lists(SCALARS, max_size=3), max_size=3),
)
#: Sizes of the values that grow: mostly up to 2^14, now and then 2^20.
SIZES = st.sampled_from(list(range(4, 15)) * 5 + [16, 18, 20])
POS = st.integers(0, 10**6 - 1)  # a position as a fraction of a region, in millionths
RAW_DATA = st.one_of(
    st.tuples(st.just("flip"), st.just("data"), POS, st.integers(1, 255)),
    st.tuples(st.just("set"), st.just("data"), POS, st.binary(min_size=1, max_size=8).map(bytes.hex)),
)

SEMANTIC = st.one_of(
    st.tuples(st.just("cut"), POS),
    st.tuples(st.just("batch"), st.integers(2, 3)),
    st.tuples(st.just("batch_layer"), POS, st.integers(2, 3)),
    st.tuples(st.just("retype"), st.sampled_from(["F64", "F32", "F16", "BF16"])),
    st.tuples(st.just("retype_layer"), POS, st.sampled_from(["F64", "F16", "BF16"])),
    st.tuples(st.just("drop_layer"), POS),
    st.tuples(st.just("heads"), st.sampled_from([2, 4])),
    st.tuples(st.just("swap"), POS),
    st.tuples(st.just("reorder"), POS),
    st.tuples(st.just("noise"), POS, st.sampled_from(["nan", "inf", "zero", "flip", "denormal"])),
)
TEXT_EDITS = st.one_of(
    st.tuples(
        st.just("insert"), POS, st.sampled_from([',"start":0', ',"length":1', "[", "]", "}", "{", '"', "\\", ","])
    ),
    st.tuples(st.just("insert"), POS, st.text(max_size=6)),
    st.tuples(st.just("delete"), POS, st.integers(1, 40)),
    st.tuples(
        st.just("replace"),
        st.sampled_from(
            ["", "null", "[]", "{}", "NaN", "1e999", '{"a":1,"a":2}', '"\\ud800"', "[" * 100000, '{"format":' * 3000]
        ),
    ),
    st.tuples(st.just("wrap"), st.integers(1, 2000)),
    st.tuples(st.just("dupkey"), POS),
)
OUTER_VALUES = st.one_of(
    JSON,
    st.sampled_from(STRINGS),
    st.lists(st.sampled_from(BIG_INTS) | st.integers(-3, 64), max_size=6),
)
RAW = st.one_of(
    st.tuples(st.just("flip"), st.sampled_from(["any", "length", "header", "data"]), POS, st.integers(1, 255)),
    st.tuples(
        st.just("set"),
        st.sampled_from(["any", "header", "data"]),
        POS,
        st.binary(min_size=1, max_size=8).map(bytes.hex),
    ),
    st.tuples(st.just("truncate"), st.sampled_from(["any", "header", "data", "at8", "at_end_of_header"]), POS),
    st.tuples(st.just("extend"), st.integers(1, 4096), st.sampled_from(["zero", "random", "copy", "space"])),
    st.tuples(
        st.just("insert"),
        st.sampled_from(["any", "header", "data"]),
        POS,
        st.binary(min_size=1, max_size=16).map(bytes.hex),
    ),
)


@st.composite
def recipes(draw, seeds: list[Seed], real_share: float):
    """A mutation recipe: JSON-ready, applied by :func:`build` to the seed it names."""
    real = [s for s in seeds if s.real]
    tiny = [s for s in seeds if not s.real]
    pool = real if real and draw(st.integers(0, 999)) < real_share * 1000 else tiny
    seed = draw(st.sampled_from(pool))
    r = {"seed": seed.name}
    # Where the input is aimed: a byte flipped in the safetensors header mostly stops at its JSON
    # parser, so the kvlab header and consistent rewrites get their own shares.
    focus = draw(st.sampled_from(["container"] * 5 + ["header"] * 9 + ["data"] * 3 + ["mixed"] * 3))
    if seed.inner is None and focus == "header":
        focus = "container"
    if focus == "container":
        kinds = draw(st.lists(st.sampled_from(["outer", "length", "raw"]), min_size=1, max_size=2, unique=True))
    elif focus == "header":
        kinds = ["inner"] + draw(st.lists(st.sampled_from(["inner", "text", "semantic"]), max_size=1))
    elif focus == "data":
        kinds = ["semantic"] + draw(st.lists(st.just("data"), max_size=1))
    else:
        kinds = draw(st.lists(st.sampled_from(["semantic", "inner", "text", "outer", "length", "raw"]), max_size=4))
    if "semantic" in kinds:
        r["semantic"] = draw(st.lists(SEMANTIC, min_size=1, max_size=3))
    if "inner" in kinds and seed.inner is not None:
        r["inner"] = draw(st.lists(inner_edit(seed), min_size=1, max_size=3))
    if "text" in kinds and seed.inner is not None:
        r["text"] = draw(st.lists(TEXT_EDITS, min_size=1, max_size=2))
    # Mostly re-signed: an edit under the old sha256 stops at the sha256 check.
    r["resign"] = draw(st.sampled_from(["sha", "sha", "digests", "digests", "digests", "none"]))
    if "outer" in kinds:
        r["outer"] = draw(st.lists(outer_edit(seed), min_size=1, max_size=3))
        r["pad"] = draw(st.sampled_from([" "] * 6 + ["", "\n", "\t", "\x00", "x"]))
    if "length" in kinds:
        r["length"] = draw(
            st.sampled_from(["n-1", "n+1", "n+8", "n-8", "0", "7", "size", "size-8", "2^63", "2^64-1", "64MiB"])
        )
    if "data" in kinds:
        r["raw"] = draw(st.lists(RAW_DATA, min_size=1, max_size=2))
    elif "raw" in kinds or not kinds:
        r["raw"] = draw(st.lists(RAW, min_size=1, max_size=3))
    return r


def inner_edit(seed: Seed):
    path = st.sampled_from(seed.paths).map(list)
    return st.one_of(
        st.tuples(st.just("set"), path, JSON),
        st.tuples(st.just("set"), path, SCALARS),
        st.tuples(st.just("del"), path),
        st.tuples(st.just("add"), path, st.sampled_from(STRINGS) | st.text(max_size=6), JSON),
        st.tuples(st.just("dup"), path),
        st.tuples(st.just("grow"), path, st.sampled_from(SIZE_KINDS), SIZES),
        st.tuples(st.just("bump"), path, st.sampled_from([-2, -1, 1, 2, 1000, 2**31])),
    )


def outer_edit(seed: Seed):
    name = st.sampled_from(seed.names + ["__metadata__"])
    field = st.sampled_from(["dtype", "shape", "data_offsets", "extra"])
    return st.one_of(
        st.tuples(st.just("entry_set"), name, field, OUTER_VALUES),
        st.tuples(st.just("entry_bump"), name, st.sampled_from(["shape", "data_offsets"]), POS, st.integers(-9, 9)),
        st.tuples(st.just("entry_del"), name),
        st.tuples(st.just("entry_drop_field"), name, field),
        st.tuples(st.just("entry_rename"), name, st.sampled_from(STRINGS) | st.text(max_size=10)),
        st.tuples(st.just("entry_copy"), name, st.sampled_from(STRINGS) | st.text(max_size=10)),
        st.tuples(st.just("meta_set"), st.sampled_from(["kvlab", "kvlab_sha256", "format", "x"]), OUTER_VALUES),
        st.tuples(st.just("meta_del"), st.sampled_from(["kvlab", "kvlab_sha256", "format"])),
        st.tuples(st.just("meta_replace"), OUTER_VALUES),
        st.tuples(st.just("grow"), st.sampled_from(["entries", "dims", "metadata", "name"]), SIZES),
    )
