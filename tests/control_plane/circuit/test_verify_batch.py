"""`met circuit diff --verify-batch`: its helpers, its verdicts, and its report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from control_plane.circuit.compare import Run, Step, compare, ulp_distance
from control_plane.circuit.report import SCHEMA, build_report, run_diff
from control_plane.circuit.shapes import (
    batch_shapes,
    capped,
    corrupted_draft,
    dedup,
    drafts,
    slot_caps,
    slot_of,
)
from control_plane.circuit.verify_batch import DiffError, ShapeReport, verify_batch_failures
from control_plane.cli.launch import start_gpu_service, stop
from control_plane.scheduler.verdict import offsets
from gpu_service.engine.facade import Engine
from gpu_service.engine.graphs import replay_eagerly
from gpu_service.model.config import ServiceConfig
from gpu_service.model.state import DeviceState
from met.main import build_parser
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import Logits

# Slow: runs whole verify batches through both forwards.
pytestmark = pytest.mark.slow


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["circuit", "diff", "--verify-batch", *extra])


# -- helpers -------------------------------------------------------------------------------


def test_batch_shapes_deepest_first_then_one_ragged_mix() -> None:
    assert batch_shapes(2, [4]) == [[4, 4]]
    assert batch_shapes(7, [2, 4, 3]) == [[4] * 7, [3] * 7, [2] * 7, [4, 4, 4, 3, 3, 2, 2]]
    assert len(batch_shapes(2, [2, 3, 4])) == 3, "too few sequences to mix"
    assert batch_shapes(3, [2, 2]) == [[2, 2, 2]]


def test_caps_slots_offsets_dedup() -> None:
    assert capped([4, 4, 4], [4, 3, 2]) == [4, 3, 2]
    assert [slot_of(i, 5, False) for i in range(5)] == [0, 1, 2, 3, 4]
    assert [slot_of(i, 5, True) for i in range(5)] == [0, 1, 3, 4, 5]
    assert offsets([4, 3, 2]) == [0, 4, 7, 9]
    assert dedup([[2, 2], [2, 2], [3, 2], [2, 2]]) == [[2, 2], [3, 2], [2, 2]]


def test_slot_caps_clamp_to_num_drafts() -> None:
    tiers = (3, 3, 2, 2, 1)
    assert slot_caps(tiers, 3, False, 5) == [4, 4, 3], "the slots' capacities"
    assert slot_caps(tiers, 3, True, 5) == [4, 3, 3], "the spare slot before sequence 1"
    assert slot_caps(tiers, 3, False, 2) == [3, 3, 3], "no more drafts than a step has"
    assert slot_caps(tiers, 3, False, 1) == [2, 2, 2]


def test_draft_corruption() -> None:
    greedy = list(range(100, 120))
    assert drafts(greedy, 0, 0, 0, 4, 320) == [101, 102, 103], "even: untouched"
    assert corrupted_draft(1, 0, 4) == 0 and corrupted_draft(3, 0, 4) == 1
    assert drafts(greedy, 2, 3, 0, 4, 320) == [103, 105, 105]
    assert drafts([5, 319], 0, 1, 0, 2, 320) == [0], "wraps at the vocabulary"
    assert corrupted_draft(1, 0, 1) is None, "no drafts to corrupt"


def test_ulp_and_compare() -> None:
    a = torch.tensor([1.0, -2.0, 0.0]).numpy().tobytes()
    b = torch.tensor([1.0, -2.0, 0.0]).nextafter(torch.tensor(9.0)).numpy().tobytes()
    assert ulp_distance(a, a, "float32") == 0 and ulp_distance(a, b, "float32") == 1
    c = torch.tensor([1.0, -2.0, 1e-45]).numpy().tobytes()
    assert ulp_distance(a, c, "float32") == 1, "across zero counts representable values"
    ref = Run(a, [0], [Step(a, [0, 1, 2])], [3], "float32", [1.0], [1.0])
    run = Run(a, [0], [Step(b, [0, 1, 1])], [3], "float32", [1.0], [1.0])
    cmp = compare("x", ref, run)
    assert (cmp.mismatched_steps, cmp.first_mismatch, cmp.max_ulp) == (1, 0, 1)
    assert cmp.argmax_agreement == pytest.approx(2 / 3)


def test_thin_shapes_fail() -> None:
    def shape(accepted: list[list[int]]) -> ShapeReport:
        ok = compare("x", *(Run(b"", [], [], [2, 2], "float32", [], []),) * 2)
        one, two = (torch.tensor([x]).numpy().tobytes() for x in (1.0, 2.0))
        ctl = compare(
            "ctl",
            Run(b"", [], [Step(one, [])], [2, 2], "float32", [], []),
            Run(b"", [], [Step(two, [])], [2, 2], "float32", [], []),
        )
        return ShapeReport([2, 2], accepted, [ok], [], ctl)

    assert verify_batch_failures([shape([[1, 0], [0, 1]])]) == []
    assert "0 partial" in verify_batch_failures([shape([[1, 1], [1, 1]])])[0]
    assert "0 full" in verify_batch_failures([shape([[0, 0], [0, 0]])])[0]


# -- whole runs ----------------------------------------------------------------------------


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize(
    "flags",
    [(), ("--fragment",), ("--mtp",), ("--fragment", "--mtp")],
    ids=["plain", "fragment", "mtp", "fragment-mtp"],
)
def test_passes_in_process(tiny_dir: Path, flags: tuple[str, ...], graphed: bool) -> None:
    """Graphed: the batched verify and chain replay graphs (run eagerly, the CPU has no
    capture) over padded buckets; `-serial` never does, so the PASS holds them to eager."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3,4:2,8:1", max_context=256))
    if graphed:
        engine.use_graphs(replay_eagerly)
    report = run_diff(engine, args("--widths", "2,3,5", "--ks", "2,3,4", "--steps", "6", *flags))
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["graphs"] == ("graphed" if graphed else "eager")
    if graphed:
        g = engine.choice.graphs
        assert g is not None and g.replays > 0, "the batched forward replayed graphs"
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in report["shapes"])
    # Slots 4-7 verify two drafts: the spare slot moves one more sequence onto them.
    caps = [s["ks"] for s in report["shapes"]]
    assert ([4, 4, 4, 3, 3] in caps) == ("--fragment" in flags)
    assert ([4, 4, 4, 4, 3] in caps) == ("--fragment" not in flags)
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    assert engine.capabilities().free_slots == 16
    assert engine.capabilities().current_forward == "eager"


