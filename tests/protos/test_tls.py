"""TLS and API keys, with certificates made here: a CA, a server certificate for localhost and
127.0.0.1, a client certificate. The generation API runs in this process over an engine;
the last test runs both service processes under mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from control_plane.admission.auth import bearer
from control_plane.cli import generate as generate_command
from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.cli.server import PROG, build_server, read_security
from control_plane.fronts.api import GenerationServicer
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.rpc.options import Access
from gpu_service.rpc.server import build_server as build_gpu_server
from gpu_service.rpc.servicer import ModelServicer
from met.main import build_parser
from protos import tls
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import SERVE_ARGS, TINY_SERVICE
from tests.servers import aio_server_in_thread

KEY = "sk-test-1"
SHORT = pb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_new_tokens=3, ignore_eos=True)


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def read(self, *paths: Path) -> list[bytes]:
        return [p.read_bytes() for p in paths]

    def client(self, with_cert: bool = False) -> grpc.ChannelCredentials:
        ca, key, cert = self.read(self.ca, self.client_key, self.client_cert)
        if not with_cert:
            return grpc.ssl_channel_credentials(ca)
        return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)


def _issue(
    directory: Path, name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, **ext
) -> tuple[x509.Name, ec.EllipticCurvePrivateKey]:
    """A certificate for `name` (self-signed when `issuer` is None) and its key, as PEM files
    `{name}.pem` and `{name}.key` in `directory`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    for extension in ext.values():
        builder = builder.add_extension(extension, critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return subject, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    ca = _issue(d, "ca", None)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _issue(
        d,
        "server",
        ca,
        san=x509.SubjectAlternativeName(names),
        eku=x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
    )
    _issue(d, "client", ca, eku=x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]))
    return Certs(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key"
    )


