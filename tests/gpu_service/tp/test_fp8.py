"""Block-FP8 checkpoints under tensor parallelism: a miniature whose every split falls on
128-row and 128-column scale blocks at TP 2 gives one device's greedy tokens over two gloo
ranks, each rank holding half the FP8 bytes and their scales; a size that would cut a block is
refused before anything loads, naming the weight and the sizes that split it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_service.engine.facade import Engine
from gpu_service.model.config import LAYER_PATTERN, ModelConfig
from gpu_service.model.shard import Shard, rank_config
from gpu_service.model.weights import stream_weights
from gpu_service.sizing import plan
from kernels.fp8.naive import FP8, BlockFp8
from met.main import build_parser
from met.main import main as met
from tests.gpu_service.tp.test_tensor_parallel import SERVICE, _calls, _fused_share, _launch
from tests.steps import decode
from training.checkpoint import init_model

# The flagship's structure at the smallest widths whose TP 2 splits are whole blocks: a rank's
# q heads are 2 x (q, gate) x 64 rows, its GDN key head's group [q, k, v, z] 384 rows and its
# value heads 128 columns of out_proj, its share of each expert 128 of the intermediate; the one
# KV head (64 rows, the tensor's own short block) is replicated. At TP 4 a rank's one value head
# is 64 rows: half a block.
TP2_FP8 = ModelConfig(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    layer_types=LAYER_PATTERN,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
)
# FP8 at TP 2 against FP8 at TP 1: the ranks quantize their activations in one device's blocks,
# so the logits move only by the row-parallel sums' reassociation, and where that flips an
# activation's e4m3 rounding downstream.
ATOL, RTOL = 2e-3, 1e-3


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("tp2-fp8") / "src"
    init_model(src, TP2_FP8, seed=3)
    met(["quantize", "--fp8-block", "128", str(src), str(src.parent / "fp8")])
    return src.parent / "fp8"


@pytest.fixture(scope="module")
def engines(fp8_dir: Path) -> Iterator[dict[int, Engine]]:
    one = Engine(fp8_dir, SERVICE, "fp32")
    one.set_forward("eager")
    split = _launch(fp8_dir, 2)
    try:
        yield {1: one, 2: split}
    finally:
        split.close()


def _greedy(engine: Engine, prompt: list[int], steps: int) -> list[int]:
    seq = engine.alloc_sequence()
    try:
        token = engine.prefill([seq], [prompt]).argmax[0]
        out = [token]
        for _ in range(steps):
            token, _ = decode(engine, seq, token)
            out.append(token)
        return out
    finally:
        engine.free_sequence(seq)


def test_tp2_gives_one_devices_logits(engines: dict[int, Engine]) -> None:
    """Prefill, batched verify and the MTP head's propose: TP 2's argmax that of TP 1 and its
    logits within rounding."""
    one, split = _calls(engines[1]), _calls(engines[2])
    assert len(one) == len(split) == 3
    for a, b in zip(one, split, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)


def test_tp2_gives_one_devices_greedy_tokens(engines: dict[int, Engine]) -> None:
    """A prefill, then 6 greedy decodes: token for token."""
    prompt = list(range(40, 63))
    assert _greedy(engines[2], prompt, 6) == _greedy(engines[1], prompt, 6)


def test_each_rank_holds_its_share_of_the_fp8_bytes(
    engines: dict[int, Engine], fp8_dir: Path
) -> None:
    """Each FP8 weight's bytes: a rank holds half of each split one, the share of its heads of
    the fused projections whose KV head is replicated, the whole of the MTP head's fc; every
    one still FP8, with its scales. The plan of one rank counts what each holds."""
    cfg, whole = engines[1].cfg, engines[1].model.wt
    held = engines[2].held_bytes_by_rank()
    assert len(held) == 2 and held[0] == held[1]
    rank = held[0]["weights"]
    fp8 = {k: w for k, w in whole.items() if isinstance(w, BlockFp8)}
    assert fp8 and all(w.weight.dtype == FP8 for w in fp8.values())
    for key, w in fp8.items():
        share = _fused_share(cfg, rank_config(cfg, 2), key) or (1 if key == "mtp.fc" else 0.5)
        assert rank[f"wt.{key}.0"] == w.weight.numel() * share, key
        # A grid has a column per run of kept columns from one block: a rank's regrouping may
        # join runs the whole one keeps apart (GDN's q and k of one key head).
        assert 0 < rank[f"wt.{key}.1"] <= w.scales.numel() * 4 * share, key
    flags = ["gpu-service", "plan", str(fp8_dir), "--dtype", "fp32", "--tp", "2"]
    made = plan.from_args(build_parser().parse_args(flags), torch.device("cpu"), False)
    assert made.parts["weights_bytes"] == sum(rank.values())


def test_a_split_that_cuts_a_block_is_refused(fp8_dir: Path) -> None:
    """At TP 4 a rank's GDN value head is half a scale block: every rank refuses before it reads
    a tensor, with the sentence naming the weight and the sizes that would split it."""
    with pytest.raises(ValueError) as refused:
        stream_weights(ModelConfig.load(fp8_dir), fp8_dir, torch.float32, "cpu", Shard(1, 4))
    said = str(refused.value)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight is FP8 in 128 x 128 scale" in said
    assert "at --tensor-parallel-size 4 rank 0 would hold its rows 0 to 191" in said
    assert said.endswith("--tensor-parallel-size 1 or 2 splits every FP8 weight on block edges")
