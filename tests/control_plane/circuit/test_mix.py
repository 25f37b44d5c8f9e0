"""`met circuit diff --verify-batch --mix`: one batched verify holding one-row verifies, MTP and
DFlash drafts and rows under allowed-token masks, byte for byte against the same verify run one
sequence at a time (eager and Triton), each drafting sequence's propose with it; a comparison
that cannot see a difference, or a forward that drops the masks, fails."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import pytest

from control_plane.circuit import mix
from control_plane.circuit.report import SCHEMA, run_diff
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from met.main import build_parser
from protos.model import SequenceHandle, Verified
from tests.control_plane.circuit.test_verify_batch import ConstantLogits, PerturbedPropose
from tests.gpu_service.dflash.drafter import write_drafter

# Tiers wide enough for a block's drafts in the low slots, and a few for the rest.
TIERS = "4:7,4:3"


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["circuit", "diff", "--verify-batch", "--mix", *extra])


@pytest.fixture(scope="module")
def drafter(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = ModelConfig.load(tiny_dir)
    taps = (0, target.num_hidden_layers - 1)
    return write_drafter(tmp_path_factory.mktemp("dflash"), target, taps=taps, scale=0.2)


@pytest.fixture
def engine(tiny_dir: Path, drafter: Path) -> Engine:
    return Engine(
        tiny_dir, ServiceConfig(verify_tiers=TIERS, max_context=256), "fp32", drafter=drafter
    )


# -- the roles and the masks ---------------------------------------------------------------


def test_roles_take_turns_and_dflash_only_with_its_drafter() -> None:
    assert mix.roles(5, dflash=True) == ("none", "mtp", "masked", "dflash", "none")
    assert mix.roles(4, dflash=False) == ("none", "mtp", "masked", "none")
    assert [mix.drafter_of(r) for r in mix.roles(4, True)] == ["mtp", "mtp", "mtp", "dflash"]
    roles = mix.roles(4, dflash=True)
    assert mix.widths([4, 4, 3, 3], roles) == [1, 4, 3, 3], "none verifies its last token alone"
    assert mix.proposers(roles) == [1, 2, 3]


def _allowed_ids(bits: bytes) -> list[int]:
    return [t for t in range(8 * len(bits)) if bits[t // 8] >> (t % 8) & 1]


def test_a_mask_allows_its_reference_and_a_fifth_of_the_vocabulary() -> None:
    bits = mix.allowed(37, keep=6, salt=2)
    assert len(bits) == 8, "two 32-bit words for 37 tokens"
    assert _allowed_ids(bits) == [3, 6, 8, 13, 18, 23, 28, 33]


def test_row_masks_cover_every_row_of_the_masked_sequences_alone() -> None:
    roles = ("none", "masked", "mtp", "masked")
    greedy = [list(range(100, 120))] * 4
    masks = mix.row_masks(roles, [1, 3, 2, 2], greedy, [0, 2, 0, 5], 1, 320)
    assert sorted(masks) == [1, 2, 3, 6, 7]
    # Row j of a sequence allows the greedy token after its position + j.
    assert all(greedy[1][2 + j + 1] in _allowed_ids(masks[1 + j]) for j in range(3))
    assert all(greedy[3][5 + j + 1] in _allowed_ids(masks[6 + j]) for j in range(2))


# -- whole runs ----------------------------------------------------------------------------


@pytest.mark.slow  # whole mixed batches through a forward and its one-at-a-time twin
def test_a_mixed_batch_equals_one_sequence_at_a_time(engine: Engine) -> None:
    flags = ["--widths", "5", "--ks", "3,4", "--steps", "3", "--num-drafts", "3"]
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["mix"]
    shapes = report["shapes"]
    assert shapes[0]["roles"] == ["none", "mtp", "masked", "dflash", "none"]
    assert [s["ks"] for s in shapes] == [[1, 4, 4, 4, 1], [1, 3, 3, 3, 1], [1, 4, 4, 3, 1]]
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in shapes)
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    caps = engine.capabilities()
    assert caps.free_slots == caps.num_slots and engine.slots.blocks.num_used == 0


@pytest.mark.slow  # interprets the Triton forward through every run of the diff
def test_a_mixed_batch_equals_one_sequence_at_a_time_under_triton(engine: Engine) -> None:
    flags = ["--widths", "4", "--ks", "3", "--steps", "2", "--num-drafts", "2"]
    report = run_diff(engine, args(*flags, "--reference", "triton", "--forwards", "triton-serial"))
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["shapes"][0]["roles"] == ["none", "mtp", "masked", "dflash"]


class MasksDropped:
    """The engine with the verify's masks left out under `forward`: the rows of the masked
    sequence come back unmasked."""

    def __init__(self, engine: Engine, forward: str) -> None:
        self.engine, self.forward = engine, forward

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        write_on_accept: bool = True,
        masks: dict[int, bytes] | None = None,
    ) -> Verified:
        if self.engine.capabilities().current_forward == self.forward:
            masks = None
        return self.engine.decode_verify_batched(tokens, ks, seqs, write_on_accept, masks)


@pytest.mark.slow  # whole mixed batches through two forwards
def test_a_forward_that_drops_the_masks_fails(engine: Engine) -> None:
    """The masks bind: without them the masked rows' logits differ, and some argmax with them."""
    flags = ["--widths", "4", "--ks", "4", "--steps", "3", "--num-drafts", "3"]
    report = run_diff(MasksDropped(engine, "eager-serial"), args(*flags))
    assert report["verdict"] == "FAIL"
    (c,) = report["shapes"][0]["comparisons"]
    assert c["mismatched_steps"] > 0 and c["first_mismatch_sequence"] == 2, "the masked one"
    assert c["argmax_agreement"] < 1, "a mask changed an argmax"


