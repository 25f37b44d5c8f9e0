"""`Model` over `met.v1.ModelService`: blocking stubs, protobuf converted at this edge, refused
requests raised as the same `ModelError`s the in-process engine raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from protos import checks
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import (
    ERRORS_BY_CODE,
    Capabilities,
    CostEntry,
    Logits,
    Proposal,
    RowDraws,
    Sampling,
    SequenceHandle,
    StepResult,
)
from protos.telemetry import ClientTracing


class GrpcModel:
    def __init__(self, target: str, timeout: float = 60.0) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target)
        self._traced = grpc.intercept_channel(self._channel, ClientTracing("met.control_plane"))
        self._stub = pb_grpc.ModelServiceStub(self._traced)
        self._logprobs: list[float] = []
        self._draws: list[RowDraws | None] = []

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the channel connects (not until the model is loaded: see health)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def _rpc(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            error = ERRORS_BY_CODE.get(e.code().name)
            if error is None:
                raise
            raise error(e.details()) from None

    @staticmethod
    def _ids(seqs: Sequence[SequenceHandle]) -> list[int]:
        return [s.seq_id for s in seqs]

    @staticmethod
    def _mirror(seqs: Sequence[SequenceHandle], lens: Sequence[int]) -> None:
        for s, n in zip(seqs, lens, strict=True):
            s.seq_len = n

    def capabilities(self) -> Capabilities:
        c = self._rpc(self._stub.Capabilities, pb.CapabilitiesRequest())
        return Capabilities(
            model_name=c.model_name,
            vocab_size=c.vocab_size,
            num_slots=c.num_slots,
            free_slots=c.free_slots,
            slot_verify_drafts=tuple(c.slot_verify_drafts),
            max_rows=c.max_rows,
            forwards=tuple(c.forwards),
            current_forward=c.current_forward,
            device=c.device,
            max_context=c.max_context,
            dtype=c.dtype,
            hidden_size=c.hidden_size,
            eos_token_ids=tuple(c.eos_token_ids),
            has_mtp=c.has_mtp,
            max_batch=c.max_batch,
            max_prefill_tokens=c.max_prefill_tokens,
        )

    def alloc_sequence(self) -> SequenceHandle:
        h = self._rpc(self._stub.AllocSequence, pb.AllocSequenceRequest())
        return SequenceHandle(h.seq_id, h.slot, h.seq_len)

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
        items = [
            pb.PrefillItem(
                seq_id=s.seq_id,
                tokens=p,
                mask=m,
                sampling=_params(smp) if smp is not None else None,
            )
            for s, p, m, smp in zip(seqs, prompts, masks, sampling, strict=True)
        ]
        r = self._rpc(self._stub.Prefill, pb.PrefillRequest(items=items))
        self._mirror(seqs, r.seq_lens)
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
        row_masks = [pb.RowMask(row=r, bits=b) for r, b in (masks or {}).items()]
        r = self._rpc(
            self._stub.DecodeVerifyBatched,
            pb.VerifyRequest(
                seq_ids=self._ids(seqs),
                ks=ks,
                tokens=tokens,
                write_on_accept=write_on_accept,
                masks=row_masks,
                sampling=_seq_sampling(list((sampling or {}).items())),
            ),
        )
        self._mirror(seqs, r.seq_lens)
        self._logprobs = list(r.logprobs)
        sampled_rows = _sampled_rows(ks, sampling or {})
        self._draws = [
            RowDraws(r.p_next[i], r.resample[i], r.sample[i]) if i in sampled_rows else None
            for i in range(len(r.argmax))
        ]
        return list(r.argmax)

    def last_draws(self) -> list[RowDraws | None]:
        return list(self._draws)

    def last_logprobs(self) -> list[float]:
        return list(self._logprobs)

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        return self._rpc(self._stub.CanBatchVerify, pb.CanBatchVerifyRequest(ks=ks)).ok

    def gdn_fold_accepted(self, seqs: Sequence[SequenceHandle], fold_rows: Sequence[int]) -> None:
        self._rpc(
            self._stub.FoldAccepted, pb.FoldRequest(seq_ids=self._ids(seqs), fold_rows=fold_rows)
        )

    def commit_accepted_prefix(
        self, seqs: Sequence[SequenceHandle], kept_rows: Sequence[int], ks: Sequence[int]
    ) -> list[int]:
        r = self._rpc(
            self._stub.CommitAcceptedPrefix,
            pb.CommitRequest(seq_ids=self._ids(seqs), kept_rows=kept_rows, ks=ks),
        )
        self._mirror(seqs, r.seq_lens)
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
                seq_ids=self._ids(seqs),
                last=last,
                stash=stash,
                num_drafts=num_drafts,
                positions=[s.seq_len for s in seqs],
                sampling=_seq_sampling(list(enumerate(sampling or ()))),
            ),
        )
        return _proposal(r, len(seqs), num_drafts)

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
                seq_ids=self._ids(seqs),
                kept_rows=kept_rows,
                ks=ks,
                proposers=proposers,
                last=last,
                num_drafts=num_drafts,
                sampling=_seq_sampling(list(enumerate(sampling or ()))),
            ),
        )
        self._mirror(seqs, r.seq_lens)
        return _proposal(r, len(proposers), num_drafts)

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
                seq_ids=self._ids(seqs),
                ks=ks,
                tokens=tokens,
                want_drafts=want_drafts,
                num_drafts=num_drafts,
            ),
        )
        self._mirror(seqs, r.seq_lens)
        self._logprobs = list(r.logprobs)
        self._draws = [None] * len(r.argmax)
        return StepResult(
            list(r.argmax),
            list(r.logprobs),
            list(r.accepted),
            list(r.proposers),
            _proposal(r, len(r.proposers), num_drafts),
        )

    def trim_proposer_state(self, seqs: Sequence[SequenceHandle], keep_own: int = 0) -> None:
        self._rpc(
            self._stub.TrimProposer, pb.TrimRequest(seq_ids=self._ids(seqs), keep_own=keep_own)
        )

    def measure_costs(
        self, widths: Sequence[int], max_depth: int, repeats: int = 5, refresh: bool = False
    ) -> tuple[list[CostEntry], bool]:
        r = self._rpc(
            self._stub.MeasureCosts,
            pb.CostRequest(widths=widths, max_depth=max_depth, repeats=repeats, refresh=refresh),
        )
        return [CostEntry(e.width, e.depth, e.verify_ms, e.propose_ms) for e in r.entries], r.cached

    def set_forward(self, name: str) -> None:
        self._rpc(self._stub.SetForward, pb.SetForwardRequest(forward=name))

    def read_logits(self) -> Logits:
        r = self._rpc(self._stub.ReadLogits, pb.ReadLogitsRequest())
        return Logits(r.data, r.dtype, tuple(r.shape))


def _proposal(reply: Any, n: int, nd: int) -> Proposal:
    """Row-major drafts and confidences back into one list per sequence."""
    drafts = [list(reply.drafts[i * nd : (i + 1) * nd]) for i in range(n)]
    confs = [list(reply.confidences[i * nd : (i + 1) * nd]) for i in range(n)]
    return Proposal(drafts, confs)


def _params(s: Sampling) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, uniforms=s.uniforms
    )


def _seq_sampling(items: list[tuple[int, Sampling | None]]) -> list[pb.SeqSampling]:
    return [pb.SeqSampling(index=i, params=_params(s)) for i, s in items if s is not None]


def _sampled_rows(ks: Sequence[int], sampling: dict[int, Sampling]) -> set[int]:
    rows, off = set(), 0
    for i, k in enumerate(ks):
        if i in sampling:
            rows.update(range(off, off + k))
        off += k
    return rows
