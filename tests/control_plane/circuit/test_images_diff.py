"""`met circuit diff --verify-batch --images`: batches mixing prompts with an image (the
checkpoint's own preprocessor over a picture of each sequence's) and text prompts, on a
Qwen3.5-MoE checkpoint written by transformers' classes with its tower, byte for byte against
the same verifies one sequence at a time (eager, and Triton), with the MTP head's proposes,
and from a prefix snapshot that cuts an image; a forward that loses the images fails, and a
service without a tower is refused with a sentence."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from control_plane.circuit.images import preprocessor, with_images
from control_plane.circuit.report import run_diff
from control_plane.circuit.shapes import batch_prompts, snapshot_prefix
from control_plane.circuit.verify_batch import DiffError
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from met.main import build_parser
from protos.handles import ImageInput
from protos.model import Prefilled, SequenceHandle
from tests.vision_files import write_preprocessor

SERVICE = ServiceConfig(verify_tiers="4:3,4:1", max_context=256, prefix_snapshots=1)


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["circuit", "diff", "--verify-batch", "--images", *extra])


@pytest.fixture(scope="module")
def checkpoint(qwen3_5_made: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MoE checkpoint with its preprocessor_config.json."""
    directory = tmp_path_factory.mktemp("moe-vision") / "checkpoint"
    shutil.copytree(qwen3_5_made["moe"][0], directory)
    write_preprocessor(directory)
    return directory


class Counted:
    """The engine, counting the prefill items that send images; under `drop`, it sends none
    (the image tokens are then read as text)."""

    def __init__(self, engine: Engine, drop: str = "") -> None:
        self.engine, self.drop, self.sent = engine, drop, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def prefill(
        self,
        seqs: Sequence[SequenceHandle],
        prompts: Sequence[Sequence[int]],
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> Prefilled:
        if self.engine.capabilities().current_forward == self.drop:
            images = None
        self.sent += sum(1 for i in images or () if i)
        return self.engine.prefill(seqs, prompts, images=images)


@pytest.mark.slow  # whole batches through a forward and its one-at-a-time twin
def test_batches_mixing_image_and_text_prompts_pass(checkpoint: Path) -> None:
    model = Counted(Engine(checkpoint, SERVICE, "fp32"))
    flags = ("--widths", "3", "--ks", "2,3", "--steps", "3", "--mtp", "--num-drafts", "2")
    report = run_diff(model, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]
    assert report["images"] and [s["ks"] for s in report["shapes"]] == [[3] * 3, [2] * 3, [3, 3, 2]]
    assert model.sent > 0
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in report["shapes"])


@pytest.mark.slow  # whole batches, from snapshots too
def test_a_snapshot_that_cuts_an_image_gives_the_whole_prefills_bytes(checkpoint: Path) -> None:
    engine = Engine(checkpoint, SERVICE, "fp32")
    pre, _ = preprocessor(engine)
    assert pre is not None
    block = engine.capabilities().kv_block_size
    prompts, images = with_images(batch_prompts(2, 400, long=130), pre, block)
    (span,) = images[0].spans
    assert span.start < snapshot_prefix(prompts[0], block) < span.start + span.length, "cut"
    assert prompts[0].count(pre.image_token_id) == span.length and images[1].spans == ()
    flags = ("--widths", "2", "--ks", "3", "--steps", "2", "--long-prompt", "130", "--snapshot")
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]
    variants = [c["variant"] for c in report["shapes"][0]["comparisons"]]
    assert variants == ["eager from a snapshot", "eager-serial", "eager-serial from a snapshot"]


@pytest.mark.slow  # interprets the Triton forward through every run of the diff
def test_batches_mixing_image_and_text_prompts_pass_under_triton(checkpoint: Path) -> None:
    engine = Engine(checkpoint, SERVICE, "fp32")
    flags = ("--widths", "2", "--ks", "2", "--steps", "2", "--reference", "triton")
    report = run_diff(engine, args(*flags, "--forwards", "triton-serial"))
    assert report["verdict"] == "PASS", report["reasons"]


@pytest.mark.slow  # whole batches through two forwards
def test_a_forward_that_loses_the_images_fails(checkpoint: Path) -> None:
    model = Counted(Engine(checkpoint, SERVICE, "fp32"), drop="eager-serial")
    report = run_diff(model, args("--widths", "2", "--ks", "2", "--steps", "2"))
    assert report["verdict"] == "FAIL"
    assert "eager-serial: prefill equal False" in report["reasons"][0]


def test_a_service_without_a_tower_is_refused(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(max_context=256))
    with pytest.raises(DiffError, match="--images: the service embeds no images"):
        run_diff(engine, args("--widths", "2", "--ks", "2", "--steps", "2"))
