"""compose.yaml, validated by the real compose v2 binary (no docker engine runs here), and
the invariants a deployment relies on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import compose
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The package's wrapper script always exits 0; the binary beside it reports errors.
BINARY = Path(compose.__file__).parent / "docker-compose"
HTTP_PORT = "8000"  # the control plane's OpenAI-compatible API
TP_SIZE = "MET_TP_SIZE"  # the tensor-parallel service's GPUs, one rank each


def _config(
    *files: Path, profile: str | None = None, tp_size: str | None = None
) -> subprocess.CompletedProcess:
    args = [a for f in files for a in ("-f", str(f))]
    args += ["--profile", profile] if profile else []
    env = {k: v for k, v in os.environ.items() if k != TP_SIZE}
    env |= {TP_SIZE: tp_size} if tp_size else {}
    return subprocess.run(
        [str(BINARY), *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _services(*files: Path, profile: str | None = None, tp_size: str | None = None) -> dict:
    result = _config(*files, profile=profile, tp_size=tp_size)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def _replicas(services: dict) -> dict[str, str]:
    """GPU-service replica name -> the address the control plane dials, from each one's command."""
    out = {}
    for name, svc in services.items():
        command = svc.get("command") or []
        if command[:3] == ["met", "gpu-service", "serve"]:
            out[name] = f"{name}:{command[command.index('--port') + 1]}"
    return out


def _devices(svc: dict) -> list[dict]:
    return svc["deploy"]["resources"]["reservations"]["devices"]


@pytest.fixture(scope="module")
def services() -> dict:
    return _services(ROOT / "compose.yaml")


@pytest.fixture(scope="module")
def cpu_services() -> dict:
    return _services(ROOT / "compose.yaml", ROOT / "compose.cpu.yaml")


def test_services_and_ports(services: dict) -> None:
    replicas = _replicas(services)
    assert len(replicas) >= 2
    assert set(services) == {"jaeger", "control-plane", *replicas}
    for name in replicas:
        assert not services[name].get("ports"), "the GPU service port stays internal"
    published = [p["published"] for p in services["control-plane"]["ports"]]
    assert published == ["50050", "9464", HTTP_PORT]
    assert [p["target"] for p in services["jaeger"]["ports"]] == [16686]
    assert "2." in services["jaeger"]["image"].rsplit(":", 1)[1], "Jaeger v2"


def test_each_replica_reserves_its_own_gpu(services: dict) -> None:
    ids = []
    for name in _replicas(services):
        (device,) = _devices(services[name])
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "count" not in device, "a count would give every replica the first GPU"
        ids += device["device_ids"]
    assert len(ids) == len(_replicas(services)) == len(set(ids)), ids


def test_gpu_only_on_the_model_services(services: dict) -> None:
    for name in ("jaeger", "control-plane"):
        assert "deploy" not in services[name]


def test_replicas_differ_only_in_name_device_and_service_name(services: dict) -> None:
    def shared(svc: dict) -> dict:
        env = {k: v for k, v in svc["environment"].items() if k != "OTEL_SERVICE_NAME"}
        return {**{k: v for k, v in svc.items() if k != "deploy"}, "environment": env}

    first, *rest = [shared(services[name]) for name in _replicas(services)]
    assert all(other == first for other in rest)


def test_the_control_plane_dials_every_replica(services: dict) -> None:
    command = services["control-plane"]["command"]
    listed = command[command.index("--gpu-service") + 1].split(",")
    assert sorted(listed) == sorted(_replicas(services).values())


def test_health_and_startup_order(services: dict) -> None:
    checked = {**dict.fromkeys(_replicas(services), "50051"), "control-plane": "50050"}
    for name, port in checked.items():
        svc = services[name]
        assert svc["healthcheck"]["test"][0] == "CMD"
        assert svc["environment"]["MET_HEALTH_TARGET"] == f"localhost:{port}"
    deps = services["control-plane"]["depends_on"]
    for name in _replicas(services):
        assert deps[name]["condition"] == "service_healthy"


