"""What routing buys the MoE layers: `python -m tools.moe_bench`.

Prefill and verify time against the expert count at a fixed routed count. Each count gets a
seeded checkpoint of the tiny model's layer pattern (hidden 128; every layer and the MTP head an
MoE of experts of inner size 32, a quarter of the hidden size as in the flagship, with a
shared expert), written to a temporary directory and
removed once timed. A prefill is 64 rows of one sequence; a verify is 4 sequences of 4 rows (its
fold and commit run after it, untimed, so that it repeats). Each figure is the median of
`--repeats` calls after one warm-up, on one thread, and is also given over the first count's;
the counts take turns call by call, so that a noisy machine's slow spells fall on all of them.
Routing's target: 256 experts cost at most 1.5x what 8 cost, prefill and verify.

Paths: `routed` (the eager forward, `routed_moe`), `dense` with `--dense` (the eager forward with
every expert over every row, `dense_moe`: the path before routing), and on `--device cuda` also
`fused` (the triton forward, `fused_moe`). Graphs are off, so each call runs its kernels; the two
forwards differ in their other kernels too (scripts/gpu_check's `moe` section times the MoE
kernels alone)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from gpu_service.engine.device import choose_device
from gpu_service.engine.facade import Engine
from gpu_service.model.backend import EagerOps
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.weights import init_weights, save_weights
from kernels.fp8.naive import BlockFp8
from kernels.moe.naive import dense_moe

HIDDEN = 128
MOE_INNER = HIDDEN // 4  # the flagship's proportion: 512 for a hidden of 2048
PREFILL_ROWS = 64
VERIFY_SEQS, VERIFY_ROWS = 4, 4
VERIFY_PROMPT = 16
TARGET_RATIO = 1.5
MAX_CONTEXT = 512
# Each verify call keeps a row of each sequence: the warm-up and the repeats must fit.
MAX_REPEATS = MAX_CONTEXT - VERIFY_PROMPT - VERIFY_ROWS - 1
SERVICE = ServiceConfig(
    verify_tiers="8:3",
    max_context=MAX_CONTEXT,
    max_rows=VERIFY_SEQS * VERIFY_ROWS,
    max_batch=8,
    max_prefill_tokens=PREFILL_ROWS,
    cuda_graphs=False,
)
# What each path runs, for the table's headings.
PATHS = {
    "routed": "the eager forward, routed_moe: each expert over its own rows",
    "dense": "the eager forward, dense_moe: every expert over every row (before routing)",
    "fused": "the triton forward, fused_moe: the fused grouped GEMM",
}


def _flag(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class Options:
    experts: tuple[int, ...] = field(
        default=(8, 64, 256), metadata=_flag("expert counts, comma-separated, least first")
    )
    routed: int = field(default=4, metadata=_flag("experts each token is routed to"))
    repeats: int = field(default=5, metadata=_flag("timed calls of each figure"))
    dense: bool = field(default=False, metadata=_flag("the eager forward's MoE as dense_moe"))
    device: str = field(default="cpu", metadata=_flag("cpu, or cuda to add the triton forward"))
    dtype: str = field(default="", metadata=_flag("fp32 or bf16 (default: fp32, bf16 on cuda)"))
    json: bool = field(default=False, metadata=_flag("print one JSON object, not tables"))

    @property
    def paths(self) -> list[str]:
        eager = "dense" if self.dense else "routed"
        return [eager, "fused"] if self.device.startswith("cuda") else [eager]

    @property
    def dtype_name(self) -> str:
        return self.dtype or ("bf16" if self.device.startswith("cuda") else "fp32")


class DenseOps(EagerOps):
    """The eager forward with the MoE as it ran before routing."""

    name = "eager-dense"

    def moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor | BlockFp8,
        w2: torch.Tensor | BlockFp8,
        experts: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        return dense_moe(x, w13, w2, experts, weights)


def moe_config(num_experts: int, routed: int) -> ModelConfig:
    return replace(
        ModelConfig.tiny(),
        hidden_size=HIDDEN,
        num_experts=num_experts,
        num_experts_per_tok=routed,
        moe_intermediate_size=MOE_INNER,
        shared_expert_intermediate_size=MOE_INNER,
    )


def write_checkpoint(directory: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """config.json and seeded weights: all the engine loads (no tokenizer; nothing reads text)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(cfg.to_json())
    save_weights(init_weights(cfg, seed), directory)
    return directory


def use_path(engine: Engine, path: str) -> None:
    """The forward of `path`; `dense` replaces the eager model's ops object."""
    engine.set_forward("triton" if path == "fused" else "eager")
    if path == "dense":
        engine.model.ops = DenseOps()


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * seed) % 251 for i in range(n)]


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prefill_timer(engine: Engine) -> Callable[[], float]:
    """One prefill of a fresh sequence, timed, in seconds."""
    prompt = _tokens(PREFILL_ROWS)

    def once() -> float:
        seq = engine.alloc_sequence()
        t0 = _now(engine.device)
        engine.prefill([seq], [prompt])
        elapsed = _now(engine.device) - t0
        engine.free_sequence(seq)
        return elapsed

    return once


