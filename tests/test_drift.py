"""What the docs and pyproject.toml say about the tree stays true of it.

Every module under ``kvlab/`` is in its folder's import-linter layers contract (where the folder
has one) and in the module table of ``docs/ARCHITECTURE.md``, whose rows follow the contract of
the folders; every repository path that ``pyproject.toml`` names exists.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvlab"
PYPROJECT = ROOT / "pyproject.toml"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def _contracts(pyproject: Path) -> list[dict]:
    return tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]


def _layer_names(contract: dict) -> list[set[str]]:
    """Each layer of a contract as the set of its names (``a | b`` is two siblings)."""
    return [{m.strip() for m in layer.split("|")} for layer in contract["layers"]]


def _children(folder: Path) -> set[str]:
    """The modules (``.py`` other than ``__init__``) and packages directly inside ``folder``."""
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").is_file()
    }


def contract_gaps(package: Path, pyproject: Path) -> list[str]:
    """Modules and packages missing from their folder's layers contract, and names it lists that do not exist."""
    out = []
    for contract in _contracts(pyproject):
        for container in contract.get("containers", []):
            folder = package.parent.joinpath(*container.split("."))
            listed = set().union(*_layer_names(contract))
            present = _children(folder)
            out += [f"{container}.{m} is in no layer of {contract['name']!r}" for m in sorted(present - listed)]
            out += [
                f"{contract['name']!r} lists {container}.{m}, which does not exist" for m in sorted(listed - present)
            ]
    return out


def uncontracted_folders(package: Path, pyproject: Path) -> list[str]:
    """Folders of ``package`` holding modules with no layers contract of their own (reported, not failed)."""
    covered = {c for contract in _contracts(pyproject) for c in contract.get("containers", [])}
    return sorted(
        ".".join(p.parent.relative_to(package.parent).parts)
        for p in package.rglob("__init__.py")
        if p.parent != package and ".".join(p.parent.relative_to(package.parent).parts) not in covered
    )


