"""Every branch of `step_mtp`'s core, driven by a fake `Model` with chosen outputs."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from control_plane.scheduler.arms import (
    canonical_assignment,
    serial_verify_plan,
    step_mtp,
    verify_batch_permutation,
)
from control_plane.scheduler.bootstrap import chunk_ranges
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.scheduler.verdict import accepted
from control_plane.scheduler.widths import LOW, CostTable, Ladder, clamp_drafts_to_slot_capacity
from control_plane.text.tokenizer import ByteTokenizer
from protos.params import DFLASH, MTP, NONE
from tests.fake_model import FakeModel, counting_oracle

NO_ENV = SchedulerOptions()  # the defaults, untouched by any METRALE_* switch


def seqs(
    model: FakeModel, n: int, drafts: list[int] | None = None, method: str = MTP, max_new: int = 100
) -> list[ActiveSeq]:
    """n admitted sequences, prefilled with [10*i], each holding `drafts[i]` correct drafts."""
    out = []
    for i in range(n):
        req = GenRequest(str(i), (10 * i,), max_new, method=method)
        a = ActiveSeq(
            req,
            lambda ev: None,
            ByteTokenizer.default(),
            ModelFacts(model.max_context, eos_ids=(257,)),
        )
        a.handle = model.alloc_sequence()
        a.last = model.prefill([a.handle], [[10 * i]]).argmax[0]
        a.generated.append(a.last)
        held = drafts[i] if drafts else 0
        a.pending_drafts = [(a.last + j + 1) % 256 for j in range(held)]
        a.pending_conf = [0.9] * held
        out.append(a)
    model.calls.clear()
    return out


def ctx(model: FakeModel, **opts) -> StepContext:
    return StepContext.build(model.capabilities(), replace(NO_ENV, **opts))


def options(env: Env) -> SchedulerOptions:
    return NO_ENV.with_env(env)


# -- width ---------------------------------------------------------------------------------


def test_ladder_rungs_and_above_the_last() -> None:
    ladder = Ladder.parse("4:3,8:3,16:1,32:1")
    assert [ladder.drafts_for(n, 3) for n in (1, 4, 5, 8, 9, 16, 17, 32)] == [3] * 4 + [1] * 4
    assert ladder.drafts_for(33, 3) == 1 and ladder.drafts_for(1000, 3) == 1, "last rung holds"
    assert ladder.drafts_for(2, 2) == 2, "clamped to num_drafts"
    assert Ladder.parse("4:0").drafts_for(1, 3) == 1, "clamped up to 1"
    assert ladder.drafts_for(2, 0) == 0, "--num-drafts 0 turns drafting off"
    assert Ladder.parse("4:1", enabled=False).drafts_for(2, 3) == 3
    with pytest.raises(ValueError, match="ascending"):
        Ladder.parse("8:3,4:1")
    with pytest.raises(ValueError, match="ACTIVE:DRAFTS"):
        Ladder.parse("4-3")
    with pytest.raises(ValueError, match="ACTIVE >= 1"):
        Ladder.parse("0:3")
    with pytest.raises(ValueError, match="K ladder rung 'x:1'"):
        SchedulerOptions(k_ladder="x:1")  # refused when the options are made


def test_env_ladder_override_and_disable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_MTP_K_LADDER", "2:2,64:1")
    caps = FakeModel().capabilities()
    assert StepContext.build(caps, options(Env.read())).rung.ladder.drafts_for(2, 3) == 2
    monkeypatch.setenv("METRALE_NO_MTP_K_LADDER", "1")
    assert StepContext.build(caps, options(Env.read())).rung.ladder.drafts_for(30, 3) == 3


def test_env_switches_override_options_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("METRALE_NO_MTP_DCUT", "METRALE_NO_FUSED_STEP"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("METRALE_DFLASH_BATCH_VERIFY", "0")
    monkeypatch.setenv("METRALE_NO_MTP_BATCH_VERIFY", "0")  # "0" leaves a switch off
    opts = SchedulerOptions(dcut_threshold=0.5).with_env(Env.read())
    assert (opts.dcut, opts.fused_step, opts.dflash_batch_verify) == (False, False, False)
    assert opts.batch_verify and opts.dcut_threshold == 0.5, "the rest stand"
    assert SchedulerOptions().with_env(Env()) == SchedulerOptions()
    every = Env(**{f.name: "1:1" if f.default is None else not f.default for f in fields(Env)})
    assert set(every.overrides()) <= {f.name for f in fields(SchedulerOptions)}
    assert len(every.overrides()) == len(fields(Env)), "each variable sets its own option"


def test_width_clamped_to_smallest_slot_capacity() -> None:
    assert clamp_drafts_to_slot_capacity(3, [3, 2, 3]) == 2
    model = FakeModel(caps=(3, 1, 3, 3))
    active = seqs(model, 2)
    assert step_mtp(model, active, ctx(model), 3).ladder_nd == 1
    assert all(len(a.pending_drafts) == 1 for a in active)


# -- bootstrap -----------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "two-calls"])
def test_bootstrap_batched(fused: bool) -> None:
    model = FakeModel()
    active = seqs(model, 3)
    report = step_mtp(model, active, ctx(model, fused_step=fused), 3)
    assert report.bootstrap == "batched"
    assert model.names() == ["verify", "stash", "fold", "commit", "propose", "trim"]
    assert model.verify_calls()[0][1] == [1, 1, 1]
    assert len(model.steps()) == int(fused), "one decode_step call, or none with the lever off"
    assert all(len(a.pending_drafts) == 3 for a in active)


def test_bootstrap_serial_for_one_sequence() -> None:
    model = FakeModel()
    assert step_mtp(model, seqs(model, 1), ctx(model), 3).bootstrap == "serial"


def test_bootstrap_serial_when_switched_off() -> None:
    model = FakeModel()
    report = step_mtp(model, seqs(model, 3), ctx(model, batch_bootstrap=False), 3)
    assert report.bootstrap == "serial"
    assert [c[1] for c in model.verify_calls()] == [[1], [1], [1]]


def test_bootstrap_serial_past_the_stash_width() -> None:
    model = FakeModel(max_batch=2)
    assert step_mtp(model, seqs(model, 3), ctx(model), 3).bootstrap == "serial"


def test_none_method_decodes_one_token_without_propose() -> None:
    model = FakeModel()
    active = seqs(model, 2, method=NONE)
    step_mtp(model, active, ctx(model), 3)
    assert "propose" not in model.names()
    assert [len(a.generated) for a in active] == [2, 2] and not active[0].pending_drafts


# -- batched verify ------------------------------------------------------------------------


def test_batched_verify_in_slot_order_with_truncation() -> None:
    model = FakeModel()
    active = seqs(model, 3, drafts=[3, 5, 3])
    active.reverse()  # arrival order differs from slot order
    report = step_mtp(model, active, ctx(model), 3)
    assert report.batched_calls == [[4, 4, 4]]
    assert model.verify_calls()[0][2] == [0, 1, 2], "ascending slot"
    # All drafts were right: 3 accepted + the bonus each, plus the prefill token.
    assert [len(a.generated) for a in active] == [5, 5, 5]
    assert [a.stats.accepted for a in active] == [3, 3, 3]


def test_chunks_follow_the_row_budget() -> None:
    model = FakeModel(max_rows=8)
    report = step_mtp(model, seqs(model, 4, drafts=[3] * 4), ctx(model), 3)
    assert report.batched_calls == [[4, 4], [4, 4]]


def test_trailing_lone_chunk_goes_serial() -> None:
    model = FakeModel(max_rows=8)
    report = step_mtp(model, seqs(model, 3, drafts=[3] * 3), ctx(model), 3)
    assert report.batched_calls == [[4, 4]] and report.serial_arms == ["K4"]


def test_chunks_follow_the_stash_width() -> None:
    model = FakeModel(max_batch=2)
    report = step_mtp(model, seqs(model, 3, drafts=[3] * 3), ctx(model), 3)
    assert report.batched_calls == [[4, 4]] and report.serial_arms == ["K4"]


def test_lone_sequence_with_drafts_goes_serial() -> None:
    model = FakeModel()
    active = seqs(model, 2, drafts=[3, 0])
    report = step_mtp(model, active, ctx(model), 3)
    assert report.serial_arms == ["K4"] and report.batched_calls == []


@pytest.mark.parametrize(("dcut", "order"), [(False, [4, 2, 4]), (True, [4, 4, 2])])
def test_short_chain_joins_the_batch_at_its_depth(dcut: bool, order: list[int]) -> None:
    """A sequence holding fewer drafts than the width (made at a narrower width, or near its
    budget) verifies them in the batch, and accepts them: in slot order, or with D-Cut on in
    its order, deepest first."""
    model = FakeModel()
    active = seqs(model, 3, drafts=[3, 1, 3])
    report = step_mtp(model, active, ctx(model, dcut=dcut), 3)
    assert report.batched_calls == [order] and report.serial_arms == []
    assert [a.stats.accepted for a in active] == [3, 1, 3]


def test_after_the_width_grows_the_step_stays_batched() -> None:
    """Every sequence holds the old width's one draft; the step verifies them together."""
    model = FakeModel()
    report = step_mtp(model, seqs(model, 3, drafts=[1, 1, 1]), ctx(model), 3)
    assert report.batched_calls == [[2, 2, 2]] and report.serial_arms == []


