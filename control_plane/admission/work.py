"""The work of admission whose cost a request chooses: its tools read and their schemas closed,
its own chat template compiled, its chat rendered, its prompt tokenized, its grammar built and
checked whole. `Preparer` does it in any process; run as `python -m control_plane.admission.work`
it is one of `workers.Workers`' processes, which run it under a deadline and a memory bound so
that no request's template, schema or grammar holds the control plane's event loop.

A worker reads framed messages on stdin and answers on its stdout (Python's own stdout is sent
to stderr, so nothing a library prints can break a frame): `WorkerSetup` once per served model,
then jobs; for each job it names every stage as it starts it (what a refusal past the deadline
names), then the result."""

from __future__ import annotations

import ctypes
import os
import pickle
import resource
import signal
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import grpc

from control_plane.admission.chats import check_tools, output_format
from control_plane.admission.media import (
    Vision,
    check_images,
    check_kept,
    expander,
    image_parts,
    read_images,
)
from control_plane.admission.prompt import opened, prompt_ids, prompt_text, reasoning_start
from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.text.chat import ChatTemplate
from control_plane.text.detok import Tokenizer
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.images import Image, ImageSpan, MediaBounds
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities
from protos.params import RequestParams

OWN_TEMPLATES = 16  # requests' own chat templates kept compiled, the oldest dropped first
# Each stage of a job: the request's field it concerns, and what was being done (the refusal
# of a stage past its deadline or its memory names both).
STAGES = {
    "tools": ("tools", "reading the tools"),
    "chat_template": ("chat_template", "compiling the request's chat_template"),
    "messages": ("messages", "rendering the chat template"),
    "images": ("messages", "reading the images"),
    "prompt": ("prompt", "tokenizing the prompt"),
    "response_format": ("response_format", "building the response_format's grammar"),
    "tool_choice": ("tool_choice", "building the grammar of the forced tool calls"),
}
_HEADER = struct.Struct("<I")


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker loads once per served model: its tokenizer files, and what its grammar
    engine needs of the model."""

    files: Mapping[str, bytes]
    origin: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    digest: str  # equal for equal files and defaults: a worker set up with it needs no other
    # The server's chat template variables (`--default-chat-template-kwargs`), which a
    # request's own override name by name.
    chat_kwargs: Mapping[str, Any] = field(default_factory=dict)
    media: MediaBounds = field(default_factory=MediaBounds)  # what a request's images may take


@dataclass(frozen=True)
class Prepared:
    """A request's costly part, done: what `door.admit` needs to finish it."""

    ids: tuple[int, ...]
    opened: bool  # the prompt ends inside a reasoning block its template opened
    tools: dict[str, dict[str, Any]]  # by name, each one's parameters schema
    thinks: bool  # the chat's template knows reasoning blocks
    # The output's grammar in llguidance's form, checked whole (None: the request has none);
    # after the reasoning when `reasoning` is set.
    grammar: str | None
    reasoning: str = ""  # where the output starts (`reasoning.OPENED`, `MAY_OPEN`; "": none)
    # The chat's images in the order of their placeholders in `ids`, each's placeholder
    # repeated once per merged patch there, and where those lie.
    images: tuple[Image, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()


class Preparer:
    """The costly work for one served model: its tokenizer, its chat template (None: it has
    none; `chat_error`: it has one that does not compile), its image side and its grammar
    engine, made when first needed; `chat_kwargs` the server's template variables."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat: ChatTemplate | None,
        compiler: Callable[[], GrammarCompiler | None] | None = None,
        chat_error: str | None = None,
        chat_kwargs: Mapping[str, Any] | None = None,
        vision: Vision | None = None,
    ) -> None:
        self.tokenizer, self.chat, self.chat_error = tokenizer, chat, chat_error
        self.chat_kwargs = dict(chat_kwargs or {})
        self.vision = vision or Vision()
        self._make_compiler = compiler
        self._compiler: GrammarCompiler | None = None
        self.compiler_error = "this server has no grammar engine"
        self._own: dict[str, ChatTemplate] = {}  # requests' own templates, by source

    @classmethod
    def from_setup(cls, setup: WorkerSetup) -> Preparer:
        tokenization = Tokenization.from_files(setup.files, setup.origin)
        chat, error = None, None
        try:
            chat = ChatTemplate.from_files(setup.files)
        except ValueError as e:
            error = f"the model's chat template is unusable: {e}"

        def compiler() -> GrammarCompiler:
            return GrammarCompiler(tokenization.tokenizer, setup.vocab_size, setup.eos_token_ids)

        vision = Vision.of(setup.files, setup.media)
        return cls(tokenization.tokenizer, chat, compiler, error, setup.chat_kwargs, vision)

    @property
    def compiler(self) -> GrammarCompiler | None:
        """None where there is none, or the model cannot have one (`compiler_error` says why)."""
        if self._compiler is None and self._make_compiler is not None:
            try:
                self._compiler = self._make_compiler()
            except ValueError as e:
                self.compiler_error, self._make_compiler = str(e), None
        return self._compiler

    def prepare(
        self,
        r: RequestParams,
        caps: Capabilities,
        max_prompt_bytes: int,
        stage: Callable[[str], None] = lambda name: None,
    ) -> Prepared:
        """The request's prompt ids and images, tools and grammar; `BadRequest` with a
        sentence. `stage` is told each stage's name (`STAGES`) as it starts."""
        stage("tools")
        tools = check_tools(r)
        parts = image_parts(r)
        check_images(parts, self.vision, caps)
        chat = self._template(r, stage)
        if r.messages:
            stage("messages")
        text = prompt_text(r, chat, max_prompt_bytes, self.chat_kwargs)
        if parts:
            stage("images")
        images = read_images(parts, self.vision, caps)
        stage("prompt")
        ids = prompt_ids(r, text, self.tokenizer, caps, expander(self.vision, images))
        located = check_kept(ids, self.vision, images)
        thinks = chat is not None and chat.thinks
        start = reasoning_start(r, text, thinks)
        form = output_format(r, tools, chat)
        grammar = None
        if form is not None:
            part = "response_format" if form == r.response_format else "tool_choice"
            stage(part)
            grammar = self._grammar(form, part, bool(start))
        return Prepared(tuple(ids), opened(r, text), tools, thinks, grammar, start, images, located)

    def _grammar(self, form: tuple[str, str], part: str, lead: bool) -> str:
        compiler = self.compiler
        if compiler is None:
            raise BadRequest(grpc.StatusCode.UNIMPLEMENTED, f"{part}: {self.compiler_error}", part)
        try:
            return compiler.grammar(*form, lead=lead)
        except ValueError as e:
            raise BadRequest(INVALID, f"{part}: {e}", part) from None

    def _template(self, r: RequestParams, stage: Callable[[str], None]) -> ChatTemplate | None:
        """The template a request's messages render with: the model's, or its own (vLLM's
        `chat_template`, with the model's special tokens)."""
        if not r.messages:
            if r.chat_template or r.continue_final_message:
                raise BadRequest(
                    INVALID,
                    "chat_template and continue_final_message go with messages; this request "
                    "has none",
                    "chat_template" if r.chat_template else "continue_final_message",
                )
            return None
        if self.chat_error is not None:
            raise BadRequest(INVALID, self.chat_error)
        if not r.chat_template:
            return self.chat
        own = self._own.get(r.chat_template)
        if own is None:
            stage("chat_template")
            try:
                own = (self.chat or ChatTemplate("", {})).with_source(r.chat_template)
            except ValueError as e:
                raise BadRequest(INVALID, f"chat_template: {e}", "chat_template") from None
            if len(self._own) >= OWN_TEMPLATES:
                self._own.pop(next(iter(self._own)))
            self._own[r.chat_template] = own
        return own


def send(out: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(body)) + body)
    out.flush()


