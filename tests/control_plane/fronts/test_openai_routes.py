"""The OpenAI front's routes beside generation, as vLLM serves them: one model by its id
(the SDK's `models.retrieve`) with `max_model_len`, `/tokenize` and `/detokenize`,
`/version`, `/ping`, and `/metrics` with vLLM's names beside ours, open without a key; and
the usage's `cached_tokens`, what the prefix cache gave."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.scheduler.metrics import VLLM_FAMILIES, Metrics
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_openai_http import KEY, PROMPT, Fronts, serving

AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    svc = ServiceConfig(verify_tiers="2:3", max_context=512, prefix_snapshots=2)
    engine = Engine(tiny_dir, svc)
    with serving(engine, 4, Metrics()) as f:
        yield f


def root(fronts: Fronts) -> str:
    return fronts.http.removesuffix("/v1")


def test_a_model_by_its_id(fronts: Fronts) -> None:
    name = fronts.engine.capabilities().model_name
    model = fronts.client.models.retrieve(name)
    assert model.id == name and model.model_extra["max_model_len"] == 512
    assert fronts.client.models.list().data[0].model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError):
        fronts.client.models.retrieve("gpt-9")


def test_tokenize_and_detokenize(fronts: Fronts) -> None:
    sent = httpx2.post(
        f"{root(fronts)}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, headers=AUTH
    ).json()
    assert sent["tokens"] == list(PROMPT.encode()) and sent["count"] == len(PROMPT)
    assert sent["max_model_len"] == 512 and "".join(sent["token_strs"]) == PROMPT
    back = httpx2.post(f"{root(fronts)}/detokenize", json={"tokens": sent["tokens"]}, headers=AUTH)
    assert back.json() == {"prompt": PROMPT}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    rendered = httpx2.post(f"{root(fronts)}/tokenize", json=chat, headers=AUTH).json()
    done = fronts.client.chat.completions.create(model="", max_tokens=1, **chat)  # type: ignore[arg-type]
    assert done.usage is not None and rendered["count"] == done.usage.prompt_tokens
    bad = httpx2.post(f"{root(fronts)}/detokenize", json={"tokens": [99999]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_version_ping_and_metrics_are_open(fronts: Fronts) -> None:
    fronts.client.completions.create(
        model="", prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert httpx2.get(f"{root(fronts)}/version").json()["version"]
    assert httpx2.get(f"{root(fronts)}/ping").status_code == 200
    text = httpx2.get(f"{root(fronts)}/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for family in VLLM_FAMILIES:
        assert {f"met:{family}", f"vllm:{family}"} <= names, family
    counts = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("generation_tokens_total")
    }
    assert counts["vllm:generation_tokens_total"] == counts["met:generation_tokens_total"] >= 3
    assert httpx2.get(f"{root(fronts)}/tokenize").status_code == 401


def test_cached_tokens_count_what_the_prefix_cache_gave(fronts: Fronts) -> None:
    prompt = "".join(chr(97 + i % 26) for i in range(150))
    cold = fronts.client.completions.create(model="", prompt=prompt, max_tokens=2)
    warm = fronts.client.completions.create(model="", prompt=prompt, max_tokens=2)
    assert cold.usage is not None and warm.usage is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 128  # two 64-token blocks
