"""`measure_costs` refuses what the service's shape cannot run before any work, in process
and over gRPC, and writes its measurements to the cache directory, never the model's."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import grpc
import pytest

from gpu_service import costs
from gpu_service.engine import Engine
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import ADMIN_KEY_METADATA, InvalidArgument
from tests.conftest import TINY_SERVICE
from tests.test_bodies import ADMIN_KEY, serving

HUGE_DEPTH = 2**32 - 1
# TINY_SERVICE: max_batch 8, the widest verify slot takes 3 drafts.
OUT_OF_RANGE = {
    "huge-depth": ([1], HUGE_DEPTH, 5, "max_depth"),
    "depth-over-capacity": ([1], 4, 5, "max_depth"),
    "no-widths": ([], 1, 5, "widths"),
    "width-zero": ([0, 1], 1, 5, "widths"),
    "width-over-max-batch": ([9], 1, 5, "max_batch"),
    "repeats-zero": ([1], 1, 0, "repeats"),
    "repeats-over-cap": ([1], 1, costs.MAX_REPEATS + 1, "repeats"),
    "past-the-context": ([1, 2, 4], 2, 40, "context of 256"),  # 9 cells x 40 commits
}


@pytest.fixture
def model_dir(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the tiny checkpoint, with the cache directory under `tmp_path/cache`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def _tables(directory: Path) -> list[Path]:
    return sorted(directory.rglob("spec_cost.*"))


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "cached"])
@pytest.mark.parametrize("case", OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_refused_in_process(model_dir: Path, case: tuple, refresh: bool) -> None:
    widths, depth, repeats, word = case
    engine = Engine(model_dir, TINY_SERVICE)
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgument, match=word):
        engine.measure_costs(widths, depth, repeats, refresh)
    assert time.perf_counter() - t0 < 1.0, "refused before any work"
    assert engine.capabilities().free_slots == TINY_SERVICE.num_slots
    assert not _tables(model_dir) and not _tables(model_dir.parent / "cache")


async def test_huge_depth_refused_over_grpc(model_dir: Path) -> None:
    async with serving(Engine(model_dir, TINY_SERVICE)) as target:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ModelServiceStub(channel)
            t0 = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.MeasureCosts(
                    pb.CostRequest(widths=[1], max_depth=HUGE_DEPTH),
                    metadata=((ADMIN_KEY_METADATA, ADMIN_KEY),),
                )
            assert time.perf_counter() - t0 < 1.0
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_depth 4294967295" in (refused.value.details() or "")
            caps = await stub.Capabilities(pb.CapabilitiesRequest())
            assert caps.free_slots == TINY_SERVICE.num_slots, "the service serves on"
    assert not _tables(model_dir)


def test_measurement_goes_to_the_cache(model_dir: Path, tmp_path: Path) -> None:
    engine = Engine(model_dir, TINY_SERVICE)
    entries, cached = engine.measure_costs([1, 2], 1, repeats=1, refresh=True)
    assert not cached and not _tables(model_dir)
    [written] = _tables(tmp_path / "cache" / "met")
    assert written.parent == costs.cache_dir()
    assert engine.measure_costs([1, 2], 1) == (entries, True)


def test_shipped_table_is_read_only(model_dir: Path) -> None:
    engine = Engine(model_dir, TINY_SERVICE)
    entries, _ = engine.measure_costs([1, 2], 1, repeats=1, refresh=True)
    [measured] = _tables(costs.cache_dir())
    shipped = model_dir / measured.name
    measured.rename(shipped)
    before = shipped.read_bytes()
    assert engine.measure_costs([1, 2], 1) == (entries, True), "read from the model directory"
    engine.measure_costs([1, 2], 1, repeats=1, refresh=True)
    assert shipped.read_bytes() == before and (costs.cache_dir() / shipped.name).exists()
