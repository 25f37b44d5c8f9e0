"""Prompt log-probabilities over the OpenAI front, on a checkpoint transformers wrote (its own
BPE tokenizer): lm-eval's `local-completions` loglikelihood request (a batch of prompts, echo,
logprobs 1, max_tokens 1) and vLLM's `prompt_logprobs` equal transformers' log-softmax over
the prompt within the parity tolerance, whole and streamed; `text_offset` spells the text;
every generated token lists its alternatives, as transformers ranks them."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
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
    return ids, reference_ids(ckpt, ids)


def reference_ids(ckpt: Checkpoint, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of every row of `ids` [len(ids), V]."""
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


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


def _alternatives_match(row: torch.Tensor, own: int, lp: float, top: list[float]) -> None:
    """A generated token's log-probability and its alternatives' against the reference row."""
    assert lp == pytest.approx(float(row[own]), abs=ATOL)
    want = row.topk(len(top)).values
    torch.testing.assert_close(torch.tensor(top), want, atol=ATOL, rtol=0)


def test_every_generated_token_lists_its_alternatives(pair: tuple[Fronts, Checkpoint]) -> None:
    """Chat's top_logprobs and completions' logprobs N, streamed: every token's alternatives
    are its row's most probable tokens, as transformers' log-softmax over the prompt and the
    tokens before it ranks them."""
    fronts, ckpt = pair
    ids_back = {"ignore_eos": True, "return_token_ids": True}
    chat = fronts.client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "def add"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=6,
        temperature=0,
        extra_body=ids_back,
    )
    prompt, ids = chat.model_extra["prompt_token_ids"], chat.choices[0].model_extra["token_ids"]
    logp = reference_ids(ckpt, prompt + ids)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(ids) == 6
    for j, (token, own) in enumerate(zip(content, ids, strict=True)):
        values = [a.logprob for a in token.top_logprobs]
        _alternatives_match(logp[len(prompt) - 1 + j], own, token.logprob, values)
    chunks = fronts.client.completions.create(  # type: ignore[call-overload]
        model="", prompt=PROMPTS[0], logprobs=3, max_tokens=6, stream=True, extra_body=ids_back
    )
    ids, prompt, lps, tops = [], None, [], []
    for c in chunks:
        if not c.choices:
            continue
        extra = c.choices[0].model_extra
        prompt = prompt or extra.get("prompt_token_ids")
        ids += extra.get("token_ids") or []
        if c.choices[0].logprobs is not None:
            lps += c.choices[0].logprobs.token_logprobs
            tops += c.choices[0].logprobs.top_logprobs
    logp = reference_ids(ckpt, prompt + ids)
    assert len(ids) == len(lps) == len(tops) == 6
    for j, (own, lp, top) in enumerate(zip(ids, lps, tops, strict=True)):
        row = logp[len(prompt) - 1 + j]
        assert lp == pytest.approx(float(row[own]), abs=ATOL)
        # Three alternatives and the token's own, by their text (byte tokens may spell alike,
        # and one key then holds the last of them).
        want = [*row.topk(3).values.tolist(), float(row[own])]
        assert 1 <= len(top) <= 4
        assert all(min(abs(v - w) for w in want) < ATOL for v in top.values()), (top, want)


def test_alternatives_past_twenty_are_refused(pair: tuple[Fronts, Checkpoint]) -> None:
    fronts, _ = pair
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.completions.create(model="", prompt="a", logprobs=21, max_tokens=5)
    assert caught.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=21
        )
    assert caught.value.body["param"] == "top_logprobs"


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


def test_the_grpc_api_streams_each_tokens_alternatives(pair: tuple[Fronts, Checkpoint]) -> None:
    fronts, ckpt = pair
    request = pb.GenerateRequest(
        prompt=PROMPTS[0], max_new_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True
    )
    messages = list(fronts.stub.Generate(request, metadata=auth.bearer(KEY), timeout=60))
    ids = [t for m in messages for t in m.token_ids]
    logp = reference_ids(ckpt, ckpt.tokenizer.encode(PROMPTS[0], add_special_tokens=False) + ids)
    top_ids = [t for m in messages for t in m.top_ids]
    values = [v for m in messages for v in m.top_logprobs]
    own = [v for m in messages for v in m.logprobs]
    assert len(ids) == len(own) == 5 and len(top_ids) == len(values) == 2 * len(ids)
    for j in range(len(ids)):
        row = logp[logp.shape[0] - len(ids) - 1 + j]
        _alternatives_match(row, ids[j], own[j], values[2 * j : 2 * j + 2])
        assert top_ids[2 * j] == ids[j], "greedy: each token is its row's first alternative"
    refused = pb.GenerateRequest(prompt="a", max_new_tokens=2, top_logprobs=2)
    with pytest.raises(grpc.RpcError) as caught:
        list(fronts.stub.Generate(refused, metadata=auth.bearer(KEY), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_logprobs needs logprobs" in caught.value.details()
