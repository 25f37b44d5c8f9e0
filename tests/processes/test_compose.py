"""compose.yaml alone, with compose.replicas.yaml, with compose.cpu.yaml and with the profiles
`tp` and `observability`, validated by the real compose v2 binary (no docker engine runs
here), and the invariants a deployment relies on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# The package's wrapper script always exits 0; the binary beside it reports errors.
BINARY = Path(compose.__file__).parent / "docker-compose"
BASE = ROOT / "compose.yaml"
REPLICAS = ROOT / "compose.replicas.yaml"
CPU = ROOT / "compose.cpu.yaml"
DEPLOY = ROOT / "deploy"
HTTP_PORT = "8000"  # the control plane's OpenAI-compatible API
METRICS_PORT = "9464"
TP_SIZE = "MET_TP_SIZE"  # the tensor-parallel service's GPUs, one rank each
# The bundled model in the image: the Dockerfile's WORKDIR, then the repository's path.
BUNDLED = "/app/gpu_service/models/default"
# Read by the files: each test sets the ones it means, and the user's own never leak in.
VARIABLES = (TP_SIZE, "MET_MODEL", "MET_MODEL_DIR", "HF_HOME", "HF_HUB_OFFLINE", "MET_ADMIN_KEY")


def _config(
    *files: Path, profiles: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    args = [a for f in files for a in ("-f", str(f))]
    args += [a for p in profiles for a in ("--profile", p)]
    base = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    return subprocess.run(
        [str(BINARY), *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=base | (env or {}),
    )


def _services(
    *files: Path, profiles: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> dict:
    result = _config(*files, profiles=profiles, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def _replicas(services: dict) -> dict[str, str]:
    """GPU-service name -> the address the control plane dials, from each one's command."""
    out = {}
    for name, svc in services.items():
        command = svc.get("command") or []
        if command[:3] == ["met", "gpu-service", "serve"]:
            out[name] = f"{name}:{command[command.index('--port') + 1]}"
    return out


def _devices(svc: dict) -> list[dict]:
    return svc["deploy"]["resources"]["reservations"]["devices"]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _mounts(svc: dict) -> dict[str, dict]:
    """A service's bind mounts by their target."""
    return {v["target"]: v for v in svc.get("volumes", [])}


@pytest.fixture(scope="module")
def services() -> dict:
    return _services(BASE)


@pytest.fixture(scope="module")
def replica_services() -> dict:
    return _services(BASE, REPLICAS)


@pytest.fixture(scope="module", params=["one", "replicas"])
def stack(request: pytest.FixtureRequest) -> dict:
    """compose.yaml alone, and with compose.replicas.yaml: what holds for both."""
    return _services(BASE, *([REPLICAS] if request.param == "replicas" else []))


@pytest.fixture(scope="module")
def cpu_services() -> dict:
    return _services(BASE, CPU)


@pytest.fixture(scope="module")
def observability() -> dict:
    return _services(BASE, profiles=("observability",))


def test_compose_yaml_alone_is_one_gpu_service_on_gpu_0(services: dict) -> None:
    assert _replicas(services) == {"gpu-service-0": "gpu-service-0:50051"}
    assert set(services) == {"jaeger", "gpu-service-0", "control-plane"}
    reserved = [d for svc in services.values() if "deploy" in svc for d in _devices(svc)]
    assert reserved == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}], (
        "exactly one GPU, device 0"
    )


def test_the_control_plane_alone_waits_for_and_dials_its_one_service(services: dict) -> None:
    control = services["control-plane"]
    assert _flag(control["command"], "--gpu-service") == "gpu-service-0:50051"
    deps = control["depends_on"]
    assert set(deps) == {"gpu-service-0", "jaeger"}
    assert deps["gpu-service-0"]["condition"] == "service_healthy"
    assert deps["jaeger"]["condition"] == "service_started"


