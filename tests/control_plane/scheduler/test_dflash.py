"""The DFlash arm of step_mtp, planning only, with a fake DFlash-capable Model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control_plane.scheduler.arms import step_mtp
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.widths import DFlashRung
from tests.control_plane.scheduler.test_step import NO_ENV, seqs
from tests.fake_model import FakeModel

WIDE = (8,) * 8


def ctx(model: FakeModel, **opts) -> StepContext:
    return StepContext.build(model.capabilities(), replace(NO_ENV, dflash=True, **opts))


def test_gamma_resolver() -> None:
    rung = DFlashRung()
    assert [rung.drafts_for(n, 8) for n in (1, 4, 5, 8, 9, 16, 17, 40)] == [8, 8, 6, 6, 4, 4, 3, 3]
    assert rung.drafts_for(2, 5) == 5, "never above the serve-wide count"
    assert DFlashRung(pinned=True).drafts_for(20, 8) == 8
    assert rung.drafts_for(20, 2) == 2, "a count below 3 is left alone"


def test_pinned_by_flag_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = FakeModel(caps=WIDE).capabilities()
    assert not StepContext.build(caps, NO_ENV).dflash_rung.pinned
    assert StepContext.build(caps, replace(NO_ENV, dflash_gamma=8)).dflash_rung.pinned
    monkeypatch.setenv("METRALE_DFLASH_STATIC_GAMMA", "1")
    assert StepContext.build(caps, NO_ENV.with_env(Env.read())).dflash_rung.pinned


def test_batches_equal_gamma_in_slot_order() -> None:
    model = FakeModel(caps=WIDE)
    active = seqs(model, 4, drafts=[8, 8, 5, 8])
    active.reverse()
    report = step_mtp(model, active, ctx(model), 8)
    assert report.batched_calls == [[9, 9, 9]] and report.serial_arms == ["DFlash"]
    assert model.verify_calls()[0][2] == [0, 1, 3], "slot order"
    assert not report.dcut, "no D-Cut in the DFlash arm"


def test_m_max_shrinks_and_a_trailing_single_goes_serial() -> None:
    model = FakeModel(caps=WIDE, max_batch=2)
    report = step_mtp(model, seqs(model, 5, drafts=[4] * 5), ctx(model), 8)
    assert report.batched_calls == [[5, 5], [5, 5]] and report.serial_arms == ["DFlash"]


def test_a_group_past_the_row_budget_goes_serial_whole() -> None:
    model = FakeModel(caps=WIDE, max_rows=9)  # two verifies of 5 rows take 10
    report = step_mtp(model, seqs(model, 3, drafts=[4] * 3), ctx(model), 8)
    assert report.dflash_declined and report.serial_arms == ["DFlash"] * 3


@pytest.mark.parametrize("lever", ["dflash_batch_verify", "batch_verify"])
def test_switched_off(lever: str) -> None:
    model = FakeModel(caps=WIDE)
    report = step_mtp(model, seqs(model, 3, drafts=[4] * 3), ctx(model, **{lever: False}), 8)
    assert report.batched_calls == [] and report.serial_arms == ["DFlash"] * 3


def test_bootstrap_then_batch_and_no_prompt_lookup() -> None:
    model = FakeModel(caps=WIDE)
    active = seqs(model, 3, drafts=[4, 4, 0])
    report = step_mtp(model, active, ctx(model, prompt_lookup=True), 8)
    assert report.bootstrap == "serial" and report.batched_calls == [[5, 5]]
    assert not any(report.copied)
    # The bootstrapped sequence proposes the resolved gamma (8 for 3 active) at once.
    assert len(active[2].pending_drafts) == 8


def test_batched_bootstrap_and_grammar_in_the_dflash_arm() -> None:
    from control_plane.text.grammar import GrammarCompiler
    from control_plane.text.tokenizer import ByteTokenizer

    model = FakeModel(caps=WIDE)
    fresh = seqs(model, 2)
    assert step_mtp(model, fresh, ctx(model), 8).bootstrap == "batched"
    compiler = GrammarCompiler(ByteTokenizer.default(), 320, (257,))
    model = FakeModel(caps=WIDE)
    active = seqs(model, 3, drafts=[4, 4, 4])
    active[0].grammar = compiler.compile("regex", "[0-9]*")  # its drafts (2, 3, ...) fall
    active[1].grammar = compiler.compile("regex", "[0-9]*")
    active[1].pending_drafts = []  # nothing pending: it bootstraps
    report = step_mtp(model, active, ctx(model), 8)
    assert active[0].stats.grammar_truncations == 1
    # Every draft fell to the grammar: it verifies its last token alone, as a bootstrap does.
    assert len(active[0].generated) == 2 and active[0].stats.drafted == 0
    assert report.dflash_declined, "one batchable sequence cannot batch"
    assert report.serial_arms == ["K1", "DFlash"]
    assert report.bootstrap == "serial" and len(active[1].generated) == 2


def test_dflash_requests_take_the_arm_beside_mtp_ones() -> None:
    """Without --dflash, requests with method dflash take the DFlash arm at the block's gamma
    (the resolver's 8 for four sequences, not the serve-wide 3) and mtp requests the MTP
    arms, in one step; the MTP widths learn nothing from the DFlash drafts."""
    from control_plane.scheduler.seq import ModelFacts
    from protos.params import DFLASH

    model = FakeModel(caps=(8,) * 8, dflash_block=16)
    blocks = seqs(model, 2, drafts=[8, 8], method=DFLASH)
    heads = seqs(model, 2, drafts=[3, 3])
    facts = ModelFacts.of(model.capabilities())
    for a in blocks:
        a.facts = facts
    c = StepContext.build(model.capabilities(), NO_ENV)
    report = step_mtp(model, [heads[0], blocks[0], heads[1], blocks[1]], c, 3)
    assert [9, 9] in report.batched_calls and [4, 4] in report.batched_calls
    assert all(len(a.pending_drafts) == 8 for a in blocks)
    assert all(len(a.pending_drafts) == 3 for a in heads)
    assert c.calibration.by_position and len(c.calibration.by_position) == 3
