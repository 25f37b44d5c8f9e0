"""Issue 61's acceptance through both real processes: a Qwen3.5 checkpoint written by
transformers, served with Qwen3.6's chat template (thinking on, its default) under a served name
of the family's, and the client libraries agents are built on, each over a real socket: the
openai SDK (a required and a named tool, the stream rebuilt as OpenAI's docs rebuild it, tools
under `auto` beside a response format, `.parse()`), openai-agents on its chat-completions and
its Responses model, pydantic-ai with a tool and a structured output, LangChain's
`with_structured_output` (json_schema and function_calling), and the anthropic SDK (a tool,
whole and streamed; `count_tokens`). Each gets its call or object and the reasoning apart,
under `none`, `mtp` and `dflash`, and with thinking off by the server's
`--default-chat-template-kwargs` (a second control plane on the same GPU service).

The model is random: every output is forced (a required or named tool, a response format), the
reasoning is closed by a budget of a few tokens, decoding is greedy, and the tests check shapes
and schemas, never words."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.text.chat import TEMPLATE_FILE
from gpu_service.model.config import ModelConfig
from tests.gpu_service.dflash.drafter import write_drafter
from tests.qwen3_5_checkpoint import make

# Slow: serves a transformers checkpoint with a GPU service and two control planes.
pytestmark = pytest.mark.slow

QWEN3_6 = Path(__file__).parents[1] / "fixtures/qwen3.6/chat_template.jinja"
MODEL = "Qwen/Qwen3.6-35B-A3B"
KEY = "unused"
BUDGET = 4  # reasoning tokens before the close is forced
MAX_TOKENS = 200  # the budget, the close and a call of about 100 byte-level tokens
ASK = "Weather in Oslo?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
THINKING_OFF = ("--default-chat-template-kwargs", json.dumps({"enable_thinking": False}))
TOOL = {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}
THINK_TAGS = ("<think>", "</think>")


class Forecast(pydantic.BaseModel):
    # Closed: a schema that allows more keys lets a random model write them until max_tokens.
    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Oslo", "Rome"]
    warm: bool


@dataclass(frozen=True)
class Config:
    method: str | None  # the speculative method a request names; None: the server's (mtp)
    thinking: bool  # the template's default, on; off by the server's default variables

    @property
    def extra_body(self) -> dict[str, Any]:
        """What an OpenAI-shaped request adds in its body for this configuration."""
        body: dict[str, Any] = {"thinking_token_budget": BUDGET} if self.thinking else {}
        if self.method is not None:
            body["speculative"] = {"method": self.method}
        return body


CONFIGS = {
    "none": Config("none", True),
    "mtp": Config("mtp", True),
    "dflash": Config("dflash", True),
    "thinking-off": Config(None, False),
}


@dataclass(frozen=True)
class Server:
    root: str  # http://host:port, Anthropic's base URL
    config: Config

    @property
    def base(self) -> str:
        """OpenAI's base URL."""
        return f"{self.root}/v1"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=KEY, max_retries=0, timeout=120)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base, api_key=KEY, max_retries=0, timeout=120)


def serve_http(gpu_service: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """A control plane on `gpu_service` serving HTTP under the family's name; -> it and its
    HTTP root."""
    seen: list[str] = []
    cp, _ = start_control_plane(
        gpu_service, "--http-port", "0", "--served-model-name", MODEL, *extra, seen=seen
    )
    base = next(line.split(" on ", 1)[1].strip() for line in seen if "OpenAI API on" in line)
    return cp, base.removesuffix("/v1")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, str]]:
    """One GPU service (the checkpoint, its MTP layer and a DFlash drafter) and two control
    planes on it: thinking as the template has it, and off by the server's default; -> each
    one's HTTP root by thinking."""
    directory = tmp_path_factory.mktemp("qwen3.6") / "model"
    directory.mkdir()
    make(directory, "dense")
    shutil.copy(QWEN3_6, directory / TEMPLATE_FILE)
    target = ModelConfig.load(directory)
    drafter = write_drafter(tmp_path_factory.mktemp("dflash"), target, taps=(0, 3))
    args = ("--max-context", "4096", "--verify-tiers", "2:3", "--drafter", str(drafter))
    gpu, gpu_service = start_gpu_service(directory, *args)
    started: list[subprocess.Popen] = []
    roots: dict[bool, str] = {}
    try:
        for thinking, extra in ((True, ()), (False, THINKING_OFF)):
            cp, roots[thinking] = serve_http(gpu_service, *extra)
            started.append(cp)
        yield roots
    finally:
        for cp in started:
            stop(cp)
        stop(gpu)


