"""`met up` (for now): start the GPU service on the default model and run one prefill,
verify and propose round against it over gRPC, printing what came back."""

from __future__ import annotations

import argparse

from control_plane.client import GrpcModel
from control_plane.launch import start_gpu_service, stop
from gpu_service.checkpoint import DEFAULT_MODEL_DIR, ensure_weights
from gpu_service.interface import Model
from gpu_service.tokenizer import ByteTokenizer


def accepted(rows: list[int], argmax: list[int]) -> int:
    """Drafts accepted: rows[1:] are drafts; draft j stands while it equals argmax[j - 1]."""
    n = 0
    while n + 1 < len(rows) and rows[n + 1] == argmax[n]:
        n += 1
    return n


def one_round(model: Model, prompt: list[int], num_drafts: int) -> dict:
    """Prefill, a one-token decode, a propose, then a verify of the drafts and its verdict."""
    seq = model.alloc_sequence()
    try:
        first = model.prefill([seq], [prompt])[0]
        bonus = model.decode_verify_batched([first], [1], [seq])[0]
        model.stash_verify_hidden_rows([0])
        model.gdn_fold_accepted([seq], [1])
        model.commit_accepted_prefix([seq], [1], [1])
        proposal = model.run_mtp_propose_batched([bonus], [0], num_drafts, [seq])
        model.trim_proposer_state([seq])
        rows = [bonus, *proposal.drafts[0]]
        argmax = model.decode_verify_batched(rows, [len(rows)], [seq])
        na = accepted(rows, argmax)
        model.stash_verify_hidden_rows([na])
        model.gdn_fold_accepted([seq], [na + 1])
        model.commit_accepted_prefix([seq], [na + 1], [len(rows)])
        return {
            "prefill_argmax": first,
            "decoded": bonus,
            "drafts": proposal.drafts[0],
            "confidences": proposal.confidences[0],
            "verify_argmax": argmax,
            "accepted": na,
            "seq_len": seq.seq_len,
        }
    finally:
        model.free_sequence(seq)


def run_demo(args: argparse.Namespace) -> int:
    if args.model.resolve() == DEFAULT_MODEL_DIR:
        ensure_weights(args.model)
    tok = ByteTokenizer.load(args.model)
    proc, target = start_gpu_service(args.model)
    try:
        model = GrpcModel(target)
        caps = model.capabilities()
        print(f"capabilities: {caps}")
        prompt = tok.encode(args.prompt)
        result = one_round(model, prompt, args.num_drafts)
        for key, value in result.items():
            print(f"{key}: {value}")
        model.close()
    finally:
        code = stop(proc)
    print(f"gpu-service exited with status {code}")
    return code
