"""The service over a real socket: same results as in process, standard health and
reflection, status codes on the wire."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import SESSION_METADATA, CircuitModel
from tests.steps import logit_rows


def transcript(model: CircuitModel) -> list[object]:
    """Every operation once or more, with each reply and each logits buffer."""
    out: list[object] = []
    caps = model.capabilities()
    out.append(dataclasses.replace(caps, free_slots=0))
    a, b, c = (model.alloc_sequence() for _ in range(3))
    out.append([(s.slot, s.seq_len) for s in (a, b, c)])
    prefilled = model.prefill([a, b, c], [[1, 2, 3, 4, 5], [9] * 12, [200, 100, 50]])
    out.append(prefilled)
    out.append(model.read_logits())
    last = prefilled.argmax
    for forward in ("eager", "eager-serial"):
        model.set_forward(forward)
        rows = [[last[0], 7, 8, 9], [last[1], 10, 11], [last[2], 12, 13]]
        verified = model.decode_verify_batched([t for r in rows for t in r], [4, 3, 3], [a, b, c])
        argmax = verified.argmax
        out.append((verified, [s.seq_len for s in (a, b, c)], logit_rows(model)))
        model.stash_verify_hidden_rows([1, 6, 9])
        model.gdn_fold_accepted([a, b, c], [2, 3, 3])
        out.append(model.commit_accepted_prefix([a, b, c], [2, 3, 3], [4, 3, 3]))
        last = [argmax[1], argmax[6], argmax[9]]
        out.append(model.run_mtp_propose_batched(last, [0, 1, 2], 3, [a, b, c]))
        out.append(model.read_logits())
        model.trim_proposer_state([a, b, c])
        argmax = model.decode_verify_batched([last[0], 1, last[2]], [2, 1], [a, c]).argmax
        out.append(model.settle_verdict([a, c], [1, 1], [2, 1], [1], [argmax[2]], 2))
        out.append(model.read_logits())
        last = [argmax[0], last[1], argmax[2]]
    model.set_forward("eager")
    for s in (a, b, c):
        model.free_sequence(s)
    return out


def test_socket_equals_in_process(engine: Engine, client: GrpcModel) -> None:
    local, remote = transcript(engine), transcript(client)
    for i, (x, y) in enumerate(zip(local, remote, strict=True)):
        assert x == y, f"reply {i} differs between in-process and gRPC"


def test_health_serving(served: str) -> None:
    with grpc.insecure_channel(served) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "met.v1.ModelService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_calls(served: str) -> None:
    """What grpcurl does: list services, fetch descriptors, call a method by name."""
    with grpc.insecure_channel(served) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"met.v1.ModelService", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("met.v1.ModelService").methods_by_name["Capabilities"]
        request = message_factory.GetMessageClass(method.input_type)
        reply = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            "/met.v1.ModelService/Capabilities",
            request_serializer=request.SerializeToString,
            response_deserializer=reply.FromString,
        )
        caps = call(request())
        assert caps.vocab_size == 320 and caps.num_slots == 8
        assert list(caps.forwards) == ["eager", "eager-serial", "triton", "triton-serial"]
        assert len(caps.slot_verify_drafts) == caps.num_slots


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.VerifyRequest(seq_ids=[123456], ks=[1], tokens=[1]), grpc.StatusCode.NOT_FOUND),
        (pb.FoldRequest(seq_ids=[], fold_rows=[]), grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["not-found", "invalid-argument"],
)
def test_status_codes_on_the_wire(served: str, request_: object, code: grpc.StatusCode) -> None:
    """Raw stubs inside a live session (a `GrpcModel` holds it open)."""
    model = GrpcModel(served)
    try:
        with grpc.insecure_channel(served) as channel:
            stub = pb_grpc.ModelServiceStub(channel)
            method = (
                stub.DecodeVerifyBatched
                if isinstance(request_, pb.VerifyRequest)
                else stub.FoldAccepted
            )
            with pytest.raises(grpc.RpcError) as caught:
                method(request_, metadata=((SESSION_METADATA, model.session_id),))
            assert caught.value.code() == code
            assert caught.value.details()
    finally:
        model.close()
