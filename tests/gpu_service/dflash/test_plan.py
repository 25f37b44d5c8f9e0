"""The memory plan with a DFlash drafter (`--drafter`): what an engine that loads it holds."""

from __future__ import annotations

from pathlib import Path

from gpu_service.engine.facade import Engine
from gpu_service.model.hybrid import held_bytes
from tests.conftest import TINY_SERVICE
from tests.gpu_service.test_plan import _plan, _tiny_flags


def test_a_dflash_drafter_is_planned_as_the_engine_holds_it(tiny_dir: Path, tmp_path: Path) -> None:
    """`--drafter`: its weights and its context KV, counted from its config alone, are what an
    engine that loads it holds; its block's activations join the workspace."""
    from gpu_service.model.config import ModelConfig
    from tests.gpu_service.dflash.drafter import write_drafter

    target = ModelConfig.load(tiny_dir)
    drafter = write_drafter(tmp_path / "d", target, taps=(0, target.num_hidden_layers - 1))
    engine = Engine(tiny_dir, TINY_SERVICE, drafter=drafter)
    made = _plan(tiny_dir, *_tiny_flags("--drafter", str(drafter)))
    plain = _plan(tiny_dir, *_tiny_flags())
    state = engine.state
    context = sum(t.numel() * t.element_size() for t in (state.dflash_k, state.dflash_v))
    assert made.parts["dflash_kv_bytes"] == context > 0
    assert engine.blocks is not None
    assert made.parts["dflash_weights_bytes"] == held_bytes(engine.blocks.net.held)
    assert plain.parts["dflash_weights_bytes"] == plain.parts["dflash_kv_bytes"] == 0
    assert made.parts["workspace_bytes"] >= plain.parts["workspace_bytes"]