def test_the_replicas_file_adds_a_service_on_gpu_1(services: dict, replica_services: dict) -> None:
    replicas = _replicas(replica_services)
    assert replicas == {
        "gpu-service-0": "gpu-service-0:50051",
        "gpu-service-1": "gpu-service-1:50051",
    }
    assert set(replica_services) == set(services) | {"gpu-service-1"}
    assert [_devices(replica_services[n])[0]["device_ids"] for n in replicas] == [["0"], ["1"]]
    assert replica_services["gpu-service-0"] == services["gpu-service-0"], "the first unchanged"
    control, alone = replica_services["control-plane"], services["control-plane"]
    assert _flag(control["command"], "--gpu-service") == "gpu-service-0:50051,gpu-service-1:50051"
    listed = _flag(alone["command"], "--gpu-service")
    both = [
        a if a != listed else _flag(control["command"], "--gpu-service") for a in alone["command"]
    ]
    assert control["command"] == both, "only the list differs"
    deps = control["depends_on"]
    assert set(deps) == {"gpu-service-0", "gpu-service-1", "jaeger"}
    assert {deps[n]["condition"] for n in replicas} == {"service_healthy"}
    for key in ("ports", "environment", "healthcheck", "build"):
        assert control[key] == alone[key], key


def test_services_and_ports(stack: dict) -> None:
    replicas = _replicas(stack)
    assert set(stack) == {"jaeger", "control-plane", *replicas}
    for name in replicas:
        assert not stack[name].get("ports"), "the GPU service port stays internal"
    published = [p["published"] for p in stack["control-plane"]["ports"]]
    assert published == ["50050", METRICS_PORT, HTTP_PORT]
    assert [p["target"] for p in stack["jaeger"]["ports"]] == [16686]
    assert "2." in stack["jaeger"]["image"].rsplit(":", 1)[1], "Jaeger v2"


def test_each_replica_reserves_its_own_gpu(stack: dict) -> None:
    ids = []
    for name in _replicas(stack):
        (device,) = _devices(stack[name])
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "count" not in device, "a count would give every replica the first GPU"
        ids += device["device_ids"]
    assert ids == [str(i) for i in range(len(_replicas(stack)))], ids


def test_gpu_only_on_the_model_services(stack: dict) -> None:
    for name in ("jaeger", "control-plane"):
        assert "deploy" not in stack[name]


def test_replicas_differ_only_in_name_device_and_service_name(replica_services: dict) -> None:
    def shared(svc: dict) -> dict:
        env = {k: v for k, v in svc["environment"].items() if k != "OTEL_SERVICE_NAME"}
        return {**{k: v for k, v in svc.items() if k != "deploy"}, "environment": env}

    first, *rest = [shared(replica_services[name]) for name in _replicas(replica_services)]
    assert rest and all(other == first for other in rest)


def test_the_control_plane_dials_every_replica(stack: dict) -> None:
    listed = _flag(stack["control-plane"]["command"], "--gpu-service").split(",")
    assert sorted(listed) == sorted(_replicas(stack).values())


def test_health_and_startup_order(stack: dict) -> None:
    checked = {**dict.fromkeys(_replicas(stack), "50051"), "control-plane": "50050"}
    for name, port in checked.items():
        svc = stack[name]
        assert svc["healthcheck"]["test"][0] == "CMD"
        assert svc["environment"]["MET_HEALTH_TARGET"] == f"localhost:{port}"
    deps = stack["control-plane"]["depends_on"]
    assert {n for n, d in deps.items() if d["condition"] == "service_healthy"} == set(
        _replicas(stack)
    )


def test_a_large_model_has_minutes_to_load(services: dict) -> None:
    """The first SERVING answer ends the wait; failures before it count only after this."""
    assert services["gpu-service-0"]["healthcheck"]["start_period"] == "20m0s"