@pytest.mark.slow  # whole mixed batches through two forwards
def test_a_blind_comparison_fails_the_mixed_detection_control(engine: Engine) -> None:
    flags = ["--widths", "4", "--ks", "3", "--steps", "2", "--num-drafts", "2"]
    report = run_diff(ConstantLogits(engine), args(*flags))
    assert report["verdict"] == "FAIL"
    assert report["reasons"] == [
        "verify-batch [1, 3, 3, 3]: the detection control saw no difference after changing a draft"
    ]


@pytest.mark.slow  # whole mixed batches through two forwards
def test_a_propose_mismatch_names_the_sequence_that_proposed(engine: Engine) -> None:
    """Only the drafting sequences propose: the propose's second row is sequence 2's."""
    flags = ["--widths", "4", "--ks", "3", "--steps", "2", "--num-drafts", "2"]
    report = run_diff(PerturbedPropose(engine, "eager-serial"), args(*flags))
    (c,) = report["shapes"][0]["comparisons"]
    assert (c["first_mismatch"], c["first_mismatch_sequence"], c["first_mismatch_row"]) == (
        0,
        2,
        -1,
    )


@pytest.mark.slow  # a whole mixed diff
def test_without_a_dflash_drafter_the_mix_leaves_dflash_out(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers=TIERS, max_context=256), "fp32")
    flags = ["--widths", "3", "--ks", "3", "--steps", "2", "--num-drafts", "2"]
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["shapes"][0]["roles"] == ["none", "mtp", "masked"]


@pytest.mark.slow  # starts `met circuit diff`, which builds an engine
def test_the_command_mixes_the_bundled_drafter_in(tmp_path: Path) -> None:
    """`met circuit diff --mix` on the bundled model loads its DFlash drafter (MODEL/dflash)."""
    out = tmp_path / "report.json"
    flags = ["--widths", "4", "--ks", "3", "--steps", "2", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "met", "circuit", "diff", "--verify-batch", "--mix", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS" and report["mix"]
    assert report["shapes"][0]["roles"] == ["none", "mtp", "masked", "dflash"]
