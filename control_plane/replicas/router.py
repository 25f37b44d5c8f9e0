"""One control plane, several GPU services: a scheduler loop per replica, and the rule that
places each new request on one of them.

**Replicas.** `--gpu-service` lists them, comma-separated. `HOST:PORT` is one replica.
`dns:///NAME:PORT` is every address NAME resolves to, resolved again every `RESOLVE_S`
(what compose's service scaling gives); over TLS each is verified against NAME. Each replica
has its own scheduler: its own `step_mtp`, slots, cost model and acceptance statistics, since
replicas may run on different hardware.

**Up.** A replica is up while its scheduler holds a connection whose model it accepted. One
that is down is probed every `PROBE_S` and rejoins by itself when it answers.

**Same model.** A replica joins only if it serves what the replicas already up serve: the same
model name and model digest (config and weights, `Capabilities.model_digest`). One that
differs is refused with a log line and never routed to. With none up, the first to come up
sets the model, so that a fleet restarted on a new checkpoint serves it.

**Routing.** A new request goes, among the replicas with free capacity, to the one whose
prefix cache holds the most of its prompt (a chat's next turn goes where its last turn's
snapshot lies, a shared system prompt where it was prefilled: SGLang's cache-aware routing);
with no prompt cached, or no free capacity, to the replica with the most free capacity. Free
capacity is the replica's free slots less the requests already waiting for one there; among
equals, the shortest queue wins; remaining ties go round robin. Only replicas that are up and
serve the tokenizer the request was tokenized with are candidates. With every replica down
it goes to the first listed, whose scheduler refuses it as it refuses any request with no
service in reach.

**Moves.** A request never moves once its slot is allocated: when its replica is lost it
ends `UNAVAILABLE`. One still waiting for a slot there is placed again, by the same rule,
among the other replicas (it then counts in both replicas' `requests`); with none up it ends
`UNAVAILABLE` too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from control_plane.scheduler.metrics import Metrics
from control_plane.scheduler.scheduler import Joins, Scheduler
from control_plane.scheduler.seq import ActiveSeq, GenRequest, QueueSink, Sink, SpecStats
from control_plane.scheduler.tally import Counters, merge_counters
from control_plane.text.detok import Tokenizer
from control_plane.text.images import Keyed
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities, FailedPrecondition, ModelError, ResourceExhausted

log = logging.getLogger("control_plane.replicas.router")
DNS_SCHEME = "dns:///"
PROBE_S = 0.5  # how often a replica that is down is asked again
RESOLVE_S = 5.0  # how often `dns:///` names are resolved again


class TargetError(ValueError):
    """A `--gpu-service` list that names no replica, or one without a port."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One entry of `--gpu-service`: an address, or a name whose every address is one."""

    host: str
    port: int
    dns: bool  # every address the name resolves to is a replica

    def addresses(self) -> list[str]:
        """The replicas' addresses (`host:port`); a name that resolves to none gives none."""
        if not self.dns:
            return [join(self.host, self.port)]
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("resolving %s: %s", self.host, e)
            return []
        return sorted({join(str(info[4][0]), self.port) for info in infos})


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_targets(spec: str) -> list[Target]:
    """`--gpu-service`'s value: `HOST:PORT` and `dns:///NAME:PORT` entries, comma-separated."""
    targets = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        dns = entry.startswith(DNS_SCHEME)
        address = entry[len(DNS_SCHEME) :] if dns else entry
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise TargetError(f"{entry!r} is not HOST:PORT or {DNS_SCHEME}NAME:PORT")
        targets.append(Target(host.strip("[]"), int(port), dns))
    if not targets:
        raise TargetError("it names no GPU service")
    return targets


# A replica's scheduler, from its name (the address) and the name its certificate must carry
# (None: the address's own host); the router passes `joins` to it.
Build = Callable[[str, str | None, Joins], Scheduler]


class Replica:
    def __init__(self, name: str, scheduler: Scheduler) -> None:
        self.name, self.scheduler = name, scheduler
        self.listed = True  # still named by its `--gpu-service` entry
        self.identity: tuple[str, str] | None = None  # model name and digest, once accepted
        self.refused: tuple[str, str] | None = None  # what it served when last refused

    @property
    def up(self) -> bool:
        return self.listed and self.scheduler.ctx is not None and self.identity is not None


