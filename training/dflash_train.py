"""`met train dflash`: a DFlash drafter for a trained target, in the published layout.

The objective is SpecForge's: in each sequence, `anchors` random positions among the generated
tokens; the block of anchor a is `[token a, MASK x (B - 1)]` at positions a .. a + B - 1, it
sees the context of positions before a and its own rows (no other block), and row k learns
token a + k with weight exp(-(k - 1) / loss_decay). The target's embedding and LM head are
read, never trained. The forward is `gpu_service.dflash.naive`'s, one sequence at a time
with a block-local mask, so training and serving compute one function.

Deterministic given the seed: the anchors and the batch of step s are drawn from (seed, s);
weights, optimizer and step are saved every `save_every` steps, so a run resumes exactly."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_service.dflash.config import MASK_EMBEDDING, DFlashConfig
from gpu_service.dflash.naive import Params, keys_values, layer, project_context, rms_norm
from gpu_service.dflash.weights import expected_tensors, load_tensors
from gpu_service.model.config import ModelConfig
from training.dflash_options import DFlashTrainConfig
from training.loop import Progress, lr_at, make_optimizer

STATE_FILE = "dflash_state.pt"
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")


def drafter_config(target: ModelConfig, tc: DFlashTrainConfig) -> DFlashConfig:
    """Qwen3 layers shaped as the target's attention and MLP; the mask is a stored embedding
    (the target's vocabulary has no spare id)."""
    return DFlashConfig(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=tc.layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        vocab_size=target.vocab_size,
        block_size=tc.block_size,
        num_target_layers=target.num_hidden_layers,
        target_layer_ids=tc.taps,
        mask_token_id=None,
        max_position_embeddings=target.max_position_embeddings,
    )


def init_drafter(cfg: DFlashConfig, seed: int) -> Params:
    """Norms at one, the rest normal(0, 0.02); residual outputs scaled by 1/sqrt(2 L)."""
    gen = torch.Generator().manual_seed(seed)
    params: Params = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.ones(shape)
        else:
            w = torch.randn(shape, generator=gen) * 0.02
        if name.endswith(_RESIDUAL_OUTPUTS):
            w *= (2 * cfg.num_hidden_layers) ** -0.5
        params[name] = w.requires_grad_(True)
    return params


def anchors_at(tc: DFlashTrainConfig, step: int, count: int) -> torch.Tensor:
    """[count, anchors] sorted distinct positions among the generated tokens whose next token
    is in the sequence (prompt_len .. seq_len - 2), drawn from (seed, step)."""
    gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step)
    span = tc.seq_len - 1 - tc.prompt_len
    picks = [torch.randperm(span, generator=gen)[: tc.anchors] for _ in range(count)]
    return torch.stack(picks).sort(-1).values + tc.prompt_len


def batch_at(tc: DFlashTrainConfig, step: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tc.seed * 999_983 + step)
    return torch.randint(0, n, (tc.batch,), generator=gen)