@contextmanager
def verify_timer(engine: Engine) -> Iterator[Callable[[], float]]:
    """One verify of the same sequences, timed, in seconds. Each call keeps one row of each
    sequence: the contexts grow by one a call. The sequences are freed on leaving."""
    seqs = [engine.alloc_sequence() for _ in range(VERIFY_SEQS)]
    try:
        engine.prefill(seqs, [_tokens(VERIFY_PROMPT, i) for i in range(VERIFY_SEQS)])
        tokens = _tokens(VERIFY_SEQS * VERIFY_ROWS, seed=1)
        ks, kept = [VERIFY_ROWS] * VERIFY_SEQS, [1] * VERIFY_SEQS

        def once() -> float:
            t0 = _now(engine.device)
            engine.decode_verify_batched(tokens, ks, seqs)
            elapsed = _now(engine.device) - t0
            engine.gdn_fold_accepted(seqs, kept)
            engine.commit_accepted_prefix(seqs, kept, ks)
            return elapsed

        yield once
    finally:
        for seq in seqs:
            engine.free_sequence(seq)


def interleaved_ms(timers: dict[int, Callable[[], float]], repeats: int) -> dict[int, float]:
    """Each timer's median in ms, over `repeats` rounds that call every timer once in turn
    (after one warm-up round), so that a slow spell of a noisy machine falls on every count
    rather than on whichever was being timed."""
    samples: dict[int, list[float]] = {n: [] for n in timers}
    for round_ in range(repeats + 1):
        for n, once in timers.items():
            elapsed = once()
            if round_:
                samples[n].append(elapsed)
    return {n: statistics.median(s) * 1e3 for n, s in samples.items()}


def measure(options: Options) -> dict[int, dict[str, dict[str, float]]]:
    """count -> path -> {prefill_ms, verify_ms}, every count's engine on a fresh checkpoint of
    its own, all loaded at once so that their calls interleave."""
    figures: dict[int, dict[str, dict[str, float]]] = {n: {} for n in options.experts}
    with tempfile.TemporaryDirectory(prefix="moe-") as tmp:
        engines = {
            n: Engine(
                write_checkpoint(Path(tmp) / str(n), moe_config(n, options.routed)),
                SERVICE,
                options.dtype_name,
                options.device,
            )
            for n in options.experts
        }
        for path in options.paths:
            for engine in engines.values():
                use_path(engine, path)
            prefill = interleaved_ms(
                {n: prefill_timer(e) for n, e in engines.items()}, options.repeats
            )
            with ExitStack() as stack:
                timers = {n: stack.enter_context(verify_timer(e)) for n, e in engines.items()}
                verify = interleaved_ms(timers, options.repeats)
            for n in options.experts:
                figures[n][path] = {"prefill_ms": prefill[n], "verify_ms": verify[n]}
    return figures


def _path_report(path: str, by_count: dict[int, dict[str, dict[str, float]]]) -> dict:
    """One path's figures by expert count, each over the least count's, and the target."""
    counts = sorted(by_count)
    base = by_count[counts[0]][path]
    rows = {}
    for n in counts:
        f = by_count[n][path]
        rows[str(n)] = {
            **f,
            "prefill_ratio": round(f["prefill_ms"] / base["prefill_ms"], 3),
            "verify_ratio": round(f["verify_ms"] / base["verify_ms"], 3),
        }
    top = rows[str(counts[-1])]
    holds = max(top["prefill_ratio"], top["verify_ratio"]) <= TARGET_RATIO
    return {"what": PATHS[path], "experts": rows, "target_holds": holds}


def run(options: Options) -> dict:
    """Every expert count's figures on one thread (the caller's thread count is restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        by_count = measure(options)
    finally:
        torch.set_num_threads(threads)
    counts = sorted(options.experts)
    return {
        **{k: v for k, v in asdict(options).items() if k != "json"},
        "dtype": options.dtype_name,
        "hidden": HIDDEN,
        "moe_intermediate_size": MOE_INNER,
        "prefill_rows": PREFILL_ROWS,
        "verify": f"{VERIFY_SEQS} x {VERIFY_ROWS}",
        "target": f"{counts[-1]} experts at most {TARGET_RATIO}x of {counts[0]}",
        "paths": {path: _path_report(path, by_count) for path in options.paths},
    }


def tables(report: dict) -> str:
    counts = list(next(iter(report["paths"].values()))["experts"])
    base = counts[0]
    lines = [
        f"MoE cost by expert count: {report['device']} {report['dtype']}, "
        f"{report['routed']} routed, median of {report['repeats']}; prefill "
        f"{report['prefill_rows']} rows, verify {report['verify']}"
    ]
    for path, p in report["paths"].items():
        lines += [
            f"{path}: {p['what']}",
            f"  experts  prefill ms  {'x' + base:>5}  verify ms  {'x' + base:>5}",
        ]
        for n, r in p["experts"].items():
            lines.append(
                f"  {n:>7}  {r['prefill_ms']:10.2f}  {r['prefill_ratio']:5.2f}  "
                f"{r['verify_ms']:9.2f}  {r['verify_ratio']:5.2f}"
            )
        verdict = "yes" if p["target_holds"] else "NO"
        lines.append(f"  {report['target']} (prefill and verify): {verdict}")
    return "\n".join(lines)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, not {text!r}"
        ) from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m tools.moe_bench", description=__doc__)
    for f in fields(Options):
        default = getattr(Options, f.name)
        flag, text = f"--{f.name}", f.metadata["help"]
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            kind = _counts if isinstance(default, tuple) else type(default)
            parser.add_argument(flag, type=kind, default=default, help=text)
    options = Options(**vars(parser.parse_args(argv)))
    if min(options.experts) < options.routed or options.routed < 1:
        parser.error(f"--routed {options.routed} must be in 1 ..= the least expert count")
    if not 1 <= options.repeats <= MAX_REPEATS:
        parser.error(f"--repeats {options.repeats} must be in 1 ..= {MAX_REPEATS}")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    device = choose_device(options.device)
    report = run(replace(options, device=str(device)))
    print(json.dumps(report, indent=2) if options.json else tables(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
