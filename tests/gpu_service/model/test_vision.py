"""The vision tower and Qwen's multimodal RoPE against transformers' own: the tower's image
embeddings against `Qwen3_5VisionModel` and `Qwen3_5MoeVisionModel` (square, oblong, two
frames), the positions against `get_rope_index`, the RoPE rows against the text model's rotary
embedding; and the vision config read as published, refused where the tower would not follow it."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Model,
    Qwen3_5TextRotaryEmbedding,
    Qwen3_5VisionModel,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from gpu_service.model.config import ModelConfig
from gpu_service.model.hybrid import _rope_table
from gpu_service.model.mrope import SeqImage, positions, rope_rows, streams
from gpu_service.model.vision import VisionTower, vision_shapes
from gpu_service.model.vision_config import VisionConfig, vision_fields
from tests.gpu_service.test_hf_config import MODELS
from tests.qwen3_5_checkpoint import TEXT, VISION

# Grids in patches: square, oblong both ways, two frames.
GRIDS = [(1, 4, 4), (1, 4, 6), (1, 6, 2), (2, 4, 4)]
# The tower in fp32 against transformers' in fp32: a few ulps of its activations.
TOL = dict(atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_the_tower_gives_transformers_embeddings(family: str) -> None:
    torch.manual_seed(0)
    config_class = Qwen3_5MoeConfig if family == "moe" else Qwen3_5Config
    model_class = Qwen3_5MoeVisionModel if family == "moe" else Qwen3_5VisionModel
    cfg = config_class(text_config=TEXT, vision_config=VISION).vision_config
    theirs = model_class(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    v = VisionConfig(**vision_fields(cfg.to_dict(), {}, {}))
    tensors = {f"model.visual.{n}": p.detach() for n, p in theirs.named_parameters()}
    assert {n: tuple(t.shape) for n, t in tensors.items()} == vision_shapes(v)
    tower = VisionTower(v, tensors, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    for grid in GRIDS:
        pixels = torch.randn(grid[0] * grid[1] * grid[2], v.patch_dim, generator=gen)
        with torch.no_grad():
            expected = theirs(pixels, grid_thw=torch.tensor([grid])).pooler_output
        got = tower.embed(pixels, grid)
        assert got.shape == (grid[0] * grid[1] * grid[2] // 4, v.out_hidden_size)
        torch.testing.assert_close(got, expected, **TOL)


def _theirs_positions(ids: list[int], grids: list[tuple[int, int, int]], image: int) -> np.ndarray:
    """transformers' `get_rope_index` of one prompt (merge size 2)."""
    cfg = Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    vision_ids = functools.partial(Qwen3_5Model.get_vision_position_ids, None)
    model = SimpleNamespace(config=cfg, get_vision_position_ids=vision_ids)
    tokens = torch.tensor([ids])
    out, delta = Qwen3_5Model.get_rope_index(
        model,  # type: ignore[arg-type]
        tokens,
        mm_token_type_ids=(tokens == image).int(),
        image_grid_thw=torch.tensor(grids),
    )
    return np.concatenate(
        [out[:, 0].numpy(), (len(ids) + np.arange(3) + int(delta))[None].repeat(3, 0)], 1
    )


def test_positions_are_get_rope_index() -> None:
    """Two images (one oblong, one of two frames) among text: each token's (t, h, w), and the
    three text positions after the prompt at its position plus the shift (transformers'
    rope delta)."""
    image, grids = 9, [(1, 4, 6), (2, 6, 4)]
    ids = [1, 2, 3]
    spans, shift = [], 0
    for grid in grids:
        count = grid[0] * grid[1] * grid[2] // 4
        merged = (grid[0], grid[1] // 2, grid[2] // 2)
        spans.append(SeqImage(len(ids) + 1, merged, len(ids) + 1 + shift))
        shift = spans[-1].shift
        ids += [7, *[image] * count, 8, 4, 5]
    got = positions(spans, range(len(ids) + 3))
    np.testing.assert_array_equal(got, _theirs_positions(ids, grids, image))
    assert shift < 0 and np.all(got[:, -1] == len(ids) + 2 + shift)


def test_rope_rows_are_the_text_models_rotary() -> None:
    """Each row's cos and sin at its three positions, interleaved by mrope_section, as
    transformers' Qwen3.5 text rotary computes them; a text row's bytes are its table row's."""
    text = dict(TEXT, head_dim=64, partial_rotary_factor=0.5)
    text["rope_parameters"] = dict(TEXT["rope_parameters"], mrope_section=[6, 5, 5])
    raw = Qwen3_5Config(text_config=text, vision_config=VISION).to_diff_dict()
    cfg = ModelConfig.from_dict(raw)
    assert cfg.vision is not None and cfg.vision.mrope_section == (6, 5, 5)
    pos = torch.tensor([[0, 3, 5, 9], [0, 4, 2, 9], [0, 7, 1, 9]])
    table = _rope_table(cfg, 16)
    got = rope_rows(table, pos, streams(cfg.vision.mrope_section, cfg.rotary_dim))
    theirs = Qwen3_5TextRotaryEmbedding(Qwen3_5Config(text_config=text).text_config)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    half = cfg.rotary_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    torch.testing.assert_close(got[:, 0], cos[0], atol=0, rtol=0)
    torch.testing.assert_close(got[:, 1], sin[0] * sign, atol=0, rtol=0)
    assert torch.equal(got[[0, 3]], table[[0, 9]])


def test_the_published_towers_read_as_transformers_counts_them() -> None:
    """Qwen3.5-35B-A3B's and 397B-A17B's vision_config as published: transformers' parameter
    count, its token ids, the text RoPE's mrope_section."""
    for name in ("qwen3.5-35b-a3b", "qwen3.5-397b-a17b"):
        raw = json.loads((MODELS / name / "config.json").read_text())
        v = ModelConfig.from_dict(raw).vision
        assert v is not None and v.image_token_id == raw["image_token_id"]
        hf = Qwen3_5MoeConfig(**{k: x for k, x in raw.items() if k != "model_type"})
        with torch.device("meta"):
            count = sum(p.numel() for p in Qwen3_5MoeVisionModel(hf.vision_config).parameters())
        assert v.params == count and v.mrope_section == (11, 11, 10)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("deepstack_visual_indexes", [8, 16], "no deepstack mergers"),
        ("hidden_act", "quick_gelu", "the tower computes"),
        ("window_size", 112, "does not read it"),
        ("patch_size", [16, 16], "an int >= 1"),
        ("rope_parameters", {"rope_type": "default"}, "axial RoPE"),
    ],
)
def test_a_vision_config_the_tower_would_not_follow_is_refused(
    field: str, value: object, said: str
) -> None:
    raw = json.loads((MODELS / "qwen3.5-35b-a3b" / "config.json").read_text())
    raw["vision_config"][field] = value
    with pytest.raises(ValueError, match=f"vision_config.{field}.*{said}"):
        ModelConfig.from_dict(raw)
