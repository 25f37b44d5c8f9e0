"""`measure_costs` refuses what the service's shape cannot run before any work, in process
and over gRPC, and writes its measurements to the cache directory, never the model's."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpu_service.engine import costs
from gpu_service.engine.facade import Engine
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import ADMIN_KEY_METADATA, CostEntry, InvalidArgument
from tests.conftest import TINY_SERVICE
from tests.protos.test_bodies import ADMIN_KEY, serving

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


def idle(engine: Engine) -> Engine:
    """The engine, failing the test if a measurement takes a scratch sequence: what is
    refused is refused before any work."""

    def no_work(*args: object) -> None:
        raise AssertionError("a refused measurement allocated a scratch sequence")

    engine.alloc_sequence = no_work  # type: ignore[method-assign]
    return engine


def _tables(directory: Path) -> list[Path]:
    return sorted(directory.rglob("spec_cost.*"))


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "cached"])
@pytest.mark.parametrize("case", OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_refused_in_process(model_dir: Path, case: tuple, refresh: bool) -> None:
    widths, depth, repeats, word = case
    engine = idle(Engine(model_dir, TINY_SERVICE))
    with pytest.raises(InvalidArgument, match=word):
        engine.measure_costs(widths, depth, repeats, refresh)
    assert engine.capabilities().free_slots == TINY_SERVICE.num_slots
    assert not _tables(model_dir) and not _tables(model_dir.parent / "cache")


async def test_huge_depth_refused_over_grpc(model_dir: Path) -> None:
    async with serving(idle(Engine(model_dir, TINY_SERVICE))) as target:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ModelServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.MeasureCosts(
                    pb.CostRequest(widths=[1], max_depth=HUGE_DEPTH),
                    metadata=((ADMIN_KEY_METADATA, ADMIN_KEY),),
                )
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


class Scripted:
    """A clock for `costs.measurement`: every timing a 1 ms verify, then the next of
    `verdicts` (ms) as its verdict; counts the timings."""

    def __init__(self, verdicts: Iterator[float]) -> None:
        self.verdicts, self.now, self.reads = verdicts, 0.0, 0

    def __call__(self) -> float:
        phase, self.reads = self.reads % 3, self.reads + 1  # start, verify done, verdict done
        self.now += 0.0 if phase == 0 else 1e-3 if phase == 1 else next(self.verdicts) * 1e-3
        return self.now

    @property
    def timings(self) -> int:
        return self.reads // 3


@pytest.mark.parametrize(
    ("first", "then", "timings", "verdict"),
    [
        # Short in the first round only: measured again once, the medians over both rounds.
        ((2.0, 1.5), (2.0, 3.0), 12, 2.25),
        # Short every time: measured again MORE_ROUNDS times, then raised to the floor.
        ((2.0, 1.5), (2.0, 1.5), 6 * (1 + costs.MORE_ROUNDS), 2.0 * (1 + costs.DRAFT_FLOOR)),
        # Never short: one round.
        ((2.0, 3.0), (2.0, 3.0), 6, 3.0),
    ],
    ids=["short-once", "short-always", "never-short"],
)
def test_a_drafts_cost_is_positive_by_construction(
    model_dir: Path, first: tuple, then: tuple, timings: int, verdict: float
) -> None:
    """Timings in order (plain, drafted) x 3 repeats: a drafted verdict not above the plain
    one is measured again with it, and one that stays short is raised above it."""
    engine = Engine(model_dir, TINY_SERVICE)
    clock = Scripted(itertools.chain(first * 3, itertools.cycle(then)))
    entries, cached = costs.run(costs.measurement(engine, [1], 1, 3, True, clock=clock))
    plain, drafted = sorted(entries, key=lambda e: e.depth)
    assert not cached and clock.timings == timings
    assert (plain.verify_ms, plain.propose_ms) == pytest.approx((1.0, 2.0))
    assert drafted.propose_ms == pytest.approx(verdict) and drafted.propose_ms > plain.propose_ms
    assert engine.capabilities().free_slots == TINY_SERVICE.num_slots


def test_a_drafted_entry_is_bounded_by_its_plain_one() -> None:
    """As measured, and as read from a table: a drafted verify as long as the plain one, a
    drafted verdict longer."""
    entries = [CostEntry(1, 0, 1.0, 2.0), CostEntry(1, 1, 0.8, 1.0), CostEntry(1, 2, 1.2, 9.0)]
    assert costs.bounded(entries) == [
        entries[0],
        CostEntry(1, 1, 1.0, pytest.approx(2.0 * (1 + costs.DRAFT_FLOOR))),
        entries[2],
    ]