class Router:
    """What the fronts drive (`Door`, `GetStats`): the scheduler's interface, over replicas."""

    def __init__(
        self,
        targets: Sequence[Target],
        build: Build,
        on_health: Callable[[bool], None] | None = None,
        probe_s: float = PROBE_S,
        resolve_s: float = RESOLVE_S,
    ) -> None:
        self.targets, self.build, self.on_health = list(targets), build, on_health
        self.probe_s, self.resolve_s = probe_s, resolve_s
        self.replicas: list[Replica] = []
        self.metrics: Metrics | None = None  # the registry the server exports
        self._tokenizations: dict[str, Tokenization] = {}  # by digest: one per model's files
        self._turn = itertools.count()  # round robin among equals
        self._route = threading.Lock()  # one placement at a time: each sees the last one's
        self._join = threading.Lock()  # the identity check and the tokenization interning
        self._stop = threading.Event()
        self._healthy: bool | None = None
        self._resolved_at = float("-inf")
        self._monitor = threading.Thread(target=self._watch, name="replicas", daemon=True)
        self._resolve()

    # -- the scheduler's interface --------------------------------------------------------

    @property
    def tokenization(self) -> Tokenization | None:
        for r in self._by_preference():
            if r.scheduler.tokenization is not None:
                return r.scheduler.tokenization
        return None

    @property
    def tokenizer(self) -> Tokenizer:
        tokenization = self.tokenization
        if tokenization is None:
            raise RuntimeError("the control plane has not connected to a GPU service yet")
        return tokenization.tokenizer

    def start(self) -> None:
        """Each replica asked once, here, before the monitor takes over: health and routing
        are right from the first request."""
        self._pass()
        for r in self.replicas:
            r.scheduler.start()
        self._monitor.start()

    def stop(self) -> None:
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=30)
        for r in self.replicas:
            r.scheduler.stop()

    def capabilities(self) -> Capabilities:
        """A replica's that is up; with none up, each is asked in turn (the last refusal is
        raised when none answers)."""
        for r in self.replicas:
            if r.up:
                return r.scheduler.capabilities()
        error: Exception | None = None
        for r in self._listed():
            try:
                caps = r.scheduler.capabilities()
            except Exception as e:  # noqa: BLE001 - the next replica may answer
                error = e
                continue
            if r.up:
                return caps
        raise error or FailedPrecondition("no GPU service serves the model of the others")

    def submit(
        self,
        req: GenRequest,
        sink: Sink,
        on_queued: QueueSink | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> str:
        """Place the request (the rule: module docstring); returns its replica's name."""
        with self._route:
            replica = self._place(tokenizer, req.cache_key)
            replica = replica or next(iter(self._listed()), self.replicas[0])
            replica.scheduler.submit(req, sink, on_queued, tokenizer)
        return replica.name

    def cancel(self, request_id: str) -> None:
        # Every replica hears it: only the one holding the request acts, and no map of
        # request ids to replicas has to be kept and pruned.
        for r in self.replicas:
            r.scheduler.cancel(request_id)

    def snapshot(self) -> dict:
        """The schedulers' snapshots summed, each replica's beside them (`replicas`)."""
        snaps = [(r, r.scheduler.snapshot()) for r in self.replicas]
        total: dict = {"counters": Counters(), "spec": SpecStats()}
        for key in ("active", "queued", "free_slots", "kv_blocks", "kv_blocks_free"):
            total[key] = sum(s[key] for _, s in snaps)
        for _, s in snaps:
            total["counters"] = merge_counters(total["counters"], s["counters"])
            total["spec"].merge(s["spec"])
        total["replicas"] = [{"replica": r.name, "up": r.up, **s} for r, s in snaps]
        return total

    # -- placement ------------------------------------------------------------------------

    def _place(
        self, tokenizer: Tokenizer | None, prompt: Keyed, lost: Scheduler | None = None
    ) -> Replica | None:
        """The replica the rule picks for `prompt`, None when none is up (other than `lost`)."""
        up = [r for r in self.replicas if r.up and r.scheduler is not lost]
        if tokenizer is not None:
            up = [r for r in up if _serves(r, tokenizer)]
        if not up:
            return None
        turn = next(self._turn)
        if len(up) == 1:
            return up[0]
        scored = []
        for i, r in enumerate(up):
            free, queued = r.scheduler.load()
            cached = r.scheduler.cached_tokens(prompt) if free > queued else 0
            # With room, the most of the prompt cached; then the most free capacity, then the
            # shortest queue, then the next in turn.
            scored.append((-cached, queued - free, queued, (i - turn) % len(up), r))
        return min(scored, key=lambda s: s[:4])[4]

    def _handoff(self, lost: Scheduler, waiting: list[ActiveSeq]) -> list[ActiveSeq]:
        """Requests that waited for a slot on a replica now lost, placed again by the rule
        among the others; -> those no other replica takes."""
        unplaced = []
        for a in waiting:
            with self._route:
                replica = self._place(a.tokenizer, a.req.cache_key, lost)
                try:
                    if replica is None:
                        raise ResourceExhausted("no other replica is up")
                    replica.scheduler.submit(a.req, a.sink, a.on_queued, a.tokenizer)
                except ModelError:
                    unplaced.append(a)
        if len(unplaced) < len(waiting):
            log.info(
                "%d requests waiting on a lost replica went to others", len(waiting) - len(unplaced)
            )
        return unplaced

    def _by_preference(self) -> list[Replica]:
        return [*(r for r in self.replicas if r.up), *(r for r in self.replicas if not r.up)]

    def _listed(self) -> list[Replica]:
        return [r for r in self.replicas if r.listed]

    # -- joining --------------------------------------------------------------------------

    def _joins(self, sched: Scheduler, caps: Capabilities, served: Tokenization) -> Tokenization:
        """A replica's connection, accepted (its tokenization returned) or refused."""
        identity = (caps.model_name, caps.model_digest)
        with self._join:
            replica = next(r for r in self.replicas if r.scheduler is sched)
            others = {
                r.identity
                for r in self.replicas
                if r is not replica and r.up and r.identity is not None
            }
            if others and identity not in others:
                replica.identity = None
                want = " or ".join(f"{n!r} (digest {d})" for n, d in sorted(others))
                message = (
                    f"replica {replica.name} serves {caps.model_name!r} (digest "
                    f"{caps.model_digest}) where the replicas up serve {want}; it is not "
                    "routed to"
                )
                if replica.refused != identity:  # said once, not at every probe
                    log.error("%s", message)
                    replica.refused = identity
                raise FailedPrecondition(message)
            replica.identity, replica.refused = identity, None
            # Replicas serving the same files share one tokenizer object: a request
            # tokenized with it is not stale on whichever replica it lands.
            return self._tokenizations.setdefault(served.digest, served)

    # -- the monitor ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.probe_s):
            self._pass()

    def _pass(self) -> None:
        self._resolve()
        for r in self._listed():
            if r.scheduler.ctx is None:
                self._probe(r)
        if self.metrics is not None:
            for r in self.replicas:
                self.metrics.up.labels(replica=r.name).set(int(r.up))
        self._tell_health()

    @property
    def healthy(self) -> bool:
        """Serving while at least one replica is up."""
        return any(r.up for r in self.replicas)

    def _probe(self, r: Replica) -> None:
        try:
            r.scheduler.capabilities()
        except Exception as e:  # noqa: BLE001 - a replica down stays down until it answers
            log.debug("replica %s is down: %s", r.name, e)
        else:
            log.info("replica %s is up", r.name)

    def _tell_health(self) -> None:
        healthy = self.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            if self.on_health is not None:
                self.on_health(healthy)

    def _resolve(self) -> None:
        """The replicas the targets name now: new addresses join, vanished ones are no
        longer routed to (their requests finish where they are)."""
        now = time.monotonic()
        if now - self._resolved_at < self.resolve_s:
            return
        self._resolved_at = now
        named: dict[str, str | None] = {}
        for t in self.targets:
            for address in t.addresses():
                named.setdefault(address, t.host if t.dns else None)
        known = {r.name: r for r in self.replicas}
        for address, authority in named.items():
            if address in known:
                known[address].listed = True
                continue
            replica = Replica(address, self.build(address, authority, self._joins))
            replica.scheduler.handoff = self._handoff
            self.replicas.append(replica)
            if self._monitor.is_alive():  # new after the start: started here
                replica.scheduler.start()
            log.info("replica %s listed", address)
        for r in self.replicas:
            if r.name not in named and r.listed:
                r.listed = False
                log.info("replica %s is no longer listed", r.name)


# What the fronts drive: one scheduler (in process, or one GPU service), or a router.
Drives = Scheduler | Router


def _serves(r: Replica, tokenizer: Tokenizer) -> bool:
    t = r.scheduler.tokenization
    return t is not None and t.tokenizer is tokenizer
