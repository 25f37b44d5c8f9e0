"""compose.yaml, validated by the real compose v2 binary (no docker engine runs here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import compose

ROOT = Path(__file__).resolve().parent.parent
# The package's wrapper script always exits 0; the binary beside it reports errors.
BINARY = Path(compose.__file__).parent / "docker-compose"


def _config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BINARY), "-f", str(path), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_is_valid() -> None:
    result = _config(ROOT / "compose.yaml")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert {"jaeger", "gpu-service"} <= services.keys()
    gpu = services["gpu-service"]
    assert not gpu.get("ports"), "the GPU service port must stay inside the compose network"
    assert gpu["healthcheck"]["test"][0] == "CMD"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert any(p["target"] == 16686 for p in services["jaeger"]["ports"])
    cp = services["control-plane"]
    assert cp["depends_on"]["gpu-service"]["condition"] == "service_healthy"
    assert [p["published"] for p in cp["ports"]] == ["50050"]
    assert "gpu-service:50051" in cp["command"]


def test_binary_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    assert _config(broken).returncode != 0