def test_every_service_exports_to_jaeger(stack: dict) -> None:
    for name in (*_replicas(stack), "control-plane"):
        env = stack[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_SERVICE_NAME"] == name


def test_the_control_plane_serves_http_on_its_published_port(services: dict) -> None:
    command = services["control-plane"]["command"]
    assert _flag(command, "--http-port") == HTTP_PORT
    assert _flag(command, "--host") == "0.0.0.0"


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


def test_the_gpu_stack_serves_on_cuda_from_cuda_wheels(stack: dict) -> None:
    for name in _replicas(stack):
        assert _flag(stack[name]["command"], "--device") == "cuda"
    for name in (*_replicas(stack), "control-plane"):
        assert "/whl/cu" in _index_url(stack[name]), name


def test_the_default_model_is_the_bundled_one_in_the_image(stack: dict) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    assert "WORKDIR /app" in dockerfile and "COPY gpu_service gpu_service" in dockerfile
    relative = Path(BUNDLED).relative_to("/app")
    assert (ROOT / relative / "config.json").is_file()
    for name in _replicas(stack):
        assert _flag(stack[name]["command"], "--model") == BUNDLED


def test_met_model_names_every_services_model() -> None:
    model = "Qwen/Qwen3-Next-80B-A3B-Instruct"
    for files, profiles in (((BASE, REPLICAS), ("tp",)), ((BASE, REPLICAS, CPU), ("replicas",))):
        found = _services(*files, profiles=profiles, env={"MET_MODEL": model})
        models = {n: _flag(found[n]["command"], "--model") for n in _replicas(found)}
        assert len(models) >= 2 and set(models.values()) == {model}, (files, models)


def test_the_hf_cache_and_the_model_dir_are_mounted_read_only(tmp_path: Path) -> None:
    """Defaults: the user's ~/.cache/huggingface and the repository's models folder, both of
    which exist or are made empty; set, the host's HF_HOME and MET_MODEL_DIR."""
    home = Path.home() / ".cache" / "huggingface"
    for env, cache, models in (
        ({}, home, ROOT / "gpu_service" / "models"),
        (
            {"HF_HOME": str(tmp_path / "hf"), "MET_MODEL_DIR": str(tmp_path)},
            tmp_path / "hf",
            tmp_path,
        ),
    ):
        for name, svc in _services(BASE, REPLICAS, env=env).items():
            if name not in ("gpu-service-0", "gpu-service-1"):
                assert not svc.get("volumes"), name
                continue
            mounts = _mounts(svc)
            hf = mounts[svc["environment"]["HF_HOME"]]
            assert Path(hf["source"]) == cache and hf["read_only"], name
            assert Path(mounts["/models"]["source"]) == models and mounts["/models"]["read_only"]
            assert svc["environment"]["HF_HUB_OFFLINE"] == "1", "a read-only cache: no downloads"


def test_cpu_variant_reserves_no_gpu(services: dict, cpu_services: dict) -> None:
    assert _replicas(cpu_services) == _replicas(services)
    assert set(cpu_services) == set(services), "its gpu-service-1 lines stay out"
    _same_but_on_the_cpu(services, cpu_services)


def test_cpu_variant_with_the_replicas_file(replica_services: dict) -> None:
    """compose.cpu.yaml last, with its profile `replicas`: both services on the CPU; without
    the profile compose refuses the stack rather than start it without gpu-service-1."""
    cpu = _services(BASE, REPLICAS, CPU, profiles=("replicas",))
    assert set(cpu) == set(replica_services)
    assert _replicas(cpu) == _replicas(replica_services)
    _same_but_on_the_cpu(replica_services, cpu)
    refused = _config(BASE, REPLICAS, CPU)
    assert refused.returncode != 0 and "gpu-service-1" in refused.stderr


def _same_but_on_the_cpu(gpu: dict, cpu: dict) -> None:
    for name in cpu:
        assert "deploy" not in cpu[name], name
    for name in _replicas(cpu):
        assert _flag(cpu[name]["command"], "--device") == "cpu"
        without = [a for a in cpu[name]["command"] if a not in ("--device", "cpu")]
        assert without == [a for a in gpu[name]["command"] if a not in ("--device", "cuda")]
        for key in ("environment", "healthcheck", "volumes", "depends_on"):
            assert cpu[name][key] == gpu[name][key], (name, key)
    for name in (*_replicas(cpu), "control-plane"):
        assert _index_url(cpu[name]).endswith("/whl/cpu"), name
    assert cpu["control-plane"]["command"] == gpu["control-plane"]["command"]
    assert HTTP_PORT in [p["published"] for p in cpu["control-plane"]["ports"]]


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
    tp = _services(BASE, profiles=("tp",), env={TP_SIZE: size} if size else {})
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
    assert gpu["volumes"] == replica["volumes"]
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
    # Prometheus's one target, `control-plane:9464`, reaches it in place of the plain one.
    assert control["networks"]["default"]["aliases"] == ["control-plane"]


def test_observability_is_a_profile(services: dict, observability: dict) -> None:
    added = {"prometheus", "grafana"}
    assert set(observability) == set(services) | added and not added & set(services)
    for name in added:
        assert observability[name]["profiles"] == ["observability"]
        assert "deploy" not in observability[name]
    both = _services(BASE, REPLICAS, profiles=("observability",))
    assert set(both) == set(observability) | {"gpu-service-1"}


def _read_only_source(svc: dict, target: str) -> Path:
    mount = _mounts(svc)[target]
    assert mount["type"] == "bind" and mount["read_only"], target
    source = Path(mount["source"])
    assert source.is_relative_to(DEPLOY) and source.exists(), source
    return source


def test_prometheus_scrapes_the_control_planes_metrics(observability: dict) -> None:
    prometheus = observability["prometheus"]
    config = yaml.safe_load(
        _read_only_source(prometheus, "/etc/prometheus/prometheus.yml").read_text()
    )
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (static,) = job["static_configs"]
    port = _flag(observability["control-plane"]["command"], "--metrics-port")
    assert static["targets"] == [f"control-plane:{port}"]
    assert [p["target"] for p in prometheus["ports"]] == [9090]
    assert prometheus["image"].startswith("prom/prometheus:v3.")


def test_grafana_provisions_the_data_source_and_the_dashboard(observability: dict) -> None:
    grafana = observability["grafana"]
    assert grafana["image"].startswith("grafana/grafana:")
    provisioning = _read_only_source(grafana, "/etc/grafana/provisioning")
    (source_file,) = (provisioning / "datasources").glob("*.yml")
    (datasource,) = yaml.safe_load(source_file.read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    assert datasource["url"] == "http://prometheus:9090"
    (provider_file,) = (provisioning / "dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    assert provider["type"] == "file"
    # The provider reads the folder compose mounts, which holds the dashboard.
    folder = provider["options"]["path"]
    dashboards = _read_only_source(grafana, folder)
    dashboard = json.loads((dashboards / "met.json").read_text())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{folder}/met.json"
    queries = [t for p in dashboard["panels"] for t in [p, *p.get("targets", [])]]
    queries += dashboard["templating"]["list"]
    uids = {t["datasource"]["uid"] for t in queries if "datasource" in t}
    assert uids == {datasource["uid"]}, "every panel, query and variable on the provisioned source"
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_started"
    assert [p["target"] for p in grafana["ports"]] == [3000]


def test_binary_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    assert _config(broken).returncode != 0


def test_prefix_caching_is_on_in_every_gpu_service(stack: dict, cpu_services: dict) -> None:
    """Room for 32 prefix snapshots unless MET_PREFIX_SNAPSHOTS says otherwise; the control
    plane's prefix cache is on by default, so this turns it on."""
    for services in (stack, cpu_services):
        for name in _replicas(services):
            assert _flag(services[name]["command"], "--prefix-snapshots") == "32", name
    tp = _services(BASE, profiles=("tp",), env={"MET_PREFIX_SNAPSHOTS": "0"})
    for name in _replicas(tp):
        assert _flag(tp[name]["command"], "--prefix-snapshots") == "0", name
