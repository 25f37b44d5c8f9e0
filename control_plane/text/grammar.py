"""Grammars that constrain a request's output: the `Grammar` interface the scheduler uses, and
its engine, llguidance (JSON schema, regex, Lark).

A grammar follows the committed tokens (`advance`), says which tokens may come next
(`mask`, an allowed-token bitmask the GPU service applies before its argmax, or `mask_after`
a few uncommitted drafts), and how many of a run of drafts it would accept (`valid_prefix`),
which is where drafts are cut. A grammar may hold only after a free part (`reasoning.py`'s,
after the reasoning block): while `constrains()` is false its masks are empty and the
scheduler treats its sequence as unconstrained once its drafts are cut."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Protocol

import llguidance

from control_plane.text.detok import Tokenizer

# What a grammar may cost, checked by llguidance itself: its size in symbols, the lexer states
# it builds and the work of one mask. Errors carry no parser state (`verbose_errors`), which
# would hand a client hundreds of kilobytes of the library's internals.
LIMITS = llguidance.LLParserLimits(
    max_grammar_size=100_000, max_lexer_states=50_000, verbose_errors=False
)
# A grammar's text at most (a JSON schema, a regex, a Lark grammar, or the calls of a request's
# tools): its build time grows faster than its size.
MAX_GRAMMAR_BYTES = 256 << 10
MAX_ERROR_CHARS = 300  # of a library's error, quoted in a refusal
WALK_TOKENS = 4
# What may stand between a reasoning block's close and a grammar that follows it: the blank
# line Qwen's templates write after `</think>`, which a model is trained to write too.
LEAD = r"/[ \n]{0,2}/"


def sentence(error: str) -> str:
    """A library's error as a refusal may quote it: its first line, without a backtrace."""
    first = re.split(r"\n|<backtrace>|stack backtrace", error.strip(), maxsplit=1)[0].strip()
    if first.startswith("panic"):  # an assertion inside the library: its text means nothing here
        return "the grammar engine cannot build it (past one of its internal limits)"
    return first if len(first) <= MAX_ERROR_CHARS else first[: MAX_ERROR_CHARS - 3] + "..."


class Grammar(Protocol):
    def advance(self, tokens: list[int]) -> None:
        """Follow committed tokens; `ValueError` with a sentence for tokens it refuses."""
        ...

    def mask(self) -> bytes:
        """The tokens allowed next, a little-endian bitmask of 32-bit words (empty: any)."""
        ...

    def mask_after(self, tokens: list[int]) -> bytes:
        """`mask` after `tokens` (uncommitted drafts it accepts), leaving its state as it was."""
        ...

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) to keep: those before the first it refuses, and for a
        grammar not constraining yet, those before the first after which it would."""
        ...

    def is_done(self) -> bool:
        """Whether the output is complete: the request ends here."""
        ...

    def constrains(self) -> bool:
        """Whether the next token is constrained now. While not, every mask is empty and any
        draft `valid_prefix` keeps leaves it so: its sequence may batch as an unconstrained
        one."""
        ...

    def remaining(self) -> Grammar | None:
        """What constrains the rest of the output: this grammar, or once past a free part, what
        follows it (None: nothing), which then takes its place."""
        ...


class _Vocabulary:
    """What llguidance reads of a byte-level tokenizer: each id's bytes."""

    def __init__(self, vocab_size: int, eos: int, specials: dict[str, int]) -> None:
        names = {i: s.encode() for s, i in specials.items()}
        self.tokens = [
            bytes([i]) if i < 256 else names.get(i, b"<|unused%d|>" % i) for i in range(vocab_size)
        ]
        self.eos_token_id, self.bos_token_id = eos, specials.get("<|bos|>")
        self.special_token_ids = [i for i in range(256, vocab_size)]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


class LLGuidanceGrammar:
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if self.matcher.is_error():
            raise ValueError(f"the grammar does not compile: {sentence(self.matcher.get_error())}")

    def advance(self, tokens: list[int]) -> None:
        if tokens and not self.matcher.consume_tokens(tokens):
            raise ValueError(
                f"the grammar refused committed tokens: {sentence(self.matcher.get_error())}"
            )

    def mask(self) -> bytes:
        return self.matcher.compute_bitmask()

    def mask_after(self, tokens: list[int]) -> bytes:
        if not tokens:
            return self.mask()
        self.matcher.consume_tokens(tokens)
        bits = self.matcher.compute_bitmask()
        self.matcher.rollback(len(tokens))
        return bits

    def valid_prefix(self, tokens: list[int]) -> int:
        return self.matcher.validate_tokens(tokens)

    def is_done(self) -> bool:
        return self.matcher.is_stopped()

    def constrains(self) -> bool:
        return True

    def remaining(self) -> Grammar | None:
        return self


