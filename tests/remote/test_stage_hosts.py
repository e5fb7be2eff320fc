"""Stages on other hosts, end to end: stage hosts as separate processes on loopback, the server
finding them through a real Redis, a Realtime session over the official openai SDK."""

from __future__ import annotations

import asyncio
import base64
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from tests.conftest_redis import start_tcp_redis
from tests.live_server import LiveServer, live_server
from tests.realtime.wire import ServerEvents, sdk_session
from tests.remote.hosts import (
    KEY,
    StageHostProcess,
    restart_tcp_redis,
    start_host,
    tiny_pipeline,
    until,
    wait_members,
)

pytestmark = pytest.mark.system


@pytest.fixture
def stage_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OMNIDUPLEX_STAGE_KEY", KEY)
    return KEY


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    return tiny_pipeline(tmp_path / "qwen3-omni-tiny.yaml")


@pytest.fixture
def hosts() -> Iterator[list[StageHostProcess]]:
    started: list[StageHostProcess] = []
    yield started
    for host in started:
        host.kill()


async def audio_turn(conn: object, events: ServerEvents, text: str, within_s: float = 60) -> list:
    await conn.conversation.item.create(  # type: ignore[attr-defined]
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await conn.response.create()  # type: ignore[attr-defined]
    return await events.collect_until("response.done", within_s=within_s)


def audio_bytes(turn: list) -> int:
    return sum(len(base64.b64decode(r.raw["delta"])) for r in turn if r.type == "response.output_audio.delta")


def metric(text: str, series: str) -> float:
    """The value of one series in a Prometheus exposition."""
    found = [line for line in text.splitlines() if line.startswith(series + " ")]
    assert len(found) == 1, (series, [line for line in text.splitlines() if line.startswith(series[:30])])
    return float(found[0].rsplit(" ", 1)[1])


def qwen_server(
    tmp_path: Path, pipeline: Path, redis_url: str, *remote: str
) -> AbstractContextManager[LiveServer]:
    return live_server(
        tmp_path / "srv", pipeline=str(pipeline), redis_url=redis_url, remote_stages=remote, vad=False
    )


async def test_talker_and_code2wav_on_two_hosts_serve_a_realtime_session(
    tmp_path: Path, pipeline: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    hosts.append(start_host(pipeline, "talker", redis_url))
    hosts.append(start_host(pipeline, "code2wav", redis_url))
    with qwen_server(tmp_path, pipeline, redis_url, "talker", "code2wav") as server:
        assert isinstance(server, LiveServer)
        orchestrator = server.ctx.orchestrator
        await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
        async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            first = await audio_turn(conn, events, "hello there")
            second = await audio_turn(conn, events, "and again")
        for turn in (first, second):
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            assert audio_bytes(turn) > 24_000  # over half a second of 24 kHz PCM16
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            listing = (await http.get("/v1/stages")).json()  # open: loopback, no API keys
            metrics = (await http.get("/metrics")).text
        rows = {row["stage"]: row for row in listing["data"]}
        assert set(rows) == {"thinker", "talker", "code2wav", "vad", "transcribe"}
        assert rows["thinker"]["address"] == "local"
        for stage, host in (("talker", hosts[0]), ("code2wav", hosts[1])):
            row = rows[stage]
            assert row["address"] == f"{host.control}/0" and row["state"] == "SERVING", row
            assert row["in_flight"] == 0 and row["calls"] > 0 and row["failures"] == 0, row
            assert 0 < row["lease_expires_in_s"] <= 3, row
            labels = f'host="{host.control}",replica_id="{row["replica_id"]}",stage="{stage}"'
            assert metric(metrics, f"omniduplex_remote_stage_calls_total{{{labels}}}") >= row["calls"]
            assert f"omniduplex_remote_stage_call_seconds_count{{{labels}}}" in metrics
        assert listing["registry_error"] is None and listing["refused"] == []
        # code2wav's audio came back through the transfer engine, not the control messages
        code2wav_owner = rows["code2wav"]["transfer_session"]
        assert metric(metrics, f'omniduplex_stage_transfer_bytes_total{{owner="{code2wav_owner}"}}') > 24_000
        assert f'omniduplex_stage_transfer_seconds_count{{owner="{code2wav_owner}"}}' in metrics


async def test_a_host_killed_mid_response_fails_it_naming_the_stage_and_a_replacement_serves_the_next(
    tmp_path: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    pipeline = tiny_pipeline(tmp_path / "qwen3-omni-tiny.yaml", max_frames=250)  # ~6 s of talker work
    talker = start_host(pipeline, "talker", redis_url)
    hosts += [talker, start_host(pipeline, "code2wav", redis_url)]
    with qwen_server(tmp_path, pipeline, redis_url, "talker", "code2wav") as server:
        assert isinstance(server, LiveServer)
        orchestrator = server.ctx.orchestrator
        await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
        async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
            )
            await conn.response.create()
            first = await events.wait_for("response.output_audio.delta", "response.done", within_s=120)
            assert first.type == "response.output_audio.delta", first.raw  # the talker is still going
            killed_at = time.monotonic()
            talker.kill()
            done = await events.wait_for("response.done", within_s=15)
            assert time.monotonic() - killed_at < 5
            response = done.event.response
            assert response.status == "failed", done.raw
            error = done.raw["response"]["status_details"]["error"]
            assert error["message"] == "stage_unavailable: stage talker lost its host mid-request", error
            # The session stays usable; a replacement host registers and serves the next turn.
            hosts.append(start_host(pipeline, "talker", redis_url))
            await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
            assert len(orchestrator.remote.stages["talker"].members) == 1  # the dead one is gone
            turn = await audio_turn(conn, events, "still there?", within_s=120)
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            assert audio_bytes(turn) > 24_000


async def test_a_host_killed_before_a_response_sent_anything_has_it_re_run_on_another_replica(
    tmp_path: Path, pipeline: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    """The thinker on two hosts. The session's host is frozen (SIGSTOP) before the second turn,
    so the turn's first work call waits there and nothing of it can reach the client; then it is
    killed: the turn runs again on the other host and completes, the client never sees a failure."""
    hosts += [start_host(pipeline, "thinker", redis_url), start_host(pipeline, "thinker", redis_url)]
    with qwen_server(tmp_path, pipeline, redis_url, "thinker") as server:
        assert isinstance(server, LiveServer)
        orchestrator = server.ctx.orchestrator
        stage = orchestrator.remote.stages["thinker"]
        await wait_members(orchestrator, {"thinker": 2})
        async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            turn = await audio_turn(conn, events, "hello there")
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            (sticky,) = [m for m in stage.members.values() if m.worker.calls > 0]  # the session's host
            (other,) = [m for m in stage.members.values() if m is not sticky]
            (frozen,) = [h for h in hosts if sticky.entry.url == f"{h.control}/0"]
            calls_before = other.worker.calls
            frozen.proc.send_signal(signal.SIGSTOP)
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
            )
            await conn.response.create()
            # well within the 3 s heartbeat timeout: the turn went to the frozen host
            await until(lambda: sticky.replica.load > 0, 2, "the turn on the frozen host")
            frozen.kill()
            turn = await events.collect_until("response.done", within_s=120)
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            assert audio_bytes(turn) > 24_000
            assert not [r for r in turn if r.type == "error"], [r.raw for r in turn if r.type == "error"]
            assert orchestrator.reruns.counts == {"thinker": 1}
            assert other.worker.calls > calls_before and not orchestrator.reruns.aliases
            # the next turn sticks to the surviving host
            turn = await audio_turn(conn, events, "still there?")
            assert turn[-1].event.response.status == "completed", turn[-1].raw
        assert orchestrator.health()["remote"]["reruns"] == {"thinker": 1}


async def test_a_host_with_another_key_never_gets_work(
    tmp_path: Path, pipeline: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    impostor = start_host(pipeline, "talker", redis_url, key="another-stage-key-9876543210")
    hosts += [impostor, start_host(pipeline, "code2wav", redis_url)]
    with qwen_server(tmp_path, pipeline, redis_url, "talker", "code2wav") as server:
        assert isinstance(server, LiveServer)
        orchestrator = server.ctx.orchestrator
        await wait_members(orchestrator, {"code2wav": 1})
        await until(lambda: bool(orchestrator.remote.refused), 30, "the impostor refused")
        (reason,) = [why for _, why in orchestrator.remote.refused.values()]
        assert "another stage key" in reason
        assert not orchestrator.remote.stages["talker"].members
        async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            turn = await audio_turn(conn, events, "anyone?")
            assert turn[-1].event.response.status == "failed"
            error = turn[-1].raw["response"]["status_details"]["error"]
            assert error["message"] == "stage_unavailable: stage talker has no live replica on a stage host"
            hosts.append(start_host(pipeline, "talker", redis_url))  # the right key: it serves
            await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
            turn = await audio_turn(conn, events, "now?")
            assert turn[-1].event.response.status == "completed", turn[-1].raw
        assert impostor.proc.poll() is None  # refused, still running, never given a call
        assert "work call" not in impostor.output


def test_a_non_loopback_listen_without_a_key_refuses_to_start(pipeline: Path) -> None:
    host = start_host(
        pipeline, "talker", "redis://127.0.0.1:1/0", key=None, extra=["--listen", "10.29.0.9"], wait=False
    )
    assert host.proc.wait(60) == 2
    host.ready.wait(10)
    assert "refusing to listen on 10.29.0.9 without OMNIDUPLEX_STAGE_KEY" in host.output


async def test_voice_cascade_with_its_tts_on_a_stage_host(
    tmp_path: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    hosts.append(start_host("voice-cascade", "tts", redis_url))
    with live_server(tmp_path / "srv", redis_url=redis_url, remote_stages=("tts",), vad=False) as server:
        orchestrator = server.ctx.orchestrator
        await wait_members(orchestrator, {"tts": 1})
        async with sdk_session(server) as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            turn = await audio_turn(conn, events, "good morning")
        assert turn[-1].event.response.status == "completed", turn[-1].raw
        transcript = "".join(
            r.raw["delta"] for r in turn if r.type == "response.output_audio_transcript.delta"
        )
        assert transcript.strip() == "You said: good morning"
        assert audio_bytes(turn) > 24_000  # Piper's speech, resampled to 24 kHz PCM16
        (row,) = orchestrator.remote.snapshot()
        assert row["stage"] == "tts" and row["calls"] > 0 and row["failures"] == 0


async def test_redis_restart_is_a_clear_registry_error_then_recovers(
    tmp_path: Path, pipeline: Path, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    redis = start_tcp_redis(tmp_path / "redis")
    try:
        hosts += [start_host(pipeline, "talker", redis.url), start_host(pipeline, "code2wav", redis.url)]
        with qwen_server(tmp_path, pipeline, redis.url, "talker", "code2wav") as server:
            assert isinstance(server, LiveServer)
            orchestrator = server.ctx.orchestrator
            await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
            redis.stop()
            await until(lambda: orchestrator.remote.registry_error is not None, 15, "a registry error")
            assert "redis unavailable" in orchestrator.remote.registry_error
            await asyncio.sleep(4)  # past the hosts' 3 s lease: the replicas that answer are kept
            assert len(orchestrator.remote.stages["talker"].members) == 1
            redis = restart_tcp_redis(redis)  # empty: the hosts register again on their next beat
            await until(lambda: orchestrator.remote.registry_error is None, 15, "the registry back")
            await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
            async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
                await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
                turn = await audio_turn(conn, events, "back again")
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            assert audio_bytes(turn) > 24_000
    finally:
        redis.stop()


async def test_sigterm_drains_a_host_it_finishes_the_response_it_holds_and_leaves(
    tmp_path: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    pipeline = tiny_pipeline(tmp_path / "qwen3-omni-tiny.yaml", max_frames=150)
    talker = start_host(pipeline, "talker", redis_url)
    hosts += [talker, start_host(pipeline, "code2wav", redis_url)]
    with qwen_server(tmp_path, pipeline, redis_url, "talker", "code2wav") as server:
        orchestrator = server.ctx.orchestrator
        await wait_members(orchestrator, {"talker": 1, "code2wav": 1})
        async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
            )
            await conn.response.create()
            first = await events.wait_for("response.output_audio.delta", "response.done", within_s=120)
            assert first.type == "response.output_audio.delta", first.raw
            talker.proc.send_signal(signal.SIGTERM)  # mid-response
            turn = await events.collect_until("response.done", within_s=120)
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            exit_code = await asyncio.to_thread(talker.proc.wait, 60)
            assert exit_code == 0, talker.output[-2000:]
            # it left the registry: the pool drops it, and a turn now has no talker
            await until(lambda: not orchestrator.remote.stages["talker"].members, 30, "the talker gone")
            turn = await audio_turn(conn, events, "anyone left?")
            error = turn[-1].raw["response"]["status_details"]["error"]
            assert error["message"] == "stage_unavailable: stage talker has no live replica on a stage host"


async def test_a_draining_thinker_hands_its_sessions_kv_to_the_replica_that_takes_them_over(
    tmp_path: Path, pipeline: Path, redis_url: str, stage_key: str, hosts: list[StageHostProcess]
) -> None:
    first = start_host(pipeline, "thinker", redis_url)
    hosts.append(first)
    with qwen_server(tmp_path, pipeline, redis_url, "thinker") as server:
        orchestrator = server.ctx.orchestrator
        stage = orchestrator.remote.stages["thinker"]
        await wait_members(orchestrator, {"thinker": 1})
        async with sdk_session(server, model="qwen3-omni-tiny") as (conn, events):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            for text in ("hello there", "tell me more"):
                turn = await audio_turn(conn, events, text)
                assert turn[-1].event.response.status == "completed", turn[-1].raw
            (old_id,) = stage.members
            # the thinker's figures for its last request (turn 2): its whole prompt's length
            before = (await stage.members[old_id].worker.ask("stats"))["engine"]
            second = start_host(pipeline, "thinker", redis_url)
            hosts.append(second)
            await wait_members(orchestrator, {"thinker": 2})
            (new_id,) = set(stage.members) - {old_id}
            first.proc.send_signal(signal.SIGTERM)  # drains: its session's KV is handed on
            await until(lambda: len(stage.kv_moves) == 1, 30, "the KV handed on")
            turn = await audio_turn(conn, events, "and one more thing")
            assert turn[-1].event.response.status == "completed", turn[-1].raw
            stats = await stage.members[new_id].worker.ask("stats")
        assert stats["kv_imported"] == 1 and not stage.kv_moves
        engine = stats["engine"]  # the thinker's figures for its last request: this turn
        assert engine["requests"] == 1 and engine["reused_tokens"] > 0
        # only the new turn's tokens were prefilled: the conversation so far (at least all of
        # turn 2's prompt) came with the KV
        assert engine["prefill_tokens"] > 0, engine
        assert engine["reused_tokens"] >= before["prefill_tokens"] + before["reused_tokens"], (engine, before)
        assert await asyncio.to_thread(first.proc.wait, 60) == 0  # it left once the KV was taken
