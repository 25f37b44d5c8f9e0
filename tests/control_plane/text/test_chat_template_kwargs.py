"""A chat template's own variables (vLLM's `chat_template_kwargs`, such as Qwen3's
`enable_thinking`): rendered as transformers' `apply_chat_template(..., **kwargs)` renders them,
taken over the gRPC API, the OpenAI front and `met generate`; a value that is not a JSON object,
or a name the server sets itself, is INVALID_ARGUMENT (HTTP 400) with a sentence. An image,
audio or video part of a message is a 400 too: the server serves text, and text parts are
joined with newlines as vLLM joins them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from control_plane.admission import auth
from control_plane.admission.door import Admission, admit
from control_plane.cli import generate
from control_plane.fronts.openai_body import chat_request
from control_plane.fronts.openai_fields import InvalidParam
from control_plane.text.chat import SERVER_SET, TEMPLATE_FILE, ChatTemplate, parse_kwargs
from control_plane.text.tokenizer import Tokenization
from gpu_service.engine.facade import Engine
from met.main import build_parser
from protos.met.v1 import generate_pb2 as pb
from protos.params import from_pb
from tests.control_plane.fronts.test_openai_http import KEY, ONE_SLOT, Fronts, serving
from tests.control_plane.text.test_chat import CHAT, QWEN3, both, messages, save_checkpoint

OFF = {"enable_thinking": False}
TURN = CHAT[:2]  # a system message and a user's
# Every kind of JSON value, and a special token overridden, as transformers lets kwargs do.
VALUES = (
    "{{ bos_token }}|{{ n }}|{{ x }}|{{ items | tojson }}|{{ flag }}|{{ missing is defined }}"
    "{% for m in messages %}|{{ m.content }}{% endfor %}"
)
VALUE_KWARGS = {"bos_token": "<B>", "n": 3, "x": 1.5, "items": [1, {"a": None}, "é"], "flag": None}
CASES = {
    "thinking-off": (QWEN3, OFF),
    "thinking-on": (QWEN3, {"enable_thinking": True}),
    "json-values": (VALUES, VALUE_KWARGS),
}


@pytest.mark.parametrize(("template", "kwargs"), CASES.values(), ids=CASES.keys())
def test_render_matches_transformers(tmp_path: Path, template: str, kwargs: dict) -> None:
    save_checkpoint(tmp_path, template, jinja=True)
    hf, ours = both(tmp_path)
    want = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render(CHAT, True, kwargs) == want


def test_thinking_off_closes_an_empty_think_block() -> None:
    template = ChatTemplate(QWEN3, {})
    plain = template.render(TURN, True)
    assert template.render(TURN, True, OFF) == plain + "<think>\n\n</think>\n\n"
    assert template.render(TURN, False, OFF) == template.render(TURN, False)


@pytest.mark.parametrize("name", SERVER_SET)
def test_a_name_the_server_sets_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"^chat_template_kwargs may not set {name}; "):
        ChatTemplate(QWEN3, {}).render(TURN, True, {name: 1})


NOT_KWARGS = {
    "array": ("[1]", "chat_template_kwargs is [1]; it must be a JSON object of template variables"),
    "not-json": ("{", "chat_template_kwargs is not JSON text: "),
    "too-deep": ("[" * 100_000, "chat_template_kwargs is not JSON text: "),
    "surrogate": ('{"a": "\\ud800"}', "chat_template_kwargs holds text that is not valid Unicode"),
}


@pytest.mark.parametrize(("text", "sentence"), NOT_KWARGS.values(), ids=NOT_KWARGS.keys())
def test_parse_refuses_what_is_not_a_json_object(text: str, sentence: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_kwargs(text)
    assert str(caught.value).startswith(sentence)


def test_parse_reads_a_json_object() -> None:
    assert parse_kwargs("") == {}
    assert parse_kwargs('{"enable_thinking": false, "n": 2}') == {"enable_thinking": False, "n": 2}


# -- over the fronts -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with Qwen3's template, which branches on `enable_thinking`."""
    directory = tmp_path_factory.mktemp("qwen3-template") / "model"
    shutil.copytree(tiny_dir, directory)
    (directory / TEMPLATE_FILE).write_text(QWEN3)
    return directory


