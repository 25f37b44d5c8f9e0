"""Client libraries no one here wrote, against the OpenAI front on a real socket: LangChain's
`bind_tools` and `with_structured_output(method="function_calling")`, litellm's
`ContextWindowExceededError`, and the request bodies lm-eval's `local-completions` sends for
batched generation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx2
import pytest
from pydantic import BaseModel, Field

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_openai_http import KEY, Fronts, serving
from tests.control_plane.fronts.test_openai_tools import TOOLS, check_call

# litellm fetches its price list from the network when imported unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class Forecast(BaseModel):
    """A forecast; every field bounded, so that a sampled answer always ends."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process engine of four slots, a queue of 16."""
    with serving(Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=2048)), 16) as f:
        yield f


def model_name(fronts: Fronts) -> str:
    return fronts.engine.capabilities().model_name


def chat_model(fronts: Fronts):  # type: ignore[no-untyped-def]
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model_name(fronts), base_url=fronts.http, api_key=KEY, max_retries=0, temperature=0
    )


def test_langchain_bind_tools(fronts: Fronts) -> None:
    """LangChain's tool calls, forced and named, parsed into its `tool_calls` with their
    arguments as dicts."""
    llm = chat_model(fronts).bind_tools(TOOLS, tool_choice="get_weather")
    reply = llm.invoke("Weather in Rome for two days?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"], dict)
    streamed = None
    for chunk in llm.stream("Weather in Rome for two days?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls == [
        {**reply.tool_calls[0], "id": streamed.tool_calls[0]["id"]}
    ]


def test_langchain_structured_output_by_function_calling(fronts: Fronts) -> None:
    structured = chat_model(fronts).with_structured_output(Forecast, method="function_calling")
    answer = structured.invoke("Forecast for Paris?")
    assert isinstance(answer, Forecast) and 1 <= answer.days <= 5


def test_openai_sdk_tool_calls_validate(fronts: Fronts) -> None:
    done = fronts.client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "time?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
    )
    (call,) = done.choices[0].message.tool_calls or []
    assert check_call(call)


def test_litellm_recognises_a_context_overflow(fronts: Fronts) -> None:
    import litellm

    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{model_name(fronts)}",
            api_base=fronts.http,
            api_key=KEY,
            messages=[{"role": "user", "content": "word " * 1000}],
            max_tokens=1500,
            num_retries=0,
        )


def test_lm_eval_batched_generation(fronts: Fronts) -> None:
    """lm-eval's `local-completions` generate_until with `--batch_size 2`: a list of prompts,
    greedy, its stops, a seed; one choice per prompt, each the text of that prompt alone."""
    prompts = ["Q: 1+1?\nA:", "Q: the sky?\nA:"]
    body = {
        "model": model_name(fronts),
        "prompt": prompts,
        "max_tokens": 12,
        "temperature": 0,
        "stop": ["\n\n", "Q:"],
        "seed": 1234,
    }
    headers = {"authorization": f"Bearer {KEY}"}
    batch = httpx2.post(f"{fronts.http}/completions", json=body, headers=headers, timeout=120)
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(prompts, choices, strict=True):
        alone = httpx2.post(
            f"{fronts.http}/completions",
            json={**body, "prompt": prompt},
            headers=headers,
            timeout=120,
        ).json()["choices"][0]
        assert choice["text"] == alone["text"]
    single = [
        httpx2.post(
            f"{fronts.http}/completions", json={**body, "prompt": p}, headers=headers, timeout=120
        ).json()["usage"]["prompt_tokens"]
        for p in prompts
    ]
    assert batch.json()["usage"]["prompt_tokens"] == sum(single)
