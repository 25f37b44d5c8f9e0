"""A checkpoint `transformers` made, served end to end by both real processes with no
`--tokenizer`: the control plane tokenizes, renders chats and stops with what the GPU service
hands it, and its tokens and text are transformers' own."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import jsonschema
import openai
import pytest
import torch
from transformers import GenerationConfig

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.hf_checkpoint import MESSAGES, PROMPT, Checkpoint, greedy, make_checkpoint

# Slow: serves a transformers checkpoint with both processes.
pytestmark = pytest.mark.slow


@dataclass
class Pair:
    checkpoint: Checkpoint
    stub: pb_grpc.GenerationServiceStub
    openai: openai.OpenAI  # the control plane's HTTP front
    gpu: subprocess.Popen


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("hf"))
    gpu, target = start_gpu_service(checkpoint.directory, "--max-context", "256")
    try:
        seen: list[str] = []
        cp, cp_target = start_control_plane(target, "--http-port", "0", seen=seen)
        base = next(line.split(" on ", 1)[1].strip() for line in seen if "OpenAI API on" in line)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                yield Pair(checkpoint, pb_grpc.GenerationServiceStub(channel), client, gpu)
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


GREEDY = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})


def test_the_openai_client_gets_the_grpc_apis_text(pair: Pair) -> None:
    """Completions and chat, whole and streamed, against the real HTTP front: the greedy text
    of the same prompt over gRPC."""
    _, text, _ = generate(pair.stub, prompt=PROMPT, max_new_tokens=12, ignore_eos=True)
    whole = pair.openai.completions.create(model="", prompt=PROMPT, **GREEDY)
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
    parts = pair.openai.completions.create(model="", prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in parts if c.choices) == text

    messages = [pb.ChatMessage(**m) for m in MESSAGES]
    _, chat_text, _ = generate(pair.stub, messages=messages, max_new_tokens=12, ignore_eos=True)
    reply = pair.openai.chat.completions.create(model="", messages=MESSAGES, **GREEDY)
    assert reply.choices[0].message.content == chat_text
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    parts = pair.openai.chat.completions.create(model="", messages=MESSAGES, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == chat_text


def test_a_json_schema_reply_validates(pair: Pair) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = pair.openai.chat.completions.create(
        model="",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_a_bad_request_is_400_in_openais_shape(pair: Pair) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        pair.openai.chat.completions.create(model="", messages=MESSAGES, n=0)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["message"] == "n is 0; it must be from 1 to 128"


def test_echoed_prompt_logprobs_are_transformers(pair: Pair) -> None:
    """lm-eval's loglikelihood request through both processes: the prompt's scores cross the
    GPU service's wire and equal transformers' log-softmax."""
    ck = pair.checkpoint
    ids = ck.tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(ck.model(torch.tensor([ids])).logits[0].float(), -1)
    done = pair.openai.completions.create(
        model="", prompt=[PROMPT], max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    got = done.choices[0].logprobs
    assert got is not None and got.token_logprobs is not None
    want = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor(got.token_logprobs[1 : len(ids)]), want, atol=4e-4, rtol=0
    )


def test_a_required_tool_call_through_both_processes(pair: Pair) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"enum": ["a", "b"]}},
                "required": ["key"],
            },
        },
    }
    fields = dict(
        model="",
        messages=MESSAGES,
        tools=[tool],
        tool_choice="required",
        max_tokens=200,
        parallel_tool_calls=False,
    )
    for stream in (False, True):
        if stream:
            args = "".join(
                t.function.arguments or ""
                for c in pair.openai.chat.completions.create(**fields, stream=True)
                for ch in c.choices
                for t in ch.delta.tool_calls or []
            )
        else:
            done = pair.openai.chat.completions.create(**fields)
            (call,) = done.choices[0].message.tool_calls or []
            args = call.function.arguments
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])


def test_with_the_gpu_service_stopped_requests_are_503(pair: Pair) -> None:
    """Last in this module: it stops the GPU service."""
    stop(pair.gpu)
    with pytest.raises(openai.APIStatusError) as caught:
        pair.openai.completions.create(model="", prompt=PROMPT, max_tokens=2)
    assert caught.value.status_code == 503
    assert (
        caught.value.body["code"] == "unavailable" and "GPU service" in caught.value.body["message"]
    )