def test_passes_beside_a_long_sequence() -> None:
    """The first sequence's prompt 400 tokens and the others' 200, so that these are verified
    in batches whose keys reach 448 while alone theirs stop at 256: the eager attention once
    summed over every key of the call, and these rows then read other bytes (this run FAILed
    before it summed block by block). The default model."""
    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig(verify_tiers="4:3", max_context=512), "fp32")
    flags = ["--widths", "3", "--ks", "2,4", "--steps", "3", "--long-prompt", "400"]
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["long_prompt"] == 400
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in report["shapes"])


@pytest.fixture(scope="module")
def served_default() -> Iterator[str]:
    proc, target = start_gpu_service(DEFAULT_MODEL_DIR)
    yield target
    stop(proc)


ACCEPTANCE = ["--widths", "2,3,5", "--ks", "2,3,4", "--steps", "6", "--forwards", "eager-serial"]


@pytest.mark.parametrize(
    "flags",
    [(), ("--fragment",), ("--mtp",), ("--fragment", "--mtp")],
    ids=["plain", "fragment", "mtp", "fragment-mtp"],
)
def test_default_model_in_process_and_served(
    tmp_path: Path, served_default: str, flags: tuple[str, ...]
) -> None:
    """The acceptance command on the default model, in process and against a served one."""
    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig())
    local = run_diff(engine, args(*ACCEPTANCE, *flags))
    assert local["verdict"] == "PASS", local["reasons"]
    out = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "met",
            "circuit",
            "diff",
            "--verify-batch",
            *ACCEPTANCE,
            *flags,
            "--gpu-service",
            served_default,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    remote = json.loads(out.read_text())
    assert remote["verdict"] == "PASS"
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in remote["shapes"])
    assert (remote["fragment_slots"], remote["drafter"]) == (
        "--fragment" in flags,
        "--mtp" in flags,
    )
    assert [s["accepted"] for s in remote["shapes"]] == [s["accepted"] for s in local["shapes"]]
    jsonschema.validate(remote, json.loads(SCHEMA.read_text()))


def _perturb(state: DeviceState, slots: list[int]) -> None:
    state.gdn[:, slots[0]] *= 1 + 1e-6


def test_perturbed_gdn_state_fails_naming_shape_and_step(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))
    engine.add_forward("eager-perturbed", _perturb)
    report = run_diff(
        engine, args("--widths", "2", "--ks", "3", "--steps", "4", "--forwards", "eager-perturbed")
    )
    assert report["verdict"] == "FAIL"
    (reason,) = report["reasons"]
    # The first fold perturbs the state; the next step's logits show it.
    assert reason.startswith("verify-batch [3, 3], eager-perturbed:")
    assert "(first at 1," in reason
    assert report["shapes"][0]["comparisons"][0]["max_ulp"] > 0


def test_ks_of_one_is_thin(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))
    report = run_diff(engine, args("--widths", "2", "--ks", "1", "--steps", "2"))
    assert report["verdict"] == "FAIL"
    assert report["reasons"] == ["verify-batch [1, 1]: 4 full and 0 partial accepts; it needs both"]


def test_a_failing_run_frees_its_sequences_and_restores_the_forward(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))

    def explode(state: DeviceState, slots: list[int]) -> None:
        raise RuntimeError("planted")

    engine.add_forward("eager-broken", explode)
    engine.set_forward("eager-serial")
    with pytest.raises(RuntimeError, match="planted"):
        run_diff(
            engine,
            args(
                "--widths",
                "3",
                "--ks",
                "2",
                "--steps",
                "2",
                "--fragment",
                "--forwards",
                "eager-broken",
            ),
        )
    caps = engine.capabilities()
    assert caps.free_slots == caps.num_slots and caps.current_forward == "eager-serial"


