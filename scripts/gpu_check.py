"""The device check behind scripts/gpu_check.sh (see there)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable


def _time(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def kernel_timings(device: str, repeats: int) -> None:
    import torch

    from kernels.argmax import naive as an
    from kernels.argmax import triton as at
    from kernels.attention import naive as tn
    from kernels.attention import triton as tt
    from kernels.gated_delta_rule import chunk, naive, recurrent
    from kernels.rmsnorm import naive as rn
    from kernels.rmsnorm import triton as rt

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    x, w, logits = rand(64, 256), rand(256), rand(64, 4096)
    hk, hv, dk, dv, t = 2, 4, 64, 64, 64
    q, k, v = rand(t, hk, dk), rand(t, hk, dk), rand(t, hv, dv)
    g, beta = -rand(t, hv).abs(), rand(t, hv).sigmoid()
    states, rows = rand(4, hv, dk, dv), torch.zeros(t + 8, hv, dk, dv, device=device)
    i32 = {"dtype": torch.int32, "device": device}
    cu, slots, vr = (torch.tensor(a, **i32) for a in ([0, t], [1], [0]))
    kc, vc = rand(4, 256, 2, 64), rand(4, 256, 2, 64)
    qa = rand(4, 4, 64)
    cases = {
        "rms_norm": (lambda: rn.rms_norm(x, w, 1e-6), lambda: rt.rms_norm(x, w, 1e-6)),
        "argmax": (lambda: an.argmax_confidence(logits), lambda: at.argmax_confidence(logits)),
        "gdn recurrent (64 rows)": (
            lambda: naive.recurrent_gated_delta_rule(q, k, v, g, beta, states[1]),
            lambda: recurrent.recurrent_gated_delta_rule(
                q, k, v, g, beta, states.clone(), cu, slots, rows, vr, False
            ),
        ),
        "gdn chunk (64 rows)": (
            lambda: naive.chunk_gated_delta_rule(q, k, v, g, beta, states[1]),
            lambda: chunk.chunk_gated_delta_rule(q, k, v, g, beta, states.clone(), cu, slots),
        ),
        "attention (4 rows, 200 keys)": (
            lambda: tn.tiled_attention(
                qa, kc[1, :256], vc[1, :256], torch.arange(196, 200, device=device)
            ),
            lambda: tt.attention(
                qa,
                kc,
                vc,
                torch.tensor([0, 4], **i32),
                torch.tensor([1], **i32),
                torch.tensor([196], **i32),
            ),
        ),
    }
    print(f"{'kernel':32} {'torch ms':>10} {'triton ms':>10}")
    for name, (ref, ker) in cases.items():
        print(f"{name:32} {_time(ref, sync, repeats):10.3f} {_time(ker, sync, repeats):10.3f}")


def model_check(device: str) -> bool:
    """The tiny hybrid model, seeded weights, under eager and triton: prefill, a ragged verify
    and a drafter pass; logits within 1e-3 and the same argmaxes."""
    import torch

    from gpu_service.config import ModelConfig, ServiceConfig
    from gpu_service.model.hybrid import PREFILL, VERIFY, HybridModel, Segment
    from gpu_service.model.weights import init_weights
    from gpu_service.state import DeviceState

    cfg = ModelConfig.tiny()
    svc = ServiceConfig(verify_tiers="4:3", max_context=256)
    weights = {n: w.to(device) for n, w in init_weights(cfg, 7).items()}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 37)]
    drafts = [torch.randint(0, 256, (n,), generator=gen) for n in (4, 2)]
    results = {}
    for mode in ("eager", "triton"):
        model = HybridModel(cfg, weights, svc.max_context)
        model.triton = mode == "triton"
        state = DeviceState(cfg, svc, torch.float32, device)
        segs, row = [], 0
        for slot, p in enumerate(prompts):
            segs.append(Segment(slot, 0, len(p), row))
            row += len(p)
        hidden = model.forward(torch.cat(prompts).to(device), segs, state, PREFILL)
        pre = model.logits(hidden[:row])
        vsegs, row = [], 0
        for slot, (p, d) in enumerate(zip(prompts, drafts, strict=True)):
            vsegs.append(Segment(slot, len(p), len(d), row))
            row += len(d)
        vhidden = model.forward(torch.cat(drafts).to(device), vsegs, state, VERIFY, False)
        ver = model.logits(vhidden[:row])
        msegs = [
            Segment(s, len(p) + len(d), 1, i)
            for i, (s, p, d) in enumerate(zip((0, 1), prompts, drafts, strict=True))
        ]
        last = torch.stack([vhidden[s.row + s.count - 1] for s in vsegs])
        mtp = model.logits(
            model.mtp_forward(torch.tensor([1, 2], device=device), last, msegs, state)[:2]
        )
        results[mode] = (pre.cpu(), ver.cpu(), mtp.cpu())
    ok = True
    for name, a, b in zip(
        ("prefill", "verify", "propose"), results["eager"], results["triton"], strict=True
    ):
        err = (a - b).abs().max().item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        print(f"model {name:8} max abs diff {err:.2e}  argmax agreement {agree:.3f}")
        ok &= err < 1e-3 and agree == 1.0
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--cpu", action="store_true", help="run the checks under Triton's interpreter on the CPU"
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-pytest", action="store_true", help="skip the kernel tests")
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU on this machine; nothing to check (--cpu runs the same "
            "checks under the interpreter)"
        )
        return 0
    device = "cpu" if args.cpu else "cuda"
    from kernels import configure_interpreter

    configure_interpreter(device)
    print(f"gpu_check on {device}: torch {torch.__version__}", end="")
    import triton

    print(f", triton {triton.__version__}")
    code = 0
    if not args.no_pytest:
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "--noconftest",
                "-p",
                "no:cacheprovider",
                "tests/kernels",
            ]
        )
    ok = model_check(device)
    kernel_timings(device, args.repeats)
    return code or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
