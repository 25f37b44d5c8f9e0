"""The tap convention against the published reference: z-lab's `extract_context_feature` takes
`hidden_states[i + 1]` of transformers' output for id i, the residual stream after decoder
layer i. Ours is the same for every layer but the last, where transformers' entry is the final
norm's output and ours the stream before it (published drafters tap layers 1 to L - 3 only)."""

from __future__ import annotations

import torch
from transformers import Qwen3NextForCausalLM

from gpu_service.model.config import ModelConfig
from gpu_service.model.weights import load_weights
from protos.defaults import DEFAULT_MODEL_DIR
from training.forward import TrainForward


def test_taps_are_transformers_hidden_states_after_each_layer() -> None:
    theirs = Qwen3NextForCausalLM.from_pretrained(
        DEFAULT_MODEL_DIR, attn_implementation="eager", dtype=torch.float32
    ).eval()
    params, cfg = load_weights(
        ModelConfig.load(DEFAULT_MODEL_DIR), DEFAULT_MODEL_DIR, torch.float32
    )
    ours = TrainForward(cfg, params, 64)
    tokens = torch.randint(2, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    last = cfg.num_hidden_layers - 1
    with torch.no_grad():
        hidden = theirs(tokens, output_hidden_states=True).hidden_states
        ids = (1, 5, last - 1)
        expect = torch.cat([hidden[i + 1] for i in ids], -1)
        torch.testing.assert_close(ours.taps(tokens, ids), expect, atol=1e-4, rtol=1e-4)
        stream = ours.taps(tokens, (last,))
        torch.testing.assert_close(
            ours.norm(stream, "model.norm"), hidden[last + 1], atol=1e-4, rtol=1e-4
        )
