"""Every float field of every request type at the values a careless or hostile client sends
(NaN, the infinities, 1e-45, 1e38, -0.0, past fp32): the gRPC `GenerateRequest`, the OpenAI
completion, chat and Responses bodies and Anthropic's Messages, the GPU service's penalties
and sampling parameters. A value is taken, and every number of the reply is finite, or refused
with a sentence (400, INVALID_ARGUMENT), never a 500, UNKNOWN or INTERNAL. A row whose logits
are not finite all the same fails its request alone. In process: both fronts over one engine,
and the engine."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from control_plane.admission import auth
from control_plane.cli import generate
from control_plane.fronts.openai_body import chat_request, completion_request
from control_plane.fronts.openai_fields import InvalidParam
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from met.main import build_parser
from protos import checks
from protos.met.v1 import generate_pb2 as pb
from protos.model import InvalidArgument, Penalties, Sampling
from tests.control_plane.fronts.test_openai_http import KEY, Fronts, serving

SERVICE = ServiceConfig(verify_tiers="4:3", max_context=256)  # two requests at once
EDGES = [math.nan, math.inf, -math.inf, 1e-45, -1e-45, 1e-38, 1e38, 3.4e38, 1e308, -0.0, 0.5]
FLOATS = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE}
BODY_FLOATS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
]
PROMPT = [3, 4, 5]
LONG_PROMPT = list(range(3, 200))
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    with serving(Engine(tiny_dir, SERVICE), 4) as f:
        yield f


def request_floats() -> list[str]:
    """The float fields of a `GenerateRequest`, a map to floats (the logit biases) among them."""
    names = []
    for f in pb.GenerateRequest.DESCRIPTOR.fields:
        entry = f.message_type
        is_map = entry is not None and entry.GetOptions().map_entry
        kind = entry.fields_by_name["value"].type if is_map else f.type
        if kind in FLOATS:
            names.append(f.name)
    return names


def non_finite(msg: Message) -> list[str]:
    """The float fields of `msg`, nested ones included, that hold NaN or an infinity."""
    bad = []
    for f, value in msg.ListFields():
        values = value if f.is_repeated else [value]
        if f.type in FLOATS:
            bad += [f.name for v in values if not math.isfinite(v)]
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            bad += [n for v in values for n in non_finite(v)]
    return bad


def strict(text: str) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise AssertionError(f"a reply carries a bare {name}: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def test_grpc_floats_are_taken_finite_or_refused(fronts: Fronts) -> None:
    names = request_floats()
    assert "repetition_penalty" in names and "logit_bias" in names
    codes: dict[str, int] = {}
    for name in names:
        for value in EDGES:
            r = pb.GenerateRequest(
                prompt_token_ids=PROMPT, max_new_tokens=3, logprobs=True, temperature=1.0, seed=1
            )
            if name == "logit_bias":
                r.logit_bias[7] = value
            else:
                setattr(r, name, value)
            try:
                replies = list(fronts.stub.Generate(r, metadata=auth.bearer(KEY), timeout=30))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, value, e.details())
                assert name in e.details(), (name, value, e.details())
                codes[e.code().name] = codes.get(e.code().name, 0) + 1
                continue
            assert replies[-1].finish_reason in ("stop", "length"), (name, value)
            assert not [n for m in replies for n in non_finite(m)], (name, value)
            codes["OK"] = codes.get("OK", 0) + 1
    assert codes["OK"] and codes["INVALID_ARGUMENT"]


def http_body(kind: str, name: str, value: Any, stream: bool) -> dict:
    body: dict[str, Any] = {"model": "", "max_tokens": 3, "logprobs": True, "stream": stream}
    if kind == "responses":
        body = {"model": "", "input": "hi", "max_output_tokens": 3, "stream": stream}
    elif kind == "messages":
        body = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        body["stream"] = stream
    elif kind == "completions":
        body |= {"prompt": PROMPT, "logprobs": 0}
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    body[name] = {"7": value} if name == "logit_bias" else value
    return body


@pytest.mark.parametrize("kind", ["completions", "chat/completions", "responses", "messages"])
def test_http_floats_are_taken_finite_or_refused(fronts: Fronts, kind: str) -> None:
    """Sent as JSON doubles (NaN and Infinity as Python's json writes them), and as an integer
    past any double."""
    url = f"{fronts.http}/{kind}"
    statuses = set()
    with httpx2.Client(headers=HEADERS, timeout=30) as http:
        for name in BODY_FLOATS:
            for i, value in enumerate([*EDGES, 10**400]):
                body = http_body(kind, name, value, stream=i % 2 == 0)
                sent = http.post(
                    url, content=json.dumps(body), headers={"content-type": "application/json"}
                )
                assert sent.status_code in (200, 400), (name, value, sent.text)
                statuses.add(sent.status_code)
                if sent.status_code == 400:
                    assert strict(sent.text)["error"]["message"], (name, value)
                elif body["stream"]:  # a Responses event names its type on a line before
                    events = [e.split("data: ", 1) for e in sent.text.split("\n\n")]
                    events = [e[1] for e in events if len(e) == 2 and e[1].startswith("{")]
                    assert events and all(strict(e) for e in events), (name, value)
                else:
                    reply = strict(sent.text)
                    kind_of = reply.get("object") or reply.get("type")
                    assert reply.get("choices") or kind_of in ("response", "message"), (name, value)
    assert statuses == {200, 400}


WRONG = [[], {}, [1.5], {"a": 1}, "x", True, -1, 1.5, 10**30, math.nan, "9" * 5000]
BODY_FIELDS = [
    *BODY_FLOATS,
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "seed", "top_k",
    "min_tokens", "ignore_eos", "stop", "stop_token_ids", "stream", "stream_options",
    "logprobs", "response_format", "speculative", "add_generation_prompt",
    "chat_template_kwargs", "best_of", "echo", "suffix", "top_logprobs", "tools",
]  # fmt: skip


@pytest.mark.parametrize("parse", [completion_request, chat_request])
def test_every_body_field_of_a_wrong_type_is_a_sentence(parse) -> None:
    """In process: only `InvalidParam` (a 400 naming its field) leaves the body's parser."""
    base = {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    nested = {
        "speculative": lambda v: {"method": v},
        "stream_options": lambda v: {"include_usage": v},
        "response_format": lambda v: {"type": v},
        "logit_bias": lambda v: {"7": v},
    }
    for name in BODY_FIELDS:
        for value in WRONG:
            for shaped in (value, nested.get(name, lambda v: v)(value)):
                try:
                    parse({**base, name: shaped})
                except InvalidParam as e:
                    assert str(e), (name, shaped)


def test_a_row_whose_logits_are_not_finite_fails_its_request_alone(
    fronts: Fronts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past every check (here, the checks switched off), a repetition penalty of 1e-45 makes
    each logit of its rows infinite: that request fails with a sentence, the one beside it
    streams on, and no event carries a NaN."""
    monkeypatch.setattr(checks, "number_problem", lambda *args: None)
    healthy = pb.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=48, ignore_eos=True, logprobs=True
    )
    beside = fronts.stub.Generate(healthy, metadata=auth.bearer(KEY), timeout=30)
    first = next(beside)
    # Many prompt tokens: the penalty divides the positive logits among them.
    poisoned = pb.GenerateRequest(
        prompt_token_ids=LONG_PROMPT, max_new_tokens=8, repetition_penalty=1e-45
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(fronts.stub.Generate(poisoned, metadata=auth.bearer(KEY), timeout=30))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "are not finite (NaN or infinity)" in caught.value.details()
    rest = [first, *beside]
    assert sum(len(m.token_ids) for m in rest) == 48 and rest[-1].finish_reason == "length"
    assert not [n for m in rest for n in non_finite(m)]
    body = {"model": "", "prompt": LONG_PROMPT, "max_tokens": 8, "stream": True, "logprobs": 0}
    body["repetition_penalty"] = 1e-45
    sent = httpx2.post(
        f"{fronts.http}/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
    )
    events = [strict(e[6:]) for e in sent.text.split("\n\n") if e.startswith("data: {")]
    assert "are not finite" in events[-1]["error"]["message"], sent.text


PENALTY_FIELDS = ["presence", "frequency", "repetition"]
SAMPLING_FIELDS = ["temperature", "top_p", "min_p", "uniforms"]


def test_the_gpu_service_takes_finite_numbers_or_refuses(tiny_dir: Path) -> None:
    """`alloc_sequence`'s penalties and a prefill's sampling parameters: `InvalidArgument`, or
    logprobs and draws that are finite."""
    engine = Engine(tiny_dir, SERVICE)
    taken = 0
    for name in [*PENALTY_FIELDS, "bias", *SAMPLING_FIELDS]:
        for value in EDGES:
            if name == "bias":
                pen = Penalties(bias_ids=(7,), bias_values=(value,))
            else:
                pen = Penalties(**{name: value}) if name in PENALTY_FIELDS else None
            smp = Sampling(temperature=1.0, uniforms=(0.5,))
            if name in SAMPLING_FIELDS:
                smp = replace(smp, **{name: (value,) if name == "uniforms" else value})
            try:
                seq = engine.alloc_sequence(pen)
            except InvalidArgument as e:
                assert str(e), (name, value)
                continue
            try:
                done = engine.prefill([seq], [PROMPT], sampling=[smp])
                assert all(math.isfinite(v) for v in done.logprobs), (name, value)
                taken += 1
            except InvalidArgument as e:
                assert str(e), (name, value)
            finally:
                engine.free_sequence(seq)
    assert taken and engine.capabilities().free_slots == engine.capabilities().num_slots


OUT_OF_RANGE = {
    "--max-new-tokens": "-5",
    "--seed": "-1",
    "--num-drafts": "-1",
    "--min-new-tokens": "-1",
    "--stop-token-id": "-1",
    "--logit-bias": "5000000000:1",
    "--repetition-penalty": "1e-45",
    "--temperature": "nan",
}


@pytest.mark.parametrize("flag", OUT_OF_RANGE)
def test_met_generate_refuses_out_of_range_values_naming_the_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["generate", "hi", flag, OUT_OF_RANGE[flag]])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and "it must be" in err and "Traceback" not in err


def test_met_generate_takes_huge_budgets_as_usage_errors_and_top_k_minus_one() -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["generate", "hi", "--max-new-tokens", "99999999999"])
    assert caught.value.code == 2
    r = generate.build_request(build_parser().parse_args(["generate", "hi", "--top-k", "-1"]))
    assert r.top_k == -1  # vLLM's no limit, as the Door reads it


def test_top_k_minus_one_is_no_limit_on_both_fronts(fronts: Fronts) -> None:
    """vLLM's clients send -1 for no limit: the same draws as 0."""

    def grpc_tokens(top_k: int) -> list[int]:
        r = pb.GenerateRequest(
            prompt_token_ids=PROMPT, max_new_tokens=6, temperature=1.0, seed=3, top_k=top_k
        )
        return [t for m in fronts.stub.Generate(r, metadata=auth.bearer(KEY)) for t in m.token_ids]

    assert grpc_tokens(-1) == grpc_tokens(0)
    done = fronts.client.completions.create(
        model="", prompt="a", max_tokens=6, temperature=1.0, seed=3, extra_body={"top_k": -1}
    )
    assert done.choices[0].finish_reason in ("stop", "length")


def past_the_limit(name: str) -> Any:
    """One more of what `checks.LIMITS[name]` counts, as its field holds it in a body."""
    over = checks.LIMITS[name].most + 1
    return {
        "stop": [f"s{i}" for i in range(over)],
        "stop_chars": ["x" * over],
        "stop_token_ids": list(range(over)),
        "logit_bias": {str(i): 1.0 for i in range(over)},
        "allowed_token_ids": list(range(over)),
    }[name]


@pytest.mark.parametrize("name", checks.LIMITS)
def test_past_a_per_step_limit_both_fronts_refuse_naming_it(fronts: Fronts, name: str) -> None:
    """400 and INVALID_ARGUMENT, the sentence naming the field and its limit; the GPU service
    refuses the penalties' sizes with the same sentence."""
    limit, value = checks.LIMITS[name], past_the_limit(name)
    sentence = f"this server takes at most {limit.most}"
    body = {"model": "", "prompt": PROMPT, "max_tokens": 3, limit.field: value}
    with httpx2.Client(headers=HEADERS, timeout=30) as http:
        sent = http.post(f"{fronts.http}/completions", content=json.dumps(body))
    assert sent.status_code == 400, sent.text
    error = strict(sent.text)["error"]
    assert error["param"] == limit.field and sentence in error["message"], error
    r = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=3)
    if name == "logit_bias":
        r.logit_bias.update({int(k): v for k, v in value.items()})
    else:
        getattr(r, limit.field).extend(value)
    with pytest.raises(grpc.RpcError) as refused:
        list(fronts.stub.Generate(r, metadata=auth.bearer(KEY), timeout=30))
    details = refused.value.details()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(limit.field) and sentence in details, details
    if name in ("logit_bias", "allowed_token_ids"):
        ids = tuple(range(len(value)))
        pen = Penalties(bias_ids=ids, bias_values=(1.0,) * len(ids))
        if name == "allowed_token_ids":
            pen = Penalties(allowed_ids=ids)
        with pytest.raises(InvalidArgument, match=f"^{re.escape(details)}$"):
            fronts.engine.alloc_sequence(pen)
