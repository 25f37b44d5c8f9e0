"""One control plane over several GPU services: the routing rule, the same-model check and
health with chosen fakes; then two real GPU-service processes behind one control plane, all
over real gRPC: outputs equal to one replica's, the split in `GetStats`, and a replica killed
mid-run, which fails its own streams alone and rejoins after its restart."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop, wait_serving
from control_plane.replicas.router import Router, Target, TargetError, parse_targets
from control_plane.scheduler.env import Env
from control_plane.scheduler.metrics import Metrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.scheduler import Joins, Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import NONE
from tests.collect import Outcome
from tests.conftest import SERVE_ARGS
from tests.fake_model import FakeModel

TOKENIZER = ByteTokenizer.default()


def test_targets_parse() -> None:
    assert parse_targets("a:1, [::1]:2,dns:///svc:3") == [
        Target("a", 1, False),
        Target("::1", 2, False),
        Target("svc", 3, True),
    ]
    for bad in ("", " , ", "a", "a:", ":1", "dns:///svc", "a:b"):
        with pytest.raises(TargetError):
            parse_targets(bad)


def test_a_dns_name_is_every_address_it_resolves_to() -> None:
    assert "127.0.0.1:7" in parse_targets("dns:///localhost:7")[0].addresses()
    assert Target("localhost", 7, False).addresses() == ["localhost:7"]  # gRPC resolves it
    assert Target("no-such-host.invalid", 7, True).addresses() == []


# Slow: starts a control plane process.
@pytest.mark.slow
def test_a_bad_list_ends_the_process_with_a_sentence() -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "met", "control-plane", "serve"]
    done = subprocess.run([*cmd, "--gpu-service", "a:1,b"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--gpu-service 'a:1,b': 'b' is not HOST:PORT" in done.stderr


class Fakes:
    """Routers over fakes: each address's model, or None for one that cannot be reached."""

    def __init__(self, models: dict[str, FakeModel | None]) -> None:
        self.models = models

    def router(self, start: bool = False) -> Router:
        def build(address: str, authority: str | None, joins: Joins) -> Scheduler:
            def connect() -> FakeModel:
                model = self.models[address]
                if model is None or getattr(model, "down", False):
                    raise OSError(f"{address} is down")
                return model

            opts = SchedulerOptions(max_queue=64)
            return Scheduler(connect, TOKENIZER, opts, Env(), replica=address, joins=joins)

        router = Router(parse_targets(",".join(self.models)), build)
        router.metrics = Metrics()
        if start:
            router.start()
        else:  # no threads: every replica asked once, requests stay where they are placed
            router._pass()
        return router


def _place(router: Router, n: int) -> list[str]:
    return [
        router.submit(GenRequest(f"r{i}", (1, 2), 4, method=NONE), Outcome(), None, TOKENIZER)
        for i in range(n)
    ]


def test_equal_replicas_take_turns() -> None:
    router = Fakes({"a:1": FakeModel(), "b:1": FakeModel()}).router()
    assert _place(router, 6) == ["a:1", "b:1"] * 3


def test_most_free_capacity_first_then_turns() -> None:
    """b has 4 slots to a's 8: a takes requests until its free slots less its queue fall to
    b's, then they alternate."""
    router = Fakes({"a:1": FakeModel(), "b:1": FakeModel(caps=(3, 3, 2, 1))}).router()
    placed = _place(router, 8)
    assert placed[:4] == ["a:1"] * 4
    assert sorted(placed[4:]) == ["a:1", "a:1", "b:1", "b:1"]


def test_the_shorter_queue_breaks_a_tie_of_free_capacity() -> None:
    """a has two slots, b one that another client holds. The third request finds both with
    no capacity left; b's queue is the shorter, though a's turn has come."""
    a, b = FakeModel(caps=(1, 1)), FakeModel(caps=(1,))
    b.alloc_sequence()  # held by another client: b reports no free slot
    router = Fakes({"a:1": a, "b:1": b}).router()
    assert _place(router, 3) == ["a:1", "a:1", "b:1"]


