"""Tensor parallelism over real processes (gloo on the CPU): what each rank holds, its logits
against one device's, transformers' against TP 2's, and what the shard rules promise."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from gpu_service.engine.facade import Engine
from gpu_service.engine.ranks import Launch, TpEngine, launch
from gpu_service.model import shard
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.weights import weight_shapes
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.flagship import MINI_FLAGSHIP
from tests.steps import logit_rows

SERVICE = ServiceConfig(verify_tiers="4:3,4:2", max_context=256, prefix_snapshots=2)
# fp32, as the HF-parity tests: a row-parallel sum is reassociated (each rank's partial, then
# their sum), so logits move by rounding, never by more.
ATOL, RTOL = 4e-4, 1e-4
PROMPTS = [[(7 * i + 3 + 13 * s) % 250 for i in range(n)] for s, n in enumerate((29, 12))]


# -- the shard rules, from shapes alone -------------------------------------------------------


@pytest.mark.parametrize("cfg", [ModelConfig(), MINI_FLAGSHIP], ids=["default", "mini-flagship"])
@pytest.mark.parametrize("size", [2, 4])
def test_each_index_is_held_as_often_as_its_head_is_shared(cfg: ModelConfig, size: int) -> None:
    """Every split tensor's indices over the ranks: each once, except the heads replicated
    where the ranks outnumber them (KV heads, GDN key heads: size / heads copies each). A
    rank's part has the shape the rank's own config gives the tensor, so the packing that
    follows sees an ordinary, smaller checkpoint."""
    held = shard.rank_config(cfg, size)
    local_shapes = weight_shapes(held)
    copies_kv = max(1, size // cfg.num_key_value_heads)
    copies_keys = max(1, size // cfg.linear_num_key_heads)
    for name, shape in weight_shapes(cfg).items():
        parts = [shard.part(cfg, shard.Shard(r, size), name, shape) for r in range(size)]
        if parts[0] is None:
            assert all(p is None for p in parts)
            assert local_shapes[name] == shape, name
            continue
        dim = parts[0][0]
        counts = Counter(i for p in parts if p is not None for i in p[1])
        assert set(counts) == set(range(shape[dim])), name
        kind = name.removesuffix(".weight").rpartition(".")[2]
        if kind in ("k_proj", "v_proj"):
            assert set(counts.values()) == {copies_kv}, name
        elif kind in ("in_proj_qkvz", "conv1d"):
            assert set(counts.values()) <= {1, copies_keys}, name
        else:
            assert set(counts.values()) == {1}, name
        if name not in ("model.embed_tokens.weight", "lm_head.weight"):
            assert all(len(p[1]) == local_shapes[name][dim] for p in parts if p), name


def test_what_does_not_divide_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\)"):
        shard.rank_config(ModelConfig(), 3)
    with pytest.raises(ValueError, match="at least 1"):
        shard.check(ModelConfig(), 0)


# -- real ranks ---------------------------------------------------------------------------------


def _launch(directory: Path, size: int, dtype: str = "fp32") -> TpEngine:
    faults: list[str] = []
    engine = launch(Launch(directory, SERVICE, dtype, "cpu", size), on_fault=faults.append)
    engine.set_forward("eager")
    return engine


@pytest.fixture(scope="module")
def tp_engines(mini_dir: Path) -> Iterator[dict[str, Engine]]:
    """One device and TP 2 on the bundled model, one device and TP 4 on the flagship in
    miniature (1 KV head, 2 GDN key heads: TP 4 replicates both)."""
    made: dict[str, Engine] = {}
    try:
        made["default-1"] = Engine(DEFAULT_MODEL_DIR, SERVICE, "fp32")
        made["default-2"] = _launch(DEFAULT_MODEL_DIR, 2)
        made["mini-1"] = Engine(mini_dir, SERVICE, "fp32")
        made["mini-4"] = _launch(mini_dir, 4)
        for e in made.values():
            e.set_forward("eager")
        yield made
    finally:
        for e in made.values():
            if isinstance(e, TpEngine):
                e.close()


def _rows(engine: Engine) -> torch.Tensor:
    return torch.stack(
        [torch.frombuffer(bytearray(r), dtype=torch.float32) for r in logit_rows(engine)]
    )


def _calls(engine: Engine) -> list[torch.Tensor]:
    """A prefill of two prompts, a batched verify, a fold and commit, a propose: the logits
    of each."""
    seqs = [engine.alloc_sequence() for _ in PROMPTS]
    try:
        first = engine.prefill(seqs, PROMPTS).argmax
        out = [_rows(engine)]
        engine.decode_verify_batched([first[0], 5, 9, 11, first[1], 3], [4, 2], seqs)
        out.append(_rows(engine))
        engine.stash_verify_hidden_rows([1, 4])  # each sequence's last kept row
        engine.gdn_fold_accepted(seqs, [2, 1])
        engine.commit_accepted_prefix(seqs, [2, 1], [4, 2])
        if engine.capabilities().has_mtp:
            engine.run_mtp_propose_batched([7, 8], [0, 1], 2, seqs)
            out.append(_rows(engine))
        return out
    finally:
        for s in seqs:
            engine.free_sequence(s)


@pytest.mark.parametrize(("model", "size"), [("default", 2), ("mini", 4)])
def test_logits_match_one_device(tp_engines: dict[str, Engine], model: str, size: int) -> None:
    """Prefill, verify and propose logits at TP N against one device's, within the fp32
    tolerance of the HF-parity tests; the argmax the same."""
    one, split = _calls(tp_engines[f"{model}-1"]), _calls(tp_engines[f"{model}-{size}"])
    assert len(one) == len(split) == 3
    for a, b in zip(one, split, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _fused_share(cfg: ModelConfig, held: ModelConfig, name: str) -> float | None:
    """The share of a fused projection (or the per-head q and k norm table) a rank holds, by
    the heads it holds of each part: the KV heads and GDN key heads may be replicated, so these
    shares exceed 1/N there."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if name.endswith(".qkvg") or name.startswith("head_norms.") and name.endswith(".1"):
        return (held.num_attention_heads + held.num_key_value_heads) / (
            cfg.num_attention_heads + cfg.num_key_value_heads
        )
    if name.endswith(".in_proj_qkvz"):
        return (2 * held.linear_num_key_heads * dk + 2 * held.linear_num_value_heads * dv) / (
            2 * cfg.linear_num_key_heads * dk + 2 * cfg.linear_num_value_heads * dv
        )
    if name.endswith(".conv1d.weight"):
        return held.conv_dim / cfg.conv_dim
    return None


