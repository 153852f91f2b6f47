"""The import direction of kvlab's modules (docs/ARCHITECTURE.md): always down the layers, never in a circle.

Every module of the package is parsed with ``ast``; every import of another kvlab module,
at module level or inside a function, is an edge. The test fails on an edge that points
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
    {"errors", "atomic", "digests", "tiny"},
    {"models"},
    {"rope", "fragments"},
    {"identity", "strategies", "merge", "recompute", "repro", "catalog", "cacheformat", "cachefile"},
    {"references", "case", "metrics", "fidelity", "mismatch"},
    {"plots", "explorer", "report", "check", "cli"},
]
#: ``kvlab/__init__.py`` re-exports the public API; it sits above everything.
TOP = "__init__"


def layer_of(module: str) -> int:
    if module == TOP:
        return len(LAYERS)
    for i, layer in enumerate(LAYERS):
        if module in layer:
            return i
    raise KeyError(module)


def modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def imports(module: str) -> list[tuple[str, list[str], int, bool]]:
    """``(imported module, names, line, at module level)`` for each kvlab import of ``module``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import a
                out.append((node.module.split(".")[0], [a.name for a in node.names], node.lineno, id(node) in top_level))
            elif node.level == 1:  # from . import x
                for a in node.names:
                    out.append((a.name, [], node.lineno, id(node) in top_level))
            elif node.level == 0 and node.module and node.module.split(".")[0] == "kvlab":
                parts = node.module.split(".")
                target = parts[1] if len(parts) > 1 else None
                for a in node.names:
                    out.append((target or a.name, [] if target is None else [a.name], node.lineno, id(node) in top_level))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "kvlab" and len(parts) > 1:
                    out.append((parts[1], [], node.lineno, id(node) in top_level))
    return out


def graph() -> dict[str, set[str]]:
    return {m: {target for target, *_ in imports(m) if target != m} for m in modules()}


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if m != TOP and not any(m in layer for layer in LAYERS)]
    assert unplaced == [], f"add these modules to a layer in LAYERS and docs/ARCHITECTURE.md: {unplaced}"
    gone = sorted(set().union(*LAYERS) - set(modules()))
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


@pytest.mark.parametrize("source, expected", [
    ("from .models import LoadedModel\n", [("models", ["LoadedModel"], 1, True)]),
    ("def f():\n    from kvlab.cli import main\n", [("cli", ["main"], 2, False)]),
    ("from . import recompute\n", [("recompute", [], 1, True)]),
])
def test_the_parser_sees_every_import_form(tmp_path, monkeypatch, source, expected):
    # The checks above are only as good as the import parser; pin the forms kvlab uses.
    (tmp_path / "probe.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert imports("probe") == expected


def test_an_upward_import_would_be_caught():
    # metrics -> plots is what the layers forbid; the rule itself must say so.
    assert layer_of("plots") > layer_of("metrics")
    assert layer_of("identity") > layer_of("models")
