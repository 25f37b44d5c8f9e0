"""The README's client examples run as written: grpcurl (the binary the test extras install)
against the control plane's generation API, through server reflection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GRPCURL = Path(sys.executable).parent / "grpcurl"


def test_grpcurl_streams_a_generation(control_plane: str) -> None:
    body = json.dumps({"prompt": "def fib(n):", "max_new_tokens": 4, "ignore_eos": True})
    done = subprocess.run(
        [
            str(GRPCURL),
            "-plaintext",
            "-d",
            body,
            control_plane,
            "met.v1.GenerationService/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    decoder, text, messages = json.JSONDecoder(), done.stdout.strip(), []
    while text:
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    assert sum(len(m.get("token_ids", [])) for m in messages) == 4
    assert messages[-1]["usage"]["completion_tokens"] == 4
