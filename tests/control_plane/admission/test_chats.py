"""A chat's messages as its template takes them: several leading system messages (pydantic-ai
sends its instructions and its system prompt so) are merged where Qwen3.6's template refuses
them, and left apart where a template takes them; a system message after the conversation began
is refused naming it; the server's template variables sit under the request's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.admission.chats import render
from control_plane.admission.refusal import BadRequest
from control_plane.cli.server import admission
from control_plane.text.chat import ChatTemplate
from met.main import build_parser
from protos.params import ChatMessage, RequestParams
from tests.hf_checkpoint import TEMPLATE as CHATML

QWEN3_6 = ChatTemplate(
    (Path(__file__).parents[2] / "fixtures/qwen3.6/chat_template.jinja").read_text(), {}
)
SYSTEMS = (
    ChatMessage("system", "Be brief."),
    ChatMessage("system", "Answer in JSON."),
    ChatMessage("user", "Hi"),
)


def chat(*messages: ChatMessage, **fields) -> RequestParams:
    return RequestParams(messages=messages, **fields)


def test_leading_system_messages_merge_where_the_template_needs_it() -> None:
    merged = chat(ChatMessage("system", "Be brief.\n\nAnswer in JSON."), SYSTEMS[2])
    assert render(chat(*SYSTEMS), QWEN3_6) == render(merged, QWEN3_6)
    chatml = ChatTemplate(CHATML, {})  # takes them: both stay
    assert render(chat(*SYSTEMS), chatml).count("<|im_start|>system") == 2


def test_a_late_system_message_is_refused_naming_it() -> None:
    late = chat(*SYSTEMS[:1], SYSTEMS[2], ChatMessage("assistant", "Hello"), SYSTEMS[1])
    with pytest.raises(BadRequest) as caught:
        render(late, QWEN3_6)
    assert caught.value.param == "messages"
    assert str(caught.value).startswith(
        "messages[3] is a system message after the conversation began; this model's chat "
        "template takes system messages only at the start (it says: System message must be at "
        "the beginning.)"
    )


def test_the_servers_variables_under_the_requests() -> None:
    off = {"enable_thinking": False}
    assert render(chat(SYSTEMS[2]), QWEN3_6, defaults=off).endswith("<think>\n\n</think>\n\n")
    on = chat(SYSTEMS[2], chat_template_kwargs='{"enable_thinking": true}')
    assert render(on, QWEN3_6, defaults=off).endswith("<think>\n")


def test_the_flag_sets_the_servers_variables(capsys: pytest.CaptureFixture) -> None:
    serve = ["control-plane", "serve", "--gpu-service", "localhost:1"]
    flag = "--default-chat-template-kwargs"
    args = build_parser().parse_args([*serve, flag, '{"enable_thinking": false}'])
    assert admission(args).chat_kwargs == {"enable_thinking": False}
    assert admission(build_parser().parse_args(serve)).chat_kwargs == {}
    with pytest.raises(SystemExit):
        build_parser().parse_args([*serve, flag, "[1]"])
    assert f"{flag} is [1]; it must be a JSON object" in capsys.readouterr().err
