"""Every operation of the model contract (`protos.model`) beside its RPC of `met.v1.ModelService`
and the four conversions it crosses the wire by: the one table the gRPC client
(`control_plane/replicas/client.py`), the servicer (`gpu_service/rpc/servicer.py`) and
tensor parallelism's mirror (`gpu_service/engine/ranks.py`) are built from.

A conversion's arguments are the contract method's, by name: `request` takes the call's
arguments (without `self`) and builds the request message; `arguments` is its inverse on the
service's side (handles carry only ids there, `convert.handles`); `reply` builds the reply from
the result and the arguments (the handles then hold their new lengths); `result` is its inverse
on the caller's side, and gives the caller's handles their new lengths. Nothing here imports
torch."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protos import checks
from protos import convert as cv
from protos.handles import Prefilled, SequenceHandle, Verified
from protos.met.v1 import model_pb2 as pb
from protos.model import (
    MTP_HEAD,
    Capabilities,
    CircuitModel,
    Logits,
    Penalties,
    ServingModel,
)

Args = Mapping[str, Any]
SERVING = "serving"
CIRCUIT = "circuit"


@dataclass(frozen=True)
class Operation:
    name: str  # the contract's method
    rpc: str  # ModelService's RPC
    layer: str  # SERVING or CIRCUIT: the protocol that declares it
    request: Callable[[Args], Any] | None = None
    arguments: Callable[[Any], dict[str, Any]] | None = None
    reply: Callable[[Any, Args], Any] | None = None
    result: Callable[[Any, Args], Any] | None = None
    # Whether the call needs the admin key, by its arguments.
    admin: Callable[[Args], bool] = field(default=lambda a: False)
    session: bool = True  # whether it names a session (read-only calls need none)
    # Whether every tensor-parallel rank runs it (it reads or writes device state); the rest
    # read rank 0's state.
    mirrored: bool = True
    # Streams (the tokenizer's files, the step stream) are written out by hand on both sides;
    # the table still names them.
    stream: bool = False

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The contract's signature of the operation, with `self` (read once: every call of
        the generated client binds its arguments by it)."""
        protocol = ServingModel if self.layer == SERVING else CircuitModel
        return inspect.signature(getattr(protocol, self.name))


def _none(reply: Any, a: Args) -> None:
    return None


def _lens(reply: Any, a: Args) -> None:
    cv.mirror_seq_lens(a["seqs"], reply.seq_lens)


def _verify_request(a: Args) -> pb.VerifyRequest:
    return pb.VerifyRequest(
        seq_ids=cv.seq_ids(a["seqs"]),
        ks=a["ks"],
        tokens=a["tokens"],
        write_on_accept=a["write_on_accept"],
        masks=cv.row_masks_to_pb(a["masks"] or {}),
        sampling=cv.seq_sampling_to_pb((a["sampling"] or {}).items()),
        top=a["top"] or (),
    )


def _verify_arguments(r: pb.VerifyRequest) -> dict[str, Any]:
    seqs = cv.handles(r.seq_ids)
    sampled = cv.seq_sampling_from_pb(r.sampling, len(seqs))
    return {
        "tokens": list(r.tokens),
        "ks": list(r.ks),
        "seqs": seqs,
        "write_on_accept": r.write_on_accept,
        "masks": cv.row_masks_from_pb(r.masks),
        "sampling": {i: s for i, s in enumerate(sampled) if s is not None},
        "top": list(r.top) or None,
    }


def _verified(r: pb.VerifyReply, a: Args) -> Verified:
    _lens(r, a)
    draws = cv.draws_from_pb(r, a["ks"], a["sampling"] or {})
    ids, values = cv.tops_from_pb(r, cv.row_tops(a["ks"], a["top"] or ()))
    return Verified(list(r.argmax), list(r.logprobs), draws, list(r.next_logprobs), ids, values)


def _verified_pb(v: Verified, a: Args) -> pb.VerifyReply:
    return pb.VerifyReply(
        argmax=v.argmax,
        seq_lens=cv.seq_lens(a["seqs"]),
        logprobs=v.logprobs,
        next_logprobs=v.next_logprobs,
        **cv.draws_to_pb(v.draws),
        **cv.tops_to_pb(v.top_ids, v.top_logprobs),
    )