def test_a_prompt_goes_where_it_is_cached_while_there_is_room() -> None:
    """b's prefix cache holds the prompt's first block: the request goes there though a has
    four free slots to b's two; a prompt b does not hold goes by free capacity as before; and
    once b has none left, the cached prompt goes to a."""
    a, b = FakeModel(caps=(3, 3, 3, 3)), FakeModel(caps=(3, 3))
    router = Fakes({"a:1": a, "b:1": b}).router()
    cache = PrefixCache(budget=2, block=4)
    cached = (7, 7, 7, 7, 8)
    cache.taken(cached, 4, snapshot=1)
    router.replicas[1].scheduler.prefix = cache

    def place(prompt: tuple[int, ...]) -> str:
        return router.submit(GenRequest("r", prompt, 4, method=NONE), Outcome(), None, TOKENIZER)

    assert router.replicas[1].scheduler.cached_tokens(cached) == 4
    assert [place(cached), place(cached)] == ["b:1", "b:1"]
    assert [place((1, 2)), place((1, 2))] == ["a:1", "a:1"]
    assert place(cached) == "a:1", "b has no free capacity left"
    assert cache.queries == cache.hits == 0, "placing counts no lookup"


def test_a_chats_next_turn_goes_to_the_replica_holding_its_last(tiny_dir: Path) -> None:
    """Two in-process engines behind a router, equal in every way: turn 1 of a chat goes to
    one of them; its answer is snapshotted there once idle; turn 2, which starts with turn 1's
    prompt and answer, goes to the same one (round robin would have sent it to the other) and
    restores 128 tokens there."""
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, prefix_snapshots=4)
    engines = {"a:1": Engine(tiny_dir, svc), "b:1": Engine(tiny_dir, svc)}

    def build(address: str, authority: str | None, joins: Joins) -> Scheduler:
        engine = engines[address]
        opts = SchedulerOptions()
        return Scheduler(lambda: engine, TOKENIZER, opts, Env(), replica=address, joins=joins)

    router = Router(parse_targets(",".join(engines)), build)
    router.start()
    try:
        first = tuple(range(5, 75))
        out = Outcome()
        one = router.submit(GenRequest("t1", first, 70, ignore_eos=True, method=NONE), out)
        assert out.done.wait(60) and len(out.tokens) == 70
        assert all(r.scheduler.settle(60) for r in router.replicas)
        holder = next(r.scheduler for r in router.replicas if r.name == one)
        assert holder.prefix is not None
        hits = holder.prefix.hits
        nxt = (*first, *out.tokens, *range(100, 120))
        two = router.submit(GenRequest("t2", nxt, 4, method=NONE), second := Outcome())
        assert second.done.wait(60) and second.finish is not None
        assert two == one and holder.prefix.hits - hits == 128
    finally:
        router.stop()


def test_a_replica_down_is_skipped_and_health_follows() -> None:
    router = Fakes({"a:1": None, "b:1": FakeModel()}).router()
    assert router.healthy
    sample = router.metrics.registry.get_sample_value
    up = [sample("met:replica_up", {"replica": r}) for r in ("a:1", "b:1")]
    assert up == [0, 1], "met:replica_up says which"
    assert _place(router, 3) == ["b:1"] * 3
    assert [r["up"] for r in router.snapshot()["replicas"]] == [False, True]
    assert Fakes({"a:1": None}).router().healthy is False


def test_a_replica_serving_another_model_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    models = {"a:1": FakeModel(), "b:1": FakeModel(digest="other")}
    with caplog.at_level(logging.ERROR, logger="control_plane.replicas.router"):
        router = Fakes(models).router()  # type: ignore[arg-type]
    assert _place(router, 2) == ["a:1", "a:1"]
    assert [r.up for r in router.replicas] == [True, False]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "replica b:1 serves 'fake' (digest other)" in line
    assert "'fake' (digest fake)" in line and "not routed to" in line


def test_replicas_share_one_tokenizer_and_serve_through_the_router() -> None:
    """Requests tokenized once are not stale on either replica, and the snapshot sums both."""
    router = Fakes({"a:1": FakeModel(), "b:1": FakeModel()}).router(start=True)
    try:
        a, b = (r.scheduler for r in router.replicas)
        assert a.tokenization is b.tokenization is router.tokenization
        outs = [Outcome() for _ in range(6)]
        for i, out in enumerate(outs):
            router.submit(GenRequest(f"r{i}", (1, 2 + i), 5, method=NONE), out)
        assert all(o.done.wait(30) for o in outs)
        assert all(o.finish is not None and len(o.tokens) == 5 for o in outs)
        snap = router.snapshot()
        assert snap["counters"].finished == 6
        assert [r["counters"].finished for r in snap["replicas"]] == [3, 3]
    finally:
        router.stop()


