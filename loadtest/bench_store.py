"""Session store micro-benchmarks on a real redis-server (embedded on a unix socket by default).

1. **Admission at open**: 200 sessions call ``AdmissionController.try_admit``: all in one loop
   tick (``burst``, coalesced: the shipped path), arriving over ``--spread-ms`` (``spread``,
   like handshakes), and one EVALSHA per open for comparison; latency per call from the call
   to its decision, over ``--trials`` bursts. Redis-side script time comes from SLOWLOG.
2. **Resume replay**: a session with 300 logged events (2/3 are 1,280-byte audio deltas);
   ``SessionStore.resume`` (tenant + token check and the last 100 events: one round trip).
3. **Round trips per flush / per turn**: a paced response of 50 audio deltas (20 ms apart) and
   its text/transcript deltas through a ``SessionWriter``; round trips are counted on the
   client by a connection class that counts ``send_packed_command`` calls (a pipeline or a
   script call is one send).

    .venv/bin/python -m loadtest.bench_store                 # embedded redis-server
    .venv/bin/python -m loadtest.bench_store --redis-url redis://127.0.0.1:6379/15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from redis.asyncio import Connection, ConnectionPool, Redis, UnixDomainSocketConnection

from runtime.metrics import percentile
from session.admission import AdmissionController, Admitted
from session.store import EmbeddedRedis, SessionStore, SessionWriter


class Sends:
    count = 0


class CountingTcp(Connection):
    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        Sends.count += 1
        await super().send_packed_command(command, check_health)


class CountingUnix(UnixDomainSocketConnection):
    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        Sends.count += 1
        await super().send_packed_command(command, check_health)


def counting_client(url: str, max_connections: int = 64) -> Redis:
    u = urlparse(url)
    if u.scheme == "unix":
        pool = ConnectionPool(
            connection_class=CountingUnix, path=u.path, decode_responses=True, max_connections=max_connections
        )
    else:
        pool = ConnectionPool(
            connection_class=CountingTcp,
            host=u.hostname or "127.0.0.1",
            port=u.port or 6379,
            db=int(u.path.strip("/") or 0),
            decode_responses=True,
            max_connections=max_connections,
        )
    return Redis(connection_pool=pool)


def row(name: str, ms: Sequence[float], extra: str = "") -> str:
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    return f"| {name} | {len(ms)} | {p50:.3f} | {p99:.3f} | {max(ms):.3f} | {extra} |"


async def bench_admission(redis: Redis, trials: int, opens: int, spread_ms: float) -> dict[str, Any]:
    """Modes: ``burst`` (all opens in one loop tick, coalesced), ``spread`` (opens arriving
    uniformly over ``spread_ms``, as handshakes do), ``burst_uncoalesced`` (one EVALSHA each)."""
    results: dict[str, Any] = {}
    for mode in ("burst", "spread", "burst_uncoalesced"):
        lat: list[float] = []
        trips: list[int] = []
        server_us: list[float] = []
        await redis.config_set("slowlog-log-slower-than", 0)
        await redis.config_set("slowlog-max-len", 4096)
        for trial in range(trials):
            ctl = AdmissionController(
                redis, replica_id=f"bench-{mode}-{trial}", replica_limit=opens, tenant_limit=opens
            )
            await ctl.load_scripts()
            await redis.slowlog_reset()

            async def open_one(
                i: int, ctl: AdmissionController = ctl, trial: int = trial, mode: str = mode
            ) -> float:
                if mode == "spread":
                    await asyncio.sleep(spread_ms / 1000 * i / opens)
                sid, tenant = f"sess_b{trial}_{i}", f"tenant{i % 4}"
                t0 = time.perf_counter()
                if mode == "burst_uncoalesced":
                    d = (await ctl._decide_batch([_req(ctl, sid, tenant)]))[0]
                else:
                    d = await ctl.try_admit(sid, tenant)
                assert isinstance(d, Admitted), d
                return (time.perf_counter() - t0) * 1000

            lat += await asyncio.gather(*(open_one(i) for i in range(opens)))
            trips.append(ctl.round_trips)
            for entry in await redis.slowlog_get(4096):
                command = entry.get("command", b"")
                text = command.decode() if isinstance(command, bytes) else str(command)
                if text.upper().startswith("EVALSHA"):
                    server_us.append(float(entry["duration"]))
            for i in range(opens):
                await ctl.release(f"sess_b{trial}_{i}")
            await ctl.close()
        await redis.config_set("slowlog-log-slower-than", 10000)
        results[mode] = {
            "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99),
            "max_ms": max(lat),
            "calls": len(lat),
            "round_trips_per_burst": sum(trips) / len(trips),
            "redis_evalsha_us_total_per_burst": sum(server_us) / trials,
            "_lat": lat,
        }
    return results


def _req(ctl: AdmissionController, sid: str, tenant: str) -> Any:
    from session.admission import PendingAdmission

    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    return PendingAdmission(sid, tenant, ctl.tenant_limit(tenant), True, fut)


async def bench_resume(redis: Redis, trials: int) -> dict[str, Any]:
    store = SessionStore(redis)
    await store.load_scripts()
    record, token = await store.create_session("bench", {"voice": "alloy"})
    writer = SessionWriter(store, record)
    sent = []
    for i in range(300):
        kind = "response.output_audio.delta" if i % 3 else "response.output_text.delta"
        sent.append(
            writer.append({"type": kind, "response_id": "resp_1", "delta": "A" * 1280 if i % 3 else "word "})
        )
    await writer.flush()
    last_seen = sent[199]["event_id"]
    lat: list[float] = []
    Sends.count = 0
    for _ in range(trials):
        t0 = time.perf_counter()
        resumed = await store.resume("bench", record.session_id, token, last_seen)
        lat.append((time.perf_counter() - t0) * 1000)
        events = resumed.events
        assert events is not None and len(events) == 100 and events[0]["event_id"] == sent[200]["event_id"]
    return {
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat),
        "round_trips": Sends.count / trials,
        "_lat": lat,
    }


async def bench_turn(redis: Redis, turns: int) -> dict[str, Any]:
    store = SessionStore(redis)
    await store.load_scripts()
    record, _ = await store.create_session("bench")
    writer = SessionWriter(store, record)  # defaults: 25 ms timer, 128 events per batch
    await writer.start()
    Sends.count = 0
    events = 0
    for t in range(turns):
        writer.put_item({"id": f"item_u{t}", "type": "message", "role": "user"})
        for kind in ("response.created", "response.output_item.added", "response.content_part.added"):
            writer.append({"type": kind})
            events += 1
        for i in range(50):  # 1 s of audio in 20 ms deltas, with transcript deltas
            writer.append({"type": "response.output_audio.delta", "delta": "A" * 1280})
            writer.append({"type": "response.output_audio_transcript.delta", "delta": f"w{i} "})
            events += 2
            await asyncio.sleep(0.02)
        writer.put_item({"id": f"item_a{t}", "type": "message", "role": "assistant", "status": "completed"})
        writer.append({"type": "response.done"})
        events += 1
        await writer.flush()
    await writer.close()
    return {
        "turns": turns,
        "events_per_turn": events / turns,
        "round_trips_per_turn": Sends.count / turns,
        "flushes": writer.flushes,
        "events_per_round_trip": events / max(1, Sends.count),
        "round_trips_per_input_audio_frame": 0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    embedded: EmbeddedRedis | None = None
    url = args.redis_url
    with tempfile.TemporaryDirectory(prefix="od-bench-") as tmp:
        if url is None:
            embedded = EmbeddedRedis(Path(tmp) / "od", fsync=args.fsync)
            url = await embedded.start()
        redis = counting_client(url, max_connections=args.opens + 8)
        try:
            out = {
                "redis": url.split("://")[0],
                "admission": await bench_admission(redis, args.trials, args.opens, args.spread_ms),
                "resume": await bench_resume(redis, args.resume_trials),
                "turn": await bench_turn(redis, args.turns),
            }
        finally:
            await redis.aclose()
            if embedded is not None:
                await embedded.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default=None, help="default: an embedded redis-server on a unix socket")
    ap.add_argument("--fsync", choices=["always", "everysec"], default="always", help="embedded AOF policy")
    ap.add_argument("--opens", type=int, default=200)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--spread-ms", type=float, default=100.0)
    ap.add_argument("--resume-trials", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    adm = out["admission"]
    print(
        f"redis transport: {out['redis']}, "
        f"embedded appendfsync: {args.fsync if not args.redis_url else '-'}\n"
    )
    print("| measure | n | p50 ms | p99 ms | max ms | notes |\n|---|---|---|---|---|---|")
    for mode, r in adm.items():
        note = (
            f"{r['round_trips_per_burst']:.1f} round trips per {args.opens} opens; "
            f"redis script time {r['redis_evalsha_us_total_per_burst'] / 1000:.2f} ms per {args.opens} opens"
        )
        print(row(f"admission, {args.opens} opens at once ({mode})", r["_lat"], note))
    res = out["resume"]
    print(row("resume: authorize + replay 100 events", res["_lat"], f"{res['round_trips']:.0f} round trips"))
    turn = out["turn"]
    print(
        f"\nper turn: {turn['events_per_turn']:.0f} logged events, "
        f"{turn['round_trips_per_turn']:.1f} round trips "
        f"({turn['events_per_round_trip']:.1f} events per round trip); 0 per input audio frame"
    )
    if args.json:
        clean = json.loads(json.dumps(out, default=str))
        for section in (clean["admission"].values(), [clean["resume"]]):
            for r in section:
                r.pop("_lat", None)
        args.json.write_text(json.dumps(clean, indent=2))


if __name__ == "__main__":
    main()
