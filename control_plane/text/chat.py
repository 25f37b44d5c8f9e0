"""A checkpoint's chat template, rendered as transformers' `apply_chat_template(messages,
tokenize=False, **kwargs)` renders it: the same sandboxed jinja2 environment and helpers, and the
same context (the messages, `add_generation_prompt`, the special tokens of tokenizer_config.json
and a request's own variables, such as Qwen3's `enable_thinking`), so that a chat becomes the
prompt the model was trained on."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import TOKENIZER_FILES

CONFIG_FILE, TEMPLATE_FILE = TOKENIZER_FILES[1:3]  # tokenizer_config.json, chat_template.jinja
KWARGS = "chat_template_kwargs"  # the request field of a template's own variables
# The context the server sets itself, by name, and what it sets: a template variable of a
# request may not take their place (transformers too refuses a second `messages`).
SERVER_SET = {
    "messages": "the request's messages",
    "add_generation_prompt": "the request's add_generation_prompt field",
    "tools": "the request's tools field",
    "documents": "none: this server takes no documents",
}


# A chat template's source, at most: published templates are a few kilobytes (Qwen3.6's about
# 8), and compiling costs time and memory by its size.
MAX_TEMPLATE_BYTES = 256 << 10
# The longest string or list a template's `*` may make: one expression could otherwise fill
# the memory before the rendered text's bound is ever checked.
MAX_REPEAT = 1 << 20


class TooLong(ValueError):
    """The rendered chat passed its bound."""


class Refusal(jinja2.TemplateError):
    """The template called `raise_exception`: it will not render this chat."""


class Refused(ValueError):
    """`render`'s sentence for a chat the template refuses (its `raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise Refusal(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own filter escapes HTML characters (`<` as \u003c), which would change the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict` for templates: its calls without its class attributes, a way out of the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template may not store {name!r} on a namespace: underscore names are refused"
        )


