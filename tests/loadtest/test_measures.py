"""The load generator's pure parts: playout simulation, delta sizing, SLOs, summaries."""

from __future__ import annotations

import base64
import json

import pytest

from loadtest.playout import PlayoutBuffer
from loadtest.server_metrics import Scrape, histogram_quantile
from loadtest.slo import evaluate, parse_slo
from loadtest.speech import encode_utterance, tone_utterance
from loadtest.stats import summarize
from loadtest.turns import TurnRecord
from loadtest.voice_ws import delta_audio_ms
from loadtest.workload import parse_levels

pytestmark = pytest.mark.unit


def test_playout_paced_stream_never_underruns() -> None:
    buf = PlayoutBuffer(prebuffer_ms=100)
    for i in range(50):  # 40 ms chunks arriving every 40 ms, with ±20 ms jitter
        buf.push(1.0 + i * 0.04 + (0.02 if i % 2 else -0.02) * (i > 0), 40)
    assert buf.underruns == 0
    assert buf.finished_at() == pytest.approx(1.1 + 2.0)


def test_playout_counts_a_late_chunk_and_resumes() -> None:
    buf = PlayoutBuffer(prebuffer_ms=50)
    buf.push(0.0, 40)  # plays 0.05 .. 0.09
    buf.push(0.2, 40)  # 110 ms late: a stall, then plays 0.2 .. 0.24
    buf.push(0.21, 40)
    assert (buf.underruns, round(buf.stall_s, 3)) == (1, 0.11)
    assert buf.underrun_at == [0.2]  # when: to line stalls up with other timelines
    assert buf.played_ms(0.22) == pytest.approx(60.0)


def test_delta_audio_ms_from_base64_length() -> None:
    for n_bytes in (1920, 1918, 1919, 2):
        b64 = base64.b64encode(bytes(n_bytes)).decode()
        event = {"type": "response.output_audio.delta", "event_id": "e", "response_id": "r", "delta": b64}
        raw = json.dumps(event, separators=(",", ":")).encode()
        assert delta_audio_ms(raw) == pytest.approx(n_bytes / 48)
    assert delta_audio_ms(b'{"type":"response.output_audio.delta","delta":"AAAA","x":1}') is None


def test_turn_metrics() -> None:
    turn = TurnRecord(0, 0, spoke_at=0.0, speech_ms=1000, speech_end=1.0)
    for i in range(5):
        turn.on_audio(1.2 + i * 0.04, 40)
    assert turn.ttfa_ms == pytest.approx(200)
    assert turn.stream_ms == pytest.approx(160)
    assert turn.rtf == pytest.approx((1.36 - 1.0) / 0.2)
    assert max(turn.gaps_s) == pytest.approx(0.04)
    assert turn.to_json()["underrun_at"] == []
    turn.on_audio(1.8, 40)  # 240 ms after the last: the 100 ms prebuffer ran dry
    assert turn.underruns == 1 and turn.to_json()["underrun_at"] == [1.8]


def test_utterance_frames_are_padded_and_timed() -> None:
    utt = encode_utterance(tone_utterance(1010), append_ms=40)
    assert len(utt.frames) == 26 and utt.speech_ms == pytest.approx(1010)
    assert utt.pad_ms == pytest.approx(26 * 40 - 1010)
    event = json.loads(utt.frames[0])
    assert event["type"] == "input_audio_buffer.append" and len(base64.b64decode(event["audio"])) == 960 * 2


def test_slo_and_summary() -> None:
    level = {
        "summary": {
            "ttfa_ms": summarize([100, 200, 300, 400]),
            "underruns": 0,
            "errors": 1,
            "admissions": {},
        },
        "server": {"rss_growth_mb": 12.0},
    }
    verdicts = evaluate(parse_slo("ttfa_p95_ms<=400, underruns==0, errors==0, rss_growth_mb<=100"), level)
    assert [v.ok for v in verdicts] == [True, True, False, True]
    with pytest.raises(ValueError):
        parse_slo("ttfa<=1")
    assert summarize([])["p50"] is None


def test_histogram_quantile_and_scrape() -> None:
    text = (
        "# TYPE h histogram\n"
        'h_bucket{le="0.1"} 10\nh_bucket{le="0.2"} 20\nh_bucket{le="+Inf"} 20\nh_count 20\nh_sum 2\n'
    )
    scrape = Scrape.parse(text, 0.0)
    assert histogram_quantile(0.5, scrape.buckets("h")) == pytest.approx(0.1)
    assert histogram_quantile(0.75, scrape.buckets("h")) == pytest.approx(0.15)
    assert histogram_quantile(0.5, []) is None


def test_parse_levels() -> None:
    assert parse_levels("1-16") == [1, 2, 4, 8, 16]
    assert parse_levels("3,1,200") == [1, 3, 200]


def test_world_stats_fps_jitter_and_action_latency() -> None:
    from loadtest.world import WARMUP_S, Action, WorldStats, world_summary

    stats = WorldStats(fps_requested=15.0, started_at=0.0)
    period = 1 / 15
    # One frame per chunk, on time, except chunk 40 which arrives 50 ms late (then on time).
    t = WARMUP_S
    for i in range(60):
        t += period + (0.05 if i == 40 else 0.0) - (0.05 if i == 41 else 0.0)
        stats.chunk_at.append(t)
        stats.chunk_frames.append(1)
    jitter = stats.jitter_ms()
    assert len(jitter) == 59
    assert max(jitter) == pytest.approx(50.0) and min(jitter) == pytest.approx(-50.0)
    assert stats.late_chunks() == 1  # > half a period late
    assert stats.fps() == pytest.approx(15.0)
    stats.actions["a"] = Action(sent_at=1.0, queued_at=1.01, applies_at=5, applied_at=1.06, applied_chunk=6)
    stats.actions["a"].frame_at = 1.07
    stats.actions["b"] = Action(sent_at=2.0)  # never queued
    assert stats.action_ms() == [pytest.approx(70.0)]
    assert stats.queued_to_applied_ms() == [pytest.approx(50.0)]
    summary = world_summary([stats])
    assert summary["actions_sent"] == 2 and summary["actions_applied"] == 1
    assert summary["applied_later_than_declared"] == 1
    assert summary["fps"]["min"] == pytest.approx(15.0)
    assert len(summary["frame_jitter_quantiles_ms"]) == 101


def test_rtc_speech_decodes_the_bank_at_48k() -> None:
    from loadtest.speech import build_speech_bank, rtc_speech

    bank = build_speech_bank("tone", append_ms=40, speech_ms=500)
    speech = rtc_speech(bank)
    assert len(speech) == len(bank.utterances)
    assert all(abs(len(s) - 24_000) <= 2 for s in speech)  # 500 ms at 48 kHz, padding dropped
    assert rtc_speech(bank) is speech  # decoded once per bank
