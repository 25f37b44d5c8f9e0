"""vLLM's request parameters over the OpenAI front, through the official client's
`extra_body` as a vLLM user sends them: each one's effect, or a 400 naming it. Unknown
parameters are refused too; OpenAI's bookkeeping ones are taken and change nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_openai_http import KEY, PROMPT, Fronts, serving

GREEDY = {"model": "", "temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    with serving(Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=512)), 8) as f:
        yield f


def complete(fronts: Fronts, prompt: str = PROMPT, **extra: Any) -> Any:
    body = {**GREEDY, "extra_body": {**GREEDY["extra_body"], **extra}}
    return fronts.client.completions.create(prompt=prompt, **body)


def chat(fronts: Fronts, messages: list[dict] = CHAT, **extra: Any) -> Any:
    body = {**GREEDY, "extra_body": {**GREEDY["extra_body"], **extra}}
    return fronts.client.chat.completions.create(messages=messages, **body)


def test_structured_outputs_constrain(fronts: Fronts) -> None:
    choice = complete(fronts, structured_outputs={"choice": ["yes.", "no (sure)"]})
    assert choice.choices[0].text in ("yes.", "no (sure)")
    regex = complete(fronts, structured_outputs={"regex": "[a-c]{5}"}).choices[0].text
    assert re.fullmatch("[a-c]{5}", regex)
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    value = json.loads(complete(fronts, structured_outputs={"json": schema}).choices[0].text)
    assert value["a"] in (1, 2)
    grammar = complete(fronts, structured_outputs={"grammar": 'start: "x" ("y" | "z")'})
    assert grammar.choices[0].text in ("xy", "xz")
    assert isinstance(json.loads(complete(fronts, guided_json=schema).choices[0].text), dict)
    loose = complete(fronts, structured_outputs={"json_object": True}).choices[0]
    assert_object(loose.text, loose.finish_reason)


def assert_object(text: str, finish: str) -> None:
    """Any object: whole when the grammar ended it, else cut by the budget, begun as one."""
    assert text.startswith("{")
    assert finish == "length" or isinstance(json.loads(text), dict)


def test_json_object_is_an_object(fronts: Fronts) -> None:
    done = fronts.client.chat.completions.create(
        messages=CHAT, response_format={"type": "json_object"}, model="", max_tokens=60
    )
    assert_object(done.choices[0].message.content or "", done.choices[0].finish_reason)


def test_allowed_token_ids_bind(fronts: Fronts) -> None:
    text = complete(fronts, allowed_token_ids=[ord("a"), ord("b")]).choices[0].text
    assert set(text) <= {"a", "b"} and text


def test_truncate_prompt_tokens_keeps_the_end(fronts: Fronts) -> None:
    long = "x" * 100 + PROMPT
    cut = complete(fronts, long, truncate_prompt_tokens=len(PROMPT))
    assert cut.usage.prompt_tokens == len(PROMPT)
    assert cut.choices[0].text == complete(fronts).choices[0].text
    whole = complete(fronts, "y" * 600, truncate_prompt_tokens=-1, max_tokens=None)
    assert whole.usage.prompt_tokens == 511


def test_include_stop_str_in_output(fronts: Fronts) -> None:
    free = complete(fronts).choices[0].text
    stop = free[5:7]
    cut = complete(fronts, stop=[stop]).choices[0].text
    kept = complete(fronts, stop=[stop], include_stop_str_in_output=True).choices[0].text
    assert kept == cut + stop and free.startswith(kept)


def test_chat_template_and_its_kwargs(fronts: Fronts) -> None:
    template = "{% for m in messages %}{{ m.content | upper }}{{ suffix }}{% endfor %}"
    own = chat(fronts, chat_template=template, chat_template_kwargs={"suffix": "::"})
    assert own.usage.prompt_tokens == len("HI::")
    assert chat(fronts).usage.prompt_tokens != own.usage.prompt_tokens


def test_continue_final_message(fronts: Fronts) -> None:
    """The assistant's turn goes on from its text: the prompt is the template's, cut after
    that text, so it is the gRPC-free equivalent of sending that text as a prompt."""
    partial = [*CHAT, {"role": "assistant", "content": "Sure, the answer"}]
    went_on = chat(fronts, partial, continue_final_message=True, add_generation_prompt=False)
    as_text = complete(fronts, "<|bos|><|user|>\nhi\n<|assistant|>\nSure, the answer")
    assert went_on.choices[0].message.content == as_text.choices[0].text


def test_return_token_ids_and_request_id(fronts: Fronts) -> None:
    done = complete(fronts, return_token_ids=True, request_id="mine")
    choice = done.choices[0].model_extra
    assert choice["prompt_token_ids"] == list(PROMPT.encode())
    # The byte tokenizer spells ids past 255 (special and unused ones) as nothing.
    spelled = bytes(t for t in choice["token_ids"] if t < 256).decode(errors="replace")
    assert spelled == done.choices[0].text
    assert len(choice["token_ids"]) == done.usage.completion_tokens
    assert done.id == "cmpl-mine"
    body = {"model": "", "messages": CHAT, "max_tokens": 4, "return_token_ids": True}
    body |= {"temperature": 0, "ignore_eos": True}  # four tokens, whatever the model draws
    body |= {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx2.stream("POST", f"{fronts.http}/chat/completions", json=body, headers=headers) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
    assert chunks[0]["prompt_token_ids"] and chunks[0]["choices"][0]["delta"]["role"]
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert len(ids) == 4 and chunks[-1]["usage"]["completion_tokens"] == 4


def test_max_tokens_beside_max_completion_tokens(fronts: Fronts) -> None:
    done = fronts.client.chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=9,
        max_completion_tokens=3,
        extra_body=GREEDY["extra_body"],
    )
    assert done.usage.completion_tokens == 3


def test_inert_parameters_are_taken(fronts: Fronts) -> None:
    done = fronts.client.completions.create(
        model="", prompt=PROMPT, max_tokens=2, user="u1", extra_body={"metadata": {"k": "v"}}
    )
    assert done.choices[0].text is not None


REFUSED = {
    "prompt_logprobs": (21, "prompt_logprobs is 21; it must be an integer, 0 to 20"),
    "bad_words": (
        ["x"],
        'bad_words is ["x"]; this server bans no words (logit_bias or '
        "allowed_token_ids ban tokens)",
    ),
    "priority": (3, "priority is 3; this server schedules first come, first served (priority: 0)"),
    "cache_salt": ("s", 'cache_salt is "s"; this server keeps one prefix cache for every request'),
    "skip_special_tokens": (
        False,
        "skip_special_tokens is false; this server always leaves special tokens out of the text",
    ),
    "add_special_tokens": (
        True,
        "add_special_tokens is true; this server tokenizes prompts as "
        "given, adding no special tokens",
    ),
    "guided_decoding_backend": (
        "xgrammar",
        'guided_decoding_backend is "xgrammar"; this server decodes every grammar with llguidance',
    ),
    "use_beam_search": (True, "use_beam_search is true; this server has no beam search"),
    "frobnicate": (
        1,
        "frobnicate is not a parameter of this endpoint; this server does not take it",
    ),
    "structured_outputs": (
        {"whitespace_pattern": " "},
        "structured_outputs.whitespace_pattern "
        "is not taken here; this server takes structured_outputs.json, "
        "structured_outputs.regex, structured_outputs.choice, "
        "structured_outputs.grammar, structured_outputs.json_object",
    ),
    "truncate_prompt_tokens": (
        0,
        "truncate_prompt_tokens is 0; keep at least 1 token, or -1 for the context's most",
    ),
}


@pytest.mark.parametrize(
    ("name", "value", "sentence"), [(k, *v) for k, v in REFUSED.items()], ids=REFUSED.keys()
)
def test_a_parameter_not_honoured_is_refused(
    fronts: Fronts, name: str, value: Any, sentence: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        complete(fronts, **{name: value})
    assert caught.value.body["param"] == (
        name if name != "structured_outputs" else "structured_outputs.whitespace_pattern"
    )
    assert caught.value.body["message"] == sentence


def test_a_context_overflow_speaks_vllms_words(fronts: Fronts) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.completions.create(model="", prompt="z" * 500, max_tokens=100)
    assert caught.value.body["param"] == "max_tokens"
    assert caught.value.body["message"] == (
        "This model's maximum context length is 512 tokens. However, you requested 600 tokens "
        "(500 in the messages, 100 in the completion). Please reduce the length of the "
        "messages or completion."
    )
