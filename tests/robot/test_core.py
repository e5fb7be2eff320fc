"""The sans-I/O parts: openpi's msgpack-numpy codec (strict decoding) and the session core
(dialects, validation against the metadata, the context a session keeps)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.payloads import Observation
from session.robot.core import (
    OPENPI_CLOSE,
    CloseConnection,
    Dialect,
    Infer,
    PolicyContext,
    ResetPolicy,
    RobotSessionCore,
    SendFrame,
    UpdatePrompt,
)
from session.robot.wire import WireError, pack, unpack

pytestmark = pytest.mark.unit

META = {
    "image_keys": ["cam/front"],
    "image_shape": [8, 8, 3],
    "state_key": "state",
    "state_dim": 3,
    "prompt_key": "prompt",
    "action_horizon": 4,
    "action_dim": 2,
}


def obs(**extra: object) -> dict[str, object]:
    return {"cam/front": np.zeros((8, 8, 3), np.uint8), "state": np.arange(3, dtype=np.float64), **extra}


def test_arrays_round_trip_read_only_and_refuse_bad_dtypes() -> None:
    value = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "s": np.float32(1.5), "t": "x"}
    back = unpack(pack(value))
    np.testing.assert_array_equal(back["a"], value["a"])
    assert back["a"].dtype == np.int16 and not back["a"].flags.writeable
    assert back["s"] == np.float32(1.5) and back["t"] == "x"
    for dtype in ("|O", "<c16", "|V8", "nope"):
        frame = pack({"x": {b"__ndarray__": True, b"data": b"", b"dtype": dtype, b"shape": [0]}})
        with pytest.raises(WireError) as info:
            unpack(frame)
        assert info.value.code in ("unsupported_dtype", "invalid_array")
    with pytest.raises(WireError, match="needs 8 bytes, got 7"):
        unpack(pack({"x": {b"__ndarray__": True, b"data": b"1234567", b"dtype": "<f4", b"shape": [2]}}))
    with pytest.raises(WireError) as info:
        unpack(b"\x92\x01")  # truncated
    assert info.value.code == "invalid_msgpack"
    with pytest.raises(WireError) as info:
        unpack(b"\x90" * 11, max_bytes=10)
    assert info.value.code == "payload_too_large"


def test_openpi_dialect_errors_close_1011_and_vllm_omni_additions_switch_dialect() -> None:
    core = RobotSessionCore(META, "sess_a")
    out = core.handle_frame(b"\xc1", 0.0)
    assert isinstance(out[0], SendFrame) and isinstance(out[0].data, str) and "invalid_msgpack" in out[0].data
    assert out[1] == CloseConnection(*OPENPI_CLOSE)
    out = core.handle_frame(pack({"endpoint": "reset"}), 0.0)
    assert core.dialect is Dialect.VLLM_OMNI
    assert isinstance(out[0], ResetPolicy) and unpack(out[1].data) == {"status": "reset successful"}  # type: ignore[union-attr,arg-type]
    err = core.handle_frame(pack(obs(state=np.zeros(4))), 0.0)
    assert len(err) == 1 and unpack(err[0].data)["code"] == "invalid_shape"  # type: ignore[union-attr,arg-type]
    pinned = RobotSessionCore(META, "sess_b", explicit_dialect=True)
    pinned.handle_frame(pack({"endpoint": "reset"}), 0.0)
    assert pinned.dialect is Dialect.OPENPI  # asked for openpi: never switched


def test_observations_become_infer_effects_with_prompt_changes() -> None:
    core = RobotSessionCore(META, "sess_a")
    (first,) = core.handle_frame(pack(obs(prompt="pick")), 1.0)
    assert isinstance(first, Infer) and first.prompt == "pick" and first.observation.seq == 1
    assert isinstance(first.observation, Observation) and first.observation.state.dtype == np.float32
    (again,) = core.handle_frame(pack(obs(prompt="pick")), 2.0)
    assert isinstance(again, Infer) and again.prompt is None  # unchanged: no update
    nested = {"cam": {"front": np.ones((3, 8, 8), np.float32)}, "state": np.zeros(3, np.float32)}
    (third,) = core.handle_frame(pack(nested), 3.0)  # nested keys, CHW floats in [0, 1]
    assert isinstance(third, Infer) and third.observation.images["cam/front"].shape == (8, 8, 3)
    assert third.observation.images["cam/front"].max() == 255
    upd = core.handle_frame(pack({"endpoint": "update", "prompt": "place"}), 4.0)
    assert isinstance(upd[0], UpdatePrompt) and core.context.prompt == "place"
    (ack,) = core.handle_frame(pack({"__ctrl__": "episode_end"}), 5.0)
    assert unpack(ack.data) == {"__ack__": "episode_end"}  # type: ignore[union-attr,arg-type]


def test_reply_is_openpi_shaped_and_context_round_trips() -> None:
    core = RobotSessionCore(META, "sess_a")
    actions = np.arange(8, dtype=np.float32).reshape(4, 2)
    reply = unpack(core.on_actions(actions, 3.0))
    assert sorted(reply) == ["actions", "server_timing"] and reply["server_timing"] == {"infer_ms": 3.0}
    core.on_answered(7.0)
    assert unpack(core.on_actions(actions, 1.0))["server_timing"]["prev_total_ms"] == 7.0
    core.context.prompt = "pick"
    restored = PolicyContext.from_record(core.context.to_record())
    assert restored.prompt == "pick" and restored.step == 2
    assert restored.previous is not None
    np.testing.assert_array_equal(restored.previous, actions)


def test_an_infer_endpoint_is_an_observation_timed_when_it_came() -> None:
    core = RobotSessionCore(META, "sess_a")
    (infer,) = core.handle_frame(pack({"endpoint": "infer", **obs()}), 12.5)
    assert isinstance(infer, Infer) and infer.received_at == 12.5 and core.dialect is Dialect.VLLM_OMNI
    (meta,) = core.handle_frame(pack({"endpoint": "metadata"}), 13.0)
    assert unpack(meta.data)["state_dim"] == 3  # type: ignore[union-attr,arg-type]
