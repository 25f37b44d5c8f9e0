"""`n` choices over the OpenAI front: each a request of its own, seeded one apart, streamed by
index or whole, with the usage counting the prompt once and a `choice` span each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_openai_http import PROMPT, Fronts, serving


@pytest.fixture(scope="module")
def wide(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process engine of four slots, a queue of eight."""
    with serving(Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=512)), 8) as f:
        yield f


def test_n_choices_are_the_requests_seeded_one_apart(wide: Fronts) -> None:
    """n sampled choices: choice i is the text of one request with seed + i, whole and
    streamed; the usage counts the prompt once and every choice's tokens; each choice is a
    `choice` span under the request's."""
    fields = dict(model="", prompt=PROMPT, max_tokens=12, temperature=0.9)
    alone = [
        wide.client.completions.create(**fields, seed=40 + i).choices[0].text for i in range(3)
    ]
    assert len(set(alone)) > 1, "three seeds drew one text"
    wide.spans.clear()
    whole = wide.client.completions.create(**fields, seed=40, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == alone
    single = wide.client.completions.create(**fields, seed=40)
    assert whole.usage is not None and single.usage is not None
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 3 * 12  # no EOS in twelve tokens of these seeds
    spans = wide.spans.get_finished_spans()
    top = next(sp for sp in spans if sp.name == "generate")
    choices = [sp for sp in spans if sp.name == "choice"]
    assert sorted(sp.attributes["met.choice_index"] for sp in choices) == [0, 1, 2]
    assert top.attributes["gen_ai.request.choice.count"] == 3
    assert all(sp.parent is not None and sp.parent.span_id == top.context.span_id for sp in choices)

    chunks = list(
        wide.client.completions.create(
            **fields, seed=40, n=3, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == alone
    assert chunks[-1].usage == whole.usage


def test_n_greedy_chat_choices_are_alike(wide: Fronts) -> None:
    turn = {"role": "user", "content": "hi"}
    done = wide.client.chat.completions.create(
        model="", messages=[turn], max_tokens=8, temperature=0, n=2
    )
    first, second = (c.message.content for c in done.choices)
    assert first and first == second
    chunks = list(
        wide.client.chat.completions.create(
            model="", messages=[turn], max_tokens=8, temperature=0, n=2, stream=True
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    text = {0: "", 1: ""}
    for c in chunks:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert text == {0: first, 1: first}
