"""The vision tower's share of the memory plan (`plan.py`) beyond its weights, which the model
holds and the plan counts as it counts the text model's: what a prefill with images allocates.

- The tower's activations for one image at the bound (`--max-image-pixels`): images run one at
  a time, each image's patches through every block, so one image's peak is the tower's. A block
  holds its residual, the normed rows, qkv, q and k rotated (through fp32) and the attention's
  output, or in its MLP the intermediate twice; the position grid's four taps per patch are made
  in fp32 first. Attention itself runs by `scaled_dot_product_attention`, whose CUDA kernels
  (flash, memory-efficient) keep no patches x patches scores: none are counted (the CPU's math
  kernel would make them: a large image wants a GPU).
- The image embeddings the sequences hold ([tokens, text hidden] each image): between calls a
  sequence holds at most one image whose tokens are not all in (every slot, at the largest
  image's tokens, up to its context), and so does a prefix snapshot taken inside an image;
  within a call, each of its sequences may start one more, and the images it starts and ends
  hold no more rows than the call's tokens."""

from __future__ import annotations

from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.vision_config import VisionConfig


def image_patches(v: VisionConfig, svc: ServiceConfig) -> int:
    """Patches of the largest image the service takes: whole merge blocks within the bound."""
    patches = svc.max_image_pixels // v.patch_size**2
    return max(v.merge_unit, patches // v.merge_unit * v.merge_unit)


def tower_activation_bytes(v: VisionConfig, patches: int, itemsize: int) -> int:
    """The tower's live activations for one image of `patches` patches, at its widest step:
    the position grid's taps (n x 4 x hidden, in the dtype and in fp32), a block's attention
    (9 x hidden in the dtype, 3 x hidden fp32 for the rotation), or its MLP (3 x hidden and
    2 x intermediate)."""
    h, i = v.hidden_size, v.intermediate_size
    per_patch = max(4 * h * (itemsize + 4), 9 * h * itemsize + 12 * h, (3 * h + 2 * i) * itemsize)
    merged = patches // v.merge_unit * v.out_hidden_size * itemsize  # the image's embeddings
    return patches * per_patch + merged


def held_embedding_bytes(cfg: ModelConfig, svc: ServiceConfig, itemsize: int) -> int:
    """The image embeddings held at once: every slot's and every prefix snapshot's image cut by
    a chunk, one more started by each sequence of a call, and the call's tokens of the images
    it ends."""
    assert cfg.vision is not None
    tokens = min(image_patches(cfg.vision, svc) // cfg.vision.merge_unit, svc.max_context)
    cut = svc.num_slots + svc.prefix_snapshots + svc.max_batch
    rows = cut * tokens + svc.max_prefill_tokens
    return rows * cfg.vision.out_hidden_size * itemsize


def vision_bytes(cfg: ModelConfig, svc: ServiceConfig, itemsize: int) -> int:
    """The tower's activations at the largest image and the embeddings held (0 without a
    tower)."""
    if cfg.vision is None:
        return 0
    patches = image_patches(cfg.vision, svc)
    activations = tower_activation_bytes(cfg.vision, patches, itemsize)
    return activations + held_embedding_bytes(cfg, svc, itemsize)