@pytest.mark.parametrize(("model", "size"), [("default", 2), ("mini", 4)])
def test_each_rank_holds_a_share_plus_what_is_replicated(
    tp_engines: dict[str, Engine], model: str, size: int
) -> None:
    """Counted tensor by tensor against one device's: each rank holds 1/N of every split
    tensor, the whole of each replicated one (norms, the router, the shared expert's gate, the
    MTP head's fc, the per-row and per-slot state), and of the fused projections and state
    whose heads may be replicated (KV heads, GDN key heads) the share of the heads it holds.
    Its total is then 1/N of one device's plus what is replicated."""
    one = tp_engines[f"{model}-1"].held_bytes_by_rank()[0]
    ranks = tp_engines[f"{model}-{size}"].held_bytes_by_rank()
    cfg = tp_engines[f"{model}-1"].cfg
    held = shard.rank_config(cfg, size)
    assert len(ranks) == size and all(r == ranks[0] for r in ranks)
    rank = ranks[0]
    for part in ("weights", "state"):
        assert set(rank[part]) == set(one[part])
    whole = replicated = extra = 0
    for name, full in one["weights"].items():
        got, share = rank["weights"][name], _fused_share(cfg, held, name)
        whole += full
        if share is not None:
            assert got == full * share, name
            extra += got - full // size
        elif got == full:
            assert "norm" in name or name.endswith((".mlp.gate", "shared_expert_gate", "mtp.fc")), (
                name
            )
            replicated += full
        else:
            assert got * size == full, name
    assert sum(rank["weights"].values()) == (whole - replicated) // size + replicated + extra
    kv = held.num_key_value_heads / cfg.num_key_value_heads
    for name, full in one["state"].items():
        got = rank["state"][name]
        if name in ("k_cache", "v_cache", "mtp_k", "mtp_v"):
            assert got == full * kv, name
        elif name in ("gdn", "verify_gdn", "snap_gdn", "logits"):  # value heads; held token ids
            assert got * size == full, name
        elif name in ("conv", "verify_conv", "snap_conv"):
            assert got * cfg.conv_dim == full * held.conv_dim, name
        else:
            assert got == full, name  # per-row and per-slot tables


