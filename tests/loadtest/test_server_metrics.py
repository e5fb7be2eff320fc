"""`web.server.metrics.ServerMetrics`: a per-app registry fed by runtime and driver hooks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from loadtest.server_metrics import Scrape
from media.audio import PCM24K
from runtime.metrics import RuntimeMetrics
from session.realtime.conversation import Content, Conversation, Item
from session.voice.driver import RealtimeDriver
from web.server.metrics import ServerMetrics

pytestmark = pytest.mark.unit


def test_metrics_from_hooks_and_scrape_time_state() -> None:
    runtime = RuntimeMetrics()
    runtime.add_stage("respond", replicas=1)
    metrics = ServerMetrics()
    metrics.bind_runtime(runtime)
    conversation = Conversation()
    answer = Content(type="output_audio", output_audio=bytearray(960), output_format=PCM24K)
    conversation.insert(
        Item(
            id="item_1",
            type="message",
            role="user",
            content=[Content(type="input_audio", input_audio=np.zeros(1600, np.float32)), answer],
        )
    )
    driver = RealtimeDriver(SimpleNamespace(conversation=conversation), None)  # type: ignore[arg-type]
    held = RealtimeDriver(  # a session whose log holds 5,000 bytes of audio deltas for a resume
        SimpleNamespace(conversation=Conversation()),  # type: ignore[arg-type]
        None,
        log=SimpleNamespace(held_bytes=5000),  # type: ignore[arg-type]
    )
    metrics.bind_sessions(lambda: [driver, held, object()])

    runtime.step("respond", 0, batch=8, step_s=0.002)
    runtime.queue("respond", 0, depth=3, live=9)
    runtime.request("respond", 0.5, "completed")
    runtime.counters("respond", {"prompt": 120, "prompt_cached": 96})  # a prefix-caching LM stage
    runtime.counters("respond", {"prompt": 40, "prompt_cached": 0})
    metrics.response_started()
    metrics.first_audio(0.21)
    metrics.response_finished("completed", 2.3)
    metrics.error("invalid_value")
    metrics.admission("admitted")
    metrics.admission("server_busy")

    scrape = Scrape.parse(metrics.render().decode(), 0.0)
    assert scrape.value("omniduplex_stage_step_seconds_count", stage="respond") == 1
    assert scrape.value("omniduplex_stage_batch_size_sum", stage="respond") == 8
    assert scrape.value("omniduplex_stage_queue_depth", stage="respond", replica="0") == 3
    assert scrape.value("omniduplex_stage_live_requests", stage="respond", replica="0") == 9
    assert scrape.by_label("omniduplex_stage_engine_total", "counter") == {"prompt": 160, "prompt_cached": 96}
    assert runtime.snapshot()["stages"]["respond"]["counters"] == {"prompt": 160, "prompt_cached": 96}
    assert scrape.value("omniduplex_time_to_first_audio_seconds_sum") == 0.21
    assert scrape.value("omniduplex_turn_latency_seconds_count", status="completed") == 1
    assert scrape.value("omniduplex_errors_total", code="invalid_value") == 1
    assert scrape.by_label("omniduplex_admissions_total", "outcome") == {"admitted": 1, "server_busy": 1}
    assert scrape.value("omniduplex_active_sessions") == 3
    assert scrape.value("omniduplex_conversation_audio_bytes") == 1600 * 4 + 960
    assert scrape.value("omniduplex_held_audio_bytes") == 5000
    assert scrape.value("process_resident_memory_bytes") > 0


def test_registries_are_per_app() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.error("x")
    assert Scrape.parse(b.render().decode(), 0.0).value("omniduplex_errors_total", code="x") == 0