def _compact_json(schema: str) -> str:
    """JSON without whitespace between tokens unless the schema's `x-guidance` allows it: a
    model allowed free whitespace may spend its whole budget on it (a weak or random model
    does), and compact output is what a client parses anyway."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )


def _led(grammar: str) -> str:
    """`grammar` (llguidance's JSON form, or Lark text) with `LEAD` before it: a Lark start
    rule that references it by name."""
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
    else:
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = top["grammars"]
    name = first.get("name") or "led"
    lead = {"lark_grammar": f"start: {LEAD} @{name}"}
    return json.dumps({**top, "grammars": [lead, {**first, "name": name}, *rest]})


def _ll_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    text = getattr(tokenizer, "json", None)
    if text is not None:  # an HF tokenizer.json's text: llguidance parses it directly
        # Only a string that starts with "{" is JSON to llguidance (else a path or a name).
        return llguidance.LLTokenizer(text.lstrip(), n_vocab=vocab_size, eos_token=list(eos_ids))
    specials = getattr(tokenizer, "special_tokens", {})
    vocab = _Vocabulary(vocab_size, eos_ids[0], specials)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size, eos_token=list(eos_ids)
    )


class GrammarCompiler:
    """Compiles response formats for one vocabulary (the tokenizer's bytes, built once)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        """`ValueError` with a sentence for a model no grammar can serve."""
        if not eos_ids:
            raise ValueError(
                "the served model names no EOS token (config.json, generation_config.json and "
                "the tokenizer's eos_token name none), so no grammar could end its output"
            )
        self.source, self.vocab_size = tokenizer, vocab_size  # the served tokenizer
        try:
            self.tokenizer = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
        except Exception as e:  # llguidance's own types, on a tokenizer it cannot read
            raise ValueError(
                f"the grammar engine cannot read the served tokenizer: {sentence(str(e))}"
            ) from None

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        """kind: json_schema, regex or lark. Raises ValueError with a sentence."""
        return self.matcher(self.grammar(kind, spec))

    def grammar(self, kind: str, spec: str, lead: bool = False) -> str:
        """`spec` as llguidance's grammar (`lead`: after a reasoning block, with `LEAD` before
        it), checked whole: built into a matcher that takes its first `WALK_TOKENS` tokens (the
        lowest id each mask allows), so that what a matcher finds only at its first tokens (a
        lexer past its limits) is found here, before a prefill runs. Raises ValueError with a
        sentence."""
        builders: dict[str, Callable[[str], str]] = {
            "json_schema": _compact_json,
            "regex": llguidance.LLMatcher.grammar_from_regex,
            "lark": llguidance.LLMatcher.grammar_from_lark,
        }
        if kind not in builders:
            raise ValueError(f"response format {kind!r} is unknown (json_schema, regex, lark)")
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise ValueError(
                f"the {kind} is {size} bytes; this server takes at most {MAX_GRAMMAR_BYTES}"
            )
        if kind == "json_schema":
            try:
                json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not JSON: {e}") from None
            except RecursionError:
                raise ValueError("the JSON schema nests past what this server parses") from None
        try:
            grammar = builders[kind](spec)
        except Exception as e:  # the builders raise their own types on bad input
            raise ValueError(f"the {kind} does not compile: {sentence(str(e))}") from None
        if lead:
            grammar = _led(grammar)
        message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=LIMITS)
        if message:
            raise ValueError(f"the {kind} does not compile: {sentence(message)}")
        walk = self.matcher(grammar).matcher
        for _ in range(WALK_TOKENS):
            allowed = int.from_bytes(walk.compute_bitmask(), "little")
            if walk.is_error() or not allowed or walk.is_stopped():
                break
            walk.consume_token((allowed & -allowed).bit_length() - 1)  # the lowest id allowed
        if walk.is_error():
            raise ValueError(f"the {kind} does not compile: {sentence(walk.get_error())}")
        return grammar

    def matcher(self, grammar: str) -> LLGuidanceGrammar:
        """A matcher of a grammar `grammar` returned (llguidance builds it without the GIL)."""
        return LLGuidanceGrammar(self.tokenizer, grammar)
