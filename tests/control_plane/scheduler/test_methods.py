"""Methods as strategies: a toy method added in this test alone is served (drafted, verified,
counted under its name, taken by the OpenAI front), and no serving module branches on a
method's or a drafter's name outside the modules that define them."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from control_plane.fronts.openai_body import completion_request
from control_plane.scheduler import methods
from control_plane.scheduler.arms import step_mtp
from control_plane.scheduler.methods import BLOCK, HEAD, LOOKUP, PLAIN, Method, register
from protos.model import Capabilities
from protos.params import NONE
from tests.control_plane.scheduler.test_step import ctx, seqs
from tests.fake_model import FakeModel

ROOT = Path(__file__).resolve().parents[3]
SERVING = ("control_plane", "gpu_service", "protos")
# Where a method's or a drafter's name is defined and told apart: the registries and the wire.
DEFINED = {
    "control_plane/scheduler/methods.py",
    "protos/params.py",
    "protos/model.py",
    "gpu_service/engine/drafters.py",
    "gpu_service/model/quantization.py",  # its `method` is a checkpoint's quantization's
}
BRANCH = re.compile(
    r"\b(method|drafter)\s*(==|!=|\bin\b\s*[(\[{])"
    r"|[=!]=\s*(DFLASH|MTP_HEAD|MTP|NONE|PROMPT_LOOKUP|AUTO)\b"
)


@dataclass(frozen=True)
class Echo(Method):
    """A toy: drafts the newest token again, as many times as it may."""

    @property
    def copies(self) -> bool:
        return True

    def copy(self, history: Sequence[int], most: int) -> list[int]:
        return [history[-1]] * most


@pytest.fixture
def echo() -> Iterator[Method]:
    toy = Echo("echo")
    register(toy)
    yield toy
    del methods.METHODS[toy.name]


def test_a_toy_method_is_served_under_its_name(echo: Method) -> None:
    model = FakeModel(caps=(3,) * 4, oracle=lambda h: h[-1])  # the model repeats, too
    toy = seqs(model, 2, method=echo.name)
    plain = seqs(model, 2, method=NONE)
    for _ in range(4):
        step_mtp(model, toy, ctx(model), 3)
        step_mtp(model, plain, ctx(model), 3)
    for a, b in zip(toy, plain, strict=True):
        assert a.generated[: len(b.generated)] == b.generated, "lossless"
        assert len(a.generated) > len(b.generated), "its drafts stood"
    counts = toy[0].stats.by_method[echo.name]
    assert counts.drafted > 0 and counts.accepted == counts.drafted, "its copies stood"
    asked = completion_request({"prompt": "x", "speculative": {"method": "echo"}})
    assert asked.request.method == "echo"


def test_each_method_answers_for_itself() -> None:
    caps = Capabilities(
        "m",
        256,
        4,
        4,
        (3,) * 4,
        64,
        ("eager",),
        "eager",
        "cpu",
        128,
        "float32",
        8,
        (1,),
        True,
        4,
        256,
        "d",
        dflash_block=16,
    )
    assert (PLAIN.drafts, HEAD.drafts, LOOKUP.drafts, BLOCK.drafts) == (False, True, False, True)
    assert LOOKUP.copies and not HEAD.copies
    assert HEAD.room(125, 3, caps) and not HEAD.room(127, 3, caps)
    assert BLOCK.room(112, 3, caps) and not BLOCK.room(113, 3, caps), "a whole block's room"
    assert HEAD.most_drafts(caps) == BLOCK.most_drafts(caps) == 3, "within the slots"
    assert BLOCK.most_drafts(Capabilities(**{**caps.__dict__, "dflash_block": 3})) == 2
    no_block = Capabilities(**{**caps.__dict__, "dflash_block": 0})
    assert BLOCK.refusal(caps) is None and "DFlash drafter" in (BLOCK.refusal(no_block) or "")
    with pytest.raises(ValueError, match="'x' is unknown; use one of none, mtp"):
        methods.method("x")


def serving_files() -> Iterator[Path]:
    for package in SERVING:
        yield from (ROOT / package).rglob("*.py")


def test_no_serving_module_branches_on_a_method_name() -> None:
    """Every `method ==` / `drafter ==` test lives in the strategies: the scheduler, the
    wire and the service ask a `Method` (or the service's drafter) instead."""
    found = []
    for path in serving_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in DEFINED or "_pb2" in rel:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if BRANCH.search(code) and "request.method" not in code:
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
