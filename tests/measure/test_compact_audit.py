"""Auditing a store's compaction and press: kvlab's own pass, and each one-defect version fails exactly its lines.

The wrong implementations live in ``compact_targets.py`` (this folder), written from each defect's
description; the CLI imports them as ``compact_targets:NAME``.
"""

from __future__ import annotations

import functools
import json

import compact_targets as T
import pytest
import torch
from transformers import DynamicCache

from conftest import TINY_HERE, tiny
from kvlab.cache.compact import compact
from kvlab.cache.fragments import prefill_ids
from kvlab.cli import main
from kvlab.compat import ASSIGNED_LAYERS_READ_EMPTY, forward
from kvlab.errors import AuditTargetError, CompactError, UnsupportedRopeError
from kvlab.measure.audit.run import audit
from kvlab.measure.certificate import NA, PASS, REFUSED
from kvlab.models.loaded import LoadedModel
from kvlab.testing import (
    assert_compact_conforms,
    assert_press_conforms,
    inplace_compact,
    key_norm_press,
    key_norm_rerotation_press,
    rerotate_compact,
)

COMPOSING = sorted(set(TINY_HERE) - {"tiny-dynamic"})

#: Every check a compaction audit reports, in order.
CHECKS = [
    "versions", "kept tokens", "phase", "values", "length", "by reference", "sliding window", "dtype and device",
    "keep all", "refusal", "context error",
]  # fmt: skip

OWN = [
    ("compact", rerotate_compact, "kept"),
    ("compact", inplace_compact, "original"),
    ("press", key_norm_press, "original"),
    ("press", key_norm_rerotation_press, "kept"),
]


@functools.cache
def certificate(model: str, kind: str, name: str, positions: str):
    """The audit of ``compact_targets.<name>`` (a ``kind``) on a tiny model, run once per session."""
    return audit(tiny(model), **{kind: getattr(T, name)}, positions=positions)


def failing(cert) -> set[str]:
    return {line.check for line in cert.lines if line.failed}


def lines_of(cert, check: str):
    return [x for x in cert.lines if x.check == check]


# -- what passes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", COMPOSING)
@pytest.mark.parametrize("kind, fn, positions", OWN, ids=lambda x: getattr(x, "__name__", x))
def test_kvlabs_own_compactions_and_presses_pass_on_every_model_that_composes(model, kind, fn, positions):
    cert = audit(tiny(model), **{kind: fn}, positions=positions)
    assert cert.passed, cert.table(verbose=True)
    assert [x.check for x in cert.lines if x.check != "phase"] == [c for c in CHECKS if c != "phase"]
    # A press chooses its tokens: keep all has nothing to ask it; positions=original turns nothing to refuse.
    assert (lines_of(cert, "keep all")[0].status == NA) == (kind == "press")
    assert (lines_of(cert, "refusal")[0].status == NA) == (positions == "original")


@pytest.mark.parametrize(
    "model, name",
    [("tiny-llama", "store_compact"), ("tiny-gemma3", "store_compact"), ("tiny-phi", "store_compact"),
     ("tiny-yarn", "store_compact"), ("tiny-cohere", "store_interleaved"), ("tiny-llama", "store_in_place")],
)  # fmt: skip
def test_a_right_compaction_written_by_hand_passes(model, name):
    cert = certificate(model, "compact", name, "original" if name == "store_in_place" else "kept")
    assert cert.passed, cert.table(verbose=True)


def test_the_helpers_pass_kvlabs_own_and_return_the_certificate():
    assert assert_compact_conforms(rerotate_compact, positions="kept").passed
    assert assert_press_conforms(key_norm_press, model="tiny-gemma3", positions="original").passed


def test_on_dynamic_ntk_kvlabs_rerotation_is_refused_and_the_in_place_one_passes():
    dyn = tiny("tiny-dynamic")
    for kind, fn in (("compact", rerotate_compact), ("press", key_norm_rerotation_press)):
        cert = audit(dyn, **{kind: fn}, positions="kept")
        assert not cert.passed and "FAIL" not in {x.status for x in cert.lines}  # refused, not failed
        assert lines_of(cert, "phase")[0].status == REFUSED
        assert "dynamic" in lines_of(cert, "phase")[0].detail
    assert audit(dyn, compact=inplace_compact, positions="original").passed


