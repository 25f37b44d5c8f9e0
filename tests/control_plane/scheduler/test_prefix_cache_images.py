"""The prefix cache over images: a prompt's image placeholders are alike whatever the image,
so a block is keyed by the digests of the images whose placeholders it holds. Two chats with
the same system prompt and the same image share the snapshot past the image; the same chat with
another image (the same placeholders) hits only before it, never past; a request waits for one
ahead sharing the same image, not one with another; a finished answer whose replay would need
an image's rows again is not replayed. On the fake model, through `prefixing`'s glue."""

from __future__ import annotations

import hashlib

from control_plane.scheduler import prefixing
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.scheduler.tally import Tally
from control_plane.text.images import ImageSpan, keyed
from control_plane.text.tokenizer import ByteTokenizer
from tests.fake_model import FakeModel

B = 4  # the block
PAD = 250  # the image placeholder's id
SYSTEM = (1, 2, 3, 4, 5, 6, 7, 8)  # two whole blocks
CAT, DOG = hashlib.sha256(b"cat").digest(), hashlib.sha256(b"dog").digest()


def chat(digest: bytes, question: tuple[int, ...] = (20, 21, 22)) -> GenRequest:
    """The system prompt, an image of 6 placeholders (ending inside the fourth block), then a
    question: the same ids for every image."""
    ids = (*SYSTEM, 9, *[PAD] * 6, 10, *question)
    return GenRequest(
        f"r{len(question)}", ids, 4, image_spans=(ImageSpan(len(SYSTEM) + 1, 6, digest),)
    )


def test_keyed_names_an_images_placeholders_by_its_digest() -> None:
    assert keyed((1, PAD, PAD, 2), (ImageSpan(1, 2, CAT),)) == (1, CAT, CAT, 2)
    assert keyed((1, 2), ()) == (1, 2)
    assert chat(CAT).prompt_ids == chat(DOG).prompt_ids
    assert chat(CAT).cache_key != chat(DOG).cache_key


def test_the_policy_hits_past_the_same_image_only() -> None:
    cache = PrefixCache(budget=4, block=B)
    first = chat(CAT).cache_key
    cache.seen(first)
    cache.taken(first, 8, snapshot=1)  # the system prompt
    cache.taken(first, 16, snapshot=2)  # past the image
    again = cache.lookup(chat(CAT, (30, 31)).cache_key)
    assert again is not None and (again.snapshot, again.tokens) == (2, 16)
    other = cache.lookup(chat(DOG).cache_key)
    assert other is not None and (other.snapshot, other.tokens) == (1, 8), "before the image"
    assert cache.peek(chat(DOG).cache_key) == 8


def seq(req: GenRequest, model: FakeModel) -> ActiveSeq:
    a = ActiveSeq(req, lambda ev: None, ByteTokenizer.default(), ModelFacts(1024))
    a.handle = model.alloc_sequence()
    return a


def prefilled(model: FakeModel, cache: PrefixCache, a: ActiveSeq) -> None:
    """The sequence prefilled to its end, snapshotted at each point the cache asked for."""
    while a.prefilled < len(a.context):
        end = a.snap_points[0] if a.snap_points else len(a.context)
        model.prefill([a.live_handle], [list(a.context[a.prefilled : end])])
        a.prefilled = end
        prefixing.snapshot(model, cache, [a])


def test_chats_with_the_same_image_share_a_snapshot_and_another_image_never_hits() -> None:
    model, cache, tally = FakeModel(), PrefixCache(budget=8, block=B), Tally(None)
    first = seq(chat(CAT, (20, 21, 22)), model)
    prefixing.restore(model, cache, [first], tally)
    assert first.snap_points == [16], "its last whole block, past the image"
    prefilled(model, cache, first)
    second = seq(chat(CAT, (30, 31, 32)), model)
    prefixing.restore(model, cache, [second], tally)
    assert second.prefix_hit == 16
    assert model.snapshots and model.seqs[second.live_handle.seq_id].tokens == list(
        chat(CAT).prompt_ids[:16]
    )
    third = seq(chat(DOG, (30, 31, 32)), model)
    prefixing.restore(model, cache, [third], tally)
    assert third.prefix_hit == 0, "no snapshot before the image was taken: nothing to share"
    assert third.snap_points == [8, 16], "where it parts from the cat's chat, and its end"


def test_a_request_waits_for_one_ahead_with_the_same_image_only() -> None:
    model, cache = FakeModel(), PrefixCache(budget=8, block=B)
    ahead = seq(chat(CAT, (20, 21, 22, 23, 24)), model)
    same = seq(chat(CAT, (30, 31, 32, 33, 34)), model)
    other = seq(chat(DOG, (30, 31, 32, 33, 34)), model)
    assert prefixing.held(cache, same, [ahead])
    assert 16 in ahead.snap_points, "where they part: past the shared image"
    ahead.snap_points = []
    assert prefixing.held(cache, other, [ahead])
    assert ahead.snap_points == [8], "they share the system prompt only"


def test_an_answer_whose_replay_needs_an_image_is_not_replayed() -> None:
    model, cache = FakeModel(), PrefixCache(budget=8, block=B)
    a = seq(chat(CAT), model)
    a.generated, a.finished = [40, 41, 42, 43, 44], "stop"
    prefixing.remember(cache, a)
    assert cache.answers[0][9:15] == (CAT,) * 6
    before = list(model.calls)
    prefixing.answer(model, cache, 64, "replica")
    assert model.calls == before, "no sequence taken, nothing prefilled"
