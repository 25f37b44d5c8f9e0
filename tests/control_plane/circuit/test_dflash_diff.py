"""`met circuit diff --verify-batch --dflash`: sequences drafting with a DFlash drafter, the
batched verify and the batched block propose byte for byte against one sequence at a time,
after whole prefills and after prefix snapshots; a fault in the block's context is seen."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from control_plane.circuit.report import run_diff
from control_plane.circuit.verify_batch import DiffError
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.state import DeviceState
from met.main import build_parser
from tests.gpu_service.dflash.drafter import write_drafter


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["circuit", "diff", "--verify-batch", "--dflash", *extra])


@pytest.fixture(scope="module")
def drafter(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = ModelConfig.load(tiny_dir)
    taps = (0, target.num_hidden_layers - 1)
    return write_drafter(tmp_path_factory.mktemp("dflash"), target, taps=taps, scale=0.2)


def test_the_batched_block_propose_passes(tiny_dir: Path, drafter: Path) -> None:
    svc = ServiceConfig(verify_tiers="4:7", max_context=512, prefix_snapshots=1)
    engine = Engine(tiny_dir, svc, "fp32", drafter=drafter)
    flags = ["--widths", "2,3", "--ks", "4", "--steps", "3", "--num-drafts", "3"]
    flags += ["--long-prompt", "130", "--snapshot", "--forwards", "eager-serial"]
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]
    names = [c["variant"] for s in report["shapes"] for c in s["comparisons"]]
    assert "eager-serial from a snapshot" in names


@pytest.mark.slow  # interprets the Triton forward through every run of the diff
def test_the_triton_block_propose_passes(tiny_dir: Path, drafter: Path) -> None:
    """The same under the Triton forward at one shape (with snapshots and more shapes it takes
    minutes interpreted: `met circuit diff --verify-batch --dflash --snapshot --reference
    triton --forwards triton-serial` over this drafter PASSes)."""
    engine = Engine(
        tiny_dir, ServiceConfig(verify_tiers="4:7", max_context=256), "fp32", drafter=drafter
    )
    flags = ["--widths", "2", "--ks", "3", "--steps", "2", "--num-drafts", "2"]
    flags += ["--reference", "triton", "--forwards", "triton-serial"]
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "PASS", report["reasons"]


def test_a_fault_in_the_drafters_context_is_seen(tiny_dir: Path, drafter: Path) -> None:
    """A forward that perturbs one slot's DFlash context after each fold: its proposes differ."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:7", max_context=256), drafter=drafter)

    def perturb(state: DeviceState, slots: list[int]) -> None:
        block = int(state.block_table[slots[-1], 0])
        state.dflash_k[:, block] += 1e-3

    engine.add_forward("eager-faulty", perturb)
    flags = ["--widths", "2", "--ks", "3", "--steps", "3", "--forwards", "eager-faulty"]
    report = run_diff(engine, args(*flags))
    assert report["verdict"] == "FAIL"


def test_dflash_needs_a_drafter(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    with pytest.raises(DiffError, match="no DFlash drafter"):
        run_diff(engine, args("--widths", "2"))