def test_every_service_exports_to_jaeger(services: dict) -> None:
    for name in (*_replicas(services), "control-plane"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_SERVICE_NAME"] == name


def test_the_control_plane_serves_http_on_its_published_port(services: dict) -> None:
    command = services["control-plane"]["command"]
    assert command[command.index("--http-port") + 1] == HTTP_PORT
    assert "--host" in command and command[command.index("--host") + 1] == "0.0.0.0"


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _index_url(svc: dict) -> str:
    """The TORCH_INDEX_URL a service's image is built with: its build argument, else the
    Dockerfile's default."""
    args = svc["build"].get("args") or {}
    if "TORCH_INDEX_URL" in args:
        return args["TORCH_INDEX_URL"]
    (line,) = [
        x for x in (ROOT / "Dockerfile").read_text().splitlines() if x.startswith("ARG TORCH_")
    ]
    return line.split("=", 1)[1]


def test_the_gpu_stack_serves_on_cuda_from_cuda_wheels(services: dict) -> None:
    for name in _replicas(services):
        assert _flag(services[name]["command"], "--device") == "cuda"
    for name in (*_replicas(services), "control-plane"):
        assert "/whl/cu" in _index_url(services[name]), name


def test_cpu_variant_reserves_no_gpu(services: dict, cpu_services: dict) -> None:
    assert _replicas(cpu_services) == _replicas(services)
    for name in cpu_services:
        assert "deploy" not in cpu_services[name], name
    for name in _replicas(cpu_services):
        assert _flag(cpu_services[name]["command"], "--device") == "cpu"
        without = [a for a in cpu_services[name]["command"] if a not in ("--device", "cpu")]
        assert without == [a for a in services[name]["command"] if a not in ("--device", "cuda")]
    for name in (*_replicas(cpu_services), "control-plane"):
        assert _index_url(cpu_services[name]).endswith("/whl/cpu"), name
    assert cpu_services["control-plane"]["command"] == services["control-plane"]["command"]
    assert HTTP_PORT in [p["published"] for p in cpu_services["control-plane"]["ports"]]


def test_dockerfile_installs_as_the_readme() -> None:
    install = "python3 -m venv .venv && .venv/bin/pip install"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert install in dockerfile
    assert install in (ROOT / "README.md").read_text()
    assert '--extra-index-url "$TORCH_INDEX_URL" -e .' in dockerfile, "torch's build: the arg"
    assert "gcc" in dockerfile, "Triton builds its driver with a C compiler"


@pytest.mark.parametrize("size", [None, "4"], ids=["default", "four"])
def test_the_tensor_parallel_profile_reserves_n_gpus(services: dict, size: str | None) -> None:
    """One service over N GPUs (`count: N`, `--tensor-parallel-size N`), and a control plane
    that dials it alone; a plain `up` starts neither."""
    tp = _services(ROOT / "compose.yaml", profile="tp", tp_size=size)
    added = {"gpu-service-tp", "control-plane-tp"}
    assert set(tp) == set(services) | added and not added & set(services)
    n = size or "2"
    gpu, control = tp["gpu-service-tp"], tp["control-plane-tp"]
    assert gpu["profiles"] == control["profiles"] == ["tp"]
    (device,) = _devices(gpu)
    assert device["count"] == int(n) and "device_ids" not in device
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert _flag(gpu["command"], "--tensor-parallel-size") == n
    assert int(gpu["shm_size"]) >= 2**30, "NCCL's shared memory between the ranks"
    replica = services["gpu-service-0"]
    without = [a for a in gpu["command"] if a not in ("--tensor-parallel-size", n)]
    assert without == replica["command"]
    assert gpu["healthcheck"] == replica["healthcheck"]
    assert gpu["environment"] == {**replica["environment"], "OTEL_SERVICE_NAME": "gpu-service-tp"}
    assert _flag(control["command"], "--gpu-service") == "gpu-service-tp:50051"
    assert control["depends_on"]["gpu-service-tp"]["condition"] == "service_healthy"
    assert set(control["depends_on"]) == {"gpu-service-tp", "jaeger"}
    plain = services["control-plane"]
    for key in ("ports", "environment", "healthcheck", "build"):
        assert control[key] == plain[key], key
    listed = _flag(plain["command"], "--gpu-service")
    dials = [a if a != listed else "gpu-service-tp:50051" for a in plain["command"]]
    assert control["command"] == dials


def test_binary_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    assert _config(broken).returncode != 0
