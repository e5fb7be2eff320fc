"""GPT-Live on the wire (``/v1/live/sessions``, duplex-tiny, a real server on loopback): every
client event and its answer, and every refusal: a bad first message, an unknown event, audio
before the start, a wrong audio format, oversized frames and appends, a wrong key, a start that
never comes. Refusals after the start leave the session usable; before it, the connection ends
with 1008 (there is no session to keep). ``GET``/``DELETE /v1/sessions/{id}`` reach live sessions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets

from tests.live.wire import append, connect, pcm_b64, start_event
from tests.live_server import LiveServer

pytestmark = pytest.mark.system


async def test_every_client_event_is_answered(server: LiveServer) -> None:
    client = await connect(server)
    async with client.ws:
        started = await client.start()
        session = started["session"]
        assert session["id"].startswith("sess_") and session["model"] == "duplex-tiny"
        assert session["audio"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert session["delegation"] == {"type": "client"}
        assert "omni" not in session  # resume data only for a client that asks (headers: always)
        for i in range(5):
            await client.send(append(0.1, seed=i))
        answers = [
            ({"type": "session.input_audio.mute", "event_id": "m1"}, "session.input_audio.muted"),
            ({"type": "session.input_audio.unmute", "event_id": "u1"}, "session.input_audio.unmuted"),
            (
                {
                    "type": "session.instructions.append",
                    "event_id": "i1",
                    "delegation_id": None,
                    "content": "Be brief.",
                },
                "session.instructions.appended",
            ),
            (
                {
                    "type": "session.thinking.append",
                    "event_id": "t1",
                    "delegation_id": None,
                    "content": "It rains.",
                },
                "session.thinking.appended",
            ),
            (
                {
                    "type": "session.commentary.append",
                    "event_id": "c1",
                    "delegation_id": None,
                    "content": "Say hi.",
                },
                "session.commentary.appended",
            ),
            (
                {"type": "session.update", "event_id": "s1", "session": {"delegation": {"type": "client"}}},
                "session.updated",
            ),
            (
                {
                    "type": "response.item.create",
                    "event_id": "r1",
                    "item": {"type": "function_call_output", "call_id": "call_1", "output": "42"},
                },
                "response.item.created",
            ),
        ]
        for event, answer in answers:
            await client.send(event)
            got = await client.wait_for(answer)
            assert got["client_event_id"] == event["event_id"]
        await client.send({"type": "response.create", "event_id": "rc1"})
        created = await client.wait_for("response.event")
        assert created["event"]["type"] == "response.created"
        completed = await client.wait_for("response.event")
        assert completed["event"]["type"] == "response.completed"
        assert completed["event"]["response"]["id"] == created["event"]["response"]["id"]
        await client.send({"type": "session.close", "event_id": "x1"})
        usage = await client.wait_for("session.usage.updated", skip_audio=True)
        closed = await client.wait_for("session.closed")
        assert closed["reason"] == "close_requested"
        assert closed["usage"]["seconds"] == usage["usage"]["seconds"] == pytest.approx(0.5)
        code, _ = await client.closed()
        assert code == 1000


async def test_refusals_after_the_start_keep_the_session(server: LiveServer) -> None:
    client = await connect(server)
    async with client.ws:
        await client.start()

        async def refused(event: dict[str, Any] | str, code: str) -> dict[str, Any]:
            await client.send(event)
            error = await client.wait_for("error")
            assert error["error"]["code"] == code, error
            assert error["error"]["message"]
            return error

        error = await refused({"type": "session.dance", "event_id": "e1"}, "unknown_event")
        assert error["error"]["client_event_id"] == "e1"
        await refused("{not json", "invalid_json")
        await refused(
            {"type": "session.input_audio.append", "audio": "x" * (300 * 1024)}, "message_too_large"
        )
        await refused({"type": "session.input_audio.append", "audio": pcm_b64(3.0)}, "input_audio_too_large")
        await refused({"type": "session.input_audio.append", "audio": "!!!!"}, "invalid_audio")
        await refused(
            {"type": "session.input_audio.append", "audio": "AA=="}, "invalid_audio"
        )  # one byte: not PCM16
        await refused({"type": "session.input_audio.append"}, "missing_required_parameter")
        error = await refused(start_event(), "session_already_started")
        assert error["error"]["client_event_id"] == "evt_start"
        await refused(
            {"type": "session.update", "session": {"delegation": {"type": "responses"}}},
            "delegation_immutable",
        )
        await refused({"type": "session.update", "session": {"voice": "cedar"}}, "unknown_parameter")
        await refused(
            {"type": "session.commentary.append", "delegation_id": "dlg_nope", "content": "x"},
            "unknown_delegation",
        )
        await refused(
            {"type": "session.instructions.append", "delegation_id": None, "content": "x" * 5000},
            "text_too_large",
        )
        await refused(
            {"type": "session.thinking.append", "delegation_id": None}, "missing_required_parameter"
        )
        await refused({"type": "response.create"}, "invalid_value")  # nothing queued to deliver
        await refused({"type": "session.input_audio.mute", "muted": True}, "unknown_parameter")
        # still served
        await client.send(append())
        await client.send({"type": "session.input_audio.mute", "event_id": "m"})
        assert (await client.wait_for("session.input_audio.muted"))["client_event_id"] == "m"
        await client.send({"type": "session.close"})
        assert (await client.wait_for("session.closed"))["reason"] == "close_requested"


@pytest.mark.parametrize(
    ("first", "code"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_event"),
        (json.dumps(append()), "session_not_started"),  # audio before the start
        (json.dumps({"type": "session.input_audio.mute"}), "session_not_started"),
        (json.dumps({"type": "session.begin"}), "unknown_event"),
        (json.dumps(start_event(audio={"format": {"type": "audio/pcmu"}})), "unsupported_audio_format"),
        (
            json.dumps(start_event(audio={"format": {"type": "audio/pcm", "rate": 16000}})),
            "unsupported_audio_format",
        ),
        (json.dumps(start_event(model="gpt-4o-realtime")), "model_not_found"),
        (json.dumps(start_event(delegation={"type": "responses"})), "delegation_unavailable"),
        (json.dumps(start_event(temperature=0.5)), "unknown_parameter"),
        (json.dumps({"type": "session.start"}), "missing_required_parameter"),
        (json.dumps(start_event(instructions="x" * 40_000)), "text_too_large"),
    ],
)
async def test_a_bad_first_message_is_refused_and_the_connection_ends(
    server: LiveServer, first: str, code: str
) -> None:
    client = await connect(server)
    async with client.ws:
        await client.send(first)
        error = await client.event()
        assert error["type"] == "error" and error["error"]["code"] == code, error
        close_code, reason = await client.closed()
        assert close_code == 1008 and code in reason
    await _no_live_sessions(server)


async def test_without_session_start_the_connection_ends_at_the_deadline(server: LiveServer) -> None:
    client = await connect(server)
    async with client.ws:
        error = await client.event(within_s=20)
        assert error["error"]["code"] == "session_start_timeout"
        assert (await client.closed())[0] == 1008
    await _no_live_sessions(server)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
async def test_an_unauthorised_key_is_refused_before_the_upgrade(server: LiveServer, key: str | None) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await connect(server, key)
    response = refused.value.response
    assert response.status_code == 401
    assert json.loads(response.body)["error"]["code"] == "invalid_api_key"


async def test_sessions_api_describes_and_deletes_a_live_session(server: LiveServer) -> None:
    client = await connect(server, "sk-live-b")
    async with client.ws:
        sid = (await client.start())["session"]["id"]
        for i in range(3):
            await client.send(append(0.1, seed=i))
        headers = {"Authorization": "Bearer sk-live-b"}
        async with httpx.AsyncClient(base_url=server.http_url, headers=headers) as http:
            for _ in range(50):  # the appends are handled in order with this request's answer
                body = (await http.get(f"/v1/sessions/{sid}")).json()
                if body.get("live", {}).get("usage_s") == 0.3:
                    break
                await asyncio.sleep(0.05)
            assert body["kind"] == "live" and body["state"] == "active"
            assert body["live"]["phase"] == "live" and body["live"]["usage_s"] == 0.3
            other = await http.get(f"/v1/sessions/{sid}", headers={"Authorization": "Bearer sk-live-a"})
            assert other.status_code == 404  # another tenant's
            assert (await http.delete(f"/v1/sessions/{sid}")).status_code == 200
        closed = await client.wait_for("session.closed")
        assert closed["reason"] == "remote_hangup"
        assert (await client.closed())[0] == 1000
    await _no_live_sessions(server)


async def _no_live_sessions(server: LiveServer) -> None:
    for _ in range(100):
        if server.ctx.metrics.session_counts()["live"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a live session was left behind")