def test_batched_verify_switched_off() -> None:
    model = FakeModel()
    opts = options(Env(no_batch_verify=True))
    report = step_mtp(
        model, seqs(model, 3, drafts=[3] * 3), StepContext.build(model.capabilities(), opts), 3
    )
    assert report.batched_calls == [] and report.serial_arms == ["K4"] * 3


def test_canonical_ragged_batch_in_slot_order() -> None:
    """With D-Cut aside, sequences holding different draft counts verify in one call at
    their own depths, in canonical (ascending slot) order, not deepest first."""
    model = FakeModel()
    active = seqs(model, 3, drafts=[3, 1, 2])
    active.reverse()
    report = step_mtp(model, active, ctx(model, dcut=False), 3)
    assert report.batched_calls == [[4, 2, 3]] and not report.dcut
    assert model.verify_calls()[0][2] == [0, 1, 2], "ascending slot"
    assert [a.stats.accepted for a in reversed(active)] == [3, 1, 2]


# -- --mtp-max-seqs ------------------------------------------------------------------------


def _width_source(model: FakeModel, source: str, mtp_max_seqs: int) -> StepContext:
    """A context whose width comes from `source`, set up to draft."""
    opts = replace(NO_ENV, mtp_max_seqs=mtp_max_seqs, spec_cost_slack=0.0)
    costs = CostTable(model.measure_costs([1, 2, 4, 8, 16], 3)[0])
    c = StepContext.build(model.capabilities(), opts, costs if source == "cost-model" else None)
    for _ in range(64):  # first drafts that stand: the rung rises, the cost model drafts
        c.rung.observe(1, 1)
        c.calibration.observe(3, 3)
    assert c.rung.raised
    return c