def serve_argv(certs: Certs, *extra: str) -> list[str]:
    return [
        "control-plane",
        "serve",
        "--gpu-service",
        "127.0.0.1:1",
        *("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)),
        *extra,
    ]


@pytest.fixture(scope="module")
def target(certs: Certs, tiny_dir: Path) -> Iterator[str]:
    """The generation API over TLS with one API key, on a grpc.aio server in a thread, over an
    in-process engine; its security read from `met control-plane serve` flags."""
    args = build_parser().parse_args(serve_argv(certs, "--api-key", KEY))
    security = read_security(args, PROG)
    engine = Engine(tiny_dir, TINY_SERVICE)
    scheduler = Scheduler(lambda: engine, ByteTokenizer.default())
    scheduler.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        servicer = GenerationServicer(scheduler)
        health_servicer = health.aio.HealthServicer()
        server = build_server(servicer, health_servicer, security.api_keys)
        port = tls.add_port(server, "127.0.0.1:0", security.server)
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return server, port

    with aio_server_in_thread(start) as target:
        yield target
    scheduler.stop()


def generate(channel: grpc.Channel, metadata=None) -> list[int]:
    stub = pb_grpc.GenerationServiceStub(channel)
    return [t for msg in stub.Generate(SHORT, timeout=30, metadata=metadata) for t in msg.token_ids]


def refused(channel: grpc.Channel, metadata=None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        generate(channel, metadata)
    return caught.value


def test_tls_client_with_the_ca_succeeds(target: str, certs: Certs) -> None:
    with tls.open_channel(target, certs.client()) as channel:
        assert len(generate(channel, bearer(KEY))) == 3


def test_plaintext_client_fails(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        assert refused(channel, bearer(KEY)).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        (None, "requires an API key"),
        ((("authorization", "Bearer wrong"),), "not one this server accepts"),
        ((("authorization", KEY),), "not of the form `Bearer <key>`"),
    ],
    ids=["no-key", "wrong-key", "no-scheme"],
)
def test_generation_without_a_valid_key_is_unauthenticated(
    target: str, certs: Certs, metadata, words: str
) -> None:
    with tls.open_channel(target, certs.client()) as channel:
        error = refused(channel, metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert words in error.details()
        stats = pb_grpc.GenerationServiceStub(channel).GetStats
        with pytest.raises(grpc.RpcError) as caught:
            stats(pb.GetStatsRequest(), timeout=10, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_open_without_a_key(target: str, certs: Certs) -> None:
    with tls.open_channel(target, certs.client()) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert "met.v1.GenerationService" in services


def test_met_generate_sends_the_key(
    target: str, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "abc", "--target", target, "--tls-ca", str(certs.ca)]
    argv += ["--max-new-tokens", "2", "--ignore-eos"]
    assert generate_command.run(build_parser().parse_args([*argv, "--api-key", KEY])) == 0
    assert "[length] 3 prompt + 2 completion tokens" in capsys.readouterr().err
    assert generate_command.run(build_parser().parse_args(argv)) == 1
    assert "error: UNAUTHENTICATED: this API requires an API key" in capsys.readouterr().err


def test_key_file_one_key_a_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alpha\n\n  beta  \n")
    args = build_parser().parse_args(
        ["control-plane", "serve", "--gpu-service", "x:1", "--api-key", "gamma"]
        + ["--api-key-file", str(keys)]
    )
    assert read_security(args, PROG).api_keys == {"alpha", "beta", "gamma"}


# argv after `met control-plane serve --gpu-service x:1`, and words of the refusal's sentence;
# {cert}, {key}, {ca}, {client_cert} name the files made here, {missing} none, {empty} one empty.
REFUSALS = {
    "cert-without-key": ("--tls-cert {cert}", "--tls-cert needs --tls-key"),
    "key-without-cert": ("--tls-key {key}", "--tls-key needs --tls-cert"),
    "client-ca-without-cert": ("--tls-client-ca {ca}", "--tls-client-ca needs --tls-cert"),
    "unreadable-cert": ("--tls-cert {missing} --tls-key {key}", "--tls-cert {missing} cannot"),
    "not-pem": ("--tls-cert {empty} --tls-key {key}", "--tls-cert {empty} holds no PEM block"),
    "client-cert-without-key": (
        "--gpu-service-cert {client_cert}",
        "--gpu-service-cert needs --gpu-service-key",
    ),
    "unreadable-gpu-service-ca": ("--gpu-service-ca {missing}", "--gpu-service-ca {missing}"),
    "unreadable-key-file": ("--api-key-file {missing}", "--api-key-file {missing} cannot"),
    "empty-key-file": ("--api-key-file {empty}", "--api-key-file {empty} holds no key"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_inconsistent_flags_exit_2(
    certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    (tmp_path / "empty").write_text("")
    files = {
        "cert": certs.server_cert,
        "key": certs.server_key,
        "ca": certs.ca,
        "client_cert": certs.client_cert,
        "missing": tmp_path / "missing",
        "empty": tmp_path / "empty",
    }
    flags, words = (text.format(**files) for text in REFUSALS[case])
    argv = ["control-plane", "serve", "--gpu-service", "x:1", *flags.split()]
    with pytest.raises(SystemExit) as caught:
        read_security(build_parser().parse_args(argv), PROG)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG}: error: ") and words in err and err.count("\n") == 1


# Slow: starts each process.
@pytest.mark.slow
@pytest.mark.parametrize("process", ["control-plane", "gpu-service"])
def test_processes_refuse_a_cert_without_its_key(certs: Certs, process: str) -> None:
    """Both servers end with status 2 and the sentence, before they load anything."""
    argv = [process, "serve", "--port", "0", "--tls-cert", str(certs.server_cert)]
    if process == "control-plane":
        argv += ["--gpu-service", "127.0.0.1:1"]
    result = subprocess.run(
        [sys.executable, "-m", "met", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    sentence = "--tls-cert needs --tls-key: a certificate is served with its key."
    assert result.stderr == f"met {process} serve: error: {sentence}\n"


# Slow: both processes under mTLS.
@pytest.mark.slow
def test_mutual_tls_between_the_processes(certs: Certs, tiny_dir: Path) -> None:
    """The GPU service requires the control plane's client certificate; the control plane
    serves TLS with an API key. A client without a certificate cannot reach the GPU service."""
    server_tls = ("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key))
    mutual = ("--tls-client-ca", str(certs.ca))
    gpu, gpu_target = start_gpu_service(
        tiny_dir,
        *SERVE_ARGS,
        *server_tls,
        *mutual,
        credentials=certs.client(with_cert=True),
    )
    client_tls = ("--gpu-service-ca", str(certs.ca), "--gpu-service-key", str(certs.client_key))
    client_tls += ("--gpu-service-cert", str(certs.client_cert))
    try:
        cp, cp_target = start_control_plane(
            gpu_target,
            *("--tokenizer", str(tiny_dir), "--api-key", KEY),
            *client_tls,
            *server_tls,
            credentials=certs.client(),
        )
        try:
            with tls.open_channel(cp_target, certs.client()) as channel:
                assert len(generate(channel, bearer(KEY))) == 3
            with tls.open_channel(gpu_target, certs.client()) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                with pytest.raises(grpc.RpcError) as caught:
                    check(health_pb2.HealthCheckRequest(), timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            assert stop(cp) == 0
    finally:
        assert stop(gpu) == 0


def test_a_replica_found_by_name_is_verified_against_that_name(
    certs: Certs, tiny_dir: Path, tmp_path: Path
) -> None:
    """An address that `dns:///NAME` resolved to is dialled by address, and its certificate
    must carry NAME: it is accepted under NAME and refused under another or under none."""
    name = "gpu.replicas.test"
    ca_key = serialization.load_pem_private_key((certs.ca.parent / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = (x509.load_pem_x509_certificate(certs.ca.read_bytes()).subject, ca_key)
    san = x509.SubjectAlternativeName([x509.DNSName(name)])  # no IP: the address alone fails
    _issue(tmp_path, name, ca, san=san)
    key, cert = (tmp_path / f"{name}.key").read_bytes(), (tmp_path / f"{name}.pem").read_bytes()
    engine = Engine(tiny_dir, TINY_SERVICE)

    async def start() -> tuple[grpc.aio.Server, int]:
        servicer = ModelServicer(Access())
        servicer.engine = engine
        server = build_gpu_server(servicer, health.aio.HealthServicer())
        creds = grpc.ssl_server_credentials([(key, cert)])
        port = tls.add_port(server, "127.0.0.1:0", creds)
        await server.start()
        return server, port

    with aio_server_in_thread(start) as target:
        model = GrpcModel(target, timeout=10, credentials=certs.client(), authority=name)
        assert model.capabilities().model_name == engine.name
        model.close()
        for authority in (None, "other.replicas.test"):
            with pytest.raises(grpc.RpcError):
                GrpcModel(target, timeout=5, credentials=certs.client(), authority=authority)
