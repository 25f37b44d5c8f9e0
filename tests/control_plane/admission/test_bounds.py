"""Each input a request adds to every step, at its limit and one past it: taken, then refused
with INVALID_ARGUMENT and a sentence naming the field and the limit. The stop strings'
automaton is built at admission, not on the scheduler's thread."""

from __future__ import annotations

import pytest

from control_plane.admission.bounds import check_per_step
from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.text import detok
from control_plane.text.tokenizer import ByteTokenizer
from protos import checks
from protos.params import RequestParams, SamplingParams


def params(name: str, count: int) -> RequestParams:
    """A request with `count` of what `checks.LIMITS[name]` counts."""
    if name == "stop":
        return RequestParams(prompt="x", stop=tuple(f"s{i}" for i in range(count)))
    if name == "stop_chars":
        return RequestParams(prompt="x", stop=("x" * count,))
    if name == "stop_token_ids":
        return RequestParams(prompt="x", stop_token_ids=tuple(range(count)))
    if name == "logit_bias":
        return RequestParams(
            prompt="x", sampling=SamplingParams(logit_bias=dict.fromkeys(range(count), 1.0))
        )
    return RequestParams(prompt="x", sampling=SamplingParams(allowed_token_ids=tuple(range(count))))


@pytest.mark.parametrize("name", checks.LIMITS)
def test_each_limit_is_taken_and_one_past_it_refused_naming_it(name: str) -> None:
    limit = checks.LIMITS[name]
    check_per_step(params(name, limit.most))
    with pytest.raises(BadRequest) as refused:
        check_per_step(params(name, limit.most + 1))
    e = refused.value
    assert e.code == INVALID and e.param == limit.field
    assert str(e).startswith(f"{limit.field} holds {limit.most + 1} ")
    assert str(e).endswith(f"this server takes at most {limit.most}")


def test_the_stop_strings_automaton_is_built_at_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, ...]] = []

    class Counted(detok.StopStrings):
        def __init__(self, stops: tuple[str, ...]) -> None:
            built.append(stops)
            super().__init__(stops)

    monkeypatch.setattr(detok, "StopStrings", Counted)
    stop = ("a stop string no other test sends", "")
    check_per_step(RequestParams(prompt="x", stop=stop))
    assert built == [stop[:1]]
    detok.Detokenizer(ByteTokenizer.default(), stop)  # as the scheduler's thread makes it
    assert built == [stop[:1]]
