"""Every JSON example in docs/protocol.md is a message the real decoders accept."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from streamer.core.protocol import (
    ConfigMessage,
    decode_server_message,
    message_dict,
    parse_client_message,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
TEXT = DOC.read_text(encoding="utf-8")
JSON_BLOCKS = re.findall(r"```json\n(.*?)```", TEXT, re.S)
EXCHANGE = re.search(r"## Example exchange.*?```\n(.*?)```", TEXT, re.S)


def test_the_doc_has_examples() -> None:
    assert len(JSON_BLOCKS) >= 6 and EXCHANGE is not None


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=lambda b: orjson.loads(b)["type"])
def test_server_message_examples_decode(block: str) -> None:
    message = decode_server_message(block)
    # nothing in the example is ignored: every field it shows is a field of the message
    assert message_dict(message) == orjson.loads(block)


def test_example_exchange_lines_decode() -> None:
    assert EXCHANGE is not None
    lines = EXCHANGE.group(1).splitlines()
    server = [line[3:] for line in lines if line.startswith("S: {")]
    client = [line[3:] for line in lines if line.startswith("C: {")]
    assert [decode_server_message(s).type for s in server] == [
        "ready", "speech_start", "partial", "partial", "final", "speech_start", "final", "end",
    ]  # fmt: skip
    for s in server:
        assert message_dict(decode_server_message(s)) == orjson.loads(s)
    assert [type(parse_client_message(c)).__name__ for c in client] == ["StopMessage"]


def test_client_message_table_types_parse() -> None:
    table = re.findall(r'^\| `(\{"type":"(\w+)"[^`]*\})`', TEXT, re.M)
    assert {name for _, name in table} == {"config", "finalize", "stop", "keepalive"}
    for example, name in table:
        if name == "config":
            assert isinstance(
                parse_client_message('{"type":"config","language":"en"}'), ConfigMessage
            )
        else:
            assert type(parse_client_message(example)).__name__.lower().startswith(name)