@pytest.mark.parametrize("source", ["static-ladder", "adaptive-rung", "cost-model"])
def test_above_mtp_max_seqs_steps_decode_plainly(source: str) -> None:
    """Whichever source sets the width, more active sequences than the cap plain-decode;
    at the cap each drafts its own width."""
    n = LOW  # the adaptive rung's range: the ladder drafts 1 and the risen rung 2
    widths = {}
    for cap in (n - 1, n):
        model = FakeModel(caps=(3,) * n)
        active = seqs(model, n)
        c = _width_source(model, source, cap)
        if source == "static-ladder":
            c.rung.enabled = False
        widths[cap] = step_mtp(model, active, c, 3).ladder_nd
        assert ("propose" in model.names()) == (widths[cap] > 0)
    drafting = {"static-ladder": 1, "adaptive-rung": 2, "cost-model": 3}[source]
    assert widths == {n - 1: 0, n: drafting}


def test_above_mtp_max_seqs_no_drafts_are_proposed() -> None:
    model = FakeModel()
    active = seqs(model, 3, drafts=[0, 0, 0])
    report = step_mtp(model, active, ctx(model, mtp_max_seqs=2), 3)
    assert report.ladder_nd == 0 and "propose" not in model.names()
    assert [len(a.generated) for a in active] == [2, 2, 2]
    assert all(a.pending_drafts == [] for a in active)


def test_mtp_max_seqs_1_verifies_serially() -> None:
    model = FakeModel()
    report = step_mtp(model, seqs(model, 1, drafts=[3]), ctx(model, mtp_max_seqs=1), 3)
    assert report.ladder_nd == 3 and report.serial_arms == ["K4"]


def test_partial_accept_verdict() -> None:
    """Drafts wrong from the second on: one accepted, the bonus is the oracle's token."""
    model = FakeModel()
    active = seqs(model, 2, drafts=[3, 3])
    active[0].pending_drafts[1] = 999 % 256
    step_mtp(model, active, ctx(model), 3)
    assert [c for c in model.calls if c[0] in ("stash", "fold", "commit")] == [
        ("stash", [1, 7]),
        ("fold", [2, 4]),
        ("commit", [2, 4]),
    ]
    first = active[0]
    assert first.generated == [1, 2, 3] and first.last == 3
    assert first.stats.drafted == 3 and first.stats.accepted == 1


# -- plans and orders ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "nd", "plan"),
    [
        (1, 3, (1, "K2")),
        (2, 3, (2, "K3")),
        (3, 3, (3, "K4")),
        (5, 3, (3, "K4")),
        (5, 5, (5, "KN")),
        (3, 0, (0, "none")),
    ],
)
def test_serial_verify_plan(held: int, nd: int, plan: tuple[int, str]) -> None:
    assert serial_verify_plan(held, nd) == plan


