"""A Qwen3-Next checkpoint as a user brings one: written by `transformers` (random weights), with
its own byte-level BPE tokenizer of another vocabulary size than the default model's, a chat
template, and two EOS ids in generation_config.json. Nothing here is our code's output."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3NextConfig, Qwen3NextForCausalLM

VOCAB = 512
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's ChatML shape, small enough to read.
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROMPT = "def fibonacci(n):\n    "
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sum a list, please."},
]
# A small Qwen3-Next: three GDN layers, then one attention layer; no experts.
BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_experts=0,
    partial_rotary_factor=0.25,
    max_position_embeddings=512,
)
CONFIG = {**BASE, "vocab_size": VOCAB}
CORPUS = textwrap.dedent(
    '''
    def add(a, b):
        """Return the sum of a and b."""
        return a + b

    class Stack:
        def __init__(self):
            self.items = []

        def push(self, item):
            self.items.append(item)

        def pop(self):
            return self.items.pop()

    for i in range(10):
        if i % 2 == 0:
            print("even", i)
        else:
            print("odd", i)
    The quick brown fox jumps over the lazy dog. Sum a list, please: sum(values).
    '''
)


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    model: Qwen3NextForCausalLM
    tokenizer: PreTrainedTokenizerFast
    eos_ids: tuple[int, int]  # config.json's, then the one only generation_config.json adds


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,  # a few ids of the embedding stay unused, as in Qwen's
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok


def greedy(model: Qwen3NextForCausalLM, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, no EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def make_checkpoint(directory: Path) -> Checkpoint:
    """The checkpoint in `directory`. Its second EOS id is the third token of PROMPT's greedy
    continuation (one the first two are not), so a request for PROMPT stops on it."""
    torch.manual_seed(0)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = TEMPLATE
    first_eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen3NextConfig(**CONFIG, eos_token_id=first_eos, attn_implementation="eager")
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # every parameter away from its initial constant
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    run = greedy(model, ids, 8)
    second = next(t for i, t in enumerate(run) if i >= 2 and t not in run[:i] and t != first_eos)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [first_eos, second], "do_sample": False}, indent=2)
    )
    return Checkpoint(directory, model, tokenizer, (first_eos, second))
