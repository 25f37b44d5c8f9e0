"""Waiting is visible: a `Generate` call gets its headers at once, and a request that cannot
be admitted at once hears its place in the queue before its tokens, over real gRPC."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from control_plane.cli.generate import add_args, run
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import QUEUED_UPDATE_S, ActiveSeq, GenRequest, ModelFacts, Queued
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.servers import serving

ONE_SLOT = ServiceConfig(verify_tiers="1:3", max_context=2048)
TOK = ByteTokenizer.default()
PROMPT = (3, 4, 5)
# Holds the one slot far longer than the test needs it; cancelled once the other is queued.
LONG = pb.GenerateRequest(
    prompt_token_ids=PROMPT,
    max_new_tokens=2000,
    ignore_eos=True,
    speculative_method=pb.SPECULATIVE_METHOD_NONE,
)
SHORT = pb.GenerateRequest(prompt_token_ids=[7, 8, 9], max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def one_slot(tiny_dir: Path) -> Iterator[str]:
    engine = Engine(tiny_dir, ONE_SLOT)
    with serving(Scheduler(lambda: engine, TOK)) as target:
        yield target


def tokens_of(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_admitted_at_once_hears_no_queue(one_slot: str) -> None:
    with grpc.insecure_channel(one_slot) as channel:
        messages = list(pb_grpc.GenerationServiceStub(channel).Generate(SHORT, timeout=60))
    assert len(tokens_of(messages)) == 12
    assert not any(m.HasField("queued") for m in messages)


def test_queued_stream_hears_its_place_then_its_tokens(one_slot: str) -> None:
    with grpc.insecure_channel(one_slot) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        quiet = tokens_of(list(stub.Generate(SHORT, timeout=60)))
        hold = stub.Generate(LONG, timeout=60)
        assert next(hold).token_ids  # admitted: the slot is taken
        waiting = stub.Generate(SHORT, timeout=60)
        waiting.initial_metadata()  # were they held back, they would come with the call's end
        assert waiting.is_active()
        first = next(waiting)
        assert first.HasField("queued") and not first.token_ids
        assert (first.queued.position, first.queued.queue_length) == (1, 1)
        assert hold.is_active()  # heard while the slot was still held
        hold.cancel()
        rest = list(waiting)
    assert tokens_of(rest) == quiet
    assert rest[-1].finish_reason == "length"
    assert not any(m.HasField("queued") for m in rest if m.token_ids)


def test_headers_come_before_any_event(tiny_dir: Path) -> None:
    """A scheduler that never runs sends nothing, yet the call's headers arrive."""
    engine = Engine(tiny_dir, ONE_SLOT)
    idle = Scheduler(lambda: engine, TOK)  # not started: requests stay in its inbox
    with serving(idle, run=False) as target, grpc.insecure_channel(target) as channel:
        call = pb_grpc.GenerationServiceStub(channel).Generate(SHORT, timeout=30)
        call.initial_metadata()  # were they held back, they would come with the call's end
        assert call.is_active()
        call.cancel()


def test_met_generate_prints_its_place(one_slot: str, capsys: pytest.CaptureFixture[str]) -> None:
    with grpc.insecure_channel(one_slot) as channel:
        hold = pb_grpc.GenerationServiceStub(channel).Generate(LONG, timeout=60)
        assert next(hold).token_ids
        threading.Timer(0.5, hold.cancel).start()
        parser = argparse.ArgumentParser()
        add_args(parser)
        argv = ["hi", "--target", one_slot, "--max-new-tokens", "4", "--ignore-eos"]
        assert run(parser.parse_args(argv)) == 0
    err = capsys.readouterr().err
    assert "queued: position 1 of 1" in err and "[length]" in err


def test_places_are_told_once_then_only_forward_and_throttled() -> None:
    told: list[Queued] = []
    a = ActiveSeq(GenRequest("w", PROMPT, 4), lambda ev: None, TOK, ModelFacts(256))
    a.on_queued = told.append
    a.tell_place(2, 2, now=0.0)
    a.tell_place(2, 3, now=1.0)  # others queued behind: not news
    a.tell_place(1, 3, now=QUEUED_UPDATE_S / 2)  # forward, but too soon
    a.tell_place(1, 3, now=QUEUED_UPDATE_S)
    assert told == [Queued(2, 2), Queued(1, 3)]
