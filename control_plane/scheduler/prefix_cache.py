"""The prefix cache's policy: which prompt prefixes the GPU service keeps snapshots of, and
which one a new prompt goes on from. The service owns the bytes (`gpu_service/memory/prefixes.py`);
this owns the names.

Prompts are seen as chains of KV blocks (the service's `kv_block_size` tokens): a node is a
block boundary of some prompt served, named by the hash chained over its blocks, so that two
prompts reach the same node exactly when they share every token up to it (a tree over blocks,
as vLLM's and SGLang's; the tokens are kept and compared, so a hash collision is never a hit).
A node may hold a snapshot, taken while a prompt was prefilled up to it. An image's
placeholder tokens are alike whatever the image, so the cache sees a prompt as its keyed
tokens (`text.images.keyed`): each image's placeholders as its digest (the sha256 of its
file), so that two chats with the same image share a prefix through it and a different image
never hits.

- A new prompt goes on from its deepest node with a snapshot that leaves at least one of its
  tokens to prefill (the service computes the logits of the last one).
- While a prompt is prefilled, snapshots are taken where the next prompts will resume: at its
  last whole block, which its own continuation (the next turn of a chat) starts with, and at
  the deepest node it shares with a prompt served before, where two prompts diverge. That node
  is where a third one sharing the first part goes on from, and a shared system prompt ends.
- A request that shares uncached whole blocks with one ahead of it in the queue or being
  prefilled waits until that one is snapshotted where they part (`prefixing.held`).
- A finished request's prompt and answer are snapshotted at their last whole block, which the
  next turn of its chat starts with. Decode does not keep the state there, so this costs a
  prefill of the answer: it waits in `answers` until the scheduler has nothing else to do
  (`prefixing.answer`), the most recent `budget` of them, so that the cache never slows the
  requests being served.
- Snapshots hold KV blocks, so when the service's pool may be short of what the live
  sequences take next, they go first (`prefixing.reserve`): the cache never fails a request
  that would run without it.
- Snapshots are dropped least recently used first when more than the budget are held, those
  where prompts diverge after all the others; nodes without one are kept least recently used
  too, up to `NODE_FACTOR` times the budget."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from control_plane.scheduler.options import SchedulerOptions
from control_plane.text.images import Keyed
from protos.model import Capabilities

# Nodes remembered without a snapshot, per snapshot of the budget: where prompts diverge is
# known only from prompts seen before.
NODE_FACTOR = 8


@dataclass
class Node:
    tokens: Keyed  # the prefix up to the node (compared on every hit)
    snapshot: int | None = None
    diverges: bool = False  # prompts went on from here in different ways


@dataclass(frozen=True)
class Hit:
    snapshot: int
    tokens: int  # the prefix's length


class PrefixCache:
    def __init__(self, budget: int, block: int) -> None:
        self.budget, self.block = budget, block
        self._nodes: OrderedDict[int, Node] = OrderedDict()  # by key, least recently used first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, tokens a snapshot gave
        # Finished requests' prompt and answer tokens, to snapshot once idle, oldest first:
        # more than the budget would only evict each other.
        self.answers: deque[Keyed] = deque(maxlen=max(budget, 0))

    @property
    def enabled(self) -> bool:
        return self.budget > 0 and self.block > 0

    def _keys(self, prompt: Keyed) -> list[tuple[int, int]]:
        """(length, key) of every block boundary of the prompt, shortest first."""
        out, key = [], 0
        for end in range(self.block, len(prompt) + 1, self.block):
            key = hash((key, tuple(prompt[end - self.block : end])))
            out.append((end, key))
        return out

    def _node(self, prompt: Keyed, end: int, key: int) -> Node | None:
        node = self._nodes.get(key)
        if node is None or node.tokens != tuple(prompt[:end]):
            return None
        self._nodes.move_to_end(key)
        return node

    def lookup(self, prompt: Keyed) -> Hit | None:
        """The snapshot a prompt goes on from, if any (counted in `queries` and `hits`): the
        deepest that leaves a token of it to prefill."""
        self.queries += len(prompt)
        best = self.deepest(prompt, len(prompt) - 1)
        if best is not None:
            self.hits += best.tokens
        return best

    def deepest(self, tokens: Keyed, limit: int) -> Hit | None:
        """The deepest snapshot `tokens` start with, at most `limit` tokens long."""
        best = None
        for end, key in self._keys(tokens):
            if end > limit:
                break
            node = self._node(tokens, end, key)
            if node is not None and node.snapshot is not None:
                best = Hit(node.snapshot, end)
        return best

    def peek(self, prompt: Keyed) -> int:
        """The tokens `lookup` would restore, touching nothing (no count, no recency): what a
        router asks from its own thread while the loop's thread changes the cache, with dict
        reads alone, each atomic."""
        best = 0
        for end, key in self._keys(prompt):
            if end > len(prompt) - 1:
                break
            node = self._nodes.get(key)
            if (
                node is not None
                and node.snapshot is not None
                and node.tokens == tuple(prompt[:end])
            ):
                best = end
        return best

    def points(self, prompt: Keyed, start: int) -> list[int]:
        """Where to snapshot the prompt while it is prefilled from `start`: block boundaries
        past it, without a snapshot yet, ascending (see the module's docstring)."""
        keys = self._keys(prompt)
        shared, fork = 0, None
        for end, key in keys:
            node = self._node(prompt, end, key)
            if node is None:
                break
            shared, fork = end, node
        if fork is not None and shared < keys[-1][0]:
            fork.diverges = True
        wanted = {shared, keys[-1][0] if keys else 0}
        out = []
        for end, key in keys:
            node = self._nodes.get(key)
            if end in wanted and end > start and (node is None or node.snapshot is None):
                out.append(end)
        return out

    def seen(self, prompt: Keyed) -> list[int]:
        """Remember the prompt's block boundaries (where later prompts may diverge from it)
        -> snapshots to drop, evicted."""
        for end, key in self._keys(prompt):
            if self._node(prompt, end, key) is None:
                self._nodes[key] = Node(tuple(prompt[:end]))
        return self._evict()

    def taken(self, prompt: Keyed, end: int, snapshot: int) -> list[int]:
        """The snapshot of the prompt's first `end` tokens -> snapshots to drop, evicted (or
        the one given, where its node holds one already)."""
        key = dict((e, k) for e, k in self._keys(prompt))[end]
        node = self._node(prompt, end, key)
        if node is None:
            node = self._nodes[key] = Node(tuple(prompt[:end]))
        if node.snapshot is not None:
            return [snapshot]
        node.snapshot = snapshot
        return self._evict()

    def forget(self, snapshot: int) -> None:
        """A snapshot the service no longer holds (refused on restore)."""
        for node in self._nodes.values():
            if node.snapshot == snapshot:
                node.snapshot = None

    def clear(self) -> list[int]:
        """Every snapshot (the service they lie in is gone or serves another model)."""
        held = [n.snapshot for n in self._nodes.values() if n.snapshot is not None]
        self._nodes.clear()
        self.answers.clear()
        return held

    def oldest(self, n: int) -> list[int]:
        """The `n` snapshots `_evict` would drop first, dropped."""
        return self._evict(self.budget - self.num_snapshots + n)

    def snapshot_tokens(self) -> list[int]:
        """Each snapshot's prefix length."""
        return [len(n.tokens) for n in self._nodes.values() if n.snapshot is not None]

    def evict_for(self, wanted: int) -> list[int]:
        """Snapshots to drop before `wanted` more are taken (at most the budget): the service
        holds no more than the budget, so the space is made first, by `_evict`'s order."""
        return self._evict(min(wanted, self.budget))

    def _evict(self, spare: int = 0) -> list[int]:
        """Past the budget less `spare`, snapshots go least recently used first, those where
        prompts diverge last (where the next prompt sharing a start will resume)."""
        dropped = []
        held = [(n.diverges, k) for k, n in self._nodes.items() if n.snapshot is not None]
        with_snapshot = [k for _, k in sorted(held, key=lambda dk: dk[0])]  # stable: LRU kept
        for key in with_snapshot[: max(0, len(with_snapshot) - self.budget + spare)]:
            node = self._nodes[key]
            assert node.snapshot is not None
            dropped.append(node.snapshot)
            node.snapshot = None
        bare = [k for k, n in self._nodes.items() if n.snapshot is None]
        for key in bare[: max(0, len(bare) - NODE_FACTOR * self.budget)]:
            del self._nodes[key]
        return dropped

    @property
    def num_snapshots(self) -> int:
        return sum(1 for n in self._nodes.values() if n.snapshot is not None)


def prefix_cache(opts: SchedulerOptions, caps: Capabilities) -> PrefixCache | None:
    """The connection's cache: as many snapshots as the service holds (`--prefix-snapshots`
    there), when `--prefix-cache` is on and it holds any."""
    budget = caps.prefix_snapshots if opts.prefix_cache else 0
    cache = PrefixCache(budget, caps.kv_block_size)
    return cache if cache.enabled else None
