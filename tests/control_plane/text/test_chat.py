"""Chat requests: a checkpoint's chat template renders as transformers' `apply_chat_template`
renders it, and a request with messages generates what its rendered prompt generates; a model
without a template, or a chat its template refuses, is INVALID_ARGUMENT with a sentence."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import grpc
import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from control_plane.admission import workers
from control_plane.admission.door import Admission, BadRequest, admit
from control_plane.admission.work import WorkerSetup
from control_plane.cli import generate
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.chat import CONFIG_FILE, TEMPLATE_FILE, ChatTemplate
from control_plane.text.tokenizer import Tokenization
from gpu_service.engine.facade import Engine
from met.main import build_parser
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import from_pb
from tests.conftest import TINY_SERVICE
from tests.servers import serving

# Qwen3's template without its tool calls: system first, the last query found by a reversed
# walk with a namespace, reasoning split out of assistant turns after it.
QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
        and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501
# tojson (its options, no HTML escaping, non-ASCII kept), loop controls, the special tokens and
# strftime_now.
LOOPS = """\
{{ bos_token }}
{% for message in messages %}
{% if message.role == 'system' %}{% continue %}{% endif %}
{{ loop.index }}: {{ message | tojson }}
{% if message.content == 'stop' %}{% break %}{% endif %}
{% endfor %}
{{ {'n': messages | length, 'text': '<é>'} | tojson(indent=2, sort_keys=true) }}
{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}{{ eos_token }}{% endif %}
"""
# transformers' `{% generation %}` block, which marks the assistant's tokens.
GENERATION = """\
{% for m in messages %}
{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}[{% endif %}
"""
REFUSING = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('only user and assistant turns, not ' + m.role) }}"
    "{% endif %}{{ m.content }}{% endfor %}"
)
CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sum a list."},
    {"role": "assistant", "content": "<think>\nsum()\n</think>\n\nUse sum(values)."},
    {"role": "user", "content": "And stop"},
    {"role": "assistant", "content": "stop"},
    {"role": "user", "content": "Now with <tags> & é."},
]
CASES = {
    "qwen3-from-jinja": (QWEN3, True),
    "qwen3-from-config": (QWEN3, False),
    "named-from-config": ({"default": QWEN3, "tool_use": "tools"}, False),
    "tojson-loopcontrols": (LOOPS, True),
    "generation-block": (GENERATION, True),
}


def _word_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "sum": 1, "list": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def save_checkpoint(directory: Path, template: str | dict[str, str], jinja: bool) -> None:
    """Tokenizer files as transformers saves them: the template in chat_template.jinja, or
    (`jinja` False, as before transformers 5) in tokenizer_config.json."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="[UNK]",
        pad_token="<pad>",
    )
    hf.chat_template = template
    hf.save_pretrained(directory, save_jinja_files=jinja)
    assert (directory / TEMPLATE_FILE).exists() == jinja


def both(directory: Path) -> tuple[PreTrainedTokenizerFast, ChatTemplate]:
    """transformers' tokenizer and our template, each loaded from the checkpoint's files."""
    ours = ChatTemplate.from_files(Tokenization.from_dir(directory).files)
    assert ours is not None
    return PreTrainedTokenizerFast.from_pretrained(directory), ours


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "no-gen"])
@pytest.mark.parametrize(("template", "jinja"), CASES.values(), ids=CASES.keys())
def test_render_matches_transformers(
    tmp_path: Path, template: str | dict[str, str], jinja: bool, add_generation_prompt: bool
) -> None:
    save_checkpoint(tmp_path, template, jinja)
    hf, ours = both(tmp_path)
    want = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.render(CHAT, add_generation_prompt) == want


def test_special_tokens_match_transformers(tmp_path: Path) -> None:
    """Named and model-specific special tokens, plain or as AddedToken dicts; other `*_token`
    keys (a flag) stay out of the context."""
    save_checkpoint(tmp_path, "", jinja=False)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "</s>", "special": True}
    config |= {"image_token": "<img>", "add_bos_token": False}
    config["chat_template"] = "{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ pad_token }}"
    config["chat_template"] += "|{{ unk_token }}|{{ add_bos_token }}"
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    hf, ours = both(tmp_path)
    want = hf.apply_chat_template(CHAT, tokenize=False)
    assert ours.render(CHAT, False) == want == "<s>|</s>|<img>|<pad>|[UNK]|"


def test_raise_exception_is_a_value_error(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, REFUSING, jinja=True)
    hf, ours = both(tmp_path)
    with pytest.raises(jinja2.TemplateError, match="not system"):
        hf.apply_chat_template(CHAT, tokenize=False)
    with pytest.raises(ValueError) as caught:
        ours.render(CHAT, True)
    sentence = "the chat template refuses these messages: only user and assistant turns, not system"
    assert str(caught.value) == sentence
    assert ours.render(CHAT[1:2], True) == "Sum a list."


