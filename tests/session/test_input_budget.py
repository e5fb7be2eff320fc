"""The uncommitted input budget on a media track (WebRTC push-to-talk): the sans-I/O core drops
track audio past `max_input_audio_s` with one `error`, and takes it again once committed."""

from __future__ import annotations

import numpy as np
import pytest

from tests.session.realtime_harness import Harness

pytestmark = pytest.mark.unit


def errors(h: Harness) -> list[dict]:
    return [e["error"] for e in h.events if e["type"] == "error"]


def test_track_audio_past_the_budget_is_dropped_with_one_error() -> None:
    h = Harness(max_input_audio_s=1.0, audio_out_via_track=True)
    h.push_to_talk()
    second = np.zeros(48000, dtype=np.float32)  # 1 s at 48 kHz (Opus)
    for _ in range(5):
        h.take(h.core.feed_input_audio(second, 48000, h.now))
    (error,) = errors(h)
    assert error["code"] == "input_audio_buffer_too_large"
    assert h.core.user.input.buffered_ms < 2100  # the rest was dropped, not buffered
    h.send({"type": "input_audio_buffer.commit"})
    assert [e for e in h.events if e["type"] == "input_audio_buffer.committed"]
    h.take(h.core.feed_input_audio(second, 48000, h.now))  # room again: no new error
    assert len(errors(h)) == 1 and h.core.user.input.buffered_ms >= 900
