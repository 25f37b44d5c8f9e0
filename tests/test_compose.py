"""compose.yaml, validated by the real compose v2 binary (no docker engine runs here), and
the invariants a deployment relies on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import compose
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The package's wrapper script always exits 0; the binary beside it reports errors.
BINARY = Path(compose.__file__).parent / "docker-compose"
HTTP_PORT = "8000"  # the control plane's OpenAI-compatible API


def _config(*files: Path) -> subprocess.CompletedProcess:
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run(
        [str(BINARY), *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def services() -> dict:
    result = _config(ROOT / "compose.yaml")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def test_services_and_ports(services: dict) -> None:
    assert set(services) == {"jaeger", "gpu-service", "control-plane"}
    assert not services["gpu-service"].get("ports"), "the GPU service port stays internal"
    published = [p["published"] for p in services["control-plane"]["ports"]]
    assert published == ["50050", "9464", HTTP_PORT]
    assert [p["target"] for p in services["jaeger"]["ports"]] == [16686]
    assert "2." in services["jaeger"]["image"].rsplit(":", 1)[1], "Jaeger v2"


def test_gpu_only_on_the_model_service(services: dict) -> None:
    devices = services["gpu-service"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": 1}]
    for name in ("jaeger", "control-plane"):
        assert "deploy" not in services[name]


def test_health_and_startup_order(services: dict) -> None:
    for name, port in (("gpu-service", "50051"), ("control-plane", "50050")):
        svc = services[name]
        assert svc["healthcheck"]["test"][0] == "CMD"
        assert svc["environment"]["MET_HEALTH_TARGET"] == f"localhost:{port}"
    deps = services["control-plane"]["depends_on"]
    assert deps["gpu-service"]["condition"] == "service_healthy"
    assert "gpu-service:50051" in services["control-plane"]["command"]


def test_both_export_to_jaeger(services: dict) -> None:
    for name in ("gpu-service", "control-plane"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_SERVICE_NAME"] == name


def test_the_control_plane_serves_http_on_its_published_port(services: dict) -> None:
    command = services["control-plane"]["command"]
    assert command[command.index("--http-port") + 1] == HTTP_PORT
    assert "--host" in command and command[command.index("--host") + 1] == "0.0.0.0"


def test_cpu_variant_reserves_no_gpu() -> None:
    result = _config(ROOT / "compose.yaml", ROOT / "compose.cpu.yaml")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert "deploy" not in services["gpu-service"]
    assert HTTP_PORT in [p["published"] for p in services["control-plane"]["ports"]]


def test_dockerfile_installs_as_the_readme() -> None:
    install = "python3 -m venv .venv && .venv/bin/pip install"
    assert install in (ROOT / "Dockerfile").read_text()
    assert install in (ROOT / "README.md").read_text()


def test_binary_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    assert _config(broken).returncode != 0