# Slow: starts tensor-parallel rank processes.
@pytest.mark.slow
def test_transformers_parity_at_tp_2_and_a_hung_rank_ends_it(tmp_path: Path) -> None:
    """transformers' logits of a sharded HF checkpoint (MoE with a shared expert) against our
    TP 2's, prefill and verify. Then rank 1 is stopped (SIGSTOP) while rank 0 runs a verify:
    the first collective waits `--tp-timeout` (here 2 s), the fault handler is called (the
    service: exit 1) and the call raises, rather than hanging."""
    from tests.gpu_service.model.test_hf_parity import CONFIGS, _checkpoint

    directory, reference = _checkpoint(tmp_path, CONFIGS["moe-shared"])
    tokens = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0].float()
    faults: list[str] = []
    engine = launch(
        Launch(directory, SERVICE, "fp32", "cpu", 2, timeout_s=2.0), on_fault=faults.append
    )
    (rank1,) = engine.followers.processes
    try:
        engine.set_forward("eager")
        seq = engine.alloc_sequence()
        engine.prefill([seq], [tokens[:20].tolist()])
        got = _rows(engine)
        torch.testing.assert_close(got, expected[19:20], atol=ATOL, rtol=RTOL)
        engine.decode_verify_batched(tokens[20:24].tolist(), [4], [seq])
        got = _rows(engine)
        torch.testing.assert_close(got, expected[20:24], atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(-1), expected[20:24].argmax(-1))
        engine.gdn_fold_accepted([seq], [4])
        engine.commit_accepted_prefix([seq], [4], [4])
        assert not faults
        psutil.Process(rank1.pid).suspend()
        with pytest.raises(RuntimeError):
            engine.decode_verify_batched([1, 2], [2], [seq])
        assert len(faults) == 1 and "collective failed in decode_verify" in faults[0], faults
    finally:
        rank1.kill()
        engine.close()


# -- through the pair -------------------------------------------------------------------------


