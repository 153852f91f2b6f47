"""The import direction of kvlab's modules (docs/ARCHITECTURE.md): always down the layers, never in a circle.

Every module of the package (subpackages included: ``sweep.point`` is a module of the
``sweep`` layer entry) is parsed with ``ast``; every import of another kvlab module, at module
level or inside a function, is an edge (``import kvlab`` itself points to the top). The test fails on an edge that points
to a higher layer, on a cycle among the edges, on a module no layer lists, and on a
private name (``_x``) imported from another kvlab module.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvlab"

#: Bottom to top. A module may import from its own layer or any layer below it.
LAYERS = [
    {"errors", "atomic", "digests", "tiny", "kernel", "stats", "evalset"},
    {"models"},
    {"rope", "fragments"},
    {"identity", "strategies", "merge", "recompute", "repro", "catalog", "cacheformat", "cachefile", "sources"},
    {"references", "case", "metrics", "fidelity", "mismatch", "records", "qa", "longctx"},
    {"plots", "explorer", "report", "check", "sweep", "peers", "cli"},
]
#: ``kvlab/__init__.py`` re-exports the public API; it sits above everything.
TOP = "__init__"


def layer_of(module: str) -> int:
    """The layer of a module (``sweep.point`` sits where its package ``sweep`` does)."""
    if module == TOP:
        return len(LAYERS)
    top = module.split(".")[0]
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise KeyError(module)


def modules() -> list[str]:
    """Dotted names relative to ``kvlab``: ``models``, ``sweep`` (its ``__init__``), ``sweep.point`` ..."""
    out = []
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append(".".join(parts))
    return sorted(out)


def _path(module: str) -> Path:
    p = PACKAGE.joinpath(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def _package_of(module: str) -> list[str]:
    """The package a module's relative imports start from, as dotted parts below ``kvlab``."""
    if module == TOP:
        return []
    parts = module.split(".")
    return parts if _path(module).name == "__init__.py" else parts[:-1]


def _known(name: str) -> str:
    """The module an import names: ``sweep.run`` stays, ``sweep.run.plan`` (an attribute) shortens."""
    parts = name.split(".")
    while len(parts) > 1 and not (_path(".".join(parts)).exists()):
        parts.pop()
    return ".".join(parts) or TOP


def imports(module: str) -> list[tuple[str, list[str], int, bool]]:
    """``(imported module, names, line, at module level)`` for each kvlab import of ``module``."""
    tree = ast.parse(_path(module).read_text())
    top_level = {id(n) for n in tree.body}
    here = _package_of(module)
    out = []
    for node in ast.walk(tree):
        level = id(node) in top_level
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import a / from ..x import a / from . import x
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                prefix = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "kvlab":
                prefix = node.module.split(".")[1:]
            else:
                continue
            if node.module or not node.level:
                target = _known(".".join(prefix)) if prefix else TOP
                out.append((target, [a.name for a in node.names], node.lineno, level))
            else:
                for a in node.names:  # from . import x: x is a module (or a name of the package)
                    target = _known(".".join(prefix + [a.name])) if prefix or _path(a.name).exists() else TOP
                    out.append((target, [] if target != TOP else [a.name], node.lineno, level))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "kvlab":
                    out.append((_known(".".join(parts[1:])) if len(parts) > 1 else TOP, [], node.lineno, level))
    return out


def graph() -> dict[str, set[str]]:
    return {m: {target for target, *_ in imports(m) if target != m and target != TOP} for m in modules()}


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if m != TOP and not any(m.split(".")[0] in layer for layer in LAYERS)]
    assert unplaced == [], f"add these modules to a layer in LAYERS and docs/ARCHITECTURE.md: {unplaced}"
    gone = sorted(set().union(*LAYERS) - {m.split(".")[0] for m in modules()})
    assert gone == [], f"LAYERS lists modules that do not exist: {gone}"


def test_imports_point_down_the_layers():
    upward = []
    for m in modules():
        for target, _, line, _ in imports(m):
            if layer_of(target) > layer_of(m):
                upward.append(f"kvlab/{m}.py:{line} imports {target} (layer {layer_of(target)}) from layer {layer_of(m)}")
    assert upward == []


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_private_name_crosses_a_module():
    private = [f"kvlab/{m}.py:{line} imports {n} from {target}"
               for m in modules() for target, names, line, _ in imports(m) for n in names if n.startswith("_")]
    assert private == []


@pytest.mark.parametrize("module, source, expected", [
    ("probe", "from .models import LoadedModel\n", [("models", ["LoadedModel"], 1, True)]),
    ("probe", "def f():\n    from kvlab.cli import main\n", [("cli", ["main"], 2, False)]),
    ("probe", "from . import recompute\n", [("recompute", [], 1, True)]),
    ("probe", "def f():\n    import kvlab\n", [("__init__", [], 2, False)]),
    ("sub.probe", "from ..records import rounded\nfrom .files import x\n",
     [("records", ["rounded"], 1, True), ("sub.files", ["x"], 2, True)]),
    ("sub", "from .run import go\n", [("sub.run", ["go"], 1, True)]),
])
def test_the_parser_sees_every_import_form(tmp_path, monkeypatch, module, source, expected):
    # The checks above are only as good as the import parser; pin the forms kvlab uses.
    for name in ("models", "cli", "recompute", "records"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "sub").mkdir()
    for name in ("files", "run"):
        (tmp_path / "sub" / f"{name}.py").write_text("")
    (tmp_path / "sub" / "__init__.py").write_text(source if module == "sub" else "")
    if module != "sub":
        (tmp_path / (module.replace(".", "/") + ".py")).write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert imports(module) == expected


def test_an_upward_import_would_be_caught():
    # metrics -> plots is what the layers forbid; the rule itself must say so.
    assert layer_of("plots") > layer_of("metrics")
    assert layer_of("identity") > layer_of("models")
    assert layer_of("__init__") > layer_of("sweep.point")  # so `import kvlab` inside the package points up