def _table_rows(architecture: Path) -> list[tuple[list[str], list[str]]]:
    """``(folders, module groups)`` of each row of the module table, a row's siblings split at ``·``."""
    rows, inside = [], False
    for line in architecture.read_text().splitlines():
        if line.startswith("| folder | modules |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            folders = [f.strip().strip("`") for f in cells[0].split("·")]
            groups = [g.strip() for g in cells[1].split("·")] if cells[1] else []
            rows.append((folders, groups + [""] * (len(folders) - len(groups))))
    return rows


def table_modules(architecture: Path) -> set[str]:
    """Every module the table names, as a path under ``kvlab/`` (``cli.py``, ``measure/audit/run.py``)."""
    out = set()
    for folders, groups in _table_rows(architecture):
        for folder, group in zip(folders, groups):
            if folder.endswith(".py"):
                out.add(folder)
                continue
            nested = r"`(\w+)/`\s*\(([^)]*)\)"  # a folder inside, with its modules: `audit/` (`run`, ...)
            for sub, inner in re.findall(nested, group):
                out |= {f"{folder}{sub}/{m}.py" for m in re.findall(r"`(\w+)`", inner)}
            out |= {f"{folder}{m}.py" for m in re.findall(r"`(\w+)`", re.sub(nested, "", group))}
    return out


def modules(package: Path) -> set[str]:
    """Every module of ``package`` other than an ``__init__``, as a path under it."""
    return {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}


def table_gaps(package: Path, architecture: Path) -> list[str]:
    """Modules missing from the table, and modules it names that do not exist."""
    named, present = table_modules(architecture), modules(package)
    return [f"kvlab/{m} is not in the table of {architecture.name}" for m in sorted(present - named)] + [
        f"{architecture.name}'s table names kvlab/{m}, which does not exist" for m in sorted(named - present)
    ]


def table_order_gaps(architecture: Path, pyproject: Path) -> list[str]:
    """Where the table's rows (top to bottom, siblings at ``·``) differ from the contract of the folders."""
    top = next(c for c in _contracts(pyproject) if not c.get("containers"))
    want = [{m.removeprefix("kvlab.") for m in layer} for layer in _layer_names(top)]
    got = [{f.removesuffix("/").removesuffix(".py") for f in folders} for folders, _ in _table_rows(architecture)]
    return [] if got == want else [f"the table's rows are {got}, the contract's layers {want}"]


#: A repository path in pyproject.toml's text (a value or a comment): with a folder, or a file name with a suffix.
PATH_WORD = re.compile(
    r"(?<![\w./*:-])((?:[\w.*-]+/)+[\w.*-]*|[\w*-]+\.(?:md|py|json|toml|txt|yml|yaml|ipynb|html|cfg))(?![\w/])"
)


def _matches(base: Path, pattern: str) -> bool:
    """Whether ``pattern`` matches a path under ``base``; one without a ``/`` matches a name in any
    folder, as ruff's and setuptools' patterns do (hidden folders, such as .venv, are not searched)."""
    if next(base.glob(pattern), None) is not None:
        return True
    if "/" in pattern:
        return False
    for _, subfolders, files in os.walk(base):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        if any(fnmatch.fnmatch(name, pattern) for name in files + subfolders):
            return True
    return False


def missing_paths(root: Path, pyproject: Path) -> list[str]:
    """Paths ``pyproject.toml`` names that match nothing in ``root`` (package data: in the package)."""
    package_data = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}).get("package-data", {})
    bases = [root] + [root / package for package in package_data]
    words = sorted(set(PATH_WORD.findall(pyproject.read_text())))
    return [w for w in words if not any(_matches(base, w.rstrip("/")) for base in bases)]


#: Past this many lines a module must be named in ARCHITECTURE.md's "Large modules", with the reason.
LARGE = 450


def large_gaps(package: Path, architecture: Path) -> list[str]:
    """Modules over :data:`LARGE` lines that the "Large modules" section does not name with their length."""
    text = architecture.read_text()
    start = text.index("## Large modules")
    section = text[start : text.index("\n## ", start + 1)]
    named = {m: int(n) for m, n in re.findall(r"^\* `([\w/]+\.py)` \((\d+)\)", section, re.M)}
    gaps = []
    for p in sorted(package.rglob("*.py")):
        rel, lines = p.relative_to(package).as_posix(), len(p.read_text().splitlines())
        if lines > LARGE and rel not in named:
            gaps.append(f"kvlab/{rel} has {lines} lines and is not in ARCHITECTURE.md's Large modules")
        elif rel in named and named[rel] != lines:
            gaps.append(f"ARCHITECTURE.md's Large modules gives kvlab/{rel} {named[rel]} lines; it has {lines}")
    return gaps


# --------------------------------------------------------------------------- the checks


def test_every_module_past_450_lines_is_named_with_its_reason():
    assert large_gaps(PACKAGE, ARCHITECTURE) == []


def test_every_module_is_in_its_folders_layers_contract():
    assert contract_gaps(PACKAGE, PYPROJECT) == []


def test_every_module_is_in_the_architecture_table():
    assert table_gaps(PACKAGE, ARCHITECTURE) == []


def test_the_table_rows_follow_the_contract_of_the_folders():
    assert table_order_gaps(ARCHITECTURE, PYPROJECT) == []


def test_every_path_pyproject_names_exists():
    assert missing_paths(ROOT, PYPROJECT) == []


def test_every_folder_has_a_layers_contract():
    assert uncontracted_folders(PACKAGE, PYPROJECT) == []


# --------------------------------------------------------------------------- the checks have teeth


@pytest.fixture()
def tree(tmp_path):
    """A copy of the package's layout (empty modules), pyproject.toml and the table, to break."""
    for p in PACKAGE.rglob("*.py"):
        target = tmp_path / "kvlab" / p.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    for p in PACKAGE.rglob("*.schema.json"):
        (tmp_path / "kvlab" / p.relative_to(PACKAGE)).touch()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text(ARCHITECTURE.read_text())
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.read_text())
    return tmp_path


def test_the_copy_passes_as_the_tree_does(tree):
    assert contract_gaps(tree / "kvlab", tree / "pyproject.toml") == []
    assert table_gaps(tree / "kvlab", tree / "docs" / "ARCHITECTURE.md") == []
    assert table_order_gaps(tree / "docs" / "ARCHITECTURE.md", tree / "pyproject.toml") == []


def test_a_new_module_fails_both_the_contract_and_the_table(tree):
    (tree / "kvlab" / "files" / "dummy.py").touch()
    assert contract_gaps(tree / "kvlab", tree / "pyproject.toml") == [
        "kvlab.files.dummy is in no layer of "
        + repr(next(c["name"] for c in _contracts(PYPROJECT) if c.get("containers") == ["kvlab.files"]))
    ]
    assert table_gaps(tree / "kvlab", tree / "docs" / "ARCHITECTURE.md") == [
        "kvlab/files/dummy.py is not in the table of ARCHITECTURE.md"
    ]


def test_a_new_module_in_a_nested_folder_or_at_the_top_fails_the_table(tree):
    (tree / "kvlab" / "measure" / "audit" / "dummy.py").touch()
    (tree / "kvlab" / "dummy.py").touch()
    assert table_gaps(tree / "kvlab", tree / "docs" / "ARCHITECTURE.md") == [
        "kvlab/dummy.py is not in the table of ARCHITECTURE.md",
        "kvlab/measure/audit/dummy.py is not in the table of ARCHITECTURE.md",
    ]
    assert any("kvlab.measure.audit.dummy" in gap for gap in contract_gaps(tree / "kvlab", tree / "pyproject.toml"))


def test_a_removed_module_fails_both(tree):
    (tree / "kvlab" / "files" / "schemes.py").unlink()
    assert any(
        "kvlab.files.schemes, which does not exist" in g for g in contract_gaps(tree / "kvlab", tree / "pyproject.toml")
    )
    assert table_gaps(tree / "kvlab", tree / "docs" / "ARCHITECTURE.md") == [
        "ARCHITECTURE.md's table names kvlab/files/schemes.py, which does not exist"
    ]


def test_rows_out_of_the_contracts_order_fail(tree):
    doc = tree / "docs" / "ARCHITECTURE.md"
    lines = doc.read_text().splitlines()
    i = next(n for n, l in enumerate(lines) if l.startswith("| `testing.py` |"))
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    doc.write_text("\n".join(lines) + "\n")
    assert table_order_gaps(doc, tree / "pyproject.toml") != []


def test_a_path_pyproject_names_that_is_gone_fails(tmp_path):
    (tmp_path / "kvlab" / "files").mkdir(parents=True)
    (tmp_path / "kvlab" / "files" / "format.py").touch()
    (tmp_path / "kvlab" / "files" / "header.schema.json").touch()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").touch()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_a.ipynb").touch()
    pyproject = tmp_path / "pyproject.toml"
    text = """
[project]
readme = "README.md"
dependencies = [
    "xxhash>=3.4",  # XXH3-128 digests of cache-file tensors (kvlab/files/format.py)
]
# The layers of docs/ARCHITECTURE.md, checked by `lint-imports`.
[tool.setuptools.package-data]
kvlab = ["files/*.schema.json"]
[tool.ruff.lint.per-file-ignores]
"kvlab/files/*.py" = ["E501"]
"*.ipynb" = ["E402"]
"""
    pyproject.write_text(text)
    assert missing_paths(tmp_path, pyproject) == ["README.md"]
    (tmp_path / "README.md").touch()
    assert missing_paths(tmp_path, pyproject) == []
    pyproject.write_text(text.replace("(kvlab/files/format.py)", "(see kvlab/cacheformat.py)"))
    assert missing_paths(tmp_path, pyproject) == ["kvlab/cacheformat.py"]
    pyproject.write_text(text.replace('"files/*.schema.json"', '"files/*.schema.yaml"'))
    assert missing_paths(tmp_path, pyproject) == ["files/*.schema.yaml"]
    pyproject.write_text(text.replace('"kvlab/files/*.py"', '"kvlab/gone/*.py"'))
    assert missing_paths(tmp_path, pyproject) == ["kvlab/gone/*.py"]
    (tmp_path / "notebooks" / "01_a.ipynb").unlink()
    pyproject.write_text(text)
    assert missing_paths(tmp_path, pyproject) == ["*.ipynb"]


def test_a_module_grown_past_450_lines_unnamed_fails(tmp_path):
    (tmp_path / "kvlab" / "measure").mkdir(parents=True)
    (tmp_path / "kvlab" / "measure" / "stats.py").write_text("x = 1\n" * (LARGE + 1))
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text("## Large modules\n\nNone.\n\n## Next\n")
    assert large_gaps(tmp_path / "kvlab", doc) == [
        f"kvlab/measure/stats.py has {LARGE + 1} lines and is not in ARCHITECTURE.md's Large modules"
    ]
    doc.write_text(f"## Large modules\n\n* `measure/stats.py` ({LARGE + 1}): one idea.\n\n## Next\n")
    assert large_gaps(tmp_path / "kvlab", doc) == []
    (tmp_path / "kvlab" / "measure" / "stats.py").write_text("x = 1\n" * LARGE)
    assert large_gaps(tmp_path / "kvlab", doc) == [
        f"ARCHITECTURE.md's Large modules gives kvlab/measure/stats.py {LARGE + 1} lines; it has {LARGE}"
    ]