def test_a_template_that_fails_or_does_not_compile_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^the chat template does not compile \(line 1\)"):
        ChatTemplate("{% for %}", {})
    with pytest.raises(ValueError, match="^the chat template failed on these messages"):
        ChatTemplate("{{ messages[0].content + 1 }}", {}).render(CHAT, True)
    with pytest.raises(ValueError, match="underscore names are refused"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render(CHAT, True)


@pytest.mark.parametrize(
    "files",
    [
        {},
        {CONFIG_FILE: b'{"bos_token": "<s>"}'},
        {CONFIG_FILE: json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]})},
    ],
    ids=["no-files", "no-template", "no-default"],
)
def test_no_template_is_none(files: Mapping[str, bytes | str]) -> None:
    as_bytes = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
    assert ChatTemplate.from_files(as_bytes) is None


def test_fresh_checkpoints_carry_the_bundled_template(tiny_dir: Path) -> None:
    bundled = (DEFAULT_MODEL_DIR / TEMPLATE_FILE).read_bytes()
    assert (tiny_dir / TEMPLATE_FILE).read_bytes() == bundled
    template = ChatTemplate.from_files(Tokenization.from_dir(DEFAULT_MODEL_DIR).files)
    assert template is not None
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "def f():"}]
    rendered = "<|bos|><|system|>\nS\n<|user|>\ndef f():\n"
    assert template.render(chat, False) == rendered
    assert template.render(chat, True) == rendered + "<|assistant|>\n"


# -- over the API ----------------------------------------------------------------------------


@dataclasses.dataclass
class Api:
    stub: pb_grpc.GenerationServiceStub
    scheduler: Scheduler


@pytest.fixture(scope="module")
def api(tiny_dir: Path) -> Iterator[Api]:
    """The generation API on a grpc.aio server in a thread, over an in-process engine whose
    tokenizer files (the tiny checkpoint's: the default template) come from the checkpoint."""
    engine = Engine(tiny_dir, TINY_SERVICE)
    scheduler = Scheduler(lambda: engine, Tokenization.from_dir(tiny_dir))
    with serving(scheduler) as target, grpc.insecure_channel(target) as channel:
        yield Api(pb_grpc.GenerationServiceStub(channel), scheduler)


@contextmanager
def serving_template(scheduler: Scheduler, template: str | None) -> Iterator[None]:
    """The served model's files with another chat template (None: none), as when the service
    comes back with another model."""
    before = scheduler.tokenization
    assert before is not None
    files = {k: v for k, v in before.files.items() if k != TEMPLATE_FILE}
    if template is not None:
        files[TEMPLATE_FILE] = template.encode()
    scheduler.tokenization = dataclasses.replace(before, files=files)
    try:
        yield
    finally:
        scheduler.tokenization = before


def messages(chat: list[dict[str, str]]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat]


