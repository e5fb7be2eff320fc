"""duplex-tiny behind GPT-Live (``/v1/live/sessions``), driven by LiveKit Agents' unmodified
``GPTLiveModel`` (PyPI ``livekit-agents`` 1.8.9, ``base_url`` pointed at the server): session
start, audio in in real time, the model's audio (a continuous stream, its bursts found by the
plugin's own gate) and transcript out, a mute and an unmute, an instructions append, and a close
answered with ``session.closed``; no ``error`` reaches the application and the plugin logs
nothing (no event it could not handle)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live.conftest import run_gpt_live
from tests.live_server import LiveServer

pytestmark = pytest.mark.system


def test_gpt_live_model_session_end_to_end(server: LiveServer, livekit_client_python: Path) -> None:
    report = run_gpt_live(livekit_client_python, server, "--api-key", "sk-live-a", "--seconds", "8")
    types = report["types"]
    assert report["errors"] == [], report["errors"]
    assert report["log"] == [], report["log"]
    # the session: started (its id is the server's), then the live stream, then closed on request
    assert types["session.started"] == 1
    assert report["session_id"] == report["started"][0]["session"]["id"]
    assert report["session_id"].startswith("sess_")
    assert report["closed"] and report["closed"][0]["reason"] == "close_requested"
    usage = report["closed"][0]["usage"]["seconds"]
    assert 7.9 <= usage <= 8.1, usage  # the session's clock is its input audio: 80 appends of 100 ms
    # the plugin acknowledged the mute, unmute and append (it logs acks at debug level only)
    assert types["session.input_audio.muted"] == 1
    assert types["session.input_audio.unmuted"] == 1
    assert types["session.instructions.appended"] == 1
    # the model's audio: a continuous stream (silence while the model is quiet) keeping up with
    # the input, with at least one burst of speech the plugin's gate opens on
    audio = report["audio"]
    # (the stream runs ~0.2 s behind the input; speech the model makes late, on a busy host, can
    # run past the input's end)
    assert 6.0 <= audio["seconds"] <= 11.0, audio
    assert audio["peak"] > 0 and audio["bursts"] >= 1, audio
    # the model's words (noise from random weights) on the output timeline, in order
    transcript = report["transcript"]
    assert transcript, "no output transcript"
    starts = [start for _text, start, _end in transcript]
    assert starts == sorted(starts)
    assert all(end > start for _text, start, end in transcript)


def test_gpt_live_model_with_a_wrong_key_ends_without_a_session(
    server: LiveServer, livekit_client_python: Path
) -> None:
    """A refused handshake (401 before the upgrade): the application hears of a failed connection
    (the plugin retries), no event ever arrives, and the server opened no session."""
    refused = server.ctx.metrics.admissions.labels(outcome="invalid_api_key")
    before = refused._value.get()
    report = run_gpt_live(
        livekit_client_python, server, "--api-key", "sk-wrong", "--seconds", "1", "--tail", "1"
    )
    assert report["types"] == {}
    assert report["errors"] and all("connection error" in e for e in report["errors"]), report["errors"]
    assert refused._value.get() > before
    assert server.ctx.metrics.session_counts()["live"] == 0
