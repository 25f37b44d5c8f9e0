"""Captured graphs of the verify forward and of the drafter's chain: CUDA graphs on a GPU, where
small-batch decoding is otherwise bound by kernel launches.

A graph is captured once per key, over persistent buffers, and replayed after its inputs are
copied in:
- the verify: (forward, batch bucket, rows per sequence, key length, whether the live state
  advances).
  One int64 buffer holds the call's tokens and every index list of its `Batch`, filled by one
  host-to-device copy; the Triton kernels' int32 lists are converted from it inside the graph.
- the chain: (forward, batch bucket, drafts, key length). Its inputs are on the device already (the
  verify's argmax and hidden rows): one copy of the token, slot and position rows, one of the
  hiddens.
A call of n sequences runs in the smallest bucket that holds it; the bucket's other sequences
are padding on the pad slot (`DeviceState.pad_slot`), which no sequence owns, at positions
0 onwards, and their rows are never read. Key lengths go in powers of two of the key block up
to the context: a row's bytes do not depend on the keys read past its own (see
`kernels/attention/naive.py`), nor on the rows beside it, so a replay gives every real row the
bytes the eager forward gives it.

A call no graph fits runs eagerly (`Graphs.fallbacks` counts them): sequences with different
row counts, more sequences than the largest bucket, a key whose capture failed (`failed` keeps
why), a sampled chain. The serial forwards never ask.

On the CPU nothing is captured: `replay_eagerly` runs the function at every replay over the
same buffers, which is how the tests exercise all but the capture itself."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from gpu_service.engine.compiled import Later
from gpu_service.model.batch import HostBatch, Segment, draft_batch, host_batch, on_device
from gpu_service.model.hybrid import VERIFY, HybridModel
from gpu_service.model.ops import ROW_TILE
from gpu_service.model.state import DeviceState
from kernels.attention.naive import KEY_BLOCK

# Sequences per graph: multiples of ROW_TILE, so a chain's rows need no padding of their own.
BUCKETS = (4, 8, 16, 32, 64, 128, 256)
# What turns the graphs off (the name users of the METRALE_* switches know); `--no-cuda-graphs`
# does the same.
NO_GRAPHS_ENV = "METRALE_NO_MTP_VERIFY_GRAPHS"

Run = Callable[[], None]
# Captures `run` (which reads and writes only persistent buffers) -> its replay.
Capture = Callable[[Run], Run]


def wanted(cuda_graphs: bool, device: torch.device, environ: Mapping[str, str]) -> bool:
    """Whether a service captures graphs: on a CUDA device, unless `--no-cuda-graphs` or
    `NO_GRAPHS_ENV` says no."""
    return cuda_graphs and device.type == "cuda" and NO_GRAPHS_ENV not in environ


def buckets(max_batch: int) -> tuple[int, ...]:
    """The buckets a service of `max_batch` sequences per call captures: up to the first that
    holds `max_batch`."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_batch:
            break
    return tuple(out)


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `n` sequences; None past the largest."""
    return next((b for b in sizes if b >= n), None)


def key_bucket(length: int, max_context: int, first: int = 1, factor: int = 2) -> int:
    """Keys a graph's attention reads to see `length` positions: `first` key blocks times a
    power of `factor`, at most the context."""
    blocks, bucket = -(-length // KEY_BLOCK), first
    while bucket < blocks:
        bucket *= factor
    return min(KEY_BLOCK * bucket, max_context)


def cuda_capture(run: Run) -> Run:
    """A CUDA graph of `run`: run once on a side stream first (lazy allocations, Triton
    compiles, cuBLAS handles happen outside the capture), then captured into the pool all
    this process's graphs share. Sharing is safe: graphs replay one at a time, and what a
    caller reads after a replay lies in buffers allocated before any capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pool()):
        run()
    return graph.replay


_POOL: list = []


def _pool():
    if not _POOL:
        _POOL.append(torch.cuda.graph_pool_handle())
    return _POOL[0]


