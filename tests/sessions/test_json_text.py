"""session/json_text.py: orjson where it can, the json module for what orjson refuses, so what
is accepted and refused stays the json module's; and json_guard's checks on what either parsed."""

from __future__ import annotations

import json
import math

import pytest

from session import json_text
from session.json_guard import INVALID_JSON, INVALID_STRING, JsonRejected, check_value, loads_checked

pytestmark = pytest.mark.unit


def test_loads_takes_what_only_the_json_module_takes() -> None:
    assert json_text.loads('{"a": "\\ud800"}') == {"a": "\ud800"}  # a lone surrogate escape
    assert json_text.loads(str(2**80)) == 2**80  # past 64 bits
    assert math.isnan(json_text.loads("NaN"))
    assert json_text.loads('{"type": "x", "n": 1}') == {"type": "x", "n": 1}


def test_loads_refuses_what_json_refuses_with_its_error() -> None:
    for bad in ("{", '{"a": }', "[1,]", b"\xff\xfe{"):
        with pytest.raises(ValueError) as got:
            json_text.loads(bad)
        with pytest.raises(type(got.value)):
            json.loads(bad)


def test_dumps_is_compact_json_and_falls_back_for_what_orjson_refuses() -> None:
    event = {"type": "response.output_audio.delta", "delta": "AAAA", "n": [1, 2.5, None, True]}
    assert json.loads(json_text.dumps(event)) == event
    assert json_text.dumps(event) == json.dumps(event, separators=(",", ":"))
    assert json_text.dumps({1: "a"}) == '{"1":"a"}'  # a non-string key
    assert json_text.dumps({"s": "\ud800"}) == '{"s":"\\ud800"}'  # a lone surrogate
    assert json_text.dumps({"big": 2**80}) == f'{{"big":{2**80}}}'
    assert json.loads(json_text.dumps({"t": "héllo"})) == {"t": "héllo"}


def test_checks_still_refuse_surrogates_and_depth_on_every_path() -> None:
    with pytest.raises(JsonRejected) as got:
        loads_checked('{"type": "x", "event_id": "\\udc00"}')  # flat, but not ASCII
    assert got.value.code == INVALID_STRING and got.value.param == "event_id"
    with pytest.raises(JsonRejected) as got:
        loads_checked("[" * 70 + "]" * 70)
    assert got.value.code == INVALID_JSON
    check_value({"type": "input_audio_buffer.append", "audio": "AAAA"})  # flat ASCII: nothing to find
    with pytest.raises(JsonRejected):
        check_value({"a": "b"}, max_depth=0)  # the shortcut does not skip the depth limit