@pytest.fixture(scope="module")
def fronts(qwen3_dir: Path) -> Iterator[Fronts]:
    with serving(Engine(qwen3_dir, ONE_SLOT), 1) as f:
        yield f


def hf_ids(directory: Path, chat: list[dict[str, str]], **kwargs: Any) -> list[int]:
    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    return hf.apply_chat_template(chat, add_generation_prompt=True, **kwargs)["input_ids"]


def test_the_door_tokenizes_transformers_rendering(fronts: Fronts, qwen3_dir: Path) -> None:
    tokenization = Tokenization.from_dir(qwen3_dir)
    request = pb.GenerateRequest(
        messages=messages(TURN), chat_template_kwargs='{"enable_thinking": false}'
    )
    chat = ChatTemplate.from_files(tokenization.files)
    caps = fronts.engine.capabilities()
    req, _ = admit(from_pb(request), tokenization.tokenizer, caps, Admission(), "r", chat=chat)
    assert list(req.prompt_ids) == hf_ids(qwen3_dir, TURN, **OFF) != hf_ids(qwen3_dir, TURN)


def prompt_tokens(fronts: Fronts, request: pb.GenerateRequest) -> int:
    replies = fronts.stub.Generate(request, metadata=auth.bearer(KEY), timeout=120)
    return [m.usage.prompt_tokens for m in replies][-1]


def test_both_fronts_render_with_the_variables(fronts: Fronts, qwen3_dir: Path) -> None:
    off, default = hf_ids(qwen3_dir, TURN, **OFF), hf_ids(qwen3_dir, TURN)
    request = pb.GenerateRequest(
        messages=messages(TURN), chat_template_kwargs='{"enable_thinking": false}', max_new_tokens=1
    )
    assert prompt_tokens(fronts, request) == len(off)

    def chat(extra_body: dict | None = None) -> int:
        done = fronts.client.chat.completions.create(
            model="", messages=TURN, max_tokens=1, temperature=0, extra_body=extra_body
        )
        assert done.usage is not None
        return done.usage.prompt_tokens

    assert chat(extra_body={"chat_template_kwargs": OFF}) == len(off)
    assert chat() == len(default) != len(off)


GRPC_REFUSED = {
    "not-an-object": (
        {"messages": messages(TURN), "chat_template_kwargs": "[1]"},
        "chat_template_kwargs is [1]; it must be a JSON object of template variables",
    ),
    "server-set": (
        {"messages": messages(TURN), "chat_template_kwargs": '{"add_generation_prompt": false}'},
        "chat_template_kwargs may not set add_generation_prompt; the server sets it to the "
        "request's add_generation_prompt field",
    ),
    "no-messages": (
        {"prompt": "def f():", "chat_template_kwargs": '{"enable_thinking": false}'},
        "chat_template_kwargs are variables of the chat template; this request has no messages",
    ),
}