def _diff_passes(target: str, out: Path) -> None:
    """`met circuit diff --verify-batch` against the service: batched against one sequence at
    a time, a fragmented slot table, the drafter's propose."""
    diff = subprocess.run(
        [
            *(sys.executable, "-m", "met", "circuit", "diff", "--verify-batch"),
            *("--gpu-service", target, "--widths", "2,3", "--ks", "2,3", "--steps", "2"),
            *("--fragment", "--mtp", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert diff.returncode == 0, diff.stderr
    assert json.loads(out.read_text())["verdict"] == "PASS"


def _generate(stub: pb_grpc.GenerationServiceStub, prompt: list[int], method: int) -> tuple:
    tokens, drafted = [], 0
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=10, ignore_eos=True, speculative_method=method
    )
    for msg in stub.Generate(request, timeout=120):
        tokens += msg.token_ids
        drafted = msg.speculative_stats.drafted
    return tokens, drafted


def killed_rank_ends_the_stream(
    stub: pb_grpc.GenerationServiceStub, gpu: subprocess.Popen, request: pb.GenerateRequest
) -> None:
    """Rank 1 killed while `request` streams: the service exits non-zero and the stream ends
    UNAVAILABLE."""
    stream = stub.Generate(request, timeout=60)
    assert next(stream).token_ids  # under way
    (rank1,) = _rank_processes(gpu)
    rank1.send_signal(signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as ended:
        for _ in stream:
            pass
    assert gpu.wait(timeout=10) != 0
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value.details()


def _rank_processes(service: subprocess.Popen) -> list[psutil.Process]:
    """The service's other ranks (not multiprocessing's resource tracker)."""
    children = psutil.Process(service.pid).children()
    return [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]


# Slow: starts tensor-parallel services.
@pytest.mark.slow
@pytest.mark.parametrize(("model", "size"), [("default", 2), ("mini", 4)])
def test_through_the_pair(mini_dir: Path, tmp_path: Path, model: str, size: int) -> None:
    """A TP service and a control plane: greedy `mtp` streams `none`'s tokens, on the bundled
    model at TP 2 and on the flagship in miniature at TP 4 (its KV head and GDN key heads
    replicated). At TP 2 the circuit diff PASSes against the service first; then a stream is
    under way when rank 1 is killed with SIGKILL: the service exits non-zero within 10 s and
    the stream ends UNAVAILABLE."""
    directory = DEFAULT_MODEL_DIR if model == "default" else mini_dir
    gpu, target = start_gpu_service(
        directory,
        *("--tp", str(size), "--dtype", "fp32"),
        *("--verify-tiers", "4:3,4:1", "--max-context", "256"),
    )
    try:
        assert len(_rank_processes(gpu)) == size - 1
        if size == 2:
            _diff_passes(target, tmp_path / "diff.json")
        cp, cp_target = start_control_plane(target)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                prompts = [list(range(30, 30 + n)) for n in (5, 23)]
                mtp = [_generate(stub, p, pb.SPECULATIVE_METHOD_MTP) for p in prompts]
                none = [_generate(stub, p, pb.SPECULATIVE_METHOD_NONE) for p in prompts]
                assert [t for t, _ in mtp] == [t for t, _ in none]
                assert sum(d for _, d in mtp) > 0 and sum(d for _, d in none) == 0
                if size != 2:
                    return
                request = pb.GenerateRequest(
                    prompt_token_ids=list(range(30, 50)),
                    max_new_tokens=200,
                    ignore_eos=True,
                    speculative_method=pb.SPECULATIVE_METHOD_MTP,
                )
                killed_rank_ends_the_stream(stub, gpu, request)
        finally:
            stop(cp)
    finally:
        if gpu.poll() is None:
            assert stop(gpu) == 0


def test_masks_and_sampling_match_one_device(tp_engines: dict[str, Engine]) -> None:
    """What reads whole rows of logits at TP 2: a mask whose allowed ids all sit in rank 1's
    columns (rank 0's row is all -inf, and adds nothing to the combined normaliser), a mask
    across both ranks, and a sampled row drawing with a given uniform: the tokens of one
    device, and the log-probabilities and alternatives (gathered whole from the ranks' columns)
    within the tolerance, through a prefill and a verify."""
    import numpy as np

    from protos.model import Sampling

    vocab = tp_engines["default-1"].cfg.vocab_size
    allowed = [np.zeros(vocab, dtype=bool) for _ in range(2)]
    allowed[0][[3000, 4000, 4095]] = True  # rank 1's ids only
    allowed[1][[5, 2100, 2047, 2048]] = True  # both ranks'
    masks = [np.packbits(a, bitorder="little").tobytes() for a in allowed]
    prompts = [*PROMPTS, [9, 8, 7]]
    sampling = [None, None, Sampling(temperature=0.8, top_k=50, uniforms=(0.37,))]
    results = []
    for name in ("default-1", "default-2"):
        engine = tp_engines[name]
        seqs = [engine.alloc_sequence() for _ in prompts]
        try:
            done = engine.prefill(seqs, prompts, masks, sampling, top=[4, 4, 4])
            drafts = [done.argmax[0], 4095, done.argmax[1], done.argmax[2], 2047]
            v = engine.decode_verify_batched(
                drafts,
                [2, 1, 2],
                seqs,
                masks={0: masks[0]},
                sampling={2: Sampling(0.8, top_k=50, uniforms=(0.37, 0.61))},
                top=[3, 3, 3],
            )
            d = v.draws[3:]
            results.append(
                (
                    [done.argmax, [t for t in done.top_ids if t], v.top_ids[1:]],
                    [done.logprobs, *done.top_logprobs, *v.top_logprobs[1:], v.next_logprobs],
                    [(x.resample, x.sample) for x in d if x is not None],
                    [(x.resample_logprob, x.sample_logprob) for x in d if x is not None],
                )
            )
        finally:
            for s in seqs:
                engine.free_sequence(s)
    (one, one_lp, one_d, one_dlp), (split, split_lp, split_d, split_dlp) = results
    assert one == split and one[0][0] in (3000, 4000, 4095) and one[0][1] in (5, 2100, 2047, 2048)
    assert one_d == split_d
    for a, b in [*zip(one_lp, split_lp, strict=True), (one_dlp, split_dlp)]:
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=RTOL)


def test_penalties_match_one_device(tp_engines: dict[str, Engine]) -> None:
    """Each rank penalizes its own columns: seen and biased ids on both ranks' sides of the
    split, through a prefill and a verify with drafts: one device's logits and tokens."""
    from protos.model import Penalties

    vocab = tp_engines["default-1"].cfg.vocab_size
    prompt = [5, 9, 5, vocab - 3, 2047, 2048, vocab - 3, 11]
    pen = Penalties(
        presence=0.5,
        frequency=0.25,
        repetition=1.5,
        prompt_tokens=len(prompt),
        bias_ids=(7, vocab - 1),
        bias_values=(3.0, 4.0),
    )
    results = []
    for name in ("default-1", "default-2"):
        engine = tp_engines[name]
        seq = engine.alloc_sequence(pen)
        try:
            first = engine.prefill([seq], [prompt]).argmax
            rows = [_rows(engine)]
            top = engine.decode_verify_batched([first[0], 2048, vocab - 3, 5], [4], [seq]).argmax
            rows.append(_rows(engine))
            engine.gdn_fold_accepted([seq], [1])
            engine.commit_accepted_prefix([seq], [1], [4])
            results.append((first + top, rows))
        finally:
            engine.free_sequence(seq)
    (one, one_rows), (split, split_rows) = results
    assert one == split
    for a, b in zip(one_rows, split_rows, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)


def test_a_prefix_snapshot_under_tp_2(tp_engines: dict[str, Engine]) -> None:
    """Every rank snapshots its share of the state and restores it: a sequence made from a
    128-token snapshot, given the rest of the prompt, has the logits of a whole prefill on the
    same ranks, byte for byte, and every block goes back to the pool."""
    engine = tp_engines["default-2"]
    prompt = [(5 * i + 1) % 250 for i in range(150)]
    whole = engine.alloc_sequence()
    want = engine.prefill([whole], [prompt]).argmax, engine.read_logits().data
    engine.free_sequence(whole)
    src, seq = engine.alloc_sequence(), engine.alloc_sequence()
    engine.prefill([src], [prompt[:128]])
    (snap,) = engine.snapshot_prefixes([src])
    engine.restore_prefixes([seq], [snap])
    got = engine.prefill([seq], [prompt[128:]]).argmax, engine.read_logits().data
    assert got == want
    for s in (src, seq):
        engine.free_sequence(s)
    engine.drop_prefixes([snap])
    caps = engine.capabilities()
    assert caps.kv_blocks_free == caps.kv_blocks