def _prefill_request(a: Args) -> pb.PrefillRequest:
    seqs = a["seqs"]
    masks = a["masks"] or [b""] * len(seqs)
    sampling = a["sampling"] or [None] * len(seqs)
    scores = a["scores"] or [None] * len(seqs)
    tops = a["top"] or [0] * len(seqs)
    images = a["images"] or [()] * len(seqs)
    checks.same_length(
        "prefill",
        seqs=seqs,
        prompts=a["prompts"],
        masks=masks,
        sampling=sampling,
        scores=scores,
        top=tops,
        images=images,
    )
    return cv.prefill_to_pb(seqs, a["prompts"], masks, sampling, scores, tops, images)


def _prefill_arguments(r: pb.PrefillRequest) -> dict[str, Any]:
    seqs, prompts, masks, sampling, scores, tops, images = cv.prefill_from_pb(r)
    return {
        "seqs": seqs,
        "prompts": prompts,
        "masks": masks,
        "sampling": sampling,
        "scores": scores if any(s is not None for s in scores) else None,
        "top": tops if any(tops) else None,
        "images": images if any(images) else None,
    }


def _prefilled(r: pb.PrefillReply, a: Args) -> Prefilled:
    _lens(r, a)
    scores = cv.scores_from_pb(r.scores) if r.scores else []
    ids, values = cv.tops_from_pb(r, a["top"] or [0] * len(a["seqs"]))
    return Prefilled(list(r.argmax), list(r.logprobs), scores, ids, values)


def _prefilled_pb(p: Prefilled, a: Args) -> pb.PrefillReply:
    return pb.PrefillReply(
        argmax=p.argmax,
        seq_lens=cv.seq_lens(a["seqs"]),
        logprobs=p.logprobs,
        scores=cv.scores_to_pb(p.scores, len(p.argmax)) if p.scores else [],
        **cv.tops_to_pb(p.top_ids, p.top_logprobs),
    )


def _verdict_request(a: Args) -> pb.VerdictRequest:
    return pb.VerdictRequest(
        seq_ids=cv.seq_ids(a["seqs"]),
        kept_rows=a["kept_rows"],
        ks=a["ks"],
        proposers=a["proposers"],
        last=a["last"],
        num_drafts=a["num_drafts"],
        sampling=cv.seq_sampling_to_pb(enumerate(a["sampling"] or ())),
        drafters=a["drafters"],
    )


def _verdict_arguments(r: pb.VerdictRequest) -> dict[str, Any]:
    return {
        "seqs": cv.handles(r.seq_ids),
        "kept_rows": list(r.kept_rows),
        "ks": list(r.ks),
        "proposers": list(r.proposers),
        "last": list(r.last),
        "num_drafts": r.num_drafts,
        "sampling": cv.seq_sampling_from_pb(r.sampling, max(len(r.proposers), 1)),
        "drafters": list(r.drafters),
    }


def _verdict(r: pb.VerdictReply, a: Args) -> Any:
    _lens(r, a)
    return cv.proposal_from_pb(r, len(a["proposers"]))


def _step_request(a: Args) -> pb.StepRequest:
    return pb.StepRequest(
        seq_ids=cv.seq_ids(a["seqs"]),
        ks=a["ks"],
        tokens=a["tokens"],
        want_drafts=a["want_drafts"],
        num_drafts=a["num_drafts"],
        drafters=a["drafters"],
        masks=cv.row_masks_to_pb(a["masks"] or {}),
    )


def _step_arguments(r: pb.StepRequest) -> dict[str, Any]:
    return {
        "tokens": list(r.tokens),
        "ks": list(r.ks),
        "seqs": cv.handles(r.seq_ids),
        "want_drafts": list(r.want_drafts),
        "num_drafts": r.num_drafts,
        "drafters": list(r.drafters),
        "masks": cv.row_masks_from_pb(r.masks),
    }


def _step(r: pb.StepReply, a: Args) -> Any:
    _lens(r, a)
    return cv.step_from_pb(r)


def _propose_request(a: Args) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        seq_ids=cv.seq_ids(a["seqs"]),
        last=a["last"],
        stash=a["stash"],
        num_drafts=a["num_drafts"],
        positions=cv.seq_lens(a["seqs"]),
        sampling=cv.seq_sampling_to_pb(enumerate(a["sampling"] or ())),
        drafters=a["drafters"],
    )


def _propose_arguments(r: pb.ProposeRequest) -> dict[str, Any]:
    seqs = cv.handles(r.seq_ids)
    return {
        "last": list(r.last),
        "stash": list(r.stash),
        "num_drafts": r.num_drafts,
        "seqs": seqs,
        "sampling": cv.seq_sampling_from_pb(r.sampling, len(seqs)),
        "drafters": list(r.drafters),
    }