def test_bad_arguments(tiny_dir: Path) -> None:
    with pytest.raises(SystemExit):
        args("--widths", "1,2")
    with pytest.raises(SystemExit):
        args("--ks", "a")
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    with pytest.raises(DiffError, match="not offered"):
        run_diff(engine, args("--forwards", "cuda-graphs", "--widths", "2"))
    with pytest.raises(DiffError, match="free slots"):
        run_diff(engine, args("--widths", "5"))
    with pytest.raises(DiffError, match="at least 2"):
        run_diff(engine, args("--steps", "1"))


def test_report_fields(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    report = build_report(engine, args("--widths", "2"), [])
    assert set(report) >= {
        "graphs",
        "fragment_slots",
        "drafter",
        "steps",
        "variants",
        "shapes",
        "verdict",
        "reasons",
    }


class ConstantLogits:
    """The engine with a logits readback that never changes: every comparison sees equal
    bytes, which only the detection control can expose."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def read_logits(self) -> Logits:
        logits = self.engine.read_logits()
        return replace(logits, data=bytes(len(logits.data)))


class PerturbedPropose:
    """The engine with one bit of sequence 1's propose logits flipped under `forward`: the
    propose differs, the verify does not."""

    def __init__(self, engine: Engine, forward: str) -> None:
        self.engine, self.forward = engine, forward
        self.proposed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def run_mtp_propose_batched(self, *args: object, **kwargs: object) -> object:
        self.proposed = True
        return self.engine.run_mtp_propose_batched(*args, **kwargs)

    def read_logits(self) -> Logits:
        logits, proposed, self.proposed = self.engine.read_logits(), self.proposed, False
        if not proposed or self.engine.capabilities().current_forward != self.forward:
            return logits
        data = bytearray(logits.data)
        data[len(data) // logits.shape[0]] ^= 1  # the lowest bit of sequence 1's first logit
        return replace(logits, data=bytes(data))


def test_a_blind_comparison_fails_the_detection_control(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))
    report = run_diff(ConstantLogits(engine), args("--widths", "2", "--ks", "3", "--steps", "4"))
    assert report["verdict"] == "FAIL"
    assert report["shapes"][0]["detection_control"]["mismatched_steps"] == 0
    assert report["reasons"] == [
        "verify-batch [3, 3]: the detection control saw no difference after changing a draft"
    ]


def test_a_propose_only_mismatch_names_row_minus_one(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))
    model = PerturbedPropose(engine, "eager-serial")
    flags = ("--widths", "2", "--ks", "4", "--num-drafts", "2", "--steps", "4", "--mtp")
    report = run_diff(model, args(*flags))
    (shape,) = report["shapes"]
    assert shape["ks"] == [3, 3], "two drafts per step: no verify wider than 3 rows"
    (c,) = shape["comparisons"]
    assert (c["first_mismatch"], c["first_mismatch_sequence"], c["first_mismatch_row"]) == (
        0,
        1,
        -1,
    )
    assert c["prefill_equal"] and c["mismatched_steps"] == 4 and c["max_ulp"] == 1
    assert c["argmax_agreement"] == 1.0
    assert report["verdict"] == "FAIL"
    assert "(first at 0, sequence 1, row -1)" in report["reasons"][0]


@pytest.mark.parametrize(
    "forwards",
    [
        ("eager-serial", "eager"),
        # Slow: interprets the Triton forward through five runs of the diff.
        pytest.param(("triton-serial", "triton"), marks=pytest.mark.slow),
    ],
)
def test_a_prefix_restored_from_a_snapshot_gives_the_whole_prefills_bytes(
    tiny_dir: Path, forwards: tuple[str, str]
) -> None:
    """Each forward's run with every prompt's start (128 and 64 tokens) restored from a snapshot
    of another sequence, then the batched verifies: byte for byte its run after whole
    prefills."""
    svc = ServiceConfig(verify_tiers="4:3", max_context=512, prefix_snapshots=1)
    engine = Engine(tiny_dir, svc, "fp32")
    reference, forward = forwards
    flags = ["--widths", "2", "--ks", "3", "--steps", "2", "--long-prompt", "130", "--snapshot"]
    report = run_diff(engine, args(*flags, "--reference", reference, "--forwards", forward))
    assert report["verdict"] == "PASS", report["reasons"]
    names = [c["variant"] for s in report["shapes"] for c in s["comparisons"]]
    assert f"{reference} from a snapshot" in names and f"{forward} from a snapshot" in names
    assert engine.slots.blocks.num_used == 0 and engine.prefixes.num_held == 0


def test_the_snapshot_case_needs_whole_blocks_and_snapshots(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=512))
    with pytest.raises(DiffError, match="--snapshot needs --long-prompt of at least 130"):
        run_diff(engine, args("--widths", "2", "--snapshot", "--long-prompt", "100"))
    with pytest.raises(DiffError, match="holds no prefix snapshots"):
        run_diff(engine, args("--widths", "2", "--snapshot", "--long-prompt", "130"))