@pytest.fixture(params=list(CONFIGS), scope="module")
def server(request: pytest.FixtureRequest, roots: dict[bool, str]) -> Server:
    config = CONFIGS[request.param]
    return Server(roots[config.thinking], config)


def apart(config: Config, reasoning: str | None, *outputs: str | None) -> None:
    """The reasoning is there when thinking is on, never in the outputs, and holds no tags."""
    if config.thinking:
        assert reasoning, "thinking on: the reasoning comes apart"
    else:
        assert not reasoning, "thinking off: no reasoning"
    for text in (reasoning, *outputs):
        assert not any(tag in (text or "") for tag in THINK_TAGS), text


def drafted_as_named(config: Config, speculative: dict[str, Any]) -> None:
    """The statistics beside the usage: a named method drafted, or `none` did not."""
    if config.method is not None:
        assert (speculative["drafted"] > 0) == (config.method != "none"), speculative


# -- the openai SDK ----------------------------------------------------------------------------


def test_openai_sdk_required_tool(server: Server) -> None:
    done = server.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=server.config.extra_body,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    apart(server.config, reasoning, choice.message.content, call.function.arguments)
    drafted_as_named(server.config, (done.model_extra or {})["speculative"])


def test_openai_sdk_named_tool_streamed(server: Server) -> None:
    """The deltas rebuilt as OpenAI's function calling guide rebuilds them: the first delta of
    an index is kept, the later ones' arguments, which come as they are generated, appended
    to it."""
    stream = server.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL, {"type": "function", "function": {"name": "ping", "parameters": {}}}],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body=server.config.extra_body,
    )
    final_tool_calls: dict[int, Any] = {}
    reasoning, content, finish, pieces = "", "", None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tool_call in delta.tool_calls or []:
            pieces += 1
            index = tool_call.index
            if index not in final_tool_calls:
                final_tool_calls[index] = tool_call
            else:
                final_tool_calls[index].function.arguments += tool_call.function.arguments
    assert finish == "tool_calls" and list(final_tool_calls) == [0]
    assert pieces > 2, "the arguments stream as they are generated"
    call = final_tool_calls[0]
    assert call.id and call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    apart(server.config, reasoning, content, call.function.arguments)


def test_openai_sdk_auto_tools_on_a_forced_text(server: Server) -> None:
    """Tools offered under `auto` beside a response format: the format holds, so the output is
    its object, and no call."""
    done = server.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL],
        tool_choice="auto",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "schema": Forecast.model_json_schema()},
        },
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=server.config.extra_body,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    Forecast.model_validate_json(choice.message.content or "")
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    apart(server.config, reasoning, choice.message.content)


def test_openai_sdk_parse(server: Server) -> None:
    done = server.openai().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        response_format=Forecast,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=server.config.extra_body,
    )
    message = done.choices[0].message
    assert isinstance(message.parsed, Forecast), message
    apart(server.config, (message.model_extra or {}).get("reasoning_content"), message.content)


