"""`met generate`: stream one request from a running control plane."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import grpc

from control_plane.admission.auth import bearer
from control_plane.text.chat import parse_kwargs
from protos import checks, params, tls
from protos.defaults import CONTROL_PLANE_PORT
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc

METHODS = {name: value for value, name in params.METHODS.items()}


def _whole(name: str, shown: str | None = None) -> Callable[[str], int]:
    """An argparse `type` for the whole number `checks.INTS[name]` holds, named `shown` in the
    sentence (default `name`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if (problem := checks.int_problem(name, value, shown)) is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def _real(name: str) -> Callable[[str], float]:
    """An argparse `type` for the number `checks.FLOATS[name]` holds."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if (problem := checks.number_problem(name, value)) is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def _bias(text: str) -> tuple[int, float]:
    """`ID:BIAS` -> (ID, BIAS), each in its range."""
    token, colon, bias = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID:BIAS (for example 42:-100)")
    return _whole("token_id", "a token id")(token), _real("logit_bias")(bias)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text; with --chat, the user's message")
    parser.add_argument(
        "--chat", action="store_true", help="send a chat, rendered by the model's chat template"
    )
    parser.add_argument("--system", default=None, help="a system message first (implies --chat)")
    parser.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="the chat template's own variables, a JSON object (implies --chat)",
    )
    parser.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enable_thinking among them, over the JSON's (Qwen3's templates; implies --chat)",
    )
    parser.add_argument(
        "--target", default=f"127.0.0.1:{CONTROL_PLANE_PORT}", help="the control plane, HOST:PORT"
    )
    parser.add_argument("--max-new-tokens", type=_whole("max_new_tokens"), default=None)
    parser.add_argument("--min-new-tokens", type=_whole("min_new_tokens"), default=0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    parser.add_argument(
        "--stop-token-id", type=_whole("token_id", "a token id"), action="append", default=[]
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=_real("temperature"), default=0.0)
    parser.add_argument("--top-p", type=_real("top_p"), default=1.0)
    parser.add_argument("--top-k", type=_whole("top_k"), default=0, help="0 or -1: no limit")
    parser.add_argument("--min-p", type=_real("min_p"), default=0.0)
    parser.add_argument("--seed", type=_whole("seed"), default=None)
    parser.add_argument("--presence-penalty", type=_real("presence_penalty"), default=0.0)
    parser.add_argument("--frequency-penalty", type=_real("frequency_penalty"), default=0.0)
    parser.add_argument(
        "--repetition-penalty", type=_real("repetition_penalty"), default=None, help="1: none"
    )
    parser.add_argument(
        "--logit-bias",
        type=_bias,
        action="append",
        default=[],
        metavar="ID:BIAS",
        help="add BIAS to token ID's logit (repeat)",
    )
    parser.add_argument("--logprobs", action="store_true")
    parser.add_argument("--method", choices=list(METHODS), default=None)
    parser.add_argument("--num-drafts", type=_whole("num_drafts"), default=None)
    parser.add_argument("--request-id", default="")
    parser.add_argument("--json-schema", default=None, help="constrain the output (JSON text)")
    parser.add_argument("--regex", default=None, help="constrain the output to a regex")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    parser.add_argument("--api-key", default=None, help="sent as `authorization: Bearer KEY`")
    tls.add_client_args(parser, "tls", "the control plane")


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The chat template's variables the flags give; None when they give none."""
    if args.chat_template_kwargs is None and args.enable_thinking is None:
        return None
    try:
        kwargs = parse_kwargs(args.chat_template_kwargs or "")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.enable_thinking is not None:
        kwargs["enable_thinking"] = args.enable_thinking
    return kwargs


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    r = pb.GenerateRequest(
        min_new_tokens=args.min_new_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias),
        logprobs=args.logprobs,
        request_id=args.request_id,
        speculative_method=METHODS.get(args.method, pb.SPECULATIVE_METHOD_UNSPECIFIED),
    )
    kwargs = _template_kwargs(args)
    if args.chat or args.system is not None or kwargs is not None:
        if args.system is not None:
            r.messages.add(role="system", content=args.system)
        r.messages.add(role="user", content=args.prompt)
        if kwargs:
            r.chat_template_kwargs = json.dumps(kwargs, ensure_ascii=False)
    else:
        r.prompt = args.prompt
    if args.json_schema is not None:
        r.response_format.json_schema = args.json_schema
    elif args.regex is not None:
        r.response_format.regex = args.regex
    for field in ("max_new_tokens", "seed", "num_drafts", "repetition_penalty"):
        if getattr(args, field) is not None:
            setattr(r, field, getattr(args, field))
    return r


def run(args: argparse.Namespace) -> int:
    credentials = tls.or_exit("met generate", lambda a: tls.channel_credentials(a, "tls"), args)
    metadata = bearer(args.api_key) if args.api_key else None
    with tls.open_channel(args.target, credentials) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            call = stub.Generate(build_request(args), timeout=args.timeout, metadata=metadata)
            for msg in call:
                if msg.HasField("queued"):
                    q = msg.queued
                    print(f"queued: position {q.position} of {q.queue_length}", file=sys.stderr)
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    s, u = msg.speculative_stats, msg.usage
                    print(
                        f"\n[{msg.finish_reason}] {u.prompt_tokens} prompt + "
                        f"{u.completion_tokens} completion tokens; {s.verifies} verifies, "
                        f"{s.accepted}/{s.drafted} drafts accepted, mean accepted length "
                        f"{s.mean_accepted_length:.2f}",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
