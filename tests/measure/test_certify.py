"""``kvlab certify``: every catalogue model certified or refused for the right reason, and each check has teeth."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvlab
from conftest import TINY_HERE, tiny
from kvlab.cli import main
from kvlab.measure.certificate import FAIL, PASS, REFUSED
from kvlab.measure.certify import certify
from kvlab.models.gguf import GGUF_MODELS

#: Tiny models whose every rotation composes: everything must pass.
COMPOSING = sorted(set(TINY_HERE) - {"tiny-dynamic"})


def lines(cert, check):
    return [line for line in cert.lines if line.check == check]


def assert_certified(cert):
    assert cert.passed, cert.table(verbose=True)
    for check in ("rotation", "rerotate phase", "recompute r=0", "recompute r=1", "file round trip", "foreign reader"):
        assert lines(cert, check) and all(line.status == PASS for line in lines(cert, check)), check
    # Every measured line sits within its bound (the statuses say so; this checks the statuses).
    for line in cert.lines:
        if line.status == PASS and isinstance(line.value, float) and isinstance(line.bound, float):
            assert line.value <= line.bound, line


@pytest.mark.parametrize("name", COMPOSING)
def test_every_tiny_model_that_composes_is_certified(name):
    m = tiny(name)
    cert = certify(m)
    assert_certified(cert)
    types = {r.layer_type for r in kvlab.layer_ropes(m.model)}
    # One line per layer kind: a NoPE layer (no phase to be wrong) has its own, held to its elementwise error.
    kinds = {r.kind for r in kvlab.layer_ropes(m.model)}
    assert {line.scope.split(" layers")[0] for line in lines(cert, "rotation")} == kinds
    assert {line.scope.split(" layers")[0] for line in lines(cert, "rerotate phase")} == kinds
    sliding = lines(cert, "sliding window")[0]
    assert sliding.status == (PASS if "sliding_attention" in types else "n/a")
    # The phase check has teeth on this very model: a naive merge is thousands of times past rounding.
    # A NoPE layer has no phase to be wrong: there a naive merge is as exact as rerotate.
    for line in lines(cert, "rerotate phase"):
        naive = float(line.detail.split("a naive merge ")[1].split(" x")[0])
        assert naive <= 1 if line.scope.startswith(tuple(k for k in kinds if k.endswith("(NoPE)"))) else naive > 1e3


def test_dynamic_ntk_is_not_certified_and_says_why():
    cert = certify(tiny("tiny-dynamic"))
    assert not cert.passed
    refused = [line for line in cert.lines if line.status == REFUSED]
    assert {line.check for line in refused} == {"rotation", "rerotate phase", "recompute r=0"}
    assert all("dynamic" in line.detail for line in refused)
    # What does not depend on rotating still holds.
    assert lines(cert, "file round trip")[0].status == PASS
    assert all(line.status == PASS for line in cert.lines if line.check.startswith("refuse"))


def _skewed(ropes):
    """The same rotary schedule with frequencies 0.1% too high: a rotation kvlab could plausibly get wrong."""
    return [dataclasses.replace(r, inv_freq=r.inv_freq * 1.001) for r in ropes]


def test_a_rotation_off_by_a_tenth_of_a_percent_fails_the_rotation_line(monkeypatch):
    import kvlab.cache.shift as shift

    real = shift.layer_ropes
    monkeypatch.setattr(shift, "layer_ropes", lambda model: _skewed(real(model)))
    cert = certify(tiny("tiny-llama"))
    assert not cert.passed
    assert [line.status for line in lines(cert, "rotation")] == [FAIL]
    assert lines(cert, "rerotate phase")[0].status == PASS  # rerotate reads its frequencies elsewhere
    assert "NOT certified" in cert.table() and "rotation" in cert.table().splitlines()[-1]


def test_a_rerotate_off_by_a_tenth_of_a_percent_fails_the_phase_line(monkeypatch):
    import kvlab.cache.strategies as strategies

    real = strategies.layer_ropes
    monkeypatch.setattr(strategies, "layer_ropes", lambda model: _skewed(real(model)))
    cert = certify(tiny("tiny-gemma3"))
    assert {line.status for line in lines(cert, "rerotate phase")} == {FAIL}
    assert lines(cert, "rotation")[0].status == PASS


def test_a_recompute_that_is_not_exact_fails_its_identity(monkeypatch):
    from kvlab.cache.recompute.strategy import Recompute

    real = Recompute.__call__

    def off(self, fragments, landings, model):
        out = real(self, fragments, landings, model)
        out.layers[-1].values[..., -1, 0] += 1e-3
        return out

    monkeypatch.setattr(Recompute, "__call__", off)
    cert = certify(tiny("tiny-qwen2"))
    assert {line.status for line in lines(cert, "recompute r=0")} == {FAIL}
    assert lines(cert, "recompute r=1")[0].status == FAIL


def test_the_command_exits_by_the_verdict_and_writes_the_record(tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    assert main(["certify", "tiny-gemma3", "--json", str(good)]) == 0
    assert "tiny-gemma3: certified" in capsys.readouterr().out
    assert main(["certify", "tiny-dynamic", "--json", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "NOT certified" in out and "REFUSED" in out and "rope_type 'dynamic'" in out
    record = json.loads(good.read_text())
    assert record["passed"] is True and record["model"] == "tiny-gemma3"
    assert record["fingerprint"]["weights_sha256"] and record["versions"]["torch"]
    assert {line["check"] for line in record["lines"]} >= {"rotation", "sliding window", "floor: batch"}
    assert json.loads(bad.read_text())["passed"] is False
    assert main(["certify", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.real
@pytest.mark.parametrize("model_fixture", ["smollm2", "gemma3"])
def test_both_real_models_are_certified(model_fixture, request):
    m = request.getfixturevalue(model_fixture)
    assert m.name in GGUF_MODELS
    cert = certify(m)
    assert_certified(cert)
    limit = m.config.get_text_config().max_position_embeddings
    assert all(f"1..{limit - 1}" in line.scope for line in lines(cert, "rotation"))
    # The context error (information) is real on these models: rotation fixes the phase, not the context.
    context = {line.scope.split(",")[0]: line.value for line in lines(cert, "context error")}
    assert context["rerotate"] > 1e-2 and context["recompute r=0.15"] < context["rerotate"]
    if model_fixture == "gemma3":
        assert lines(cert, "sliding window")[0].status == PASS
        assert "layers keep [511, 528] of 528 tokens" in lines(cert, "sliding window")[0].detail
