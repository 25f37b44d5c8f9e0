"""Shared fixtures: a tiny checkpoint written to disk, engines over it, and one real GPU
service process serving it on a loopback socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from gpu_service.config import ModelConfig, ServiceConfig
from gpu_service.device import choose_device
from gpu_service.engine import Engine
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from training.checkpoint import init_model

# The Triton interpreter decision, made before pytest imports a test module (and so a kernel).
choose_device()


@pytest.fixture(scope="session", autouse=True)
def _cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Measured cost tables go under $XDG_CACHE_HOME: a directory of the run's own, set before
    any service process starts so that it inherits it, never the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


# Tests marked `slow`, which `pytest -m "not slow"` (the fast tier) leaves out: seconds each on
# a 2-core CPU. A key is a module, a test function (all its parameters) or one node id.
SLOW_TESTS = {
    "tests/gpu_service/tp/test_tensor_parallel.py::test_transformers_parity_at_tp_2_and_a_hung_rank_ends_it": (
        "starts tensor-parallel rank processes"
    ),
    "tests/gpu_service/tp/test_tensor_parallel.py::test_through_the_pair": "starts tensor-parallel services",
    "tests/gpu_service/test_plan.py::test_flagship_bf16_at_tp2_fits_h200s_with_room_for_slots": "builds "
    "Qwen3-Next-80B's rank-0 shard on the meta device",
    "tests/gpu_service/test_plan.py::test_tp2_plan_is_each_ranks_allocations": "starts a tensor-parallel "
    "rank process",
    "tests/gpu_service/test_costs_fair.py": "measurements slowed to seconds on purpose",
    "tests/processes/test_bad_call_ends_alone.py": "starts both processes beside live streams",
    "tests/processes/test_fuzz.py": "3,000 malformed RPCs against both processes",
    "tests/processes/test_restart.py": "kills and freezes control plane processes",
    "tests/protos/test_hub.py::test_serve_serves_a_cached_hub_id": "starts a GPU service process for "
    "each id",
    "tests/gpu_service/test_prefixes.py::test_over_grpc_a_snapshot_is_its_sessions": "starts a GPU "
    "service process",
    "tests/control_plane/circuit/test_verify_batch.py::test_a_prefix_restored_from_a_snapshot_gives_the_whole_prefills"
    "_bytes[forwards1]": "interprets the Triton forward through five runs of the diff",
    "tests/processes/test_sessions.py": "starts service processes, kills and freezes clients",
    "tests/gpu_service/test_step_stream.py::test_recv_raises_unavailable_soon_after_the_service_dies": "starts "
    "and kills a GPU service",
    "tests/protos/test_tls.py::test_mutual_tls_between_the_processes": "both processes under mTLS",
    "tests/protos/test_tls.py::test_processes_refuse_a_cert_without_its_key": "starts each process",
    "tests/gpu_service/model/test_hf_parity.py": "builds transformers' reference model for every comparison",
    "tests/control_plane/cli/test_ports.py::test_a_second_server_on_a_busy_port_exits_2_before_loading": "starts "
    "each server process on a busy port",
    "tests/control_plane/cli/test_ports.py::test_up_on_a_bad_path_says_one_sentence": "starts met up and its GPU "
    "service process",
    "tests/control_plane/cli/test_ports.py::test_up_serves_a_repeated_prefix_from_the_cache": "starts met up, "
    "both processes",
    "tests/gpu_service/model/test_qwen3_5.py": "transformers' Qwen3.5 models, both processes, TP ranks, the "
    "interpreted diff",
    "tests/processes/test_serve_checkpoint.py": "serves a transformers checkpoint with both processes",
    "tests/training/test_training.py::test_training_is_deterministic_and_resumes_exactly": "trains twice",
    "tests/training/test_training.py::test_training_forward_matches_the_service_forward": "two forwards",
    "tests/control_plane/circuit/test_verify_batch.py": "runs whole verify batches through both forwards",
    "tests/gpu_service/test_default_model.py": "serves the bundled checkpoint end to end",
    "tests/control_plane/benchmarks/test_bench.py": "runs `met bench`",
    "tests/processes/test_telemetry.py": "starts both processes with an OTLP receiver",
    "tests/control_plane/fronts/test_openai_http.py::test_greedy_text_is_the_grpc_apis_whole_and_streamed": "three "
    "generations over both fronts",
    "tests/control_plane/fronts/test_openai_http.py::test_chat_is_the_grpc_apis_whole_and_streamed": "three chats",
    "tests/control_plane/fronts/test_openai_http.py::test_json_schema_output_validates": "builds the grammar engine",
    "tests/kernels/test_gated_delta_rule.py": "the chunked kernel under the Triton interpreter",
    "tests/gpu_service/model/test_triton_forward.py": "whole forwards under the Triton interpreter",
    "tests/processes/test_gpu_check.py::test_cpu_run_writes_a_passing_report": "runs the device check",
    "tests/processes/test_generation_api.py::test_gpu_service_death_ends_streams_and_recovery": "restarts a service",
    "tests/processes/test_generation_api.py::test_met_up_then_generate": "starts both processes with `met up`",
    "tests/control_plane/replicas/test_router.py::test_a_bad_list_ends_the_process_with_a_sentence": "starts a "
    "control plane process",
    "tests/gpu_service/test_verifier.py::test_verify_fold_commit_equals_one_at_a_time": "one "
    "verify per token, for every depth and write mode",
    "tests/gpu_service/test_verifier.py::test_recurrent_and_chunked_prefill_agree": "both prefills",
    "tests/gpu_service/test_sampling.py::test_seeded_sampling_with_and_without_speculation": "two full "
    "sampled generations",
    "tests/gpu_service/model/test_flagship_mini.py::test_mtp_equals_none_through_both_processes": "starts both "
    "processes on the miniature flagship",
    "tests/gpu_service/model/test_flagship_mini.py::test_circuit_diff_passes": "verify batches through a forward "
    "and its serial form (the triton one interpreted)",
    "tests/gpu_service/model/test_held_weights.py::test_peak_while_loading": "loads each checkpoint four times in "
    "processes of their own",
    "tests/gpu_service/test_plan.py::test_flagship_weights_are_its_checkpoints_bytes": "builds "
    "Qwen3-Next-80B's 76k weight tensors on the meta device",
    "tests/gpu_service/test_plan.py::test_serve_refuses_a_plan_that_does_not_fit": "starts a GPU service "
    "process",
    "tests/gpu_service/test_plan.py::test_flagship_fp8_counts_a_byte_a_weight_and_fits_one_h200": "builds "
    "the FP8 flagship on the meta device",
    "tests/gpu_service/test_quantization.py::test_mtp_equals_none_through_both_processes": "starts both "
    "processes on each FP8 checkpoint",
    "tests/gpu_service/test_quantization.py::test_serve_refuses_at_start_up_with_status_2": "starts a GPU "
    "service process",
    "tests/gpu_service/test_quantization.py::test_the_published_layout_loads_and_matches_transformers": (
        "loads the checkpoint in transformers"
    ),
    "tests/gpu_service/test_quantization.py::test_circuit_diff_passes": "verify batches through a forward "
    "and its serial form",
}
# Any test that uses one of these fixtures is slow: it waits on a process starting.
SLOW_FIXTURES = {
    "served": "starts a GPU service process",
    "two_services": "starts two GPU service processes",
    "control_plane": "starts a control plane process",
    "tp_engines": "starts tensor-parallel rank processes",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _slow_reason(item) is not None:
            item.add_marker(pytest.mark.slow)


def _slow_reason(item: pytest.Item) -> str | None:
    module, _, name = item.nodeid.partition("::")
    function = f"{module}::{name.partition('[')[0]}"
    for key in (item.nodeid, function, module):
        if key in SLOW_TESTS:
            return SLOW_TESTS[key]
    fixtures = getattr(item, "fixturenames", ())
    return next((SLOW_FIXTURES[f] for f in fixtures if f in SLOW_FIXTURES), None)


TINY = ModelConfig.tiny()
# The first bundled checkpoint (4 target layers, 1.6M parameters), kept as the fixture of tests
# that need a trained model but not the default's depth: a third of its step time.
TRAINED = Path(__file__).resolve().parent / "fixtures" / "trained4"
# Small tiers so that tests reach every tier and run out of slots quickly.
TINY_SERVICE = ServiceConfig(
    verify_tiers="2:3,2:2,4:1", max_context=256, max_rows=24, max_batch=8, max_prefill_tokens=512
)
SERVE_ARGS = (
    "--verify-tiers",
    TINY_SERVICE.verify_tiers,
    "--max-context",
    "256",
    "--max-rows",
    "24",
    "--max-batch",
    "8",
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    init_model(directory, TINY, seed=7)
    return directory


@pytest.fixture(scope="session")
def mini_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The flagship in miniature (tests/flagship.py), seeded weights."""
    from tests.flagship import MINI_FLAGSHIP

    directory = tmp_path_factory.mktemp("mini-flagship")
    init_model(directory, MINI_FLAGSHIP, seed=5)
    return directory


@pytest.fixture
def engine(tiny_dir: Path) -> Engine:
    return Engine(tiny_dir, TINY_SERVICE)


@pytest.fixture(scope="session")
def served(tiny_dir: Path) -> Iterator[str]:
    proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--max-prefill-tokens", "512")
    try:
        yield target
    finally:
        assert stop(proc) == 0, "the GPU service did not shut down cleanly on SIGTERM"


@pytest.fixture
def client(served: str) -> Iterator[GrpcModel]:
    model = GrpcModel(served)
    model.set_forward("eager")
    yield model
    model.close()


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def random_tokens(rng: torch.Generator, n: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=rng).tolist()


@pytest.fixture(scope="session")
def control_plane(served: str, tiny_dir: Path) -> Iterator[str]:
    proc, target = start_control_plane(served, "--tokenizer", str(tiny_dir))
    yield target
    assert stop(proc) == 0


@pytest.fixture
def stub(control_plane: str) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(control_plane) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