# -- openai-agents -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat-completions", "responses"])
def test_openai_agents_function_tool(server: Server, api: str, stream: bool) -> None:
    """A forced call of a function tool, run whole and streamed; the run stops on it with the
    tool's own answer, and the model's reasoning is an item of its own."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ReasoningItem, ToolCallItem

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def weather(city: Literal["Oslo", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sun in {city}"

    async def run() -> Any:
        kind = OpenAIChatCompletionsModel if api == "chat-completions" else OpenAIResponsesModel
        settings = ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=server.config.extra_body,
        )
        agent = Agent(
            name="forecaster",
            instructions="Answer with the tool.",
            model=kind(model=MODEL, openai_client=server.async_openai()),
            tools=[weather],
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        if not stream:
            return await Runner.run(agent, ASK)
        streamed = Runner.run_streamed(agent, ASK)
        async for _ in streamed.stream_events():
            pass
        return streamed

    result = asyncio.run(run())
    assert len(asked) == 1 and result.final_output == f"sun in {asked[0]}"
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    assert len(calls) == 1
    reasoning = [i for i in result.new_items if isinstance(i, ReasoningItem)]
    texts = [
        part.text
        for item in reasoning
        for part in [*item.raw_item.summary, *(item.raw_item.content or [])]
    ]
    apart(server.config, "".join(texts), calls[0].raw_item.arguments)


# -- pydantic-ai -------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["tool", "native"])
def test_pydantic_ai_tool_then_structured_output(server: Server, output: str) -> None:
    """A tool called first, then the object: each step forces its part with a per-step
    `tool_choice`. The object comes by pydantic-ai's output tool through its plain OpenAI
    provider, which sends the agent's system prompt and its instructions as two system messages
    (merged for Qwen3.6's template, which takes one), or natively (a response format) through
    its vLLM provider, which sends the response format beside the step's forced tool (the
    call wins, as vLLM's tool parsers decide). The thinking parts come apart."""
    from pydantic_ai import Agent, NativeOutput, RunContext, ToolOutput
    from pydantic_ai.messages import TextPart, ThinkingPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.providers.vllm import VLLMProvider
    from pydantic_ai.settings import ModelSettings

    native = output == "native"

    def settings(ctx: RunContext[None]) -> ModelSettings:
        last: Any = "none" if native else ["forecast"]
        return ModelSettings(
            tool_choice=["weather"] if ctx.run_step <= 1 else last,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=server.config.extra_body,
        )

    provider = (VLLMProvider if native else OpenAIProvider)(base_url=server.base, api_key=KEY)
    agent = Agent(
        OpenAIChatModel(MODEL, provider=provider),
        output_type=NativeOutput(Forecast) if native else ToolOutput(Forecast, name="forecast"),
        system_prompt="You forecast.",
        instructions="Look the weather up, then forecast.",
        model_settings=settings,
    )

    @agent.tool_plain
    def weather(city: Literal["Oslo", "Rome"]) -> str:
        """The weather in a city."""
        return f"sun in {city}"

    result = asyncio.run(agent.run(ASK))
    assert isinstance(result.output, Forecast)
    parts = [p for m in result.all_messages() for p in getattr(m, "parts", [])]
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    assert [c.tool_name for c in calls] == ["weather"] + ([] if native else ["forecast"]), parts
    texts = [p.content for p in parts if isinstance(p, TextPart)]
    assert texts == ([result.output.model_dump_json()] if native else []), texts
    thinking = [p.content for p in parts if isinstance(p, ThinkingPart)]
    assert len(thinking) == (2 if server.config.thinking else 0), parts
    apart(server.config, "".join(thinking), *texts, *[c.args_as_json_str() for c in calls])


# -- LangChain ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server: Server, method: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=server.base,
        api_key=KEY,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        extra_body=server.config.extra_body,
    )
    structured = chat.with_structured_output(Forecast, method=method, include_raw=True)
    answer = structured.invoke(ASK)
    assert answer["parsing_error"] is None and isinstance(answer["parsed"], Forecast), answer
    raw = answer["raw"]
    if method == "json_schema":
        assert Forecast.model_validate_json(raw.content) == answer["parsed"]
    else:
        (call,) = raw.tool_calls
        assert call["name"] == "Forecast" and not raw.content
    assert not any(tag in str(raw.content) for tag in THINK_TAGS)


# -- the anthropic SDK -------------------------------------------------------------------------


def anthropic_fields(server: Server) -> dict[str, Any]:
    config = server.config
    fields: dict[str, Any] = dict(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": ASK}],
        tools=[{"name": "weather", "description": "The weather.", "input_schema": WEATHER}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},  # the SDK has no argument for it; vLLM's clients send it
    )
    if config.thinking:
        fields["thinking"] = {"type": "enabled", "budget_tokens": BUDGET}
    if config.method is not None:
        fields["extra_body"]["speculative"] = {"method": config.method}
    return fields


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool(server: Server, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0, timeout=120)
    fields = anthropic_fields(server)
    if stream:
        with client.messages.stream(**fields) as events:
            seen = list(events)
            message = events.get_final_message()
        pieces = [
            e.delta.partial_json
            for e in seen
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        (last,) = [e for e in seen if e.type == "message_delta"]
        speculative = (last.model_extra or {})["speculative"]
    else:
        message = client.messages.create(**fields)
        speculative = (message.model_extra or {})["speculative"]
    assert message.stop_reason == "tool_use", message
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    if stream:
        assert json.loads("".join(pieces)) == use.input
    kinds = [b.type for b in message.content]
    assert kinds == (["thinking", "tool_use"] if server.config.thinking else ["tool_use"]), kinds
    thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
    apart(server.config, thinking, json.dumps(use.input))
    drafted_as_named(server.config, speculative)


def test_anthropic_count_tokens(server: Server) -> None:
    """The count is the prompt the same fields generate from: the request's own usage."""
    client = anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0, timeout=120)
    fields = anthropic_fields(server)
    counted = client.messages.count_tokens(
        **{k: fields[k] for k in ("model", "messages", "tools", "tool_choice")},
        **({"thinking": fields["thinking"]} if "thinking" in fields else {}),
    )
    unforced = {"max_tokens": BUDGET + 2, "tool_choice": {"type": "auto"}}
    done = client.messages.create(**fields | unforced)
    usage = done.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