def _receive(inp: IO[bytes]) -> Any:
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the control plane closed the pipe: it is done with this worker
    (size,) = _HEADER.unpack(header)
    return pickle.loads(inp.read(size))


def _die_with_parent() -> None:
    """SIGKILL this worker when the control plane ends, however it ends (Linux's
    PR_SET_PDEATHSIG); where the call is missing, the closed stdin ends it instead."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _bound_memory(budget_mb: int) -> None:
    """Allocations past what the worker holds now plus `budget_mb` fail (a MemoryError, or
    the worker's end): the data segment counts the heap and private mappings, the share a
    template or a grammar grows."""
    with open("/proc/self/status") as f:
        held = next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (held + (budget_mb << 20), hard))


def _job(preparer: Preparer, out: IO[bytes], body: tuple) -> tuple[str, Any]:
    request, caps, max_prompt_bytes = body
    try:

        def stage(name: str) -> None:
            send(out, ("stage", name))

        return "done", preparer.prepare(request, caps, max_prompt_bytes, stage)
    except BadRequest as e:
        return "refused", (e.code.name, str(e), e.param)
    except MemoryError:
        return "memory", None
    # A template or a library failing on this request's input concerns it alone.
    except Exception as e:
        return "failed", f"{type(e).__name__}: {e}"


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # Ctrl-C reaches the whole process group: the control plane ends its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    inp = sys.stdin.buffer
    preparer: Preparer | None = None
    while (message := _receive(inp)) is not None:
        kind, body = message
        if kind == "setup":
            setup, budget_mb = body
            preparer = Preparer.from_setup(setup)
            _ = preparer.compiler  # built now, outside any request's deadline
            _bound_memory(budget_mb)
            send(out, ("ready", None))
        elif preparer is not None:
            send(out, _job(preparer, out, body))


if __name__ == "__main__":
    # Through the module's own name, so what it pickles names `control_plane.admission.work`,
    # not `__main__`.
    from control_plane.admission import work

    work.main()