def compile_capture(run: Run) -> Run:
    """The CPU's counterpart of a capture: `run` compiled by inductor into one C++ function
    (`compiled.py`), run once now (the compile happens there), and at every replay."""
    from gpu_service.engine.compiled import compile_run

    return compile_run(run)


def replay_eagerly(run: Run) -> Run:
    """The CPU's stand-in for a capture: `run` once now, as the warm-up before a capture, and
    again at every replay."""
    run()
    return run


@dataclass
class _Graph:
    replay: Run
    inputs: list[torch.Tensor]  # what each call copies its inputs into
    outputs: list[torch.Tensor]
    replays: int = 0


class Graphs:
    """The engine's captured graphs, by key, with the counts tests and reports read."""

    def __init__(
        self,
        model: HybridModel,
        state: DeviceState,
        max_batch: int,
        max_context: int,
        capture: Capture,
        compiled: bool = False,
    ) -> None:
        self.model, self.state, self.capture = model, state, capture
        self.sizes, self.max_context = buckets(max_batch), max_context
        # A compiled key costs seconds to build where a CUDA capture costs milliseconds: key
        # lengths grow fourfold from four blocks, so that a context passes through few keys.
        # Its bytes differ from the eager forward's (fusion rounds otherwise), so the serial
        # forwards replay the same graphs, one sequence in the smallest bucket.
        self.compiled = compiled
        self.key_steps = (4, 4) if compiled else (1, 2)
        # A compiled verify has buckets of one and two sequences too: on the CPU a verify's
        # cost follows its rows (one request's 4 rows padded to a bucket of 4 cost 1.4x), and
        # the GEMMs need only rows padded to ROW_TILE. The chain keeps the shared buckets.
        self.verify_sizes = (1, 2, *self.sizes) if compiled else self.sizes

        self.graphs: dict[tuple, _Graph] = {}
        self.failed: dict[tuple, str] = {}  # keys whose capture raised, and what it raised
        self.fallbacks = 0
        # Compiled: a key one of whose smaller buckets is built compiles in the background,
        # its calls run meanwhile as replays of that bucket (a row's bytes do not depend on its
        # bucket). None (the circuit diff's engine): every key is built at its first call.
        self.later: Later | None = Later() if compiled else None

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def _get(self, key: tuple, capture: Callable[[], _Graph]) -> _Graph | None:
        """The graph of `key`, captured on first use (compiled: queued to the background, the
        call eager meanwhile); None (the call runs eagerly) for a key whose capture failed,
        which is kept in `failed` with its error and never tried again: a forward a device
        cannot capture costs the launches it would have saved, never the request."""
        if key in self.failed:
            self.fallbacks += 1
            return None
        graph = self.graphs.get(key)
        if graph is None and self.later is not None:
            # Compiled in the background: never on a call's path, nor waited for (a cold key
            # costs tens of seconds); the call runs eagerly meanwhile.
            self.later.submit(key, functools.partial(self._built, key, capture), first=True)
            self.fallbacks += 1
            return None
        graph = graph or self._built(key, capture)
        if graph is None:
            self.fallbacks += 1
        return graph

    def _built(self, key: tuple, capture: Callable[[], _Graph]) -> _Graph | None:
        try:
            return capture()
        except Exception as e:
            self.failed[key] = f"{type(e).__name__}: {e}"
            return None

    def _part(self, key: tuple, sizes: tuple[int, ...], capture: Callable[[], _Graph]) -> int:
        """For a compiled key not built yet: the largest smaller bucket built at the key's other
        fields, `key` then queued to compile in the background; 0 where there is none (the key
        is built now) or nothing is built in the background."""
        if self.later is None or key in self.graphs or key in self.failed:
            return 0
        part = max((b for b in sizes if b < key[2] and _at(key, b) in self.graphs), default=0)
        if part:
            self.later.submit(key, lambda: self._built(key, capture), first=True)
        return part

    @property
    def pending(self) -> int:
        """Keys queued or compiling in the background."""
        return 0 if self.later is None else len(self.later.pending)

    @property
    def replays(self) -> int:
        # A copy first: a background build may add a graph meanwhile.
        return sum(g.replays for g in list(self.graphs.values()))

    # -- verify --------------------------------------------------------------------------

    def verify(
        self, segs: list[Segment], tokens: list[int], write_live: bool
    ) -> torch.Tensor | None:
        """The verify forward of `segs` (rows in order, `tokens` theirs) by a graph -> final
        hiddens [R, H] (a view of the graph's output, valid until its next replay), or None
        where no graph fits and the caller runs it eagerly."""
        counts = {s.count for s in segs}
        if len(counts) != 1 and self.compiled:
            return self._ragged(segs, tokens, write_live, sorted(counts))
        b = bucket_for(len(segs), self.verify_sizes)
        if len(counts) != 1 or b is None:
            self.fallbacks += 1
            return None
        (k,) = counts
        keys = key_bucket(max(s.start + s.count for s in segs), self.max_context, *self.key_steps)
        key = (self.model.ops.name, "verify", b, k, keys, write_live)
        capture = lambda: self._capture_verify(key, b, k, keys, write_live)  # noqa: E731
        if part := self._part(key, self.verify_sizes, capture):
            parts = [segs[i : i + part] for i in range(0, len(segs), part)]
            return self._grouped(segs, tokens, write_live, parts)
        graph = self._get(key, capture)
        if graph is None:
            return None
        packed = self._verify_inputs(segs, tokens, b, k, keys)
        graph.inputs[0].copy_(packed, non_blocking=True)
        graph.replay()
        graph.replays += 1
        return graph.outputs[0][: len(segs) * k]

    def _ragged(
        self, segs: list[Segment], tokens: list[int], write_live: bool, counts: list[int]
    ) -> torch.Tensor | None:
        """A call of mixed row counts by compiled graphs: one replay per count, so that each
        row gets the bytes of a call of its count alone (as the serial forwards give it; the
        eager forward's differ in the last bits). A group no graph takes, once another has
        run, runs eagerly by itself: the state it reads is the call's, not advanced twice."""
        groups = [[s for s in segs if s.count == c] for c in counts]
        if any(bucket_for(len(g), self.verify_sizes) is None for g in groups):
            self.fallbacks += 1
            return None
        return self._grouped(segs, tokens, write_live, groups)

    def _grouped(
        self, segs: list[Segment], tokens: list[int], write_live: bool, groups: list[list[Segment]]
    ) -> torch.Tensor | None:
        """`segs` verified a group at a time, each group's rows of one count; the first group
        no graph takes ends the call (None: the caller runs it eagerly), a later one runs
        eagerly by itself."""
        out = torch.empty(
            sum(s.count for s in segs),
            self.model.cfg.hidden_size,
            dtype=self.model.dtype,
            device=self.model.device,
        )
        for n, group in enumerate(groups):
            c = group[0].count
            sub = [Segment(s.slot, s.start, c, i * c) for i, s in enumerate(group)]
            toks = [t for s in group for t in tokens[s.row : s.row + c]]
            hidden = self.verify(sub, toks, write_live)
            if hidden is None:
                if n == 0:
                    return None
                on = torch.tensor(toks, device=self.model.device)
                hidden = self.model.forward(on, sub, self.state, VERIFY, write_live)
            rows = torch.tensor([s.row + t for s in group for t in range(c)], device=out.device)
            out.index_copy_(0, rows, hidden[: len(toks)])
        return out

    def _padded(self, segs: list[Segment], b: int, k: int) -> list[Segment]:
        rows = len(segs) * k
        pads = [Segment(self.state.pad_slot, 0, k, rows + i * k) for i in range(b - len(segs))]
        return [*segs, *pads]

    def _verify_host(self, segs: list[Segment], b: int, k: int, keys: int) -> HostBatch:
        host = host_batch(self._padded(segs, b, k), self.model.layout(self.state, VERIFY), ROW_TILE)
        return replace(host, key_len=keys)

    def _verify_inputs(
        self, segs: list[Segment], tokens: list[int], b: int, k: int, keys: int
    ) -> torch.Tensor:
        """[tokens, padding tokens, every int64 part, every int32 list] on the host."""
        host = self._verify_host(segs, b, k, keys)
        flat = [*tokens, *[0] * ((b - len(segs)) * k)]
        flat += [x for v in host.parts.values() for x in v]
        flat += [x for v in host.small.values() for x in v]
        out = torch.tensor(flat, dtype=torch.long)
        # Pinned for a GPU, so that the copy runs without the host waiting on it.
        return out.pin_memory() if self.model.device.type == "cuda" else out

    def _capture_verify(self, key: tuple, b: int, k: int, keys: int, write_live: bool) -> _Graph:
        """Captured over a call of padding alone, so the warm-up writes only the pad slot."""
        device, state, model = self.model.device, self.state, self.model
        template = self._verify_host([], b, k, keys)
        rows = b * k
        n_parts = sum(len(v) for v in template.parts.values())
        packed = self._verify_inputs([], [], b, k, keys).to(device)
        tokens, parts, small = packed.split(
            [rows, n_parts, sum(len(v) for v in template.small.values())]
        )
        small32 = small.to(torch.int32)
        batch = on_device(template, parts, small32)
        hidden = torch.empty(
            template.padded, model.cfg.hidden_size, dtype=model.dtype, device=device
        )

        def run() -> None:
            small32.copy_(small)
            pad = state.pad_slot
            state.gdn[:, pad].zero_()  # the padding's state stays bounded, replay after replay
            state.conv[:, pad].zero_()
            hidden.copy_(model.forward(tokens, batch, state, VERIFY, write_live))

        graph = _Graph(self.capture(run), [packed], [hidden])
        self.graphs[key] = graph
        return graph

    # -- the drafter's chain ---------------------------------------------------------------

    def chain(
        self,
        tok: torch.Tensor,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        pos: torch.Tensor,
        top: int,
        num_drafts: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`Drafter.chain`'s greedy drafts by a graph -> (drafts [n, nd], confidences [n, nd],
        the last draft's logits [n, V]), views valid until the graph's next replay; None
        where no graph fits."""
        n = tok.shape[0]
        b = bucket_for(n, self.sizes)
        if b is None:
            self.fallbacks += 1
            return None
        keys = key_bucket(top + num_drafts, self.max_context, *self.key_steps)
        key = (self.model.ops.name, "chain", b, num_drafts, keys)
        capture = lambda: self._capture_chain(key, b, num_drafts, keys)  # noqa: E731
        if part := self._part(key, self.sizes, capture):
            outs = []
            for i in range(0, n, part):
                at = slice(i, i + part)
                got = self.chain(tok[at], hidden[at], slots[at], pos[at], top, num_drafts)
                if got is None:  # drafts only propose: the caller drafts them all eagerly
                    return None
                outs.append([x.clone() for x in got])  # the next part's replay overwrites it
            drafts, confs, logits = (torch.cat(x) for x in zip(*outs, strict=True))
            return drafts, confs, logits
        graph = self._get(key, capture)
        if graph is None:
            return None
        ints, hiddens = graph.inputs
        pad = torch.tensor([0, self.state.pad_slot, 0], device=tok.device)[:, None]
        ints.copy_(torch.cat([torch.stack([tok, slots, pos]), pad.expand(3, b - n)], 1))
        hiddens[:n].copy_(hidden)
        graph.replay()
        graph.replays += 1
        drafts, confs, logits = graph.outputs
        return drafts[:n], confs[:n], logits[:n]

    def _capture_chain(self, key: tuple, b: int, num_drafts: int, keys: int) -> _Graph:
        device, state, model = self.model.device, self.state, self.model
        ints = torch.zeros(3, b, dtype=torch.long, device=device)
        ints[1] = state.pad_slot
        hiddens = torch.zeros(b, model.cfg.hidden_size, dtype=model.dtype, device=device)
        index = torch.arange(b, device=device)
        drafts = torch.zeros(b, num_drafts, dtype=torch.long, device=device)
        confs = torch.zeros(b, num_drafts, dtype=torch.float32, device=device)
        logits = torch.zeros(b, model.cfg.vocab_size, dtype=model.dtype, device=device)

        def run() -> None:
            tok, hidden, slots, pos = ints[0], hiddens, ints[1], ints[2]
            last = logits
            for j in range(num_drafts):
                batch = draft_batch(slots, pos + j, index, keys, KEY_BLOCK)
                out = model.mtp_forward(tok, hidden, batch, state)
                assert out is not None
                hidden = out
                last = model.logits(hidden, ROW_TILE)
                tok, conf = model.ops.draft_argmax(last)
                drafts[:, j].copy_(tok)
                confs[:, j].copy_(conf)
            logits.copy_(last)

        graph = _Graph(self.capture(run), [ints, hiddens], [drafts, confs, logits])
        self.graphs[key] = graph
        return graph

    # -- ahead of the first call -------------------------------------------------------

    def warm(self, drafts: int, chain: bool) -> list[tuple[tuple, float]]:
        """The smallest bucket's verify of 1 to `drafts` + 1 rows and (with `chain`) chain of 1
        to `drafts` drafts, at every key length: what one request's steps replay as its context
        grows. With `later`, all queued to the background, the first key length's first, the
        rows and drafts a step most often runs first within it, and nothing built now: the
        service serves at once, eagerly until a call's key is built. Without, the first key
        length's built now -> (key, seconds) of each built (a key that fails is kept in
        `failed`, its calls eager)."""
        lengths = [key_bucket(1, self.max_context, *self.key_steps)]
        while lengths[-1] < self.max_context:
            lengths.append(key_bucket(lengths[-1] + 1, self.max_context, *self.key_steps))
        if self.later is not None:
            for keys in lengths:
                for key, capture in self._smallest(drafts, chain, keys):
                    if key not in self.graphs and key not in self.failed:
                        self.later.submit(key, functools.partial(self._built, key, capture))
            return []
        out = []
        for key, capture in self._smallest(drafts, chain, lengths[0]):
            if key not in self.graphs and key not in self.failed:
                start = time.perf_counter()
                if self._get(key, capture) is not None:
                    out.append((key, time.perf_counter() - start))
        return out

    def _smallest(
        self, drafts: int, chain: bool, keys: int
    ) -> list[tuple[tuple, Callable[[], _Graph]]]:
        """(key, capture) of `warm`'s keys at key length `keys`, in the order a request's
        steps first ask them: the verify of a full chain's rows and the chain of its drafts,
        the bootstrap's verify of one row, then the shorter verifies and chains."""
        vb, cb, name = self.verify_sizes[0], self.sizes[0], self.model.ops.name
        jobs: list[tuple[tuple, Callable[[], _Graph]]] = []
        for k in dict.fromkeys([drafts + 1, 1, *range(drafts, 1, -1)]):
            key: tuple = (name, "verify", vb, k, keys, False)
            jobs.append((key, functools.partial(self._capture_verify, key, vb, k, keys, False)))
            d = drafts if k == drafts + 1 else k - 1 if k > 1 else 0
            if chain and d >= 1 and k != 1:
                key = (name, "chain", cb, d, keys)
                jobs.append((key, functools.partial(self._capture_chain, key, cb, d, keys)))
        return jobs


def _at(key: tuple, bucket: int) -> tuple:
    """`key` (forward, kind, bucket, ...) at another bucket."""
    return (*key[:2], bucket, *key[3:])