def test_serial_arms_by_draft_count() -> None:
    model = FakeModel(caps=(5,) * 4)
    active = seqs(model, 4, drafts=[1, 2, 3, 5])
    report = step_mtp(model, active, ctx(model, fixed_width=True, batch_verify=False), 5)
    assert report.serial_arms == ["K2", "K3", "K4", "KN"]


def test_chunk_ranges() -> None:
    assert chunk_ranges([4, 4, 4], 64, 8) == [(0, 3)]
    assert chunk_ranges([4, 4, 4], 8, 8) == [(0, 2), (2, 3)]
    assert chunk_ranges([4, 4, 4], 64, 2) == [(0, 2), (2, 3)]
    assert chunk_ranges([9, 2], 8, 8) == [(0, 1), (1, 2)], "an oversized k stands alone"
    assert chunk_ranges([], 8, 8) == []


def test_verify_batch_permutation() -> None:
    assert verify_batch_permutation([5, 1, 3], [2, 4, 3], True) == [1, 2, 0]
    assert verify_batch_permutation([5, 1, 3], [2, 3, 3], False) == [1, 2, 0]
    assert verify_batch_permutation([5, 1, 3], [4, 2, 3], False) == [0, 2, 1]
    assert canonical_assignment(8)


def test_accepted() -> None:
    assert accepted([9, 1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted([9, 1, 5, 3], [1, 2, 3, 4]) == 1
    assert accepted([9], [4]) == 0
    assert counting_oracle((7,)) == 8


# -- grammar rows in the batched verify ----------------------------------------------------


def _constrained(
    model: FakeModel, patterns: list[str], drafts: list[int], method: str = MTP
) -> list[ActiveSeq]:
    from control_plane.text.grammar import GrammarCompiler

    compiler = GrammarCompiler(ByteTokenizer.default(), 320, (257,))
    active = seqs(model, len(patterns), drafts=drafts, method=method)
    for a, pattern in zip(active, patterns, strict=True):
        a.grammar = compiler.compile("regex", pattern)
    return active


def _masked_rows(model: FakeModel) -> list[int]:
    seen: list[int] = []
    verify = model.decode_verify_batched

    def spy(*args, masks=None, **kwargs):
        seen.append(len(masks or {}))
        return verify(*args, masks=masks, **kwargs)

    model.decode_verify_batched = spy  # type: ignore[method-assign]
    return seen


def test_constrained_sequences_verify_in_one_batch_with_their_masks() -> None:
    model = FakeModel(caps=(4,) * 4)
    masked = _masked_rows(model)
    anything = "[\\x00-\\x7f]*"
    active = _constrained(model, [anything] * 3, [3, 3, 3])
    report = step_mtp(model, active, ctx(model), 3)
    assert report.serial_arms == [] and report.batched_calls == [[4, 4, 4]]
    assert masked[0] == 12, "every row of the batch carries its sequence's mask"
    assert all(a.stats.accepted == 3 for a in active), "the masks keep what the model says"
    assert [c[0] for c in model.calls].count("step") == 1, "greedy masked rows: one round trip"


def test_a_constrained_sequence_joins_at_the_depth_its_grammar_leaves() -> None:
    model = FakeModel(caps=(4,) * 4)
    # Sequence 0 holds drafts 2, 3, 4 after its token 1: "[\x00-\x02]*" keeps the first;
    # sequence 2's grammar refuses its first (22 after 21): a one-row verify.
    patterns = ["[\\x00-\\x02]*", "[\\x00-\\x7f]*", "[\\x00-\\x15]*"]
    active = _constrained(model, patterns, [3] * 3)
    report = step_mtp(model, active, ctx(model), 3)
    assert report.serial_arms == [] and sorted(report.batched_calls[0]) == [1, 2, 4]
    assert active[0].stats.grammar_truncations == 1 and active[2].stats.drafted == 0
    assert active[0].generated[1] == 2 and active[0].generated[2] <= 2, "masked past it"


def test_constrained_dflash_sequences_of_other_counts_batch_together() -> None:
    model = FakeModel(caps=(8,) * 4)
    anything = "[\\x00-\\x7f]*"
    # Drafts after 1, 11, 21: the first keeps 4, the others 1 (12) and 2 (22, 23); no
    # unconstrained sequence sets a gamma, so all three verify at their own depths.
    patterns = [anything, "[\\x00-\\x0c]*", "[\\x00-\\x17]*"]
    active = _constrained(model, patterns, [4, 4, 4], DFLASH)
    report = step_mtp(model, active, ctx(model), 4)
    assert report.batched_calls == [[5, 2, 3]] and report.serial_arms == []