class LostOnPrefill(FakeModel):
    """A service that goes away at its first prefill: it cannot be dialled again."""

    down = False

    def prefill(
        self, seqs, prompts, masks=None, sampling=None, scores=None, top=None, images=None
    ) -> list[int]:
        self.down = True
        raise OSError("connection reset")


def test_requests_waiting_on_a_lost_replica_go_to_another() -> None:
    """a has one slot: the request in it fails with a; the two waiting behind it hold no slot,
    so b serves them."""
    router = Fakes({"a:1": LostOnPrefill(caps=(1,)), "b:1": FakeModel()}).router()
    a = router.replicas[0].scheduler
    outs = [Outcome() for _ in range(3)]
    for i, out in enumerate(outs):
        a.submit(GenRequest(f"r{i}", (1, 2 + i), 5, method=NONE), out, None, TOKENIZER)
    router.start()  # every replica is up before a's loop takes the three
    try:
        assert all(o.done.wait(30) for o in outs)
        first, *moved = outs
        assert first.failure is not None and first.failure.code == "UNAVAILABLE"
        assert all(o.finish is not None and len(o.tokens) == 5 for o in moved)
        finished = {r["replica"]: r["counters"].finished for r in router.snapshot()["replicas"]}
        assert finished == {"a:1": 0, "b:1": 2}
    finally:
        router.stop()


def test_with_no_other_replica_up_the_waiting_fail() -> None:
    router = Fakes({"a:1": LostOnPrefill(caps=(1,)), "b:1": None}).router()
    a = router.replicas[0].scheduler
    outs = [Outcome() for _ in range(2)]
    for i, out in enumerate(outs):
        a.submit(GenRequest(f"r{i}", (1, 2 + i), 5, method=NONE), out, None, TOKENIZER)
    router.start()
    try:
        assert all(o.done.wait(30) for o in outs)
        assert all(o.failure is not None and o.failure.code == "UNAVAILABLE" for o in outs)
    finally:
        router.stop()


# -- two real GPU services behind one control plane --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_services(tiny_dir: Path) -> Iterator[tuple[list, list[str], Callable[[int], None]]]:
    """Two GPU services on known ports; the third item restarts one on its port."""
    ports = [_free_port(), _free_port()]
    procs, targets = [], []
    for port in ports:
        proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--port", str(port))
        procs.append(proc)
        targets.append(target)

    def restart(i: int) -> None:
        procs[i], _ = start_gpu_service(tiny_dir, *SERVE_ARGS, "--port", str(ports[i]))

    try:
        yield procs, targets, restart
    finally:
        for proc in procs:
            stop(proc)


def _request(i: int, tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=[1 + i % 50, 2 + i % 7], max_new_tokens=tokens, ignore_eos=True
    )


def _generate_all(target: str, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        def one(r: pb.GenerateRequest) -> list[int]:
            return [t for msg in stub.Generate(r, timeout=120) for t in msg.token_ids]

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, requests))


def test_two_replicas_serve_what_one_serves(tiny_dir: Path, two_services) -> None:
    _, targets, _ = two_services
    requests = [_request(i, 12) for i in range(32)]
    cp, cp_target = start_control_plane(",".join(targets), "--tokenizer", str(tiny_dir))
    one, one_target = start_control_plane(targets[0], "--tokenizer", str(tiny_dir))
    try:
        both = _generate_all(cp_target, requests)
        alone = _generate_all(one_target, requests)
        with grpc.insecure_channel(cp_target) as channel:
            stats = pb_grpc.GenerationServiceStub(channel).GetStats(pb.GetStatsRequest())
    finally:
        assert stop(cp) == 0 and stop(one) == 0
    assert both == alone and all(len(t) == 12 for t in both)
    split = {r.replica: r.requests for r in stats.replicas}
    assert set(split) == set(targets) and all(n > 0 for n in split.values())
    assert sum(split.values()) == stats.requests == 32
    assert all(r.up for r in stats.replicas)


