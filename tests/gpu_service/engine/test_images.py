"""Prompts with images on Qwen3.5 and Qwen3.5-MoE checkpoints written by transformers' own
classes (tests/qwen3_5_checkpoint.py): logits with one and two images against transformers'
(prefilled whole and in chunks that cut an image, then verified), greedy decoding after an
image against transformers' `generate` in process and through a GPU service process over gRPC,
`mtp` equal to `none`, a prefix snapshot taken inside an image, and the refusals that name an
image (gpu_service/engine/images.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from gpu_service.engine import graphs
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.handles import ImageInput
from protos.model import FailedPrecondition, InvalidArgument
from tests.gpu_service.model.test_hf_parity import ATOL, RTOL
from tests.steps import logit_rows

# Slow: transformers' Qwen3.5 models beside engines, and one GPU service process.
pytestmark = pytest.mark.slow

SERVICE = ServiceConfig(
    verify_tiers="4:3,4:1", max_context=256, max_rows=24, max_batch=8, prefix_snapshots=2
)
PATCH = 3 * 2 * 4 * 4  # in_channels * temporal_patch_size * patch_size ** 2 of the tower
# Grids in patches: 6 image tokens each (merge 2), one wide, one tall.
GRIDS = [(1, 4, 6), (1, 6, 4)]


def _image(grid: tuple[int, int, int], seed: int) -> tuple[ImageInput, torch.Tensor]:
    """An image as the processor gives it: random patch rows of `grid`."""
    rows = torch.randn(
        grid[0] * grid[1] * grid[2], PATCH, generator=torch.Generator().manual_seed(seed)
    )
    return ImageInput(rows.numpy().astype("<f4").tobytes(), grid, b"\x07" * 32), rows


def _prompt(model: PreTrainedModel, grids: list[tuple[int, int, int]], text: int = 6) -> tuple:
    """Text, then each image between its start and end tokens and more text -> (ids, images,
    their rows)."""
    cfg = model.config
    ids = list(range(10, 10 + text))
    images, rows = [], []
    for n, grid in enumerate(grids):
        image, pixels = _image(grid, n)
        count = grid[0] * grid[1] * grid[2] // 4
        ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * count, cfg.vision_end_token_id]
        ids += list(range(40 + 5 * n, 45 + 5 * n))
        images.append(image)
        rows.append(pixels)
    return ids, images, rows


def _theirs(model: PreTrainedModel, ids: list[int], grids: list, rows: list, **kw) -> torch.Tensor:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        return (
            model(
                input_ids=tokens,
                pixel_values=torch.cat(rows),
                image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=(tokens == model.config.image_token_id).int(),
                **kw,
            )
            .logits[0]
            .float()
        )


def _rows(model: object) -> torch.Tensor:
    return torch.stack(
        [torch.frombuffer(bytearray(r), dtype=torch.float32) for r in logit_rows(model)]
    )  # type: ignore[arg-type]


def _first_tokens(model: PreTrainedModel, ids: list[int]) -> list[int]:
    """Where each image's first image token is."""
    image, start = model.config.image_token_id, model.config.vision_start_token_id
    return [i for i, t in enumerate(ids) if t == image and ids[i - 1] == start]


def _prefill(engine, seq, ids, images, firsts, cuts) -> None:
    """The prompt in chunks ending at `cuts`, each image sent with the chunk holding its first
    image token."""
    start = 0
    for end in cuts:
        sent = [im for im, f in zip(images, firsts, strict=True) if start <= f < end]
        engine.prefill([seq], [ids[start:end]], images=[sent])
        start = end


@pytest.mark.parametrize("kind", ["dense-tied", "moe"])
@pytest.mark.parametrize("count", [1, 2])
def test_logits_with_images_match_transformers(qwen3_5_made: dict, kind: str, count: int) -> None:
    """Whole, and in chunks cutting an image (its embeddings kept between them), then verifies
    of widths 1 to 4 after the prompt: every row within the HF-parity tolerance, the argmax the
    same. Control: at plain text positions transformers' own logits fall outside it."""
    directory, model = qwen3_5_made[kind]
    grids = GRIDS[:count]
    ids, images, rows = _prompt(model, grids)
    after = list(range(60, 70))
    expected = _theirs(model, ids + after, grids, rows)
    engine = Engine(directory, SERVICE, "fp32")
    firsts = _first_tokens(model, ids)
    for cuts in ([len(ids)], [firsts[0] + 2, firsts[-1] + 5, len(ids)]):
        seq = engine.alloc_sequence()
        _prefill(engine, seq, ids, images, firsts, cuts)
        got, pos = [_rows(engine)], len(ids)
        for k in (1, 2, 3, 4):
            engine.decode_verify_batched(after[pos - len(ids) : pos - len(ids) + k], [k], [seq])
            got.append(_rows(engine))
            engine.gdn_fold_accepted([seq], [k])
            engine.commit_accepted_prefix([seq], [k], [k])
            pos += k
        engine.free_sequence(seq)
        rows_got = torch.cat(got)
        torch.testing.assert_close(rows_got, expected[len(ids) - 1 : pos], atol=ATOL, rtol=RTOL)
        assert torch.equal(rows_got.argmax(-1), expected[len(ids) - 1 : pos].argmax(-1))
    plain = torch.arange(len(ids) + len(after))[None]
    flat = _theirs(model, ids + after, grids, rows, position_ids=plain)
    assert not torch.allclose(flat[len(ids) - 1 :], expected[len(ids) - 1 :], atol=ATOL, rtol=RTOL)


