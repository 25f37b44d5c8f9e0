"""The scheduler's prefill hands a request's images to the service (`protos.model.prefill`'s
`images`): each with the chunk that holds its first placeholder, once to a sequence however
the prompt is cut; again from the start after a preemption; not again after a prefix restored
past its first placeholder (the snapshot holds its embeddings); each sequence its own when a
refused batch is retried one sequence a call. On the fake model, which records what each
prefill item sent."""

from __future__ import annotations

import hashlib

import numpy as np

from control_plane.scheduler import prefixing
from control_plane.scheduler.prefill import prefill
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.scheduler.tally import Tally
from control_plane.text.images import Image, ImageSpan
from control_plane.text.tokenizer import ByteTokenizer
from protos.model import InvalidArgument
from tests.fake_model import FakeModel

PAD = 250  # the image placeholder's id
CAT, DOG = hashlib.sha256(b"cat").digest(), hashlib.sha256(b"dog").digest()
SYSTEM = (1, 2, 3, 4, 5, 6, 7, 8)


def image(digest: bytes, grid: tuple[int, int, int]) -> Image:
    rows = np.arange(grid[0] * grid[1] * grid[2] * 4, dtype=np.float32).reshape(-1, 4)
    return Image(rows, grid, digest)


def chat(first: bytes = CAT, question: tuple[int, ...] = (20, 21, 22)) -> GenRequest:
    """The system prompt, an image of 6 placeholders from position 9, text, an image of 4
    from position 17, a question."""
    ids = (*SYSTEM, 9, *[PAD] * 6, 10, 11, *[PAD] * 4, 12, *question)
    images = (image(first, (1, 4, 6)), image(DOG, (1, 4, 4)))
    spans = (ImageSpan(9, 6, first), ImageSpan(17, 4, DOG))
    return GenRequest("r", ids, 4, images=images, image_spans=spans)


def seq(req: GenRequest, model: FakeModel) -> ActiveSeq:
    a = ActiveSeq(req, lambda ev: None, ByteTokenizer.default(), ModelFacts(1024))
    a.handle = model.alloc_sequence()
    return a


def prefilled(model: FakeModel, a: ActiveSeq, chunk: int, cache: PrefixCache | None = None) -> None:
    """Its context prefilled in chunks of `chunk` (and blocks of 4), snapshotted where `cache`
    wants."""
    while a.prefilled < len(a.context):
        prefill(model, [a], chunk, 4096, block=4)
        if cache is not None:
            prefixing.snapshot(model, cache, [a])


def test_each_image_goes_with_the_chunk_of_its_first_placeholder_once() -> None:
    """Chunks of 4 cut both images; whole, both go in one call. Each image's rows and grid
    travel as `Image.to_input` gives them."""
    model = FakeModel()
    a = seq(chat(), model)
    prefilled(model, a, 4)
    sid = a.live_handle.seq_id
    assert model.images == [(sid, 8, [CAT]), (sid, 16, [DOG])]
    b = seq(chat(), model)
    prefilled(model, b, 64)
    assert model.images[2:] == [(b.live_handle.seq_id, 0, [CAT, DOG])]
    assert model.seqs[b.live_handle.seq_id].tokens == list(chat().prompt_ids)


def test_a_preempted_request_sends_its_images_again() -> None:
    model = FakeModel()
    a = seq(chat(), model)
    prefilled(model, a, 64)
    a.generated = [40, 41]
    model.free_sequence(a.live_handle)
    a.preempt()
    a.handle = model.alloc_sequence()
    prefilled(model, a, 10)
    sid = a.live_handle.seq_id
    assert model.images[1:] == [(sid, 8, [CAT]), (sid, 16, [DOG])]
    assert model.seqs[sid].tokens == [*chat().prompt_ids, 40]


def test_a_prefix_restored_inside_an_image_does_not_send_it_again() -> None:
    """A snapshot at 12 cuts the first image: the restored sequence sends the second only; one
    at 8, before it, sends both; another first image shares only the system prompt."""
    model, cache = FakeModel(), PrefixCache(budget=8, block=4)
    donor = seq(chat(), model)
    cache.seen(donor.cache_key)
    donor.snap_points = [8, 12]
    prefilled(model, donor, 64, cache)
    for first, hit, sent in [(CAT, 12, [[DOG]]), (DOG, 8, [[DOG, DOG]])]:
        before = len(model.images)
        a = seq(chat(first, (30, 31)), model)
        prefixing.restore(model, cache, [a], Tally(None))
        assert a.prefix_hit == hit
        prefilled(model, a, 64, cache)
        assert [d for _, _, d in model.images[before:]] == sent
        assert model.images[-1][1] == hit


class RefusesBatches(FakeModel):
    """A service that refuses a prefill of more than one sequence."""

    def prefill(self, seqs, prompts, *args, **kwargs):
        if len(seqs) > 1:
            raise InvalidArgument("one at a time")
        return super().prefill(seqs, prompts, *args, **kwargs)


def test_a_refused_batch_retried_alone_keeps_each_sequence_its_images() -> None:
    model = RefusesBatches()
    text = GenRequest("t", (1, 2, 3), 4)
    a, b = seq(text, model), seq(chat(), model)
    assert prefill(model, [a, b], 64, 4096) == [a, b]
    assert model.images == [(b.live_handle.seq_id, 0, [CAT, DOG])]