def test_a_killed_replica_fails_its_own_streams_and_rejoins(tiny_dir: Path, two_services) -> None:
    procs, targets, restart = two_services
    cp, cp_target = start_control_plane(",".join(targets), "--tokenizer", str(tiny_dir))
    try:
        with grpc.insecure_channel(cp_target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            calls = [stub.Generate(_request(i, 200), timeout=120) for i in range(8)]
            firsts = [list(next(c).token_ids) for c in calls]
            placed = {r.replica: r.requests for r in stub.GetStats(pb.GetStatsRequest()).replicas}
            assert placed == {targets[0]: 4, targets[1]: 4}
            procs[0].kill()
            procs[0].wait()
            killed = time.monotonic()
            ended = _drain(calls, firsts)
            failed = [e for e in ended if isinstance(e, tuple)]
            assert len(failed) == 4, "the killed replica's four streams fail, no others"
            for code, at in failed:
                assert code == grpc.StatusCode.UNAVAILABLE and at - killed < 2.0
            # The others finished unchanged: what the survivor gives the same prompts now.
            survived = [(i, e) for i, e in enumerate(ended) if isinstance(e, list)]
            again = _generate_all(cp_target, [_request(i, 200) for i, _ in survived])
            assert [e for _, e in survived] == again
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            restart(0)
            wait_serving(targets[0])
            _wait_up(stub, targets[0])
            before = _requests(stub)[targets[0]]
            assert all(len(t) == 3 for t in _generate_all(cp_target, [_request(9, 3)] * 4))
            assert _requests(stub)[targets[0]] > before, "the restarted replica serves again"
    finally:
        assert stop(cp) == 0


def _drain(calls: list, firsts: list[list[int]]) -> list:
    """Each stream's tokens when it finished, or (status, when) when it failed."""
    ended: list = [None] * len(calls)

    def run(i: int) -> None:
        tokens = list(firsts[i])
        try:
            for msg in calls[i]:
                tokens += msg.token_ids
        except grpc.RpcError as e:
            ended[i] = (e.code(), time.monotonic())
        else:
            ended[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return ended


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status


def _requests(stub) -> dict[str, int]:
    return {r.replica: r.requests for r in stub.GetStats(pb.GetStatsRequest()).replicas}


def _wait_up(stub, replica: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(
        r.up for r in stub.GetStats(pb.GetStatsRequest()).replicas if r.replica == replica
    ):
        assert time.monotonic() < deadline, f"{replica} did not rejoin"
        time.sleep(0.05)  # the router asks a replica that is down twice a second


def test_a_name_is_dialled_by_address_and_verified_by_name() -> None:
    """`dns:///` replicas are built with the name their certificate must carry; listed
    addresses with none (gRPC checks their own host)."""
    built: dict[str, str | None] = {}

    def build(address: str, authority: str | None, joins: Joins) -> Scheduler:
        built[address] = authority
        return Scheduler(lambda: FakeModel(), TOKENIZER, SchedulerOptions(), Env())

    Router(parse_targets("dns:///localhost:7,127.0.0.2:8"), build)
    assert built["127.0.0.1:7"] == "localhost" and built["127.0.0.2:8"] is None


def test_a_name_resolved_again_brings_and_drops_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """What compose's scaling does to a service name: a copy appears, another goes. The new
    address becomes a replica; the vanished one is no longer routed to."""
    answers = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]]

    def getaddrinfo(host: str, port: int, *args, **kwargs) -> list:
        assert host == "gpu-service"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[0]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    fakes = Fakes({"10.0.0.1:5": FakeModel(), "10.0.0.2:5": FakeModel()})
    built: list[str] = []

    def build(address: str, authority: str | None, joins: Joins) -> Scheduler:
        built.append(address)
        connect = lambda: fakes.models[address]  # noqa: E731
        return Scheduler(
            connect, TOKENIZER, SchedulerOptions(), Env(), replica=address, joins=joins
        )

    router = Router(parse_targets("dns:///gpu-service:5"), build, resolve_s=0.0)
    router._pass()
    assert built == ["10.0.0.1:5"] and _place(router, 1) == ["10.0.0.1:5"]
    answers.pop(0)
    router._pass()
    assert built == ["10.0.0.1:5", "10.0.0.2:5"]
    assert [r.up for r in router.replicas] == [True, True]
    answers.pop(0)
    router._pass()
    assert [r.up for r in router.replicas] == [False, True]
    assert _place(router, 2) == ["10.0.0.2:5"] * 2
