"""Speculative methods as strategies: what each proposes and with what, the arm of `step_mtp`
that verifies its drafts, the room its next drafts need, what it learns from a verdict and
what admission asks of the service for it. The scheduler, the door and the fronts ask a
`Method`, never a method's name: a new method is a `Method` (its own module where it drafts
on the control plane) and its name in `protos.params` and the wire's enum.

`AUTO` names no strategy: a request that leaves the method to the server gets, each step, the
one `choice.Chooser` picks for it from measured costs and its own acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from protos.model import Capabilities, room_for_block, room_to_propose
from protos.params import AUTO, DFLASH, MTP, NONE, PROMPT_LOOKUP

HEADS, BLOCKS = "heads", "blocks"  # `step_mtp`'s arms: a chain drafter's, a block drafter's
NGRAM_SIZES = (3, 2)  # prompt lookup's keys, longest first
MAX_COPY = 3  # prompt lookup's longest copy


class Service(Protocol):
    """What a method asks of the service it runs on (`Capabilities`, or a sequence's
    `ModelFacts`)."""

    @property
    def max_context(self) -> int: ...
    @property
    def dflash_block(self) -> int: ...
    @property
    def drafters(self) -> frozenset[str]: ...


@dataclass(frozen=True)
class Method:
    """A method that drafts nothing: every step verifies the newest token alone."""

    name: str
    drafter: str | None = None  # the service's drafter that proposes (`protos.model.DRAFTERS`)
    arm: str = HEADS
    teaches_widths: bool = False  # its verdicts teach the MTP widths (rung, calibration)
    stands_in: bool = False  # with `--prompt-lookup`, a copy may replace its chain for a step
    pipelines: bool = True  # the pipelined step (`ahead.py`) may plan it ahead
    chooses: bool = False  # the server picks each step's strategy (`choice.py`)

    @property
    def drafts(self) -> bool:
        """Whether the service proposes drafts for it after each verdict."""
        return self.drafter is not None

    def copy(self, history: Sequence[int], most: int) -> list[int]:
        """Drafts it makes itself on the control plane, at most `most` (none here)."""
        return []

    @property
    def copies(self) -> bool:
        return False

    def ready(self, drafters: frozenset[str]) -> bool:
        """Whether a service with these drafters can serve it."""
        return self.drafter is None or self.drafter in drafters

    def room(self, seq_len: int, num_drafts: int, service: Service) -> bool:
        """Whether its next drafts fit after `seq_len` committed tokens."""
        return room_to_propose(seq_len, num_drafts, service.max_context)

    def most_drafts(self, caps: Capabilities) -> int:
        """The most drafts one of its steps may verify on this service."""
        return max(caps.slot_verify_drafts)

    def refusal(self, caps: Capabilities) -> str | None:
        """Why a service with `caps` cannot serve it (None: it can)."""
        if self.ready(caps.drafters):
            return None
        return (
            f"speculative method {self.name} needs a GPU service with its drafter "
            f"({self.drafter}); this one has none"
        )


@dataclass(frozen=True)
class HeadChain(Method):
    """Drafts from the model's MTP head, a chain of one pass a draft."""

    drafter: str | None = MTP
    teaches_widths: bool = True
    stands_in: bool = True

    def refusal(self, caps: Capabilities) -> str | None:
        """None: a model without a head decodes plainly (its capabilities' `has_mtp` says so),
        as clients that name mtp, long the server's default, expect of any checkpoint."""
        return None


@dataclass(frozen=True)
class Block(Method):
    """Drafts from the service's block drafter: a block of them in one forward."""

    drafter: str | None = DFLASH
    arm: str = BLOCKS

    def room(self, seq_len: int, num_drafts: int, service: Service) -> bool:
        return room_for_block(seq_len, service.dflash_block, service.max_context)

    def most_drafts(self, caps: Capabilities) -> int:
        return min(super().most_drafts(caps), max(caps.dflash_block - 1, 0))

    def refusal(self, caps: Capabilities) -> str | None:
        if self.ready(caps.drafters):
            return None
        return (
            "speculative method dflash needs a GPU service with a DFlash drafter (met "
            "gpu-service serve --drafter PATH); this one has none"
        )


@dataclass(frozen=True)
class Lookup(Method):
    """Drafts copied from the request's own history: the last `n` tokens (prompt, then
    generated) looked up at their most recent earlier occurrence, for `n` in NGRAM_SIZES,
    longest first; the tokens that followed it are the copy."""

    pipelines: bool = False  # a copy needs the history up to the step's newest token

    @property
    def copies(self) -> bool:
        return True

    def copy(self, history: Sequence[int], most: int) -> list[int]:
        return find_copy(list(history), most)


@dataclass(frozen=True)
class Chosen(Method):
    """The server's choice: a step's strategy is the chooser's."""

    chooses: bool = True

    def refusal(self, caps: Capabilities) -> str | None:
        return None


def find_copy(history: list[int], max_len: int) -> list[int]:
    for n in NGRAM_SIZES:
        if len(history) <= n:
            continue
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == key:
                return history[start + n : start + n + max_len]
    return []


PLAIN, HEAD, LOOKUP, BLOCK = Method(NONE), HeadChain(MTP), Lookup(PROMPT_LOOKUP), Block(DFLASH)
METHODS: dict[str, Method] = {m.name: m for m in (PLAIN, HEAD, LOOKUP, BLOCK, Chosen(AUTO))}


def method(name: str) -> Method:
    """The strategy a request's method names."""
    try:
        return METHODS[name]
    except KeyError:
        known = ", ".join(METHODS)
        raise ValueError(f"speculative method {name!r} is unknown; use one of {known}") from None


def register(m: Method) -> None:
    """A method served from now on (a plugin's, or a test's)."""
    METHODS[m.name] = m