class _Namespace(Namespace):
    """`namespace()` refusing underscore names, which lead to Python's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: `self` is a name too
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with
    it for training masks; rendered, it is its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `*` bounded on strings and lists."""

    intercepted_binops = frozenset(["*"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = [x for x in (left, right) if isinstance(x, str | list | tuple)]
        times = [x for x in (left, right) if isinstance(x, int)]
        if sized and times and len(sized[0]) * times[0] > MAX_REPEAT:
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not repeat text past {MAX_REPEAT} characters"
            )
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env


_ENV = _environment()


class ChatTemplate:
    """One checkpoint's chat template, compiled once, and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            raise ValueError(
                f"the chat template is {size} bytes; this server takes at most {MAX_TEMPLATE_BYTES}"
            )
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile (line {e.lineno}): {e}") from None
        except (RecursionError, MemoryError):  # blocks nested past what the compiler walks
            raise ValueError("the chat template nests too deep to compile") from None
        self.special_tokens = dict(special_tokens)
        self.source = source

    def with_source(self, source: str) -> ChatTemplate:
        """Another template (a request's own) with this one's special tokens."""
        return ChatTemplate(source, self.special_tokens)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> ChatTemplate | None:
        """The template of a checkpoint's tokenizer files (by name), or None when it has none:
        `chat_template.jinja`, else tokenizer_config.json's `chat_template`, as transformers
        loads it. Raises `ValueError` for files it cannot read."""
        config = _config(files)
        if TEMPLATE_FILE in files:
            source: str | None = _text(files, TEMPLATE_FILE)
        else:
            source = _config_template(config)
        return None if source is None else cls(source, _special_tokens(config))

    @property
    def thinks(self) -> bool:
        """Whether the template knows reasoning blocks (`<think>`), so that output may hold one."""
        return "</think>" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final: bool = False,
        max_bytes: int | None = None,
    ) -> str:
        """The chat as the prompt text, `kwargs` the request's own template variables (they
        override special tokens of their name, as in transformers), `tools` OpenAI's tool
        definitions; `continue_final`: the text ends where the last message does, as
        transformers' `continue_final_message` cuts it. `ValueError` with a sentence when one
        names what the server sets, the template refuses the chat or fails on it, or its text
        passes `max_bytes` of UTF-8 (checked as it is written, so it never grows past)."""
        kwargs = kwargs or {}
        taken = next((k for k in SERVER_SET if k in kwargs), None)
        if taken is not None:
            raise ValueError(
                f"{KWARGS} may not set {taken}; the server sets it to {SERVER_SET[taken]}"
            )
        context = {
            **self.special_tokens,
            **kwargs,
            "messages": messages,
            "tools": tools or None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = _bounded(self._template.generate(context), max_bytes)
        except Refusal as e:
            raise Refused(f"the chat template refuses these messages: {e}") from None
        except (TooLong, MemoryError):  # a bound of the server's, which names it
            raise
        # A template is a program: whatever it raises concerns this chat alone.
        except Exception as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        return _cut_after_final(text, messages[-1]) if continue_final else text


def _bounded(pieces: Iterator[str], max_bytes: int | None) -> str:
    if max_bytes is None:
        return "".join(pieces)
    out, size = [], 0
    for piece in pieces:
        size += len(piece.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise TooLong(
                f"the rendered chat is longer than {max_bytes} bytes, the most this server takes"
            )
        out.append(piece)
    return "".join(out)


def _cut_after_final(text: str, final: Mapping[str, Any]) -> str:
    """The rendered chat up to the end of its last message's content (what follows is the
    template's end of turn), found as transformers finds it: the content stripped, searched
    from the end, kept with its leading space where the template kept it."""
    content = _final_text(final.get("content"))
    at = text.rfind(content.strip())
    if not content.strip() or at < 0:
        raise ValueError(
            "continue_final_message is set, but the last message's content does not appear "
            "in the rendered chat"
        )
    kept = content.lstrip()
    if text[at : at + len(kept)] == content:
        return text[: at + len(kept)]
    return text[: at + len(content.strip())]


def _final_text(content: Any) -> str:
    """The text a continued message goes on from: its content, or its last text part (as
    transformers finds it in a message of parts)."""
    if isinstance(content, list):
        return next((p["text"] for p in reversed(content) if "text" in p), "")
    return content or ""


def parse_kwargs(text: str) -> dict[str, Any]:
    """A request's template variables from their wire form, a JSON object as text (empty:
    none); `ValueError` with a sentence for anything else."""
    if not text:
        return {}
    try:
        value = json.loads(text)
        # JSON's escapes can spell lone surrogates, which no UTF-8 prompt holds.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{KWARGS} holds text that is not valid Unicode: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or nested past the stack
        raise ValueError(f"{KWARGS} is not JSON text: {e}") from None
    if not isinstance(value, dict):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"{KWARGS} is {shown}; it must be a JSON object of template variables")
    return value


def _text(files: Mapping[str, bytes], name: str) -> str:
    try:
        return files[name].decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text: {e}") from None


def _config(files: Mapping[str, bytes]) -> dict[str, Any]:
    if CONFIG_FILE not in files:
        return {}
    try:
        config = json.loads(_text(files, CONFIG_FILE))
    except json.JSONDecodeError as e:
        raise ValueError(f"{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} holds a {type(config).__name__}, not a JSON object")
    return config


def _config_template(config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's template: a string, or a list of named ones of which transformers
    renders "default" when no tools are given."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens (bos_token, eos_token, unk_token, pad_token, ...) that
    transformers puts in a template's context; a value may be an AddedToken as a dict."""
    tokens = {}
    for key, value in config.items():
        content = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(content, str):
            tokens[key] = content
    return tokens


def write_default_template(directory: Path) -> None:
    """The bundled model's chat template, its one home, into a checkpoint written fresh."""
    (directory / TEMPLATE_FILE).write_bytes((DEFAULT_MODEL_DIR / TEMPLATE_FILE).read_bytes())
