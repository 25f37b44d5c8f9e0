"""Requests the OpenAI front refuses, in OpenAI's shape with their statuses and the field to
blame, the Door's refusals too; a body that is not JSON; a missing or wrong key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from gpu_service.engine.facade import Engine
from tests.control_plane.fronts.test_openai_http import (
    KEY,
    ONE_SLOT,
    PROMPT,
    Fronts,
    client,
    serving,
)


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process one-slot engine, a queue of two (room for the batch of
    two that a refusal below names)."""
    with serving(Engine(tiny_dir, ONE_SLOT), 2) as f:
        yield f


BAD = {
    "n": ({"n": 0}, 400, "n", "n is 0; it must be from 1 to 128"),
    "best_of": (
        {"best_of": 2},
        400,
        "best_of",
        "best_of is 2; this server returns the choices it samples (best_of: 1; use n)",
    ),
    "min_p": (
        {"extra_body": {"min_p": 2}},
        400,
        "min_p",
        "min_p is 2.0; it must be from 0 (no cut) to 1",
    ),
    "presence_penalty": (
        {"presence_penalty": 3},
        400,
        "presence_penalty",
        "presence_penalty is 3.0; it must be from -2 to 2",
    ),
    "repetition_penalty": (
        {"extra_body": {"repetition_penalty": 0}},
        400,
        "repetition_penalty",
        "repetition_penalty is 0.0; it must be from 0.01 to 100 (1: none)",
    ),
    "repetition_penalty-near-0": (  # logit / r overflows: every logprob NaN
        {"extra_body": {"repetition_penalty": 1e-45}},
        400,
        "repetition_penalty",
        "repetition_penalty is 1e-45; it must be from 0.01 to 100 (1: none)",
    ),
    "speculative-method-list": (
        {"extra_body": {"speculative": {"method": ["mtp"]}}},
        400,
        "speculative",
        'speculative.method is ["mtp"]; use one of none, mtp, prompt_lookup, dflash, auto',
    ),
    "speculative-method-object": (
        {"extra_body": {"speculative": {"method": {}}}},
        400,
        "speculative",
        # str.format's braces
        "speculative.method is {{}}; use one of none, mtp, prompt_lookup, dflash, auto",
    ),
    "speculative-dflash-without-a-drafter": (
        {"extra_body": {"speculative": {"method": "dflash"}}},
        400,
        "speculative",
        "speculative method dflash needs a GPU service with a DFlash drafter (met gpu-service "
        "serve --drafter PATH); this one has none",
    ),
    "logit_bias-key-past-int": (  # past int()'s 4,300 digits
        {"logit_bias": {"9" * 5000: 1}},
        400,
        "logit_bias",
        'logit_bias names "' + "9" * 36 + "...; a key is a token id, 0 to 4294967295",
    ),
    "logit_bias-value": (
        {"logit_bias": {"7": "3"}},
        400,
        "logit_bias",
        'logit_bias of 7 is "3"; it must be a number',
    ),
    "logit_bias-key": (
        {"logit_bias": {"the": 1}},
        400,
        "logit_bias",
        'logit_bias names "the"; a key is a token id, 0 to 4294967295',
    ),
    "temperature": (
        {"temperature": -1},
        400,
        "temperature",
        "temperature is -1.0; it must be 0 (greedy) or from 0.01 to 100",
    ),
    "logprobs": (
        {"logprobs": 21},
        400,
        "logprobs",
        "logprobs is 21; it must be an integer, 0 to 20",
    ),
    "prompt-of-text-and-ids": (
        {"prompt": ["a", 3]},
        400,
        "prompt",
        'prompt is ["a", 3]; it must be text, a list of token ids, or a non-empty list of either',
    ),
    # The Door's refusals name the field the client sent, in OpenAI's or vLLM's name.
    "min_tokens-over-max": (
        {"max_tokens": 4, "extra_body": {"min_tokens": 10}},
        400,
        "min_tokens",
        "min_new_tokens is 10; it must not exceed max_new_tokens (4)",
    ),
    "top_k-past-the-vocabulary": (
        {"extra_body": {"top_k": 100000}},
        400,
        "top_k",
        "top_k is 100000; it must be at most the vocabulary size 320 (0 or -1: no limit)",
    ),
    "stop-token-outside": (
        {"extra_body": {"stop_token_ids": [999]}},
        400,
        "stop_token_ids",
        "stop_token_ids holds token id 999, outside the vocabulary (0 .. 319)",
    ),
    "model": (
        {"model": "gpt-9"},
        404,
        "model",
        "model 'gpt-9' is not served here; this server serves {model!r} (GET /v1/models)",
    ),
}


@pytest.mark.parametrize(("fields", "status", "param", "sentence"), BAD.values(), ids=BAD.keys())
def test_a_bad_request_is_refused_in_openais_shape(
    fronts: Fronts, fields: dict, status: int, param: str | None, sentence: str
) -> None:
    body = {"model": "", "prompt": PROMPT, "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        fronts.client.completions.create(**body)
    assert caught.value.status_code == status
    assert caught.value.body == {
        "message": sentence.format(model=fronts.engine.capabilities().model_name),
        "type": "not_found_error" if status == 404 else "invalid_request_error",
        "param": param,
        "code": "not_found" if status == 404 else "invalid_argument",
    }


def test_malformed_json_and_keys(fronts: Fronts) -> None:
    url = f"{fronts.http}/completions"
    sent = httpx2.post(url, content=b"{", headers={"authorization": f"Bearer {KEY}"})
    assert sent.status_code == 400
    assert sent.json()["error"]["message"].startswith("the body is not JSON")
    bare = httpx2.post(url, json={"prompt": "a"})
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(fronts.http, "wrong").completions.create(model="", prompt="a", max_tokens=1)