def generated(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> list[int]:
    """Eight tokens for the request."""
    short = pb.GenerateRequest(max_new_tokens=8, ignore_eos=True)
    short.MergeFrom(request)
    return [t for msg in stub.Generate(short, timeout=60) for t in msg.token_ids]


def test_messages_generate_as_their_rendered_prompt(api: Api, tiny_dir: Path) -> None:
    template = ChatTemplate.from_files(Tokenization.from_dir(tiny_dir).files)
    assert template is not None
    for flag in (None, True, False):
        request = pb.GenerateRequest(messages=messages(CHAT[:2]), add_generation_prompt=flag)
        text = template.render(CHAT[:2], flag is not False)
        assert generated(api.stub, request) == generated(api.stub, pb.GenerateRequest(prompt=text))


def test_chat_tokens_match_transformers(api: Api, tiny_dir: Path) -> None:
    """A chat's ids are transformers' `apply_chat_template(..., tokenize=True)`: the rendered
    text, its special tokens as written, nothing added."""
    tokenization = Tokenization.from_dir(tiny_dir)
    caps = api.scheduler.capabilities()
    request = pb.GenerateRequest(messages=messages(CHAT[:2]))
    chat = ChatTemplate.from_files(tokenization.files)
    req, _ = admit(from_pb(request), tokenization.tokenizer, caps, Admission(), "r", chat=chat)
    hf = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    want = hf.apply_chat_template(CHAT[:2], add_generation_prompt=True)["input_ids"]
    assert list(req.prompt_ids) == want and want[0] == hf.bos_token_id


def test_the_rendered_chat_is_held_to_the_prompt_bound(api: Api, tiny_dir: Path) -> None:
    tokenization = Tokenization.from_dir(tiny_dir)
    chat = ChatTemplate.from_files(tokenization.files)
    assert chat is not None
    size = len(chat.render(CHAT[:2], True).encode())
    caps, request = api.scheduler.capabilities(), pb.GenerateRequest(messages=messages(CHAT[:2]))
    for bound in (size, size - 1):
        admission = Admission(max_prompt_bytes=bound)
        if bound == size:
            assert admit(from_pb(request), tokenization.tokenizer, caps, admission, "r", chat=chat)
            continue
        with pytest.raises(BadRequest) as caught:
            admit(from_pb(request), tokenization.tokenizer, caps, admission, "r", chat=chat)
        assert str(caught.value) == (
            f"the rendered chat is longer than {size - 1} bytes, the most this server takes"
        )


USER = messages(CHAT[1:2])
REFUSED = {
    "prompt-and-messages": (
        pb.GenerateRequest(prompt="a", messages=USER),
        "give one of prompt, prompt_token_ids and messages; this request has prompt and messages",
    ),
    "ids-and-messages": (
        pb.GenerateRequest(prompt_token_ids=[1], messages=USER),
        "give one of prompt, prompt_token_ids and messages; this request has prompt_token_ids "
        "and messages",
    ),
    "empty-role": (
        pb.GenerateRequest(messages=[*USER, pb.ChatMessage(content="x")]),
        "messages[1] has an empty role",
    ),
}


@pytest.mark.parametrize(("request_", "sentence"), REFUSED.values(), ids=REFUSED.keys())
def test_a_bad_chat_request_is_refused(api: Api, request_: pb.GenerateRequest, sentence: str):
    assert refusal(api.stub, request_) == sentence


def test_a_model_without_a_template_refuses_messages(api: Api) -> None:
    with serving_template(api.scheduler, None):
        assert refusal(api.stub, pb.GenerateRequest(messages=USER)) == (
            "the model has no chat template, so it cannot take messages; send a prompt"
        )
        assert generated(api.stub, pb.GenerateRequest(prompt="def f():"))


def test_a_refusing_template_refuses_that_request_alone(api: Api) -> None:
    with serving_template(api.scheduler, REFUSING):
        assert refusal(api.stub, pb.GenerateRequest(messages=messages(CHAT[:2]))) == (
            "the chat template refuses these messages: only user and assistant turns, not system"
        )
        assert generated(api.stub, pb.GenerateRequest(messages=USER))
    with serving_template(api.scheduler, "{% for %}"):
        assert refusal(api.stub, pb.GenerateRequest(messages=USER)).startswith(
            "the model's chat template is unusable: the chat template does not compile"
        )


def test_the_door_compiles_a_template_once_per_model(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker compiles the model's template when it is set up for the model: once, and
    again when the served model's files change."""
    calls = []
    set_up = workers._Worker.set_up

    def counted(worker: workers._Worker, setup: WorkerSetup, memory_mb: int) -> None:
        calls.append(setup)
        set_up(worker, setup, memory_mb)

    monkeypatch.setattr(workers._Worker, "set_up", counted)
    request = pb.GenerateRequest(messages=USER)
    with serving_template(api.scheduler, GENERATION):
        generated(api.stub, request)
        generated(api.stub, request)
        generated(api.stub, pb.GenerateRequest(prompt="no chat"))
        assert len(calls) == 1
    generated(api.stub, request)
    assert len(calls) == 2


def refusal(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.details()


# -- met generate --chat ---------------------------------------------------------------------


def test_generate_chat_builds_messages() -> None:
    def request(*argv: str) -> pb.GenerateRequest:
        return generate.build_request(build_parser().parse_args(["generate", *argv]))

    assert request("def f():") == pb.GenerateRequest(prompt="def f():", top_p=1.0)
    chat = request("--chat", "Sum a list.")
    assert not chat.prompt and list(chat.messages) == USER
    system = request("--system", "You write Python.", "Sum a list.")
    assert list(system.messages) == messages(CHAT[:2])
    assert request("--chat", "--system", "You write Python.", "Sum a list.") == system


TURNS = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sum a list."},
]
ANSWER = "Use sum(values)."


def _turn_starts_with_the_last(template: ChatTemplate) -> None:
    """Turn 2's rendering starts with turn 1's prompt and its answer: what a multi-turn chat
    needs to hit the prefix cache with all of turn 1 (its snapshot at turn 1's last block)."""
    first = template.render(TURNS, True)
    nxt = [*TURNS, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Why?"}]
    assert template.render(nxt, True).startswith(first + ANSWER)


def test_the_bundled_template_renders_turns_that_start_with_the_last() -> None:
    template = ChatTemplate.from_files(Tokenization.from_dir(DEFAULT_MODEL_DIR).files)
    assert template is not None
    _turn_starts_with_the_last(template)


# The chat formats among the test templates; the others render a trailer over every message
# (a count, a summary), so a later turn shares with the last only its common blocks.
CHAT_FORMATS = [k for k in CASES if k.startswith(("qwen3", "named"))]


@pytest.mark.parametrize("case", CHAT_FORMATS)
def test_the_test_templates_render_turns_that_start_with_the_last(
    tmp_path: Path, case: str
) -> None:
    save_checkpoint(tmp_path, *CASES[case])
    _, ours = both(tmp_path)
    _turn_starts_with_the_last(ours)
