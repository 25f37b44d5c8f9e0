"""A checkpoint `transformers` made, served end to end by both real processes with no
`--tokenizer`: the control plane tokenizes, renders chats and stops with what the GPU service
hands it, and its tokens and text are transformers' own."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from transformers import GenerationConfig

from control_plane.launch import start_control_plane, start_gpu_service, stop
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.hf_checkpoint import MESSAGES, PROMPT, Checkpoint, greedy, make_checkpoint


@dataclass
class Pair:
    checkpoint: Checkpoint
    stub: pb_grpc.GenerationServiceStub


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("hf"))
    gpu, target = start_gpu_service(checkpoint.directory, "--max-context", "256")
    try:
        cp, cp_target = start_control_plane(target)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                yield Pair(checkpoint, pb_grpc.GenerationServiceStub(channel))
        finally:
            stop(cp)
    finally:
        stop(gpu)


def generate(
    stub: pb_grpc.GenerationServiceStub, **fields
) -> tuple[list[int], str, pb.GenerateResponse]:
    ids, text, last = [], "", pb.GenerateResponse()
    for msg in stub.Generate(pb.GenerateRequest(**fields), timeout=120):
        ids += msg.token_ids
        text += msg.text
        last = msg
    return ids, text, last


def test_tokens_and_text_are_transformers_greedy(pair: Pair) -> None:
    ck = pair.checkpoint
    prompt = ck.tokenizer.encode(PROMPT, add_special_tokens=False)
    ids, text, last = generate(pair.stub, prompt=PROMPT, max_new_tokens=12, ignore_eos=True)
    assert last.usage.prompt_tokens == len(prompt), "the served tokenizer, not the default's"
    assert ids == greedy(ck.model, prompt, 12)
    assert text == ck.tokenizer.decode(ids, skip_special_tokens=True)


def test_messages_render_as_apply_chat_template(pair: Pair) -> None:
    ck = pair.checkpoint
    chat = ck.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    messages = [pb.ChatMessage(**m) for m in MESSAGES]
    ids, text, last = generate(pair.stub, messages=messages, max_new_tokens=6, ignore_eos=True)
    assert last.usage.prompt_tokens == len(chat)
    assert ids == greedy(ck.model, chat, 6), "the continuation of exactly the rendered chat"
    assert text == ck.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_second_eos_id_ends_a_sequence(pair: Pair) -> None:
    """generation_config.json lists two EOS ids; the greedy run of PROMPT meets the second,
    which config.json does not name, and stops there as transformers stops."""
    ck = pair.checkpoint
    prompt = ck.tokenizer.encode(PROMPT, add_special_tokens=False)
    ids, _, last = generate(pair.stub, prompt=PROMPT, max_new_tokens=12)
    config = GenerationConfig.from_pretrained(ck.directory)
    with torch.no_grad():
        theirs = ck.model.generate(
            torch.tensor([prompt]), generation_config=config, max_new_tokens=12, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert theirs[-1] == ck.eos_ids[1] and len(theirs) < 12, "the checkpoint is as made"
    assert last.finish_reason == "stop"
    assert ids == theirs[:-1], "the EOS token ends the output and is not part of it"
