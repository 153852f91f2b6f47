"""The layers of docs/ARCHITECTURE.md hold: import-linter's contracts (pyproject.toml) plus two rules it has no
contract for, both checked on every module's syntax tree."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvlab"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def kvlab_imports(path: Path):
    """``(line, module, names)`` of every kvlab import in ``path``, at any depth (relative ones included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "kvlab"):
            yield node.lineno, "." * node.level + (node.module or ""), [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kvlab":
                    yield node.lineno, a.name, []


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_import_linter_contracts_are_kept():
    run = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_every_layer_folder_is_in_the_contract():
    # A new folder outside the contract would escape the layer check.
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    listed = {m.strip() for layer in contract["layers"] for m in layer.split("|")}
    present = {
        f"kvlab.{p.stem if p.is_file() else p.name}"
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert present - {"kvlab.cli"} <= listed and "kvlab.cli" in listed, present - listed


def test_no_module_imports_the_package_top_or_uses_relative_imports():
    # `import kvlab` from inside points up past every layer; relative imports hide which layer is meant.
    bad = [
        f"{p.relative_to(ROOT)}:{line} {mod}"
        for p in modules()
        for line, mod, names in kvlab_imports(p)
        if mod.startswith(".") or mod == "kvlab"
    ]
    assert bad == []


def test_no_private_name_crosses_a_module():
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {n} from {mod}"
        for p in modules()
        for line, mod, names in kvlab_imports(p)
        for n in names
        if n.startswith("_")
    ]
    assert bad == []


def test_the_checks_would_catch_a_violation(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import kvlab\n    from kvlab.models.tiny import _COMMON\nfrom .x import y\n")
    assert sorted(kvlab_imports(probe)) == [(2, "kvlab", []), (3, "kvlab.models.tiny", ["_COMMON"]), (4, ".x", ["y"])]