@pytest.mark.parametrize(("fields", "sentence"), GRPC_REFUSED.values(), ids=GRPC_REFUSED.keys())
def test_bad_variables_are_invalid_argument(fronts: Fronts, fields: dict, sentence: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        prompt_tokens(fronts, pb.GenerateRequest(**fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == sentence


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
TEXT = {"type": "text", "text": "What is this?"}
HTTP_REFUSED = {
    "image": (
        {"messages": [{"role": "user", "content": [TEXT, IMAGE]}]},
        "messages",
        "messages[0].content[1] is an image; this server serves text only (the checkpoint "
        "has no vision_config)",
    ),
    "audio": (
        {"messages": [{"role": "user", "content": [AUDIO]}]},
        "messages",
        "messages[0].content[0] is of type input_audio; this server takes text and images (no "
        "audio encoder is loaded)",
    ),
    "kwargs-not-an-object": (
        {"messages": TURN, "extra_body": {"chat_template_kwargs": [1]}},
        "chat_template_kwargs",
        "chat_template_kwargs is [1]; it must be an object",
    ),
    "kwargs-server-set": (
        {"messages": TURN, "extra_body": {"chat_template_kwargs": {"messages": []}}},
        "chat_template_kwargs",
        "chat_template_kwargs may not set messages; the server sets it to the request's messages",
    ),
}


@pytest.mark.parametrize(("fields", "param", "sentence"), HTTP_REFUSED.values(), ids=HTTP_REFUSED)
def test_media_parts_and_bad_variables_are_400(
    fronts: Fronts, fields: dict, param: str | None, sentence: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.chat.completions.create(model="", max_tokens=1, **fields)
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "message": sentence,
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_argument",
    }


def test_text_parts_are_joined_and_served_beside_a_refused_image(
    fronts: Fronts, qwen3_dir: Path
) -> None:
    parts = [TEXT, {"type": "text", "text": "A list."}]
    ask = chat_request({"messages": [{"role": "user", "content": parts}]})
    assert ask.request.messages[0].content == "What is this?\nA list."
    with pytest.raises(openai.BadRequestError):
        fronts.client.chat.completions.create(
            model="", messages=[{"role": "user", "content": [TEXT, IMAGE]}], max_tokens=1
        )
    done = fronts.client.chat.completions.create(
        model="", messages=[{"role": "user", "content": parts}], max_tokens=1, temperature=0
    )
    want = hf_ids(qwen3_dir, [{"role": "user", "content": "What is this?\nA list."}])
    assert done.usage is not None and done.usage.prompt_tokens == len(want)


def test_a_part_of_no_known_type_is_refused() -> None:
    for kind in ("audio_url", ["image_url"], None):
        with pytest.raises(
            InvalidParam, match=r"^messages\[0\].content\[0\] is .*text and image_url parts"
        ):
            chat_request({"messages": [{"role": "user", "content": [{"type": kind}]}]})


# -- met generate ----------------------------------------------------------------------------


def cli_request(*argv: str) -> pb.GenerateRequest:
    return generate.build_request(build_parser().parse_args(["generate", *argv, "Sum a list."]))


def test_generate_takes_the_variables_and_the_thinking_shorthand() -> None:
    off = cli_request("--no-enable-thinking")
    assert list(off.messages) == messages(TURN[1:])
    assert parse_kwargs(off.chat_template_kwargs) == OFF
    merged = cli_request(
        "--chat-template-kwargs", '{"n": 2, "enable_thinking": false}', "--enable-thinking"
    )
    assert parse_kwargs(merged.chat_template_kwargs) == {"n": 2, "enable_thinking": True}
    assert not cli_request("--chat").chat_template_kwargs
    with pytest.raises(SystemExit, match="^chat_template_kwargs is \\[1\\]; it must be a JSON"):
        cli_request("--chat-template-kwargs", "[1]")


# The chat template Qwen3.6-35B-A3B ships (byte for byte as its NVFP4 release lists it): thinking
# on by default, `enable_thinking` and `preserve_thinking` read from the kwargs.
QWEN3_6 = (Path(__file__).parents[2] / "fixtures/qwen3.6/chat_template.jinja").read_text()
QWEN3_6_CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sum a list."},
    {"role": "assistant", "content": "<think>\nsum() does it.\n</think>\n\nUse sum(values)."},
    {"role": "user", "content": "And the mean?"},
]


@pytest.mark.parametrize(
    "kwargs",
    [{}, OFF, {"enable_thinking": True}, {"preserve_thinking": True}],
    ids=["default", "thinking-off", "thinking-on", "preserve-thinking"],
)
def test_qwen3_6s_template_renders_as_transformers(tmp_path: Path, kwargs: dict) -> None:
    save_checkpoint(tmp_path, QWEN3_6, jinja=True)
    hf, ours = both(tmp_path)
    for gen in (True, False):
        want = hf.apply_chat_template(
            QWEN3_6_CHAT, tokenize=False, add_generation_prompt=gen, **kwargs
        )
        assert ours.render(QWEN3_6_CHAT, gen, kwargs) == want
    # thinking opens the reply's think block; with it off the block comes closed and empty
    closed = "<think>\n\n</think>\n\n" if kwargs == OFF else "<think>\n"
    assert ours.render(QWEN3_6_CHAT, True, kwargs).endswith("<|im_start|>assistant\n" + closed)