def _costs_request(a: Args) -> pb.CostRequest:
    return pb.CostRequest(
        widths=a["widths"],
        max_depth=a["max_depth"],
        repeats=a["repeats"],
        refresh=a["refresh"],
        cached_only=a["cached_only"],
    )


def _costs_arguments(r: pb.CostRequest) -> dict[str, Any]:
    return {
        "widths": list(r.widths),
        "max_depth": r.max_depth,
        "repeats": r.repeats or 5,
        "refresh": r.refresh,
        "cached_only": r.cached_only,
    }


def _alloc_request(a: Args) -> pb.AllocSequenceRequest:
    penalties: Penalties | None = a["penalties"]
    return pb.AllocSequenceRequest(
        penalties=cv.to_pb(penalties) if penalties else None, drafter=a["drafter"]
    )


def _committed(r: pb.CommitReply, a: Args) -> list[int]:
    _lens(r, a)
    return list(r.seq_lens)


def _seqs(r: Any) -> dict[str, Any]:
    return {"seqs": cv.handles(r.seq_ids)}


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "capabilities",
        "Capabilities",
        SERVING,
        request=lambda a: pb.CapabilitiesRequest(),
        arguments=lambda r: {},
        reply=lambda v, a: cv.to_pb(v),
        result=lambda r, a: cv.from_pb(Capabilities, r),
        session=False,
        mirrored=False,
    ),
    Operation(
        "tokenizer_files", "TokenizerFiles", SERVING, session=False, mirrored=False, stream=True
    ),
    Operation(
        "alloc_sequence",
        "AllocSequence",
        SERVING,
        request=_alloc_request,
        arguments=lambda r: {
            "penalties": cv.penalties_from_pb(r),
            "drafter": r.drafter or MTP_HEAD,
        },
        reply=lambda v, a: cv.to_pb(v),
        result=lambda r, a: cv.from_pb(SequenceHandle, r),
        # With the admin key (the control plane's), the session is not held to the service's
        # --max-slots-per-session.
        admin=lambda a: True,
    ),
    Operation(
        "free_sequence",
        "FreeSequence",
        SERVING,
        request=lambda a: pb.FreeSequenceRequest(seq_id=a["seq"].seq_id),
        arguments=lambda r: {"seq": cv.handles([r.seq_id])[0]},
        reply=lambda v, a: pb.FreeSequenceReply(),
        result=_none,
    ),
    Operation(
        "prefill",
        "Prefill",
        SERVING,
        request=_prefill_request,
        arguments=_prefill_arguments,
        reply=_prefilled_pb,
        result=_prefilled,
    ),
    Operation(
        "decode_verify_batched",
        "DecodeVerifyBatched",
        SERVING,
        request=_verify_request,
        arguments=_verify_arguments,
        reply=_verified_pb,
        result=_verified,
    ),
    Operation(
        "settle_verdict",
        "SettleVerdict",
        SERVING,
        request=_verdict_request,
        arguments=_verdict_arguments,
        reply=lambda v, a: pb.VerdictReply(seq_lens=cv.seq_lens(a["seqs"]), **cv.proposal_to_pb(v)),
        result=_verdict,
    ),
    Operation(
        "decode_step",
        "DecodeStep",
        SERVING,
        request=_step_request,
        arguments=_step_arguments,
        reply=lambda v, a: cv.step_to_pb(v, cv.seq_lens(a["seqs"])),
        result=_step,
    ),
    # Its plans run as `run_plan`, which every rank mirrors.
    Operation("open_steps", "StepStream", SERVING, mirrored=False, stream=True),
    Operation(
        "snapshot_prefixes",
        "SnapshotPrefixes",
        SERVING,
        request=lambda a: pb.SnapshotRequest(seq_ids=cv.seq_ids(a["seqs"])),
        arguments=_seqs,
        reply=lambda v, a: pb.SnapshotReply(snapshot_ids=v),
        result=lambda r, a: list(r.snapshot_ids),
    ),
    Operation(
        "restore_prefixes",
        "RestorePrefixes",
        SERVING,
        request=lambda a: pb.RestoreRequest(
            seq_ids=cv.seq_ids(a["seqs"]), snapshot_ids=list(a["snapshots"])
        ),
        arguments=lambda r: {"seqs": cv.handles(r.seq_ids), "snapshots": list(r.snapshot_ids)},
        reply=lambda v, a: pb.RestoreReply(seq_lens=cv.seq_lens(a["seqs"])),
        result=_lens,
    ),
    Operation(
        "drop_prefixes",
        "DropPrefixes",
        SERVING,
        request=lambda a: pb.DropPrefixesRequest(snapshot_ids=list(a["snapshots"])),
        arguments=lambda r: {"snapshots": list(r.snapshot_ids)},
        reply=lambda v, a: pb.DropPrefixesReply(),
        result=_none,
    ),
    Operation(
        "measure_costs",
        "MeasureCosts",
        SERVING,
        request=_costs_request,
        arguments=_costs_arguments,
        reply=lambda v, a: cv.costs_to_pb(*v),
        result=lambda r, a: cv.costs_from_pb(r),
        # Reading the cached table costs no engine time; a measurement does.
        admin=lambda a: not a["cached_only"],
        # Rank 0 runs the measured calls, each mirrored on its own.
        mirrored=False,
    ),
    Operation(
        "gdn_fold_accepted",
        "FoldAccepted",
        CIRCUIT,
        request=lambda a: pb.FoldRequest(seq_ids=cv.seq_ids(a["seqs"]), fold_rows=a["fold_rows"]),
        arguments=lambda r: {"seqs": cv.handles(r.seq_ids), "fold_rows": list(r.fold_rows)},
        reply=lambda v, a: pb.FoldReply(),
        result=_none,
    ),
    Operation(
        "commit_accepted_prefix",
        "CommitAcceptedPrefix",
        CIRCUIT,
        request=lambda a: pb.CommitRequest(
            seq_ids=cv.seq_ids(a["seqs"]), kept_rows=a["kept_rows"], ks=a["ks"]
        ),
        arguments=lambda r: {
            "seqs": cv.handles(r.seq_ids),
            "kept_rows": list(r.kept_rows),
            "ks": list(r.ks),
        },
        reply=lambda v, a: pb.CommitReply(seq_lens=v),
        result=_committed,
    ),
    Operation(
        "stash_verify_hidden_rows",
        "StashVerifyHiddenRows",
        CIRCUIT,
        request=lambda a: pb.StashRequest(rows=a["rows"]),
        arguments=lambda r: {"rows": list(r.rows)},
        reply=lambda v, a: pb.StashReply(),
        result=_none,
    ),
    Operation(
        "run_mtp_propose_batched",
        "Propose",
        CIRCUIT,
        request=_propose_request,
        arguments=_propose_arguments,
        reply=lambda v, a: pb.ProposeReply(**cv.proposal_to_pb(v)),
        result=lambda r, a: cv.proposal_from_pb(r, len(a["seqs"])),
    ),
    Operation(
        "trim_proposer_state",
        "TrimProposer",
        CIRCUIT,
        request=lambda a: pb.TrimRequest(seq_ids=cv.seq_ids(a["seqs"]), keep_own=a["keep_own"]),
        arguments=lambda r: {"seqs": cv.handles(r.seq_ids), "keep_own": r.keep_own},
        reply=lambda v, a: pb.TrimReply(),
        result=_none,
    ),
    Operation(
        "set_forward",
        "SetForward",
        CIRCUIT,
        request=lambda a: pb.SetForwardRequest(forward=a["name"]),
        arguments=lambda r: {"name": r.forward},
        reply=lambda v, a: pb.SetForwardReply(current_forward=a["name"]),
        result=_none,
        admin=lambda a: True,
    ),
    Operation(
        "read_logits",
        "ReadLogits",
        CIRCUIT,
        request=lambda a: pb.ReadLogitsRequest(),
        arguments=lambda r: {},
        reply=lambda v, a: cv.to_pb(v),
        result=lambda r, a: cv.from_pb(Logits, r),
        admin=lambda a: True,
        # Rank 0 gathers every rank's columns: each rank takes part.
        mirrored=True,
    ),
)
BY_NAME: dict[str, Operation] = {op.name: op for op in OPERATIONS}

# Engine calls that are not contract operations and still run on every rank: the servicer's
# (freeing an ended session's sequences, checking a propose's positions, running a plan) and
# the service's own (graphs, held bytes).
ENGINE_MIRRORED = (
    "free_sequences",
    "check_positions",
    "run_plan",
    "use_graphs",
    "held_bytes_by_rank",
)


def mirrored() -> tuple[str, ...]:
    """The engine calls every tensor-parallel rank runs, in rank 0's order."""
    return (*(op.name for op in OPERATIONS if op.mirrored), *ENGINE_MIRRORED)


def bind(op: Operation, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name, defaults filled in, as the conversions take them."""
    bound = op.signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop("self")
    return named
