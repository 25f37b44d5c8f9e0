"""`Model` over `met.v1.ModelService`: blocking stubs, protobuf converted at this edge, refused
requests raised as the same `ModelError`s the in-process engine raises. Each client is one
session of the service (protos/model.py), open from construction to `close`."""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from protos import checks, tls
from protos import convert as cv
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_METADATA,
    ERRORS_BY_CODE,
    SESSION_METADATA,
    Capabilities,
    CostEntry,
    Logits,
    Penalties,
    Proposal,
    RowDraws,
    Sampling,
    SequenceHandle,
    StepResult,
)
from protos.steps import PlanResult, StepPlan, StepStream
from protos.telemetry import ClientTracing


class GrpcModel:
    def __init__(
        self,
        target: str,
        timeout: float = 60.0,
        admin_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        authority: str | None = None,
    ) -> None:
        """Connects (over TLS with `credentials`) and opens the session: a `grpc.RpcError`
        when the service is unreachable. `admin_key`, sent on admin calls only, defaults to
        env `ADMIN_KEY_ENV`. `authority`: the name the service's certificate must carry
        when `target` is one of the addresses that name resolved to."""
        self.target = target
        self.timeout = timeout
        named = (("grpc.ssl_target_name_override", authority),) if authority and credentials else ()
        self._channel = tls.open_channel(target, credentials, named)
        self._traced = grpc.intercept_channel(self._channel, ClientTracing("met.control_plane"))
        self._stub = pb_grpc.ModelServiceStub(self._traced)
        self._logprobs: list[float] = []
        self._draws: list[RowDraws | None] = []
        # No deadline: the stream lives as long as the session.
        self._session = pb_grpc.ModelServiceStub(self._channel).OpenSession(pb.OpenSessionRequest())
        try:
            self.session_id: str = next(self._session).session_id
        except grpc.RpcError:
            self._channel.close()
            raise
        self._metadata = ((SESSION_METADATA, self.session_id),)
        key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV, "")
        self._admin_metadata = (*self._metadata, (ADMIN_KEY_METADATA, key))

    def close(self) -> None:
        """End the session (the service frees its sequences) and the connection."""
        self._session.cancel()
        self._channel.close()

    def _rpc(self, method: Callable[..., Any], request: Any, admin: bool = False) -> Any:
        metadata = self._admin_metadata if admin else self._metadata
        try:
            return method(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise _refused(e) from None

    def capabilities(self) -> Capabilities:
        return cv.from_pb(
            Capabilities, self._rpc(self._stub.Capabilities, pb.CapabilitiesRequest())
        )

    def tokenizer_files(self) -> dict[str, bytes]:
        files: dict[str, bytearray] = {}
        chunks = self._stub.TokenizerFiles(pb.TokenizerFilesRequest(), timeout=self.timeout)
        try:
            for chunk in chunks:
                files.setdefault(chunk.name, bytearray()).extend(chunk.data)
        except grpc.RpcError as e:
            raise _refused(e) from None
        return {name: bytes(data) for name, data in files.items()}

    def alloc_sequence(self, penalties: Penalties | None = None) -> SequenceHandle:
        request = pb.AllocSequenceRequest(
            penalties=cv.to_pb(penalties) if penalties is not None else None
        )
        # With the admin key (the control plane's), the session is not held to the service's
        # --max-slots-per-session.
        h = self._rpc(self._stub.AllocSequence, request, admin=True)
        return cv.from_pb(SequenceHandle, h)

    def free_sequence(self, seq: SequenceHandle) -> None:
        self._rpc(self._stub.FreeSequence, pb.FreeSequenceRequest(seq_id=seq.seq_id))

    def prefill(
        self,
        seqs: Sequence[SequenceHandle],
        prompts: Sequence[Sequence[int]],
        masks: Sequence[bytes] | None = None,
        sampling: Sequence[Sampling | None] | None = None,
    ) -> list[int]:
        # A request pairs each sequence with its prompt, so a mismatch cannot be sent.
        checks.same_length("prefill", seqs=seqs, prompts=prompts)
        masks = masks or [b""] * len(seqs)
        sampling = sampling or [None] * len(seqs)
        checks.same_length("prefill", seqs=seqs, masks=masks, sampling=sampling)
        r = self._rpc(self._stub.Prefill, cv.prefill_to_pb(seqs, prompts, masks, sampling))
        cv.mirror_seq_lens(seqs, r.seq_lens)
        self._logprobs = list(r.logprobs)
        return list(r.argmax)

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        write_on_accept: bool = True,
        masks: dict[int, bytes] | None = None,
        sampling: dict[int, Sampling] | None = None,
    ) -> list[int]:
        sampling = sampling or {}
        r = self._rpc(
            self._stub.DecodeVerifyBatched,
            pb.VerifyRequest(
                seq_ids=cv.seq_ids(seqs),
                ks=ks,
                tokens=tokens,
                write_on_accept=write_on_accept,
                masks=cv.row_masks_to_pb(masks or {}),
                sampling=cv.seq_sampling_to_pb(sampling.items()),
            ),
        )
        cv.mirror_seq_lens(seqs, r.seq_lens)
        self._logprobs = list(r.logprobs)
        self._draws = cv.draws_from_pb(r, ks, sampling)
        return list(r.argmax)

    def last_draws(self) -> list[RowDraws | None]:
        return list(self._draws)

    def last_logprobs(self) -> list[float]:
        return list(self._logprobs)

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        return self._rpc(self._stub.CanBatchVerify, pb.CanBatchVerifyRequest(ks=ks)).ok

    def gdn_fold_accepted(self, seqs: Sequence[SequenceHandle], fold_rows: Sequence[int]) -> None:
        self._rpc(
            self._stub.FoldAccepted, pb.FoldRequest(seq_ids=cv.seq_ids(seqs), fold_rows=fold_rows)
        )

    def commit_accepted_prefix(
        self, seqs: Sequence[SequenceHandle], kept_rows: Sequence[int], ks: Sequence[int]
    ) -> list[int]:
        r = self._rpc(
            self._stub.CommitAcceptedPrefix,
            pb.CommitRequest(seq_ids=cv.seq_ids(seqs), kept_rows=kept_rows, ks=ks),
        )
        cv.mirror_seq_lens(seqs, r.seq_lens)
        return list(r.seq_lens)

    def stash_verify_hidden_rows(self, rows: Sequence[int]) -> None:
        self._rpc(self._stub.StashVerifyHiddenRows, pb.StashRequest(rows=rows))

    def run_mtp_propose_batched(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
        sampling: Sequence[Sampling | None] | None = None,
    ) -> Proposal:
        r = self._rpc(
            self._stub.Propose,
            pb.ProposeRequest(
                seq_ids=cv.seq_ids(seqs),
                last=last,
                stash=stash,
                num_drafts=num_drafts,
                positions=cv.seq_lens(seqs),
                sampling=cv.seq_sampling_to_pb(enumerate(sampling or ())),
            ),
        )
        return cv.proposal_from_pb(r, len(seqs))

    def settle_verdict(
        self,
        seqs: Sequence[SequenceHandle],
        kept_rows: Sequence[int],
        ks: Sequence[int],
        proposers: Sequence[int],
        last: Sequence[int],
        num_drafts: int,
        sampling: Sequence[Sampling | None] | None = None,
    ) -> Proposal:
        r = self._rpc(
            self._stub.SettleVerdict,
            pb.VerdictRequest(
                seq_ids=cv.seq_ids(seqs),
                kept_rows=kept_rows,
                ks=ks,
                proposers=proposers,
                last=last,
                num_drafts=num_drafts,
                sampling=cv.seq_sampling_to_pb(enumerate(sampling or ())),
            ),
        )
        cv.mirror_seq_lens(seqs, r.seq_lens)
        return cv.proposal_from_pb(r, len(proposers))

    def decode_step(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        want_drafts: Sequence[bool],
        num_drafts: int,
    ) -> StepResult:
        r = self._rpc(
            self._stub.DecodeStep,
            pb.StepRequest(
                seq_ids=cv.seq_ids(seqs),
                ks=ks,
                tokens=tokens,
                want_drafts=want_drafts,
                num_drafts=num_drafts,
            ),
        )
        cv.mirror_seq_lens(seqs, r.seq_lens)
        self._logprobs = list(r.logprobs)
        self._draws = [None] * len(r.argmax)
        return cv.step_from_pb(r)

    def open_steps(self) -> StepStream:
        return GrpcSteps(self._stub.StepStream, self._metadata)

    def trim_proposer_state(self, seqs: Sequence[SequenceHandle], keep_own: int = 0) -> None:
        self._rpc(
            self._stub.TrimProposer, pb.TrimRequest(seq_ids=cv.seq_ids(seqs), keep_own=keep_own)
        )

    def snapshot_prefixes(self, seqs: Sequence[SequenceHandle]) -> list[int]:
        r = self._rpc(self._stub.SnapshotPrefixes, pb.SnapshotRequest(seq_ids=cv.seq_ids(seqs)))
        return list(r.snapshot_ids)

    def restore_prefixes(self, seqs: Sequence[SequenceHandle], snapshots: Sequence[int]) -> None:
        r = self._rpc(
            self._stub.RestorePrefixes,
            pb.RestoreRequest(seq_ids=cv.seq_ids(seqs), snapshot_ids=list(snapshots)),
        )
        cv.mirror_seq_lens(seqs, r.seq_lens)

    def drop_prefixes(self, snapshots: Sequence[int]) -> None:
        self._rpc(self._stub.DropPrefixes, pb.DropPrefixesRequest(snapshot_ids=list(snapshots)))

    def measure_costs(
        self,
        widths: Sequence[int],
        max_depth: int,
        repeats: int = 5,
        refresh: bool = False,
        cached_only: bool = False,
    ) -> tuple[list[CostEntry], bool]:
        request = pb.CostRequest(
            widths=widths,
            max_depth=max_depth,
            repeats=repeats,
            refresh=refresh,
            cached_only=cached_only,
        )
        r = self._rpc(self._stub.MeasureCosts, request, admin=not cached_only)
        return cv.costs_from_pb(r)

    def set_forward(self, name: str) -> None:
        self._rpc(self._stub.SetForward, pb.SetForwardRequest(forward=name), admin=True)

    def read_logits(self) -> Logits:
        logits = self._rpc(self._stub.ReadLogits, pb.ReadLogitsRequest(), admin=True)
        return cv.from_pb(Logits, logits)


