"""Log-probabilities under speculation, through both processes: a GPU service serving the
bundled model with its DFlash drafter and a control plane serving HTTP, on loopback. Greedy
chat completions with `top_logprobs: 5` and completions with `logprobs: 5`, 24 tokens, under
each speculative method give none's tokens, log-probabilities and alternatives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.params import AUTO, DFLASH, MTP, NONE, PROMPT_LOOKUP

# Slow: it waits on a GPU service and a control plane starting.
pytestmark = pytest.mark.slow
TOKENS, TOP = 24, 5
# Batch invariance makes a row's logits the same bytes whatever verifies it beside; the bound
# covers the fp32 the values cross the wire in and their JSON spelling.
ATOL = 1e-4
DRAFTING = (MTP, PROMPT_LOOKUP, DFLASH, AUTO)
# One row of a response: its token, its log-probability, its alternatives by their text.
Row = tuple[str, float, dict[str, float]]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    drafter = DEFAULT_MODEL_DIR / DRAFTER_DIR
    gpu, served = start_gpu_service(
        DEFAULT_MODEL_DIR, "--max-context", "512", "--drafter", str(drafter)
    )
    try:
        seen: list[str] = []
        cp, _ = start_control_plane(served, "--http-port", "0", seen=seen)
        try:
            base = next(
                line.split(" on ", 1)[1].strip() for line in seen if "OpenAI API on" in line
            )
            yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        finally:
            assert stop(cp) == 0
    finally:
        assert stop(gpu) == 0


def _extra(method: str) -> dict[str, Any]:
    return {"speculative": {"method": method}, "ignore_eos": True}


def _chat(client: openai.OpenAI, method: str, prompt: str) -> tuple[list[Row], dict]:
    done = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        extra_body=_extra(method),
    )
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(t.top_logprobs) == TOP for t in content)
    rows = [(t.token, t.logprob, {a.token: a.logprob for a in t.top_logprobs}) for t in content]
    return rows, done.model_extra["speculative"]  # type: ignore[index]


def _completion(client: openai.OpenAI, method: str, prompt: str) -> tuple[list[Row], dict]:
    done = client.completions.create(
        model="",
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=TOP,
        extra_body=_extra(method),
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    rows = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    return rows, done.model_extra["speculative"]  # type: ignore[index]


def _same(method: str, got: list[Row], want: list[Row]) -> None:
    assert [r[0] for r in got] == [r[0] for r in want], f"{method}: other tokens than none's"
    for j, ((_, lp, alts), (_, want_lp, want_alts)) in enumerate(zip(got, want, strict=True)):
        assert lp == pytest.approx(want_lp, abs=ATOL), f"{method}, token {j}"
        assert list(alts) == list(want_alts), f"{method}, token {j}: other alternatives"
        for text, value in alts.items():
            assert value == pytest.approx(want_alts[text], abs=ATOL), f"{method}, token {j}"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_method_lists_nones_logprobs_and_alternatives(
    client: openai.OpenAI, endpoint: str
) -> None:
    ask = _chat if endpoint == "chat" else _completion
    prompt = json.loads((DEFAULT_MODEL_DIR / "held_out_prompts.json").read_text())[0]["prompt"]
    plain, _ = ask(client, NONE, prompt)
    assert len(plain) == TOKENS
    for method in DRAFTING:
        rows, stats = ask(client, method, prompt)
        _same(method, rows, plain)
        # Drafts kept, so rows verified several at a time were compared with none's.
        assert stats["accepted"] > 0, f"{method} kept no draft"
