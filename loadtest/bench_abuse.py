"""Memory cost of abusive sessions (issue 13): server RSS and Redis ``used_memory`` growth per
attack, at its peak and after the session ended (target: <= 64 MB per abusive session, all
released when it ends).

Starts its own ``redis-server`` and ``omniduplex serve --pipeline null`` (no model), then, one
at a time, with the server's default limits:

* ``retrieve``: one 1.9 MB text item and 100 ``conversation.item.retrieve`` (5.5 KB sent),
  client not reading (the issue measured +360 MB server, +570 MB Redis before the byte bounds);
* ``retrieve-read`` / ``retrieve-40``: the item retrieved 40 times by a client that reads every
  reply / that reads nothing (issue 33: +239 MB and +165 MB server + Redis RSS while each reply
  was logged in full; now the log keeps a reference);
* ``items``: 60 text items of 1.9 MB (+512 MB before the conversation budget);
* ``audio``: 58 minutes of push-to-talk audio sent as fast as possible, never committed
  (+102 MB before the input budget);
* ``silent``: a client that asks for output (responses, retrieves) and never reads;
* ``idle``: 200 TCP connections that send nothing or half a request.

Each pattern's session ends with its client (parked: resumable, its state still in Redis, as
``Redis while parked`` shows), then is deleted (``after end``). "server after" is RSS the
process keeps (Python's allocator does not hand every freed page back), not live objects.

    .venv/bin/python -m loadtest.bench_abuse            # all patterns
    .venv/bin/python -m loadtest.bench_abuse --patterns retrieve,items
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import psutil
import redis.asyncio
import websockets
from websockets.asyncio.client import ClientConnection

from loadtest.server_process import ROOT, free_port
from session.store.embedded import find_redis_server

MB = 1 << 20
BIG_TEXT = "w" * (1900 * 1024)


class Rig:
    """A redis-server and an ``omniduplex serve`` on it, both measured from outside."""

    def __init__(self, folder: Path, grace_s: float, serve: list[str] | None = None) -> None:
        """``serve``: the server's command up to its options (default: ``web.cli serve
        --pipeline null``; bench_fuzz runs the session tests' echo engine)."""
        self.folder = folder
        self.redis_port = free_port()
        self.port = free_port()
        self.redis = subprocess.Popen(
            [find_redis_server(), "--port", str(self.redis_port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            cwd=folder,
        )
        args = serve or [sys.executable, "-m", "web.cli", "serve", "--pipeline", "null"]
        args = [
            *args, "--port", str(self.port),
            "--redis-url", f"redis://127.0.0.1:{self.redis_port}/0", "--data-dir", str(folder / "data"),
            "--disconnect-grace-s", str(grace_s), "--log-level", "warning",
        ]  # fmt: skip
        self.server = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.asyncio.Redis(port=self.redis_port)
        self.opened: list[str] = []  # sessions the current pattern opened (DELETEd after it)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def ready(self) -> None:
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                try:
                    if (await http.get(f"{self.http}/readyz", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.3)
        raise SystemExit("the server did not start")

    async def memory(self) -> tuple[float, float, float]:
        """(server RSS, Redis used_memory, Redis RSS) in MB."""
        rss = psutil.Process(self.server.pid).memory_info().rss / MB
        used = int((await self.client.info("memory"))["used_memory"]) / MB
        redis_rss = psutil.Process(self.redis.pid).memory_info().rss / MB
        return rss, used, redis_rss

    async def sessions(self) -> int:
        async with httpx.AsyncClient() as http:
            return int((await http.get(f"{self.http}/readyz", timeout=5)).json()["sessions"])

    def stop(self) -> None:
        for proc in (self.server, self.redis):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def connect(rig: Rig, *, silent: bool = False) -> ClientConnection:
    """A realtime session; ``silent``: a small receive window and no client-side buffering."""
    sock = socket.socket()
    if silent:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", rig.port))
    sock.setblocking(False)
    ws = await websockets.connect(
        f"ws://127.0.0.1:{rig.port}/v1/realtime", sock=sock, max_size=None, max_queue=1 if silent else 16,
        compression=None, open_timeout=30,
    )  # fmt: skip
    while (event := json.loads(await ws.recv()))["type"] != "session.created":
        pass
    rig.opened.append(event["session"]["id"])
    return ws


async def drain_until(ws: ClientConnection, kind: str, within_s: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + within_s
    while True:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            message = await ws.recv()
        event = json.loads(message)
        if event["type"] in (kind, "error"):
            return dict(event)


def text_item(text: str, item_id: str | None = None) -> str:
    item: dict[str, object] = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    if item_id:
        item["id"] = item_id
    return json.dumps({"type": "conversation.item.create", "item": item})


RETRIEVE_BIG = json.dumps({"type": "conversation.item.retrieve", "item_id": "item_big"})


async def _retrieves_unread(ws: ClientConnection, count: int) -> str:
    """``count`` retrieves of the big item by a client that reads none of the replies."""
    for _ in range(count):
        await ws.send(RETRIEVE_BIG)
    await asyncio.sleep(20)  # the outbox budget (8 MiB) or the send deadline (15 s) ends it
    ws.transport.abort()
    return f"one 1.9 MB item, {count} retrieves, client not reading"


async def retrieve(rig: Rig) -> str:
    ws = await connect(rig, silent=True)
    await ws.send(text_item(BIG_TEXT, "item_big"))
    await drain_until(ws, "conversation.item.done")
    return await _retrieves_unread(ws, 100)


async def _big_item_session(rig: Rig, *, silent: bool) -> ClientConnection:
    ws = await connect(rig, silent=silent)
    await ws.send(text_item(BIG_TEXT, "item_big"))
    await drain_until(ws, "conversation.item.done")
    await asyncio.sleep(1.0)  # the item's own record and events written: not the retrieves' cost
    return ws


async def _retrieves_read(rig: Rig, *, burst: bool) -> str:
    """40 retrieves of the item, read as they come: all sent at once (``burst``), or each
    sent once the previous reply was read."""
    ws = await _big_item_session(rig, silent=False)
    rounds, per_round = (1, 40) if burst else (40, 1)
    got = 0
    outcome = "no refusal"
    try:
        for _ in range(rounds):
            for _ in range(per_round):
                await ws.send(RETRIEVE_BIG)
            wanted = got + per_round
            while got < wanted:
                async with asyncio.timeout(60):
                    message = await ws.recv()
                event = json.loads(message)
                got += event["type"] == "conversation.item.retrieved"
    except websockets.ConnectionClosed as closed:
        outcome = f"closed {closed.rcvd.code if closed.rcvd else 'without a close frame'}"
    await asyncio.sleep(2.0)  # the hub flushes its log meanwhile
    await ws.close()
    return f"{got} received, {outcome}"


async def retrieve_read(rig: Rig) -> str:
    """Issue 33: 40 retrieves by a client that reads each reply before it asks again."""
    outcome = await _retrieves_read(rig, burst=False)
    return f"one 1.9 MB item, 40 retrieves one by one, client reading ({outcome})"


async def retrieve_burst(rig: Rig) -> str:
    """40 retrieves sent at once by a client that reads as fast as it can."""
    outcome = await _retrieves_read(rig, burst=True)
    return f"one 1.9 MB item, 40 retrieves at once, client reading ({outcome})"


async def retrieve_silent(rig: Rig) -> str:
    """Issue 33: 40 retrieves by a client that reads nothing after the item."""
    return await _retrieves_unread(await _big_item_session(rig, silent=True), 40)


async def items(rig: Rig) -> str:
    ws = await connect(rig)
    refused = 0
    for i in range(60):
        await ws.send(text_item(BIG_TEXT + str(i)))
        event = await drain_until(ws, "conversation.item.done")
        refused += event["type"] == "error"
    await ws.close()
    return f"60 items of 1.9 MB ({60 - refused} accepted, {refused} refused: conversation_too_large)"


async def audio(rig: Rig) -> str:
    ws = await connect(rig)
    await ws.send(
        json.dumps(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
    )
    chunk = base64.b64encode(bytes(48000 * 10)).decode()  # 10 s of 24 kHz PCM16
    frame = json.dumps({"type": "input_audio_buffer.append", "audio": chunk})
    for _ in range(58 * 6):  # 58 minutes
        await ws.send(frame)
    await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
    errors = 0
    while True:
        async with asyncio.timeout(60):
            message = await ws.recv()
        event = json.loads(message)
        errors += event["type"] == "error"
        if event["type"] == "session.updated" and errors:
            break
    await ws.close()
    return (
        f"58 min of audio appended, never committed ({errors} appends refused: input_audio_buffer_too_large)"
    )


async def silent(rig: Rig) -> str:
    ws = await connect(rig, silent=True)
    await ws.send(text_item(BIG_TEXT, "item_big"))
    await drain_until(ws, "conversation.item.done")
    for _ in range(20):
        await ws.send(json.dumps({"type": "response.create"}))
        await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_big"}))
    await asyncio.sleep(20)
    ws.transport.abort()
    return "responses + retrieves asked for, client never reads"


async def idle(rig: Rig) -> str:
    socks = []
    for i in range(200):
        sock = socket.create_connection(("127.0.0.1", rig.port))
        if i % 2:
            sock.sendall(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)
    await asyncio.sleep(12)  # --http-timeout-s 10
    conns = psutil.Process(rig.server.pid).net_connections()
    open_ = sum(1 for c in conns if c.status == "ESTABLISHED" and c.laddr and c.laddr.port == rig.port)
    for sock in socks:
        sock.close()
    return f"200 idle/partial TCP connections ({open_} still established after 12 s)"


PATTERNS: dict[str, Callable[[Rig], Awaitable[str]]] = {
    "retrieve": retrieve,
    "retrieve-read": retrieve_read,
    "retrieve-burst": retrieve_burst,
    "retrieve-40": retrieve_silent,
    "items": items,
    "audio": audio,
    "silent": silent,
    "idle": idle,
}


async def measure(rig: Rig, name: str, grace_s: float) -> dict[str, object]:
    before = await rig.memory()
    peak = list(before)
    peak_rss = [before[0] + before[2]]  # server + Redis RSS, at the same sample
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            now = await rig.memory()
            peak[0], peak[1], peak[2] = max(peak[0], now[0]), max(peak[1], now[1]), max(peak[2], now[2])
            peak_rss[0] = max(peak_rss[0], now[0] + now[2])
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    try:
        what = await PATTERNS[name](rig)
    finally:
        done.set()
        await sampler
    for _ in range(int((grace_s + 30) * 2)):  # polled: the server is another process
        if not await rig.sessions():
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)
    parked = await rig.memory()  # its client gone: parked, resumable (state kept in Redis)
    async with httpx.AsyncClient() as http:  # then ended for good
        for session_id in rig.opened:
            await http.delete(f"{rig.http}/v1/sessions/{session_id}", timeout=10)
    rig.opened.clear()
    await asyncio.sleep(1.0)
    after = await rig.memory()
    return {
        "pattern": name,
        "what": what,
        "server_peak_mb": round(peak[0] - before[0], 1),
        "redis_peak_mb": round(peak[1] - before[1], 1),
        "total_peak_mb": round(peak[0] - before[0] + peak[1] - before[1], 1),
        "redis_rss_peak_mb": round(peak[2] - before[2], 1),
        "total_rss_peak_mb": round(peak_rss[0] - before[0] - before[2], 1),
        "redis_parked_mb": round(parked[1] - before[1], 1),
        "server_after_mb": round(after[0] - before[0], 1),
        "redis_after_mb": round(after[1] - before[1], 1),
        "sessions_after": await rig.sessions(),
    }


async def main_async(patterns: list[str], grace_s: float) -> list[dict[str, object]]:
    folder = Path(tempfile.mkdtemp(prefix="bench-abuse-"))
    rig = Rig(folder, grace_s)
    try:
        await rig.ready()
        rows = []
        for name in patterns:
            row = await measure(rig, name, grace_s)
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        await rig.client.aclose()
        rig.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--grace-s", type=float, default=2.0, help="server --disconnect-grace-s")
    args = parser.parse_args(argv)
    names = [p.strip() for p in args.patterns.split(",") if p.strip()]
    unknown = set(names) - set(PATTERNS)
    if unknown:
        parser.error(f"unknown patterns: {sorted(unknown)}")
    rows = asyncio.run(main_async(names, args.grace_s))
    print()
    print(
        "| pattern | server RSS peak | Redis used peak | Redis RSS peak | server + Redis RSS peak "
        "| Redis parked | server after end | Redis after end |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['what']} | +{r['server_peak_mb']} MB | +{r['redis_peak_mb']} MB "
            f"| +{r['redis_rss_peak_mb']} MB | **+{r['total_rss_peak_mb']} MB** "
            f"| {r['redis_parked_mb']:+} MB | {r['server_after_mb']:+} MB | {r['redis_after_mb']:+} MB |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