class GrpcSteps:
    """The caller's end of a `StepStream` call: `send` queues the plan for the call's request
    iterator (which gRPC drains on a thread of its own), `recv` blocks for the next result and
    gives the handles of the sequences that ran their new lengths. One thread may send while
    another reads."""

    def __init__(self, method: Callable[..., Any], metadata: tuple[tuple[str, str], ...]) -> None:
        self._plans: queue.SimpleQueue[pb.StepPlan | None] = queue.SimpleQueue()
        self._sent: deque[StepPlan] = deque()  # sent, their results not read yet
        # The later steps of the plan read last (one message carries a plan's every step).
        self._steps: deque[pb.PlanResult] = deque()
        # No deadline: the stream lives as long as its caller keeps it.
        self._call = method(iter(self._plans.get, None), metadata=metadata)

    def send(self, plan: StepPlan) -> None:
        self._sent.append(plan)  # before the plan leaves, so its result always finds it
        self._plans.put(cv.plan_to_pb(plan))

    def recv(self) -> PlanResult:
        if not self._steps:
            try:
                reply = next(self._call, None)
            except grpc.RpcError as e:
                raise _refused(e) from None
            if reply is None:
                raise RuntimeError("the step stream ended: it was closed")
            self._steps.extend(cv.plan_results_from_pb(reply))
        step = self._steps.popleft()
        plan = self._sent[0]
        if not self._steps:
            self._sent.popleft()  # its last step
        result = cv.plan_result_from_pb(step)
        cv.mirror_seq_lens([plan.seqs[i] for i in result.ran], step.step.seq_lens)
        return result

    def close(self) -> None:
        """End the plans and the call; a `recv` waiting meanwhile raises CANCELLED."""
        self._plans.put(None)
        self._call.cancel()


def _refused(e: grpc.RpcError) -> Exception:
    """A refusal as the `ModelError` the in-process engine raises; a transport error as is."""
    error = ERRORS_BY_CODE.get(e.code().name)
    return e if error is None else error(e.details())
