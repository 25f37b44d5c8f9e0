"""What a request adds to the work of every step it takes part in, bounded at admission: its
stop strings (how many, their characters in all), stop token ids, logit bias entries and
allowed token ids, each refused past its limit (`protos.checks.LIMITS`, whose sentences the GPU
service gives too) before anything else of the request is worked on. Its stop strings'
automaton is built here, so the scheduler's thread finds it built."""

from __future__ import annotations

from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.text.detok import stop_strings
from protos import checks
from protos.params import RequestParams


def check_per_step(r: RequestParams) -> None:
    """`BadRequest` naming the field and its limit when one is past it; else the stop
    strings' automaton built (`stop_strings` keeps it for the request's `Detokenizer`)."""
    counts = {
        "stop": len(r.stop),
        "stop_chars": sum(map(len, r.stop)),
        "stop_token_ids": len(r.stop_token_ids),
        "logit_bias": len(r.sampling.logit_bias),
        "allowed_token_ids": len(r.sampling.allowed_token_ids),
    }
    for name, count in counts.items():
        if (problem := checks.limit_problem(name, count)) is not None:
            raise BadRequest(INVALID, problem, checks.LIMITS[name].field)
    stop_strings(r.stop)
