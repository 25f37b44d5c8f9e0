"""The checks that need the serving pair: both processes started on the device, greedy `none`
and `mtp` generations streamed from the control plane, and `met circuit diff` run against
the GPU service (the diff takes no device; the service it drives is on the device)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.model import Capabilities
from scripts.gpu_check.report import guarded
from scripts.gpu_check.settings import ROOT, Settings

METHODS = {"none": pb.SPECULATIVE_METHOD_NONE, "mtp": pb.SPECULATIVE_METHOD_MTP}
# A whole GPU-sized diff, with headroom for a cold Triton cache.
DIFF_TIMEOUT_S = 900.0
# The control plane serves within seconds. The GPU service gets launch's own bound: on the CPU
# it compiles its step at start-up (minutes with a cold cache), and one that dies while loading
# is caught at once.
START_TIMEOUT_S = 60.0


class Served:
    """The GPU service on `settings.device` (with `flags` added to its command) and a control
    plane driving it, for the length of a `with`. A start that fails is raised to each check
    that asks for the targets."""

    def __init__(self, settings: Settings, *flags: str) -> None:
        self.settings, self.flags = settings, flags
        self.procs: dict[str, subprocess.Popen] = {}
        self.gpu_target = self.cp_target = ""
        self.error: Exception | None = None
        self.exit_status: dict[str, int | None] = {}
        self.start_seconds = 0.0

    def __enter__(self) -> Served:
        model = str(self.settings.model)
        t0 = time.perf_counter()
        try:
            gpu, self.gpu_target = start_gpu_service(
                self.settings.model, *("--device", self.settings.device, *self.flags)
            )
            self.procs["gpu_service"] = gpu
            cp, self.cp_target = start_control_plane(
                self.gpu_target, "--tokenizer", model, timeout=START_TIMEOUT_S
            )
            self.procs["control_plane"] = cp
        except Exception as e:
            self.error = e
        self.start_seconds = round(time.perf_counter() - t0, 2)
        return self

    def targets(self) -> tuple[str, str]:
        """(GPU service, control plane), each HOST:PORT."""
        if self.error is not None:
            raise RuntimeError(f"the services did not start: {self.error}") from self.error
        return self.gpu_target, self.cp_target

    def __exit__(
        self, kind: type | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The control plane first: it drives the GPU service.
        for name in ("control_plane", "gpu_service"):
            if name in self.procs:
                self.exit_status[name] = _stop(self.procs[name])


def _stop(proc: subprocess.Popen) -> int | None:
    try:
        return stop(proc)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _generate(target: str, prompt: str, method: str, max_new_tokens: int) -> dict:
    request = pb.GenerateRequest(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        speculative_method=METHODS[method],
        ignore_eos=True,
    )
    tokens: list[int] = []
    last = pb.GenerateResponse()
    with grpc.insecure_channel(target) as channel:
        for msg in pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=300):
            tokens += msg.token_ids
            last = msg
    stats = last.speculative_stats
    return {"tokens": tokens, "drafted": stats.drafted, "accepted": stats.accepted}


def _generate_all(target: str, settings: Settings, method: str) -> tuple[list[dict], float]:
    """Every prompt at once, so the scheduler batches them -> (each one's, tokens a second
    over them all)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(settings.prompts)) as pool:
        out = list(
            pool.map(
                lambda p: _generate(target, p, method, settings.max_new_tokens), settings.prompts
            )
        )
    tokens = sum(len(r["tokens"]) for r in out)
    return out, round(tokens / (time.perf_counter() - t0), 1)


def _capabilities(target: str, forward: str) -> Capabilities:
    """The service's capabilities, after selecting `forward`."""
    model = GrpcModel(target)
    try:
        model.set_forward(forward)
        return model.capabilities()
    finally:
        model.close()


def check_service(served: Served, settings: Settings) -> dict:
    gpu, cp = served.targets()
    caps = _capabilities(gpu, settings.forward)
    device = caps.device
    runs = {m: _generate_all(cp, settings, m) for m in METHODS}
    out = {m: r for m, (r, _) in runs.items()}
    tok_s = {m: speed for m, (_, speed) in runs.items()}
    none = [r["tokens"] for r in out["none"]]
    mtp = [r["tokens"] for r in out["mtp"]]
    drafted = sum(r["drafted"] for r in out["mtp"])
    accepted = sum(r["accepted"] for r in out["mtp"])
    full = all(len(t) == settings.max_new_tokens for t in none + mtp)
    on_device = device.startswith(settings.device)
    identical = none == mtp
    return {
        "ok": on_device and identical and full and drafted > 0,
        "summary": (
            f"{device}, none {'==' if identical else '!='} mtp on {len(none)} prompts "
            f"({settings.max_new_tokens} tokens), {accepted} of {drafted} drafts accepted; "
            f"tok/s none {tok_s['none']:.0f}, mtp {tok_s['mtp']:.0f}"
        ),
        "device": device,
        "forward": caps.current_forward,
        "tensor_parallel_size": caps.tensor_parallel_size,
        "tok_s": tok_s,
        "prompts": list(settings.prompts),
        "none": none,
        "mtp": mtp,
        "identical": identical,
        "drafted": drafted,
        "accepted": accepted,
    }


def _diff(gpu: str, settings: Settings, mtp: bool) -> dict:
    reference, forwards = settings.diff_forwards
    flags = [
        "--verify-batch",
        *(["--mtp"] if mtp else []),
        *("--reference", reference, "--forwards", forwards),
        *("--widths", settings.diff_widths, "--ks", settings.diff_ks),
        *("--steps", str(settings.diff_steps)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "diff.json"
        cmd = [sys.executable, "-m", "met", "circuit", "diff", *flags]
        cmd += ["--gpu-service", gpu, "--out", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DIFF_TIMEOUT_S)
        if not out.exists():
            raise RuntimeError(
                f"the diff wrote no report (status {proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}"
            )
        report = json.loads(out.read_text())
    device = report["model"]["device"]
    ok = proc.returncode == 0 and report["verdict"] == "PASS"
    return {
        "ok": ok and device.startswith(settings.device),
        "summary": f"{report['verdict']} on {device}, {len(report['shapes'])} shapes",
        "args": ["met", "circuit", "diff", *flags],
        "verdict": report["verdict"],
        "reasons": report["reasons"],
        "device": device,
        "shapes": [s["ks"] for s in report["shapes"]],
    }


def check_diff(served: Served, settings: Settings) -> dict:
    gpu, _ = served.targets()
    runs = {
        name: guarded(functools.partial(_diff, gpu, settings, mtp))
        for name, mtp in (("verify", False), ("mtp", True))
    }
    return {
        "ok": all(r["ok"] for r in runs.values()),
        "summary": ", ".join(f"{name} {r['summary']}" for name, r in runs.items()),
        **runs,
    }


def served_checks(settings: Settings, *flags: str) -> dict[str, dict]:
    """The service and circuit diff sections, the service started with `flags`; the service's
    also says how long the pair took to start and how each exited (a process that does not
    stop cleanly fails it)."""
    with Served(settings, *flags) as served:
        sections = {
            "service": guarded(lambda: check_service(served, settings)),
            "circuit_diff": guarded(lambda: check_diff(served, settings)),
        }
    service = sections["service"]
    service["start_seconds"] = served.start_seconds
    service["exit_status"] = served.exit_status
    if any(status != 0 for status in served.exit_status.values()):
        service["ok"] = False
        service["summary"] += f"; exit status {served.exit_status}"
    return sections
