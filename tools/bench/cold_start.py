"""What a start costs: `met up` from empty caches (`TORCHINDUCTOR_CACHE_DIR`, `XDG_CACHE_HOME`
in new empty folders), timed to its first answer to a short prompt, then to a 600-token
prompt's.

`python -m tools.bench.cold_start [--drafter]`: the seconds from `met up`'s start to the first
answer, and from there to the long prompt's. (That a call's tokens do not depend on whether its
key was compiled yet is `tests/gpu_service/test_compiled.py`'s.)"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from control_plane.cli.launch import stop
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc

LONG = 600  # the long prompt's tokens


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(stub, prompt: list[int], tokens: int, timeout: float = 600) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=tokens, ignore_eos=True)
    return [t for r in stub.Generate(request, timeout=timeout) for t in r.token_ids]


def _first_answer(stub, prompt: list[int], deadline: float) -> None:
    """Until the control plane answers (it refuses UNAVAILABLE while the service starts)."""
    while True:
        try:
            _generate(stub, prompt, 8)
            return
        except grpc.RpcError as e:
            if time.monotonic() > deadline or e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            time.sleep(0.2)  # polling another process's start


def start(caches: Path, drafter: bool, long: int) -> dict:
    """One `met up` in `caches` -> its timings."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "XDG_CACHE_HOME": str(caches / "xdg"),
    }
    port = _port()
    extra = ["--drafter", str(DEFAULT_MODEL_DIR / DRAFTER_DIR)] if drafter else []
    cmd = [sys.executable, "-m", "met", "up", "--port", str(port), "--http-port", "0", *extra]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out: dict = {"drafter": drafter}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            grpc.channel_ready_future(channel).result(timeout=300)
            _first_answer(stub, [5, 6, 7, 8], began + 600)
            out["first_answer_s"] = time.monotonic() - began
            at = time.monotonic()
            _generate(stub, [(7 * i) % 4000 + 1 for i in range(long)], 8)
            out["long_prompt_s"] = time.monotonic() - at
    finally:
        stop(proc)
        assert proc.stderr is not None
        out["log"] = [ln for ln in proc.stderr.read().decode().splitlines() if "gpu-service" in ln]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", action="store_true", help="with the DFlash drafter")
    parser.add_argument("--long", type=int, default=LONG)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        got = start(Path(root), args.drafter, args.long)
    print(
        f"cold met up{' --drafter' if args.drafter else ''}: first answer "
        f"{got['first_answer_s']:.1f} s after start; a {args.long}-token prompt's "
        f"{got['long_prompt_s']:.1f} s after that"
    )
    print("\n".join(got["log"]))


if __name__ == "__main__":
    main()
