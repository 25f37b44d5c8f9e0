"""KV pool pressure: what one loop iteration's calls may take from the service's paged KV pool,
and who goes on when the pool cannot give it all. A full pool slows requests; it never fails
one that the pool could hold alone, nor one for another's sake (vLLM preempts; so do we, after
pausing).

Requests are served oldest work first: the decoding ones in admission order, then the
prefilling ones in theirs. When the pool may fall short:
1. the prefix cache's snapshots go first, least recently used first: they hold blocks, and the
   cache never costs a request anything;
2. a request whose blocks for the iteration are not free sits it out, keeping its own. It goes
   on once blocks free, to the same tokens as if it had never waited (a row's bytes do not
   depend on its batch);
3. when even the oldest cannot go on, the newest request holding blocks is preempted: its
   sequence is freed and it waits at the head of the queue, then prefills its prompt and what
   it generated and goes on from its newest token (`ActiveSeq.preempt`);
4. when the oldest cannot go on with every other preempted, the pool is too small for it: it
   fails alone, with RESOURCE_EXHAUSTED.
While nothing waits or sits out, new requests are admitted; otherwise they wait, since a new
one would only sit out or push out an older one.

This costs no call while the pool surely has blocks to spare: its blocks against an upper bound
of what the live sequences and the snapshots hold once the iteration's calls and the steps in flight
have run. Past that bound the service is asked its free count; only when that falls short are
the flights read back (a request sitting out must not be in one) and the count asked again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefill import chunk_length
from control_plane.scheduler.seq import ActiveSeq
from protos.model import Capabilities


@dataclass(frozen=True)
class Pool:
    """The service's KV pool as the scheduler sees it, and the most an iteration asks of it."""

    blocks: int  # the pool's blocks
    block: int  # positions a block backs
    width: int  # the most drafts one step verifies (the widest slot's)
    steps: int  # the most steps one iteration sends a sequence once nothing is in flight
    chunk: int  # a prefill chunk's tokens, at most
    budget: int  # a prefill call's tokens, at most

    @classmethod
    def of(cls, caps: Capabilities, opts: SchedulerOptions) -> Pool | None:
        """None for a service without a paged pool (nothing to share)."""
        if caps.kv_blocks <= 0 or caps.kv_block_size <= 0:
            return None
        width = max(caps.slot_verify_drafts, default=0)
        # The pipeline sends plans until two are in flight, each of up to `plan_steps` steps.
        steps = 2 * opts.plan_steps
        return cls(
            caps.kv_blocks,
            caps.kv_block_size,
            width,
            steps,
            opts.prefill_chunk,
            caps.max_prefill_tokens,
        )

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def reach(self, a: ActiveSeq, steps: int) -> int:
        """The positions a decoding sequence may back once `steps` more steps ran: each
        verifies its newest token and at most `width` drafts, and the drafter's entries may
        run `width` past them; never past its context's bound or its last token."""
        tokens = len(a.req.prompt_ids) + len(a.generated)
        bound = min(a.max_context, len(a.req.prompt_ids) + a.req.max_new_tokens) + self.width
        return min(tokens + steps * (self.width + 1) + self.width, bound)

    def decode_need(self, a: ActiveSeq, in_flight: int = 0) -> int:
        """Blocks an iteration's steps, after the `in_flight` steps sent before it, may add to
        a decoding sequence (which holds at least those of the tokens in its cache as last
        read: all but its newest)."""
        cached = len(a.req.prompt_ids) + len(a.generated) - 1
        reach = self.reach(a, self.steps + in_flight)
        return max(0, self.blocks_for(reach) - self.blocks_for(cached))

    def surely_fits(
        self,
        prefilling: Sequence[ActiveSeq],
        active: Sequence[ActiveSeq],
        in_flight: int,
        snapshots: Sequence[int],
    ) -> bool:
        """Whether the pool holds everything even at the most this iteration and the
        `in_flight` steps sent before it may take: then nobody need be asked anything."""
        held = sum(self.blocks_for(t) for t in snapshots)
        held += sum(self.blocks_for(self.reach(a, self.steps + in_flight)) for a in active)
        budget = self.budget
        for a in prefilling:
            n = max(0, chunk_length(a, self.chunk, budget, self.block))
            # and a block of its own for a snapshot taken after its chunk
            held += self.blocks_for(a.prefilled + n) + 1
            budget -= n
        return held <= self.blocks

    def plan(
        self,
        prefilling: Sequence[ActiveSeq],
        active: Sequence[ActiveSeq],
        free: int,
        in_flight: int = 0,
    ) -> PoolPlan:
        """Who goes on with `free` blocks, oldest work first: each request whose blocks for the
        iteration (and the `in_flight` steps before it) are free goes on and takes them; the
        others sit out."""
        paused: set[int] = set()
        need, budget = 0, self.budget
        for a in active:
            want = self.decode_need(a, in_flight)
            need += want
            if want <= free:
                free -= want
            else:
                paused.add(id(a))
        for a in prefilling:
            n = max(0, chunk_length(a, self.chunk, budget, self.block))
            want = self.blocks_for(a.prefilled + n) - self.blocks_for(a.prefilled)
            need += want
            if want <= free:
                free, budget = free - want, budget - n
            else:
                paused.add(id(a))
        order = [*active, *prefilling]
        return PoolPlan(paused, need, bool(order) and id(order[0]) in paused)

    def alone(self, active: Sequence[ActiveSeq], free: int) -> bool:
        """Whether the oldest request, decoding with no other left to preempt, may still go on:
        while its next token's position can be backed, even if its widest steps could not
        (the service then refuses a step of its alone, at the pool's very end)."""
        if not active:
            return False
        cached = len(active[0].req.prompt_ids) + len(active[0].generated) - 1
        return self.blocks_for(cached + 1) - self.blocks_for(cached) <= free

    def victim(
        self, prefilling: Sequence[ActiveSeq], active: Sequence[ActiveSeq]
    ) -> ActiveSeq | None:
        """The newest request holding blocks, other than the oldest: the next to preempt."""
        order = [*active, *prefilling]
        for a in reversed(order[1:]):
            if a.handle is not None and (a.prefilled > 0 or a in active):
                return a
        return None

    def starved(self, a: ActiveSeq, free: int) -> str:
        """Why the pool cannot hold the request alone, as its failure says it."""
        tokens = len(a.context) if not a.generated else len(a.req.prompt_ids) + len(a.generated)
        return (
            f"request {a.req.request_id} needs more KV blocks to go on from {tokens} tokens "
            f"than the pool can give it with no other request of this scheduler holding any: "
            f"{free} of {self.blocks} blocks of {self.block} positions are free (raise "
            "--kv-blocks, or ask for fewer tokens)"
        )


@dataclass(frozen=True)
class PoolPlan:
    paused: set[int]  # id() of the requests that sit this iteration out
    need: int  # blocks every request would take, had each its way
    head_waits: bool  # the oldest cannot go on: someone must be preempted
