"""Ours against llama.cpp on the same checkpoint: `met bench`'s llama.cpp section where a
`llama-server` binary is on the PATH, and alone as `python -m tools.bench.llama_cpp --gguf F`.

Both sides one thread, greedy, the same prompts as token ids, a fixed count of new tokens (EOS
ignored), no prompt cache: llama.cpp's `llama-server` (`-t 1`, as many slots as requests,
and again with its MTP drafts, `--spec-type draft-mtp`) against our two processes (none and
mtp), at each concurrency, in interleaved rounds after a warm-up round (our service's
background compiles settled before the counted rounds). Each arm's tok/s is the median over
the rounds of its new tokens over the round's wall time (prefill included, on both sides);
the per-round ratio llama.cpp / ours is reported with its median. Every llama.cpp token list
is compared with ours: the GGUF is the same model only if they are equal.

The GGUF comes from llama.cpp's own converter (README, "Against llama.cpp")."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tools.bench.workload import Workload, settled

BINARY = "llama-server"
MTP_FLAGS = ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3")
OURS = {"none": pb.SPECULATIVE_METHOD_NONE, "mtp": pb.SPECULATIVE_METHOD_MTP}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(gguf: Path, slots: int, mtp: bool) -> tuple[subprocess.Popen, str]:
    """A `llama-server` on a free port, once its health check answers."""
    port = _port()
    cmd = [BINARY, "-m", str(gguf), "-t", "1", "--port", str(port), "-np", str(slots)]
    cmd += ["-c", str(4096 * slots)] + (list(MTP_FLAGS) if mtp else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"{BINARY} did not start: {' '.join(cmd)}") from None
        time.sleep(0.2)  # polling another process's start


def _llama_one(base: str, prompt: tuple[int, ...], tokens: int) -> list[int]:
    body = {
        "prompt": list(prompt),
        "n_predict": tokens,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": False,
        "ignore_eos": True,
        "return_tokens": True,
    }
    request = urllib.request.Request(
        f"{base}/completion", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return list(json.load(r)["tokens"])


def _ours_one(target: str, prompt: tuple[int, ...], tokens: int, method) -> list[int]:
    with grpc.insecure_channel(target) as channel:
        request = pb.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=tokens, ignore_eos=True,
            speculative_method=method,
        )  # fmt: skip
        stream = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=600)
        return [t for m in stream for t in m.token_ids]


def _round(call, prompts: list[tuple[int, ...]]) -> tuple[float, list[list[int]]]:
    """`call(prompt)` for every prompt at once -> (tok/s over the wall time, each's tokens)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        ids = list(pool.map(call, prompts))
    return sum(map(len, ids)) / (time.perf_counter() - t0), ids


def compare(
    gguf: Path, concurrency: list[int], tokens: int, rounds: int, service: tuple[str, ...] = ()
) -> list[dict]:
    """The arms at each concurrency, interleaved -> a row per concurrency."""
    work = Workload(DEFAULT_MODEL_DIR)
    gpu, target = start_gpu_service(DEFAULT_MODEL_DIR, *service)
    cp, cp_target = start_control_plane(target)
    model = GrpcModel(target)
    rows = []
    try:
        for n in concurrency:
            prompts = [tuple(work.prompts[i % len(work.prompts)]) for i in range(n)]
            servers = {f"llama.cpp {m}": start_llama(gguf, n, m == "mtp") for m in OURS}
            try:
                arms = {k: lambda p, b=b: _llama_one(b, p, tokens) for k, (_, b) in servers.items()}
                for m, method in OURS.items():
                    arms[f"ours {m}"] = lambda p, m=method: _ours_one(cp_target, p, tokens, m)
                rows.append(
                    _rows(arms, prompts, rounds, lambda: settled(lambda: model))
                    | {"concurrency": n}
                )
            finally:
                for proc, _ in servers.values():
                    stop(proc)
    finally:
        model.close()
        stop(cp)
        stop(gpu)
    return rows


def _rows(arms: dict, prompts: list, rounds: int, settle) -> dict:
    """A warm-up round of every arm, then `rounds` counted, interleaved."""
    runs: dict[str, list[tuple[float, list[list[int]]]]] = {k: [] for k in arms}
    for counted in [False] + [True] * rounds:
        if counted and not runs["ours none"]:
            settle()  # what the warm-up's calls queued to compile, built
        for k, call in arms.items():
            got = _round(call, prompts)
            if counted:
                runs[k].append(got)
    tok_s = {k: statistics.median(r[0] for r in rs) for k, rs in runs.items()}
    ratio = {
        m: statistics.median(
            a[0] / b[0] for a, b in zip(runs[f"llama.cpp {m}"], runs[f"ours {m}"], strict=True)
        )
        for m in OURS
    }
    ours = runs["ours none"][0][1]
    return {
        "tok_s": tok_s,
        "llama_over_ours": ratio,
        # The bar: ours with MTP against llama.cpp's best on a CPU, without drafts.
        "llama_none_over_ours_mtp": tok_s["llama.cpp none"] / tok_s["ours mtp"],
        "same_tokens": {k: all(r[1] == ours for r in rs) for k, rs in runs.items()},
    }


def lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        t, ratio = r["tok_s"], r["llama_over_ours"]
        same = ", ".join(k for k, v in r["same_tokens"].items() if not v) or "every arm"
        out.append(
            f"{r['concurrency']:>3} concurrent: "
            + ", ".join(f"{k} {v:.0f}" for k, v in t.items())
            + f" tok/s; llama.cpp / ours: none {ratio['none']:.2f}x, mtp {ratio['mtp']:.2f}x; "
            + (f"tokens equal: {same}" if same == "every arm" else f"tokens differ: {same}")
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the model as llama.cpp reads it")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--service", default="", help="our GPU service's further flags")
    args = parser.parse_args(argv)
    if shutil.which(BINARY) is None:
        parser.error(f"no {BINARY} on the PATH (README, 'Against llama.cpp', builds one)")
    rows = compare(
        args.gguf, args.concurrency, args.tokens, args.rounds, tuple(args.service.split())
    )
    print("\n".join(lines(rows)))


if __name__ == "__main__":
    main()
