"""A call's arguments as they are generated (`text.arguments`): however a block's text is cut,
the pieces taken join to `parse_call`'s arguments, in both call forms; a block seen open
through `ChatOutput`."""

from __future__ import annotations

import random

import pytest

from control_plane.text.arguments import CallReader, open_block
from control_plane.text.tools import ChatOutput, parse_call

TOOLS = {
    "w": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "x": {"type": "object"},
        },
    }
}
BODIES = {
    "json": '\n{"name": "w", "arguments": {"city": "Pa\\"r\\u00e9\\ud83d\\ude00", "days": 3, '
    '"x": {"a": [1, 2.50, -1e2, true, null]}}}\n',
    "json-arguments-first": '\n{"arguments":{"days":12,"city":"Rome"},"name":"w"}\n',
    "json-empty": '\n{"name":"w","arguments":{}}\n',
    "xml": "\n<function=w>\n<parameter=city>\nPar\nis </b> x\n</parameter>\n<parameter=days>\n4\n"
    '</parameter>\n<parameter=x>\n{"a": 1}\n</parameter>\n</function>\n',
    "xml-empty": "\n<function=w>\n</function>\n",
    "xml-untyped": "\n<function=zz>\n<parameter=q>\n\n\nv\n\n</parameter>\n</function>\n",
}


@pytest.mark.parametrize("name", BODIES)
def test_pieces_join_to_the_parsed_arguments_however_cut(name: str) -> None:
    body = BODIES[name]
    call = parse_call(body, TOOLS)
    assert call is not None
    rng = random.Random(0)
    for _ in range(100):
        reader, taken = CallReader(TOOLS), []
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, min(20, len(body) - 1))))
        for cut in [*cuts, len(body)]:
            reader.read(body[:cut])
            taken.append(reader.take())
        rest, arguments = reader.finish(call.arguments)
        assert "".join(taken) + rest == arguments == call.arguments
        assert reader.name == call.name


def test_a_string_comes_character_by_character() -> None:
    body = '{"name": "w", "arguments": {"city": "Oslo"'
    reader = CallReader(TOOLS)
    pieces = []
    for cut in range(1, len(body) + 1):
        reader.read(body[:cut])
        pieces.append(reader.take())
    assert [p for p in pieces if p] == [*'{"city"', ": ", *'"Oslo"']


def test_a_key_given_twice_stands_as_the_pieces() -> None:
    """`json.loads` keeps the last value at the first place; the pieces said both."""
    body = '{"name": "w", "arguments": {"days": 1, "city": "a", "days": 2}}'
    reader = CallReader(TOOLS)
    reader.read(body)
    sent = reader.take()
    call = parse_call(body, TOOLS)
    assert call is not None and call.arguments == '{"days": 2, "city": "a"}'
    assert (
        reader.finish(call.arguments) == ("", sent)
        and sent == '{"days": 1, "city": "a", "days": 2}'
    )


def test_open_block_is_the_block_chatoutput_holds_back() -> None:
    output = ChatOutput(TOOLS, False, parallel=False)
    assert output.push("hi <tool_call>\n{") == [{"content": "hi"}]
    assert open_block(output) == "\n{"
    output.push('"name": "w", "arguments": {}}\n</tool_call> <tool_call>\n{')
    assert output.calls and open_block(output) is None  # one call only: the rest is text
