"""The generation API through the real processes: a GPU service and a control plane, each
its own process, talking gRPC over loopback."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop, wait_serving
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from met.main import build_parser
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import MTP, NONE
from tests.collect import run_all
from tests.conftest import SERVE_ARGS, TINY_SERVICE
from tests.control_plane.scheduler.test_loop import mixed_requests

METHOD = {MTP: pb.SPECULATIVE_METHOD_MTP, NONE: pb.SPECULATIVE_METHOD_NONE}


def collect(stub, request: pb.GenerateRequest) -> tuple[list[int], str, pb.GenerateResponse]:
    tokens, text, last = [], "", None
    for msg in stub.Generate(request, timeout=120):
        tokens += msg.token_ids
        text += msg.text
        last = msg
    return tokens, text, last


def wire(req) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=req.prompt_ids,
        max_new_tokens=req.max_new_tokens,
        speculative_method=METHOD[req.method],
    )


def test_lossless_over_grpc(stub, tiny_dir: Path) -> None:
    results = {}
    for method in (MTP, NONE):
        with ThreadPoolExecutor(32) as pool:
            results[method] = list(
                pool.map(lambda r: collect(stub, wire(r)), mixed_requests(method))
            )
    engine = Engine(tiny_dir, TINY_SERVICE)
    local = Scheduler(lambda: engine, ByteTokenizer.default())
    local.start()
    try:
        in_process = run_all(local, mixed_requests(MTP))
    finally:
        local.stop()
    for i, (m, n, p) in enumerate(zip(results[MTP], results[NONE], in_process, strict=True)):
        assert m[0] == n[0] == p.tokens, f"request {i} differs"
        assert m[2].finish_reason == "length" or m[2].finish_reason == "stop"
        assert m[2].usage.completion_tokens == len(m[0])
    drafted = sum(r[2].speculative_stats.drafted for r in results[MTP])
    assert drafted > 0 and all(r[2].speculative_stats.drafted == 0 for r in results[NONE])


def test_text_prompt_logprobs_and_stats(stub) -> None:
    tokens, last = [], None
    request = pb.GenerateRequest(
        prompt="def fib(n):", max_new_tokens=6, logprobs=True, request_id="mine"
    )
    for msg in stub.Generate(request, timeout=60):
        assert len(msg.logprobs) == len(msg.token_ids)
        assert all(lp <= 0 for lp in msg.logprobs)
        tokens += msg.token_ids
        last = msg
    assert len(tokens) == 6 and last.finish_reason == "length" and last.request_id == "mine"
    assert last.usage.prompt_tokens == len(b"def fib(n):")


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="a", max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="a", max_new_tokens=10_000), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt_token_ids=[1] * 300), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="a", speculative_method=9), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="a", num_drafts=9), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt_token_ids=[999]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt="a", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=[
        "empty",
        "zero-tokens",
        "past-context",
        "prompt-past-context",
        "unknown-method",
        "too-many-drafts",
        "prompt-and-ids",
        "token-outside-vocab",
        "negative-temperature",
    ],
)
def test_bad_requests(stub, request_: pb.GenerateRequest, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        collect(stub, request_)
    assert caught.value.code() == code
    assert len(caught.value.details().split()) >= 4


def _settled(stub, served: str, timeout: float = 30.0) -> pb.GetStatsReply:
    deadline = time.monotonic() + timeout
    while True:
        stats = stub.GetStats(pb.GetStatsRequest())
        if stats.active == 0 and stats.queued == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)  # the scheduler retires cancelled streams on its next iteration


def test_cancelled_streams_free_their_slots(stub, served: str) -> None:
    def start_and_cancel(i: int) -> None:
        call = stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=[i % 256] * (1 + i % 30), max_new_tokens=150, ignore_eos=True
            )
        )
        next(call)
        call.cancel()

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(start_and_cancel, range(100)))
    stats = _settled(stub, served)
    assert (stats.active, stats.queued) == (0, 0)
    model = GrpcModel(served)
    caps = model.capabilities()
    model.close()
    assert caps.free_slots == caps.num_slots == stats.free_slots
    # Every block the streams took is back in the pool.
    assert stats.kv_blocks == caps.kv_blocks == stats.kv_blocks_free > 0


def test_deadline_frees_the_slot(stub, served: str) -> None:
    request = pb.GenerateRequest(prompt_token_ids=[3], max_new_tokens=240, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as caught:
        for _ in stub.Generate(request, timeout=0.1):
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = _settled(stub, served)
    assert (stats.active, stats.queued) == (0, 0) and stats.free_slots == 8


def test_health_and_reflection(control_plane: str) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(control_plane) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert "met.v1.GenerationService" in services


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Slow: restarts a service.
@pytest.mark.slow
def test_gpu_service_death_ends_streams_and_recovery(tiny_dir: Path) -> None:
    port = str(_free_port())
    args = (*SERVE_ARGS, "--port", port)
    gpu, target = start_gpu_service(tiny_dir, *args)
    cp, cp_target = start_control_plane(target, "--tokenizer", str(tiny_dir))
    try:
        with grpc.insecure_channel(cp_target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            calls = [
                stub.Generate(
                    pb.GenerateRequest(
                        prompt_token_ids=[i + 1], ignore_eos=True, max_new_tokens=250
                    )
                )
                for i in range(3)
            ]
            for call in calls:
                next(call)
            gpu.kill()  # mid-pipeline: greedy steps run ahead on the step stream
            gpu.wait()
            killed = time.monotonic()
            for call in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    for _ in call:
                        pass
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - killed < 2.0
            gpu, _ = start_gpu_service(tiny_dir, *args)
            wait_serving(target)
            # No slot leaked: every slot serves at once again, and all are free after.
            slots = GrpcModel(target)
            try:
                num_slots = slots.capabilities().num_slots
                with ThreadPoolExecutor(num_slots) as pool:
                    ends = list(
                        pool.map(
                            lambda i: collect(
                                stub, pb.GenerateRequest(prompt_token_ids=[i], max_new_tokens=4)
                            ),
                            range(1, num_slots + 1),
                        )
                    )
                assert all(len(t) == 4 and last.finish_reason == "length" for t, _, last in ends)
                # A finished request holds its slot until the steps in flight are back.
                deadline = time.monotonic() + 2.0
                while (stats := stub.GetStats(pb.GetStatsRequest())).active:
                    assert time.monotonic() < deadline, f"{stats.active} still hold slots"
                    time.sleep(0.02)  # polling another process's frees
                assert stats.free_slots == slots.capabilities().free_slots == num_slots
            finally:
                slots.close()
    finally:
        assert stop(cp) == 0
        stop(gpu)


# Slow: starts both processes with `met up`.
@pytest.mark.slow
def test_met_up_then_generate() -> None:
    """The README's first command, then a client streaming from it."""
    up = subprocess.Popen(
        [sys.executable, "-m", "met", "up", "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if match := re.search(r"control-plane listening on (\S+)", line):
                break
        else:
            pytest.fail("met up did not start the control plane")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "met",
                "generate",
                "def fib(n):",
                "--target",
                match.group(1),
                "--max-new-tokens",
                "12",
                "--ignore-eos",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() and "[length]" in result.stderr
    finally:
        up.terminate()
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0
    assert "gpu-service exited with status 0" in out


def test_seeded_sampling_replays_over_grpc(stub) -> None:
    request = pb.GenerateRequest(
        prompt_token_ids=[3, 4, 5],
        max_new_tokens=8,
        temperature=0.9,
        top_k=20,
        seed=42,
        ignore_eos=True,
    )
    first, second = collect(stub, request)[0], collect(stub, request)[0]
    assert first == second and len(first) == 8
    request.seed = 43
    assert collect(stub, request)[0] != first


def test_get_stats_counts_the_levers(stub) -> None:
    collect(stub, pb.GenerateRequest(prompt_token_ids=[9, 8, 7], max_new_tokens=6))
    stats = stub.GetStats(pb.GetStatsRequest())
    assert stats.finished >= 1 and stats.steps >= 1
    assert stats.last_step_width >= 1, "mtp drafts: the last step had a width"
    assert stats.speculative.drafted >= stats.speculative.accepted


def test_serve_arguments_come_from_the_scheduler_options() -> None:
    """Every scheduler option is a flag of `met control-plane serve`, with its default; the
    parsed flags make the options, and the environment still wins over them."""
    parser = build_parser()
    base = ["control-plane", "serve", "--gpu-service", "x:1"]
    args = parser.parse_args(base)
    assert SchedulerOptions.from_args(args) == SchedulerOptions()
    flags = ["--no-fused-step", "--mtp-max-seqs", "2", "--k-ladder", "2:1", "--spec-cost-model"]
    args = parser.parse_args([*base, *flags, "measured", "--prompt-lookup-decoding"])
    opts = SchedulerOptions.from_args(args)
    assert opts == replace(
        SchedulerOptions(),
        fused_step=False,
        mtp_max_seqs=2,
        k_ladder="2:1",
        spec_cost_model="measured",
        prompt_lookup=True,
    )
    assert not opts.with_env(Env(no_dcut=True)).dcut
    with pytest.raises(ValueError, match="K ladder rung"):
        SchedulerOptions.from_args(parser.parse_args([*base, "--k-ladder", "3"]))
