"""Prompt log-probabilities over the OpenAI front, on a checkpoint transformers wrote (its own
BPE tokenizer): lm-eval's `local-completions` loglikelihood request (a batch of prompts, echo,
logprobs 1, max_tokens 1) and vLLM's `prompt_logprobs` equal transformers' log-softmax over
the prompt within the parity tolerance, whole and streamed; `text_offset` spells the text;
alternatives of later generated tokens are refused, naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest
import torch

from control_plane.admission import auth
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from tests.control_plane.fronts.test_openai_http import KEY, Fronts, serving
from tests.gpu_service.model.test_hf_parity import ATOL
from tests.hf_checkpoint import Checkpoint, make_checkpoint

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fronts, Checkpoint]]:
    ckpt = make_checkpoint(tmp_path_factory.mktemp("hf"))
    engine = Engine(ckpt.directory, ServiceConfig(verify_tiers="2:3", max_context=256))
    with serving(engine, 8) as fronts:
        yield fronts, ckpt


def reference(ckpt: Checkpoint, text: str) -> tuple[list[int], torch.Tensor]:
    ids = ckpt.tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, -1)


def test_lm_evals_loglikelihood_request(pair: tuple[Fronts, Checkpoint]) -> None:
    fronts, ckpt = pair
    body = {
        "model": fronts.engine.capabilities().model_name,
        "prompt": PROMPTS,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    sent = httpx2.post(
        f"{fronts.http}/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
    )
    assert sent.status_code == 200, sent.text
    for prompt, choice in zip(PROMPTS, sent.json()["choices"], strict=True):
        ids, logp = reference(ckpt, prompt)
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        # What lm-eval reads to call a continuation greedy: each row's best alternative.
        for j, top in enumerate(lp["top_logprobs"][1 : len(ids)]):
            assert max(top.values()) == pytest.approx(float(logp[j].max()), abs=ATOL)
        # The generated token's: the prompt's last row, and its offset after the prompt.
        assert max(lp["top_logprobs"][-1].values()) == pytest.approx(
            float(logp[-1].max()), abs=ATOL
        )
        text = "".join(lp["tokens"])
        assert text == choice["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:j])) for j in range(len(ids) + 1)]


def test_vllms_prompt_logprobs_whole_and_streamed(pair: tuple[Fronts, Checkpoint]) -> None:
    fronts, ckpt = pair
    ids, logp = reference(ckpt, PROMPTS[0])
    fields = dict(model="", prompt=PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 3})
    whole = fronts.client.completions.create(**fields)  # type: ignore[call-overload]
    scored = whole.choices[0].model_extra["prompt_logprobs"]
    streamed = [
        c.choices[0].model_extra.get("prompt_logprobs")
        for c in fronts.client.completions.create(**fields, stream=True)  # type: ignore[call-overload]
        if c.choices
    ]
    assert streamed[0] == scored and all(s is None for s in streamed[1:])
    assert scored[0] is None and len(scored) == len(ids)
    for j, row in enumerate(scored[1:]):
        own = row[str(ids[j + 1])]
        assert own["logprob"] == pytest.approx(float(logp[j, ids[j + 1]]), abs=ATOL)
        x = float(logp[j, ids[j + 1]])
        # Its rank among its row's, ties within the tolerance counted either way.
        least, most = (int((logp[j] > x + d).sum()) + 1 for d in (ATOL, -ATOL))
        assert least <= own["rank"] <= most
        best = max(v["logprob"] for v in row.values())
        assert best == pytest.approx(float(logp[j].max()), abs=ATOL)
        assert len(row) in (3, 4)  # three alternatives, and the prompt's token beside them


def test_alternatives_past_the_first_token_are_refused(pair: tuple[Fronts, Checkpoint]) -> None:
    fronts, _ = pair
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.completions.create(model="", prompt="a", logprobs=2, max_tokens=5)
    assert caught.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=2
        )
    assert caught.value.body["param"] == "top_logprobs"
    done = fronts.client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "a"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=1,
        extra_body={"ignore_eos": True},
    )
    (token,) = done.choices[0].logprobs.content
    assert len(token.top_logprobs) == 2
    assert token.top_logprobs[0].logprob >= token.logprob - ATOL


def test_the_grpc_api_sends_the_prompts_scores_first(pair: tuple[Fronts, Checkpoint]) -> None:
    fronts, ckpt = pair
    ids, logp = reference(ckpt, PROMPTS[1])
    request = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=3, prompt_logprobs=2)
    messages = list(fronts.stub.Generate(request, metadata=auth.bearer(KEY), timeout=60))
    first = messages[0].prompt_logprobs
    assert all(not m.HasField("prompt_logprobs") for m in messages[1:])
    want = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(list(first.logprobs)), want, atol=ATOL, rtol=0)
    assert (
        first.top == 2 and len(first.top_ids) == 2 * len(ids) and len(first.ranks) == len(ids) - 1
    )
