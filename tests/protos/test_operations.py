"""The model contract (`protos.model`) and its table (`protos.operations`): every operation in
the gRPC client, the servicer and tensor parallelism's mirror, the engine's parameters those of
the contract, the fake a serving model and nothing more, no getters."""

from __future__ import annotations

import inspect

import pytest

from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from gpu_service.engine.ranks import MIRRORED, TpEngine
from gpu_service.rpc.servicer import ModelServicer
from protos.met.v1 import model_pb2 as pb
from protos.model import CircuitModel, ServingModel
from protos.operations import CIRCUIT, OPERATIONS, SERVING, Operation
from tests.fake_model import FakeModel


def _members(cls: type) -> set[str]:
    """The public methods a class defines itself."""
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


SERVING_OPS = _members(ServingModel)
CIRCUIT_OPS = _members(CircuitModel)  # what it adds to the serving layer
OPS = pytest.mark.parametrize("op", OPERATIONS, ids=[op.name for op in OPERATIONS])


def test_the_table_lists_each_layers_operations() -> None:
    assert {op.name for op in OPERATIONS if op.layer == SERVING} == SERVING_OPS
    assert {op.name for op in OPERATIONS if op.layer == CIRCUIT} == CIRCUIT_OPS
    assert not SERVING_OPS & CIRCUIT_OPS


def test_every_rpc_but_the_sessions_and_the_old_batching_rule_is_an_operation() -> None:
    service = pb.DESCRIPTOR.services_by_name["ModelService"]
    rpcs = {m.name for m in service.methods}
    assert {op.rpc for op in OPERATIONS} <= rpcs
    assert rpcs - {op.rpc for op in OPERATIONS} == {"OpenSession", "CanBatchVerify"}


@OPS
def test_the_client_calls_it(op: Operation) -> None:
    assert callable(vars(GrpcModel).get(op.name)), f"GrpcModel lacks {op.name}"
    assert op.stream or (op.request and op.result), f"{op.name} has no client conversions"


@OPS
def test_the_servicer_serves_it(op: Operation) -> None:
    # The generated base class answers every RPC with UNIMPLEMENTED: the servicer's own
    # method is what serves it.
    assert callable(vars(ModelServicer).get(op.rpc)), f"ModelServicer lacks {op.rpc}"
    assert op.stream or (op.arguments and op.reply), f"{op.name} has no service conversions"


@OPS
def test_every_rank_runs_it_or_rank_0_answers(op: Operation) -> None:
    if op.mirrored:
        assert op.name in MIRRORED and op.name in vars(TpEngine)
    else:
        assert op.name not in MIRRORED and op.name not in vars(TpEngine)


@OPS
def test_the_engine_takes_the_contracts_parameters(op: Operation) -> None:
    """The conversions call the engine by the contract's parameter names."""
    assert op.name in vars(Engine), f"Engine lacks {op.name}"
    engine = inspect.signature(getattr(Engine, op.name))
    assert list(engine.parameters) == list(op.signature.parameters)


def test_the_fake_is_a_serving_model_and_no_more() -> None:
    defined = _members(FakeModel)
    assert SERVING_OPS - defined == set(), "operations the fake lacks"
    assert CIRCUIT_OPS & defined == set(), "circuit operations the fake should not carry"


def test_no_getter_on_the_contract() -> None:
    """Operations return what they made: nothing is read back after a call."""
    assert [n for n in SERVING_OPS | CIRCUIT_OPS if n.startswith(("last_", "get_"))] == []
