"""One port, one server, and the command line around it: a port in use ends each server, and
`met up`, with status 2 and one sentence naming the port and its flag before a model loads;
`met up` shapes its GPU services with the service's own flags; `met --help` imports no
command; an unknown flag gets the command's usage and the closest flag."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpu_service.rpc.options import SHAPE_FLAGS, UP_PREFIX_SNAPSHOTS, shape_argv
from met.main import build_parser
from protos import ports, tls
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _met(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "met", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_a_busy_port_is_refused_with_its_flag(busy_port: int) -> None:
    with pytest.raises(tls.FlagError) as refused:
        ports.check_free(
            "127.0.0.1", {"--port": 0, "--metrics-port": None, "--http-port": busy_port}
        )
    assert str(refused.value) == f"port {busy_port} (--http-port) is in use by another process"


def test_a_grpc_server_shares_no_port() -> None:
    """gRPC reuses ports by default; `ports.EXCLUSIVE` servers refuse one another's."""

    async def bind_twice() -> None:
        first = grpc.aio.server(options=ports.EXCLUSIVE)
        port = tls.add_port(first, "127.0.0.1:0", None)
        second = grpc.aio.server(options=ports.EXCLUSIVE)
        with pytest.raises(tls.FlagError, match=f"port {port} \\(--metrics-port\\)"):
            tls.add_port(second, f"127.0.0.1:{port}", None, "--metrics-port")

    asyncio.run(bind_twice())


# Slow: starts each server process on a busy port.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("gpu-service", "serve", "--port", "{port}"), "--port"),
        (("control-plane", "serve", "--gpu-service", "127.0.0.1:1", "--port", "{port}"), "--port"),
        (
            ("control-plane", "serve", "--gpu-service", "x:1", "--http-port", "{port}"),
            "--http-port",
        ),
        (("up", "--port", "{port}"), "--port"),
        (("up", "--port", "0", "--http-port", "{port}"), "--http-port"),
        (("up", "--port", "0", "--http-port", "0", "--metrics-port", "{port}"), "--metrics-port"),
    ],
    ids=["gpu-service", "control-plane", "control-plane-http", "up", "up-http", "up-metrics"],
)
def test_a_second_server_on_a_busy_port_exits_2_before_loading(
    busy_port: int, argv: tuple[str, ...], flag: str
) -> None:
    """Nothing on stdout: no memory plan, no child started, no model loaded."""
    done = _met(*(a.format(port=busy_port) for a in argv))
    prog = "met " + " ".join(argv[: 1 if argv[0] == "up" else 2])
    assert done.returncode == 2
    assert done.stderr == f"{prog}: error: port {busy_port} ({flag}) is in use by another process\n"
    assert done.stdout == ""


# Slow: starts met up and its GPU service process.
@pytest.mark.slow
def test_up_on_a_bad_path_says_one_sentence() -> None:
    done = _met("up", "--model", "/nonexistent", "--port", "0", "--http-port", "0")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["met gpu-service serve: error: /nonexistent does not exist"]
    assert "Traceback" not in done.stderr


# Slow: starts met up, both processes.
@pytest.mark.slow
def test_up_serves_a_repeated_prefix_from_the_cache() -> None:
    """`met up` as the README runs it (on free ports): the second of two requests with one
    600-token prompt is given its prefix by the prefix cache (whole blocks of 64). A Ctrl-C,
    which reaches the whole process group, then stops both processes cleanly."""
    argv = ["up", "--port", "0", "--http-port", "0"]
    cmd = [sys.executable, "-m", "met", *argv]
    pipe, quiet = subprocess.PIPE, subprocess.DEVNULL
    up = subprocess.Popen(
        cmd, stdout=pipe, stderr=quiet, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        assert up.stdout is not None
        line = next((line for line in up.stdout if "control-plane listening on" in line), "")
        target = line.split("listening on ", 1)[1].split()[0]
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            ask = pb.GenerateRequest(prompt_token_ids=[i % 200 + 10 for i in range(600)])
            ask.max_new_tokens = 2
            for _ in range(2):
                list(stub.Generate(ask, timeout=60))
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.prefix_cache_hits >= 512, stats
    finally:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(30) == 0
    assert "gpu-service exited with status 0" in up.stdout.read()


def test_up_passes_the_shaping_flags_with_prefix_snapshots_as_compose() -> None:
    compose = (ROOT / "compose.yaml").read_text()
    assert re.findall(r"MET_PREFIX_SNAPSHOTS:-(\d+)", compose) == [str(UP_PREFIX_SNAPSHOTS)] * 2
    default = shape_argv(build_parser().parse_args(["up"]))
    assert default[default.index("--prefix-snapshots") + 1] == str(UP_PREFIX_SNAPSHOTS)
    shaped = ["--device", "cpu", "--tp", "2", "--expert-parallel", "--max-context", "2048"]
    drafter = ["--drafter", "some/dflash"]
    argv = shape_argv(
        build_parser().parse_args(
            ["up", *drafter, *shaped, "--kv-blocks", "auto", "--prefix-snapshots", "4"]
            + ["--no-compile"]
        )
    )
    assert argv == [
        "--drafter", "some/dflash", "--device", "cpu", "--tensor-parallel-size", "2",
        "--expert-parallel", "--max-context", "2048", "--kv-blocks", "auto",
        "--prefix-snapshots", "4", "--no-compile",
    ]  # fmt: skip
    assert [a for a in argv if a.startswith("--")] == list(SHAPE_FLAGS[:-1]) + ["--no-compile"]
    serve = build_parser().parse_args(["gpu-service", "serve", *argv])
    assert serve.compile is False and serve.expert_parallel and shape_argv(serve) == argv
    assert "--compile" in shape_argv(build_parser().parse_args(["up", "--compile"]))
    for switch in ("compile", "expert-parallel"):
        assert switch not in " ".join(default), "unset: the service's own default"


def test_in_process_commands_take_the_services_threads() -> None:
    parse = build_parser().parse_args
    assert parse(["circuit", "diff", "--verify-batch"]).threads == 1
    assert parse(["bench", "--threads", "2"]).threads == 2
    assert parse(["gpu-service", "serve"]).threads == 1


@pytest.mark.parametrize(
    ("argv", "heavy"),
    [
        (["--help"], {"torch", "grpc", "transformers", "numpy"}),
        (["generate", "--help"], {"torch", "transformers", "numpy", "control_plane.cli.server"}),
    ],
    ids=["met", "generate"],
)
def test_help_imports_no_command(argv: list[str], heavy: set[str]) -> None:
    """`met --help` imports no command's module; the client imports no server."""
    probe = (
        "import sys, contextlib, io\n"
        "from met.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        f"    main({argv!r})\n"
        f"print(sorted({heavy!r} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout == "[]\n", done.stderr


@pytest.mark.parametrize(
    ("argv", "usage", "unknown", "hint"),
    [
        (["gpu-service", "serve", "--prot", "5"], "met gpu-service serve", "--prot 5", "--port"),
        (["up", "--max-contxt", "64"], "met up", "--max-contxt 64", "--max-context"),
        (
            ["generate", "hi", "--max-new-tokns=5"],
            "met generate",
            "--max-new-tokns=5",
            "--max-new-tokens",
        ),
    ],
    ids=["serve", "up", "generate"],
)
def test_an_unknown_flag_gets_the_commands_usage_and_the_closest_flag(
    argv: list[str], usage: str, unknown: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ")
    assert err.endswith(
        f"{usage}: error: unrecognized arguments: {unknown} (did you mean {hint}?)\n"
    )