def block_mask(anchors: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """[A * B, T + A * B]: a row of anchor a's block sees context keys before a and its own
    block's keys."""
    row_anchor = anchors.repeat_interleave(block)
    ctx = torch.arange(length)[None, :] < row_anchor[:, None]
    ids = torch.arange(anchors.numel()).repeat_interleave(block)
    return torch.cat([ctx, ids[:, None] == ids[None, :]], 1)


def sequence_loss(
    p: Params,
    cfg: DFlashConfig,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    taps: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's blocks. taps: [T, K * H], tokens: [T], anchors: [A] -> (sum of weighted
    cross-entropies, sum of weights)."""
    length, b = tokens.shape[0], cfg.block_size
    ctx = project_context(p, cfg, taps.float())
    k = torch.arange(b)
    pos = (anchors[:, None] + k[None, :]).reshape(-1)
    mask_row = embed[cfg.mask_token_id] if cfg.mask_token_id is not None else p[MASK_EMBEDDING]
    x = mask_row.expand(anchors.numel(), b, -1).clone()
    x[:, 0] = embed[tokens[anchors]]
    x = x.reshape(-1, cfg.hidden_size)
    mask = block_mask(anchors, length, b)
    ctx_pos = torch.arange(length)
    for i in range(cfg.num_hidden_layers):
        x = layer(p, cfg, i, x, pos, keys_values(p, cfg, i, ctx, ctx_pos), mask)
    h = rms_norm(x, p["norm.weight"], cfg.rms_norm_eps).view(anchors.numel(), b, -1)[:, 1:]
    target_pos = anchors[:, None] + k[None, 1:]  # [A, B - 1]
    valid = target_pos < length
    labels = tokens[target_pos.clamp(max=length - 1)]
    ce = F.cross_entropy(F.linear(h, lm_head).flatten(0, 1), labels.flatten(), reduction="none")
    weight = torch.exp(-(k[1:].float() - 1) / decay)[None, :] * valid
    return (ce * weight.flatten()).sum(), weight.sum()


def train(
    data: dict[str, torch.Tensor],
    target_params: dict[str, torch.Tensor],
    cfg: DFlashConfig,
    work: Path,
    tc: DFlashTrainConfig,
    stop_at: int | None = None,
) -> tuple[Params, list[dict], float]:
    """Train (or resume) in `work` -> fp32 weights, the loss log, seconds over every resume."""
    work.mkdir(parents=True, exist_ok=True)
    embed = target_params["model.embed_tokens.weight"].detach()
    lm_head = target_params.get("lm_head.weight", embed).detach()
    params = init_drafter(cfg, tc.seed)
    if tc.init_from:
        _start_from(params, cfg, Path(tc.init_from))
    opt = make_optimizer(params, tc)
    path = work / STATE_FILE
    step, log, seconds = _load(path, params, opt, tc)
    progress = Progress(tc.steps)
    t0, start = time.perf_counter(), step
    elapsed = 0.0
    n = data["tokens"].shape[0]
    while step < min(tc.steps, stop_at or tc.steps):
        rows = batch_at(tc, step, n)
        anchors = anchors_at(tc, step, rows.numel())
        total, weight = torch.zeros(()), torch.zeros(())
        for j, r in enumerate(rows.tolist()):
            t, w = sequence_loss(
                params,
                cfg,
                embed,
                lm_head,
                data["taps"][r],
                data["tokens"][r],
                anchors[j],
                tc.loss_decay,
            )
            total, weight = total + t, weight + w
        loss = total / weight
        for group in opt.param_groups:
            group["lr"] = lr_at(tc, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        step += 1
        log.append({"step": step, "loss": round(loss.item(), 4)})
        elapsed = time.perf_counter() - t0
        tokens_s = (step - start) * tc.batch * tc.anchors * tc.block_size / elapsed
        progress.update(
            step, {"loss": loss.item()}, tokens_s, elapsed / (step - start) * (tc.steps - step)
        )
        if step % tc.save_every == 0 or step in (tc.steps, stop_at):
            _save(path, params, opt, step, tc, log, seconds + elapsed)
    progress.close()
    return {k: v.detach() for k, v in params.items()}, log, seconds + elapsed


def _start_from(params: Params, cfg: DFlashConfig, directory: Path) -> None:
    """The weights of an exported drafter of the same shapes (checked by name and shape)."""
    loaded = load_tensors(cfg, directory, torch.float32)
    with torch.no_grad():
        for name, w in params.items():
            w.copy_(loaded[name])


def _save(
    path: Path,
    params: Params,
    opt: torch.optim.Optimizer,
    step: int,
    tc: DFlashTrainConfig,
    log: list[dict],
    seconds: float,
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "params": {k: v.detach() for k, v in params.items()},
            "optimizer": opt.state_dict(),
            "step": step,
            "settings": repr(tc),
            "log": log,
            "seconds": seconds,
        },
        tmp,
    )
    tmp.replace(path)


def _load(
    path: Path, params: Params, opt: torch.optim.Optimizer, tc: DFlashTrainConfig
) -> tuple[int, list[dict], float]:
    if not path.exists():
        return 0, [], 0.0
    saved = torch.load(path)
    if saved["settings"] != repr(tc):
        raise ValueError(f"{path} was written with other settings; remove it or pass the same ones")
    with torch.no_grad():
        for k, v in params.items():
            v.copy_(saved["params"][k])
    opt.load_state_dict(saved["optimizer"])
    print(f"resuming the drafter at step {saved['step']} from {path}", file=sys.stderr)
    return saved["step"], saved["log"], saved["seconds"]