def _greedy(engine: Engine, ids: list[int], images: list[ImageInput], n: int, drafts: int):
    """n greedy tokens by `decode_step` (drafting `drafts` with the MTP head) -> (tokens,
    drafts proposed)."""
    seq = engine.alloc_sequence()
    token = engine.prefill([seq], [ids], images=[images]).argmax[0]
    out, rows, proposed = [token], [token], 0
    while len(out) < n:
        step = engine.decode_step(rows, [len(rows)], [seq], [drafts > 0], drafts)
        new = step.argmax[: step.accepted[0] + 1]
        out += new
        rows = [new[-1], *(step.proposal.drafts[0] if step.proposers else [])]
        proposed += len(rows) - 1
    engine.free_sequence(seq)
    return out[:n], proposed


def _grpc_greedy(model: GrpcModel, ids: list[int], images: list[ImageInput], n: int) -> list[int]:
    seq = model.alloc_sequence()
    out = [model.prefill([seq], [ids], images=[images]).argmax[0]]
    while len(out) < n:
        out.append(model.decode_verify_batched([out[-1]], [1], [seq]).argmax[0])
        model.gdn_fold_accepted([seq], [1])
        model.commit_accepted_prefix([seq], [1], [1])
    model.free_sequence(seq)
    return out


def test_greedy_after_images_is_transformers_and_mtp_is_none(qwen3_5_made: dict) -> None:
    """The MoE checkpoint, two images: 8 greedy tokens in process with `none` and with `mtp`,
    and through a GPU service process over gRPC (the control plane's client), each equal to
    transformers' `generate`; an image of more than 4 MB passes the wire; a bad image over the
    wire is INVALID_ARGUMENT."""
    directory, model = qwen3_5_made["moe"]
    ids, images, rows = _prompt(model, GRIDS)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        generated = model.generate(
            input_ids=tokens,
            pixel_values=torch.cat(rows),
            image_grid_thw=torch.tensor(GRIDS),
            mm_token_type_ids=(tokens == model.config.image_token_id).int(),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    theirs = generated[0, len(ids) :].tolist()
    engine = Engine(directory, SERVICE, "fp32")
    caps = engine.capabilities()
    assert caps.vision_tower and caps.max_images_per_prompt == SERVICE.max_images_per_prompt
    none, drafted_none = _greedy(engine, ids, images, 8, 0)
    mtp, drafted = _greedy(engine, ids, images, 8, 2)
    assert none == theirs and mtp == none and drafted > 0 == drafted_none
    # The captured graphs' path (replayed eagerly on the CPU) reads each slot's RoPE shift too.
    engine.use_graphs(graphs.replay_eagerly)
    assert _greedy(engine, ids, images, 8, 2)[0] == theirs
    assert engine.choice.graphs is not None and engine.choice.graphs.replays > 0
    gpu, target = start_gpu_service(directory, "--max-context", "256", "--dtype", "fp32")
    try:
        client = GrpcModel(target)
        try:
            assert client.capabilities().max_image_pixels == SERVICE.max_image_pixels
            assert _grpc_greedy(client, ids, images, 8) == theirs
            seq = client.alloc_sequence()
            # Four frames of 64 x 64 patches: 6.3 MB of rows, past gRPC's default 4 MB bound.
            big, _ = _image((4, 64, 64), 9)
            pads = [model.config.image_token_id] * 2
            assert client.prefill([seq], [pads], images=[[big]]).argmax and seq.seq_len == 2
            client.free_sequence(seq)
            seq = client.alloc_sequence()
            bad = ImageInput(images[0].pixels[:-4], GRIDS[0])
            with pytest.raises(InvalidArgument, match="image 0 of sequence .* bytes of pixels"):
                client.prefill([seq], [ids], images=[[bad, images[1]]])
        finally:
            client.close()
    finally:
        assert stop(gpu) == 0


def test_a_batch_mixing_image_and_text_prompts_gives_each_its_own_bytes(
    qwen3_5_made: dict,
) -> None:
    """A prefill and a verify of a prompt with images beside a text prompt: each sequence's
    rows the bytes it gets alone (the circuit diff's batch invariance, with images)."""
    directory, model = qwen3_5_made["moe"]
    ids, images, _ = _prompt(model, GRIDS)
    text = list(range(100, 117))
    engine = Engine(directory, SERVICE, "fp32")

    def run(prompts: list[list[int]], sent: list[list[ImageInput]]) -> list[bytes]:
        seqs = [engine.alloc_sequence() for _ in prompts]
        first = engine.prefill(seqs, prompts, images=sent).argmax
        rows = logit_rows(engine)
        engine.decode_verify_batched([t for f in first for t in (f, 7, 8)], [3] * len(seqs), seqs)
        rows += logit_rows(engine)
        for s in seqs:
            engine.free_sequence(s)
        return rows

    image_alone, text_alone = run([ids], [images]), run([text], [[]])
    together = run([ids, text], [images, []])
    assert together == [image_alone[0], text_alone[0], *image_alone[1:], *text_alone[1:]]


def test_a_snapshot_inside_an_image_goes_on_as_the_whole_prompt(qwen3_5_made: dict) -> None:
    """A 64-token image cut by a block boundary: a snapshot there keeps the image's embeddings,
    and a sequence restored from it and given the rest of the prompt (no image sent again)
    gives the bytes of one prefilled in the same chunks."""
    directory, model = qwen3_5_made["dense-tied"]
    grid = (1, 16, 16)
    ids, images, _ = _prompt(model, [grid], text=20)
    engine = Engine(directory, SERVICE, "fp32")
    whole = engine.alloc_sequence()
    engine.prefill([whole], [ids[:64]], images=[images])
    engine.prefill([whole], [ids[64:]])
    expected = logit_rows(engine)
    donor = engine.alloc_sequence()
    engine.prefill([donor], [ids[:64]], images=[images])
    (snap,) = engine.snapshot_prefixes([donor])
    engine.free_sequence(donor)
    seq = engine.alloc_sequence()
    engine.restore_prefixes([seq], [snap])
    engine.prefill([seq], [ids[64:]])
    assert logit_rows(engine) == expected
    engine.drop_prefixes([snap])


def _refusals(model: PreTrainedModel) -> list[tuple[str, list[int], list[ImageInput]]]:
    """(what the refusal says, the prompt, its images) of prompts the service refuses."""
    ids, (image, _), _ = _prompt(model, GRIDS)
    first = _first_tokens(model, ids)
    text_inside = ids[: first[0] + 2] + [5] + ids[first[0] + 3 :]
    return [
        (
            "image 0 .*not a whole number of patch rows",
            ids,
            [ImageInput(b"\x00" * 10, GRIDS[0]), image],
        ),
        ("image 1 .*multiples of 2", ids, [image, ImageInput(b"\x00" * PATCH * 4 * 15, (1, 5, 3))]),
        (
            "image 1 .*has 20 patch rows",
            ids,
            [image, ImageInput(b"\x00" * PATCH * 4 * 20, (1, 4, 6))],
        ),
        ("at position 20 that no image of the prefill starts", ids, [image]),
        ("image 2 .*starts at no image token", ids, [image, image, image]),
        (
            "image 0 has 6 tokens from position 7, but position 9 holds token 5",
            text_inside,
            [image, image],
        ),
        ("covers 384 pixels.*--max-image-pixels", ids, [image, image]),
        ("would hold 2 images.*--limit-images-per-prompt", ids, [image, image]),
    ]


def test_bad_images_are_refused_naming_the_image(qwen3_5_made: dict, tiny_dir: Path) -> None:
    """Each refusal leaves the sequence as it was (no token, no image); a verify inside an
    image is refused until the rest of its tokens are in; a model without a tower refuses
    images."""
    directory, model = qwen3_5_made["dense-tied"]
    engine = Engine(directory, SERVICE, "fp32")
    tight = Engine(directory, ServiceConfig(max_context=256, max_image_pixels=383))
    one = Engine(directory, ServiceConfig(max_context=256, max_images_per_prompt=1))
    for said, ids, images in _refusals(model):
        e = tight if "pixels" in said else one if "images" in said else engine
        seq = e.alloc_sequence()
        with pytest.raises(InvalidArgument, match=said):
            e.prefill([seq], [ids], images=[images])
        state = e.slots.get(seq.seq_id)
        assert state.seq_len == 0 and state.images == ()
        e.free_sequence(seq)
    ids, images, _ = _prompt(model, GRIDS)
    seq = engine.alloc_sequence()
    engine.prefill([seq], [ids[:9]], images=[images[:1]])
    with pytest.raises(FailedPrecondition, match="inside its image of 6 tokens from position 7"):
        engine.decode_verify_batched([ids[9]], [1], [seq])
    engine.prefill([seq], [ids[9:]], images=[images[1:]])
    text = Engine(tiny_dir, ServiceConfig(max_context=256))
    assert not text.capabilities().vision_tower
    with pytest.raises(InvalidArgument, match="no vision tower"):
        text.prefill([text.alloc_sequence()], [[1, 2]], images=[images[:1]])
