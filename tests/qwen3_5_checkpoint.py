"""Qwen3.5 / Qwen3.6 checkpoints as a user brings one: written by transformers' own
`Qwen3_5ForConditionalGeneration` and `Qwen3_5MoeForConditionalGeneration` (random weights, a
vision tower of depth 2, tied or untied), with an `mtp.*` layer added by hand (transformers
has no class for it and saves none), a byte-level BPE tokenizer carrying the family's special
tokens after its own (the vision tokens among them, at the ids the config names) and a chat
template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from gpu_service.model.config import ModelConfig
from gpu_service.model.weights import WEIGHTS_FILE, weight_shapes
from tests.hf_checkpoint import BASE, TEMPLATE, VOCAB, _tokenizer

# The Qwen3-Next tests' small text model (its layer pattern is transformers' default), with
# Qwen3.5's RoPE: rotary dims 4 of 16, mrope_section [1, 1, 0] covering its two frequencies,
# interleaved.
TEXT = {k: v for k, v in BASE.items() if k not in ("layer_types", "num_experts")}
TEXT |= dict(
    vocab_size=VOCAB,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": TEXT.pop("partial_rotary_factor"),
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
MOE["shared_expert_intermediate_size"] = 48
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    num_position_embeddings=16,
)
KINDS = {"dense-tied": (False, True), "dense": (False, False), "moe": (True, False)}
KINDS["moe-tied"] = (True, True)
# Qwen's special tokens after <|im_end|>, in its tokenizer's order: here they follow the
# trained vocabulary (400 tokens), so the vision tokens sit at 406 (<|vision_start|>), 407
# (<|vision_end|>), 409 (<|image_pad|>) and 410 (<|video_pad|>).
QWEN_SPECIALS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# config.json's vision token fields -> their tokens.
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def tokenizer() -> PreTrainedTokenizerFast:
    """The checkpoints' tokenizer: the Qwen3-Next tests' BPE with Qwen's specials after it."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS)})
    tok.chat_template = TEMPLATE
    return tok


def make(directory: Path, kind: str, text: dict | None = None) -> PreTrainedModel:
    """A checkpoint of `kind` (a KINDS key) in `directory`, with its MTP layer; -> the model."""
    moe, tied = KINDS[kind]
    tok = tokenizer()
    torch.manual_seed(0)
    fields = {**TEXT, **(MOE if moe else {}), **(text or {})}
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in VISION_TOKENS.items()}
    cfg = config_class(text_config=fields, vision_config=VISION, tie_word_embeddings=tied, **ids)
    cfg.text_config._attn_implementation = "eager"
    model = model_class(cfg).eval()
    with torch.no_grad():  # every parameter away from its initial constant
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    add_mtp(directory)
    tok.save_pretrained(directory)
    return model


def add_mtp(directory: Path) -> None:
    """Seeded `mtp.*` tensors, as Qwen publishes them beside the text model: its norms away
    from zero, every linear a random draw."""
    cfg = ModelConfig.load(directory)
    gen = torch.Generator().manual_seed(7)
    path = directory / WEIGHTS_FILE
    tensors = load_file(str(path))
    for name, shape in weight_shapes(cfg).items():
        if name.startswith("mtp."):
            scale = 0.1 if len(shape) == 1 else shape[-1] ** -0.5
            tensors[name] = torch.randn(shape, generator=gen) * scale
    save_file(tensors, str(path), metadata={"format": "pt"})


def stack_experts(src: Path, dst: Path) -> None:
    """The checkpoint in `src` with every MoE layer's experts stacked (transformers' own
    layout, `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]) into `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(src / WEIGHTS_FILE))
    out: dict[str, torch.Tensor] = {}
    layers = sorted({n.partition(".experts.")[0] for n in tensors if ".experts." in n})
    for layer in layers:
        count = 1 + max(
            int(n.split(".experts.")[1].split(".")[0])
            for n in tensors
            if n.startswith(f"{layer}.experts.")
        )
        names = [f"{layer}.experts.{e}" for e in range(count)]
        out[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{e}.gate_proj.weight"], tensors[f"{e}.up_proj.weight"]])
                for e in names
            ]
        )
        out[f"{layer}.experts.down_proj"] = torch.stack(
            [tensors[f"{e}.down_proj.weight"] for e in names]
        )
    out |= {n: t for n, t in tensors.items() if ".experts." not in n}
    save_file(out, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})


def config_json(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())