# -- teeth: each defect fails exactly its lines --------------------------------------------------------------------

TEETH = [
    # (target, kind, positions, model, failing lines, words in the first failing line)
        # A press that forgot to re-rotate does not refuse dynamic NTK either.
    ("not_rerotated", "compact", "kept", "tiny-llama", {"phase", "refusal"}, "they follow positions=original"),
    ("off_by_one", "compact", "kept", "tiny-llama", {"phase", "keep all"}, "angle wrong"),
    ("half_on_interleaved", "compact", "kept", "tiny-cohere", {"phase"}, "wrong"),
    ("full_rotary", "compact", "kept", "tiny-phi", {"phase"}, "wrong"),
    ("global_base_everywhere", "compact", "kept", "tiny-gemma3", {"phase"}, "sliding_attention"),
    ("one_inv_freq", "compact", "kept", "tiny-gemma3", {"phase"}, "wrong"),
    ("in_place_at_kept", "compact", "original", "tiny-llama", {"length"}, "the gap n - kept is 24"),
    ("assigned_layers", "compact", "kept", "tiny-llama",
     {"length", "keep all"} if ASSIGNED_LAYERS_READ_EMPTY else set(), "never initialized"),
    ("plain_sliding_layers", "compact", "kept", "tiny-gemma3", {"length"}, ""),
    ("trims_its_input", "compact", "kept", "tiny-llama", {"by reference"}, "input layer"),
    ("next_tokens", "compact", "kept", "tiny-llama", {"kept tokens", "phase", "values", "keep all"}, "keep asks for"),
    ("press_at_kept", "press", "original", "tiny-llama", {"length"}, "the gap n - kept is 24"),
    ("press_leaving_a_hook", "press", "original", "tiny-llama", {"by reference"}, "hooks"),
]  # fmt: skip


#: Lines a defect may fail too, by release: transformers' own sliding layer, holding fewer tokens than it counts,
#: makes 5.x's attention raise (so the sliding window line cannot read it either), while 4.x builds its mask
#: another way and reads the next token, silently, at other positions (only the length line sees it).
ALSO = {"plain_sliding_layers": {"sliding window"}}


@pytest.mark.parametrize("name, kind, positions, model, named, words", TEETH, ids=[t[0] for t in TEETH])
def test_each_wrong_compaction_fails_exactly_its_lines(name, kind, positions, model, named, words):
    cert = certificate(model, kind, name, positions)
    assert named <= failing(cert) <= named | ALSO.get(name, set()), cert.table(verbose=True)
    if named:
        first = next(x for x in cert.lines if x.failed)
        assert words in first.scope + " " + first.detail, first.detail


@pytest.mark.parametrize(
    "name, kind, positions, named",
    [
        # Kept in place in a plain cache: generate would land at kept, the store's own reader passes n.
        ("press_at_kept", "press", "original", set()),
        ("in_place_at_kept", "compact", "original", set()),
        # Passing positions fixes no phase: keys kept in place, declared re-rotated.
        ("press_at_kept", "press", "kept", {"phase", "refusal"}),
    ],
)
def test_a_reader_that_passes_its_own_positions_is_read_as_it_reads(name, kind, positions, named):
    """``reader="explicit"`` (kvpress's pipeline): the length line reads at the declared position, and says what
    a generate on top would do; a wrong phase still fails."""
    cert = audit(tiny("tiny-llama"), **{kind: getattr(T, name)}, positions=positions, reader="explicit")
    assert failing(cert) == named, cert.table(verbose=True)
    if not named:
        length = lines_of(cert, "length")[0]
        assert "positions passed by the reader" in length.scope
        assert "a reader taking positions from the cache (generate) would land at 24" in length.detail
        assert "the gap n - kept is 24" in length.detail and length.value <= length.bound


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-phi"])
def test_a_press_keeping_a_prefix_in_place_passes_and_has_nothing_to_refuse(model):
    """A crop is ``kept`` with no key turned: the refusal line is n/a on dynamic NTK, not a failure; a press
    that keeps other tokens and does not raise there still fails it (the not-re-rotated teeth above)."""
    cert = audit(tiny(model), press=T.crop_press, positions="kept")
    assert not failing(cert), cert.table(verbose=True)
    refusal = lines_of(cert, "refusal")[0]
    assert refusal.status == NA and "kept a prefix" in refusal.detail
    assert lines_of(certificate("tiny-llama", "compact", "not_rerotated", "kept"), "refusal")[0].failed

    def last_half(model, input_ids):  # keeps the later half and refuses nothing
        cache = prefill_ids(LoadedModel(model, None, "audited", model.config), input_ids)
        n = cache.get_seq_length()
        keep = [torch.arange(n // 2, n).expand(1, x.keys.shape[1], -1).clone() for x in cache.layers]
        return T._compact(cache, keep, model, rerotate=False)

    assert lines_of(audit(tiny(model), press=last_half, positions="kept"), "refusal")[0].failed


def test_global_base_fails_the_sliding_layers_only():
    cert = certificate("tiny-gemma3", "compact", "global_base_everywhere", "kept")
    status = {x.scope.split(" layers")[0]: x.status for x in lines_of(cert, "phase")}
    assert status == {"full_attention": PASS, "sliding_attention": "FAIL"}


# -- kvlab's compaction itself -------------------------------------------------------------------------------------


def _keep_first(cache, k):
    return [torch.arange(k).expand(1, layer.keys.shape[1], -1).clone() for layer in cache.layers]


@pytest.mark.parametrize("positions", ["kept", "original"])
def test_keeping_every_token_gives_the_input_back_bit_for_bit(positions):
    m = tiny("tiny-gemma3")
    cache = prefill_ids(m, torch.arange(3, 43))
    keep = [torch.arange(40 - layer.keys.shape[-2], 40).expand(1, layer.keys.shape[1], -1) for layer in cache.layers]
    out = compact(cache, keep, m, positions=positions)
    assert out.get_seq_length() == 40
    for a, b in zip(out.layers, cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@torch.inference_mode()
def test_in_place_compaction_reads_the_next_token_at_n_as_explicit_positions_do():
    """Independent of kvlab's layers: the first k tokens kept in place read as a plain cache of them, read at n."""
    m = tiny("tiny-llama")
    n, k = 40, 25
    cache = prefill_ids(m, torch.arange(5, 5 + n))
    probe = torch.tensor([[7]])
    got = forward(m.model, compact(cache, _keep_first(cache, k), m, positions="original"), input_ids=probe)

    def plain() -> DynamicCache:
        out = DynamicCache(config=m.config)
        for li, layer in enumerate(cache.layers):
            out.update(layer.keys[..., :k, :].clone(), layer.values[..., :k, :].clone(), li)
        return out

    want = forward(m.model, plain(), input_ids=probe, position_ids=torch.tensor([[n]]))
    assert torch.allclose(got.logits, want.logits, atol=1e-6, rtol=0)
    wrong = forward(m.model, plain(), input_ids=probe)  # what generate reads on a plain cache: position k
    assert not torch.allclose(wrong.logits, want.logits, atol=1e-4, rtol=0)


def test_bad_keep_lists_are_refused_by_name_and_nothing_changes():
    m = tiny("tiny-llama")
    cache = prefill_ids(m, torch.arange(3, 23))
    before = [layer.keys.clone() for layer in cache.layers]
    good = _keep_first(cache, 5)
    cases = [
        (good[:-1], "one tensor per layer"),
        ([k.flip(-1) for k in good], "strictly ascending"),
        ([k + 30 for k in good], "holds 0..19"),
        ([k.float() for k in good], "integer tensor"),
        ([k[:, :1] for k in good], "needs [1, 2, kept >= 1]"),
    ]
    for keep, words in cases:
        with pytest.raises(CompactError, match=words.replace("[", r"\[").replace(".", r"\.")):
            compact(cache, keep, m)
    with pytest.raises(CompactError, match="positions must be one of"):
        compact(cache, good, m, positions="moved")
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        dyn = tiny("tiny-dynamic")
        compact(prefill_ids(dyn, torch.arange(3, 23)), good, dyn)
    assert all(torch.equal(a.keys, b) for a, b in zip(cache.layers, before, strict=True))


# -- bad targets and the command -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(compact=rerotate_compact), "positions must be one of"),
        (dict(press=key_norm_press, positions="moved"), "positions must be one of"),
        (dict(merge=T.store_compact, positions="kept"), "positions applies to a compaction or a press"),
        (dict(compact=lambda cache: cache, positions="kept"), "the compact contract calls it as"),
        (dict(press=lambda model, ids, extra: None, positions="kept"), "the press contract calls it as"),
        (dict(press=lambda model, ids: [], positions="kept"), "not a transformers.DynamicCache"),
        (dict(press=key_norm_press, positions="original", reader="generate"), "reader must be one of"),
        (dict(merge=T.store_compact, reader="explicit"), "reader applies to a compaction or a press"),
    ],
)
def test_bad_targets_are_refused_by_name(kwargs, words):
    with pytest.raises(AuditTargetError, match=words):
        audit(tiny("tiny-llama"), **kwargs)


def test_an_exception_in_the_compaction_is_its_failing_line():
    def raises(cache, keep, model):
        raise RuntimeError("the scorer ran out of heads")

    cert = audit(tiny("tiny-llama"), compact=raises, positions="kept")
    phase = lines_of(cert, "phase")[0]
    assert phase.failed and "the scorer ran out of heads" in phase.detail and "in raises" in phase.detail


def test_cli_audits_a_compaction_with_exit_codes_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    out = tmp_path / "cert.json"
    argv = ["certify", "tiny-llama", "--compact", "kvlab.testing:rerotate_compact", "--positions", "kept"]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["passed"] is True
    assert main(["certify", "tiny-llama", "--press", "kvlab.testing:key_norm_press", "--positions", "original"]) == 0
    bad = ["certify", "tiny-llama", "--compact", "compact_targets:off_by_one", "--positions", "kept"]
    assert main(bad) == 1
    assert "angle wrong" in capsys.readouterr().out
    assert main(["certify", "tiny-llama", "--compact", "kvlab.testing:rerotate_compact"]) == 2
    assert "need --positions" in capsys.readouterr().err


# -- on a real model -----------------------------------------------------------------------------------------------

REAL_TEETH = [
    ("not_rerotated", "compact", "kept", {"phase", "refusal"}),
    ("off_by_one", "compact", "kept", {"phase", "keep all"}),
    ("in_place_at_kept", "compact", "original", {"length"}),
    ("press_at_kept", "press", "original", {"length"}),
]


@pytest.mark.real
def test_on_smollm2_kvlabs_compaction_passes_and_each_defect_fails_its_lines(smollm2):
    assert audit(smollm2, compact=rerotate_compact, positions="kept").passed
    for name, kind, positions, named in REAL_TEETH:
        cert = audit(smollm2, **{kind: getattr(T, name)}, positions=positions)
        assert failing(cert) == named, (name, cert.table(verbose=True))


@pytest.mark.real
def test_on_smollm2_the_explicit_reader_is_read_where_it_reads(smollm2):
    """A press kept in place in a plain cache, whose reader passes n (kvpress's pipeline), passes; the same
    cache read where generate reads it (positions from the cache, at kept) is far off, so the read has teeth."""
    cert = audit(smollm2, press=T.press_at_kept, positions="original", reader="explicit")
    assert not failing(cert), cert.table(verbose=True)
    length = lines_of(cert, "length")[0]
    assert length.value <= length.bound and "would land at" in length.detail
    by_cache = lines_of(audit(smollm2, press=T.press_at_kept, positions="original"), "length")[0]
    assert by_cache.failed and by_cache.value > 100 * length.bound, by_cache.detail
