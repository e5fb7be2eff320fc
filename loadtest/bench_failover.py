"""Failover: kill -9 a session's replica mid-conversation; the client resumes through the gateway.

Real processes on loopback: an embedded ``redis-server`` (unix socket), two replicas
(``omniduplex serve --pipeline <paced null> --redis-url ... --advertise-url ...``, production
lease: 5 s, beat every 2 s) and a gateway. Per trial (``--trials``, default 20):

1. a client opens a session through the gateway and takes ``--turns`` turns (a user text
   item, ``response.create``, the reply streamed to ``response.done``);
2. it starts one more turn and the replica that owns the session is killed with SIGKILL at
   a random moment: mid-response (after a random number of audio deltas) or between turns;
3. the client sees its connection close (1012 ``replica_lost``) and reconnects at once with
   ``?session_id=&last_event_id=`` and its resume token: the gateway waits until the dead
   owner's lease lapses, then routes the resume to the live replica, which takes the session
   over (epoch + 1) and rebuilds it from Redis;
4. the client gets ``omni.session.resumed`` then ``omni.session.migrated``, sees the response
   that was in flight end ``failed`` / ``replica_lost``, and takes the next turn.

Measured: the lease lapse after the kill (from the dead replica's lease deadline in the
registry, on Redis's clock), and kill → the next turn's ``response.done``. Target: the next
turn completes within lease lapse + 1 s. Committed items: every item the client saw
``conversation.item.done`` for before the kill must be in the session's conversation in
Redis after the failover, with the same content; a lost one fails the trial. The killed
replica is replaced by a fresh one before the next trial.

    .venv/bin/python -m loadtest.bench_failover --trials 20 --json failover.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.bench_gateway import embedded_redis, spawn_gateway, spawn_replica, wait_http
from loadtest.realtime_client import RealtimeClient
from loadtest.report import write_json
from loadtest.server_process import Child
from loadtest.stats import summarize
from session.affinity import ReplicaRegistry
from session.store import SessionStore, redis_connection


def paced_null_pipeline(folder: Path, *, delay_ms: int, audio_ms: int) -> Path:
    """The null pipeline with a shorter, real-time paced reply."""
    doc = {
        "name": "null-paced",
        "entry": "respond",
        "stages": [
            {
                "name": "respond",
                "engine": "null.audio",
                "options": {
                    "delay_ms": delay_ms,
                    "audio_ms": audio_ms,
                    "chunk_ms": 40,
                    "sample_rate": 24000,
                    "realtime": True,
                },
                "budget": {"max_concurrency": 256, "max_batch": 64, "worker": "thread", "device": "cpu"},
            }
        ],
        "edges": [],
    }
    path = folder / "null-paced.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Client(RealtimeClient):
    """A raw realtime client that keeps every event it received (bench timeouts: 30 s)."""

    timeout_s = 30.0
    open_timeout_s = 30.0


def item_content(item: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (str(c.get("type")), str(c.get("text") or c.get("transcript") or "")) for c in item.get("content", [])
    ]


@dataclass
class Trial:
    index: int
    phase: str  # "mid_response" or "between_turns"
    lapse_after_kill_s: float = 0.0
    resumed_after_kill_s: float = 0.0
    next_turn_done_after_kill_s: float = 0.0
    within_target: bool = False
    migrated: bool = False
    in_flight_failed_replica_lost: bool | None = None  # None: nothing was in flight
    replayed: int = 0
    resynced: bool = False
    committed_items: int = 0
    lost_items: int = 0
    error: str | None = None
    notes: list[str] = field(default_factory=list)


class Deployment:
    def __init__(
        self, redis_url: str, redis: Any, tmp: Path, pipeline: Path, args: argparse.Namespace
    ) -> None:
        self.redis_url = redis_url
        self.registry = ReplicaRegistry(redis)
        self.tmp = tmp
        self.pipeline = pipeline
        self.args = args
        self.replicas: list[Child] = []
        self.gateway: Child | None = None

    async def start(self) -> None:
        self.gateway = spawn_gateway(self.redis_url, self.tmp)
        await asyncio.gather(*(self.add_replica() for _ in range(2)))
        await wait_http(self.gateway, "/healthz")
        await self.wait_registered(2)

    async def add_replica(self) -> Child:
        child = spawn_replica(
            self.redis_url,
            self.tmp,
            pipeline=str(self.pipeline),
            lease_s=self.args.lease_s,
            refresh_s=self.args.refresh_s,
        )
        self.replicas.append(child)
        await wait_http(child, "/readyz")
        return child

    async def wait_registered(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len([r for r in await self.registry.live_replicas() if r.state == "SERVING"]) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} replicas not registered")
            await asyncio.sleep(0.1)

    def replica_at(self, url: str) -> Child:
        return next(c for c in self.replicas if c.alive() and c.url == url.rstrip("/"))

    def stop(self) -> None:
        for child in [*self.replicas, *([self.gateway] if self.gateway else [])]:
            child.stop()


async def run_trial(dep: Deployment, redis: Any, index: int, rng: random.Random) -> Trial:
    args = dep.args
    assert dep.gateway is not None
    gw = dep.gateway
    client = await Client.open(f"{gw.ws_url}?omni_extensions=1")  # it resumes: asks for omni.*
    created = await client.until("session.created")
    resumable = await client.until("omni.session.resumable")
    sid, token = created["session"]["id"], resumable["resume_token"]
    for turn in range(args.turns):
        await client.ask(f"turn {turn} of trial {index}")
        await client.until("response.done")
    mid = rng.random() < args.mid_response_share
    trial = Trial(index, "mid_response" if mid else "between_turns")
    # The owner, from the session's binding, and its lease deadline (Redis clock).
    owner_id = (await redis.hget(f"omni:{{{sid}}}:owner", "replica")) or ""
    registry = {r.replica_id: r for r in await ReplicaRegistry(redis).live_replicas()}
    owner_info = registry[owner_id]
    owner = dep.replica_at(owner_info.url)
    in_flight: str | None = None
    if mid:
        await client.ask(f"the interrupted turn of trial {index}")
        in_flight = (await client.until("response.created"))["response"]["id"]
        for _ in range(rng.randint(1, max(1, args.audio_ms // 40 - 2))):  # before its last delta
            await client.until("response.output_audio.delta")
    else:
        await asyncio.sleep(rng.uniform(0.0, 0.5))
    committed = client.committed()
    # Kill; the lease deadline it had is when the registry drops it.
    lease_until_ms = next(
        r.lease_until_ms for r in await ReplicaRegistry(redis).live_replicas() if r.replica_id == owner_id
    )
    seconds, micros = await redis.time()
    killed = time.monotonic()
    owner.kill9()
    trial.lapse_after_kill_s = max(0.0, (lease_until_ms - (int(seconds) * 1000 + int(micros) // 1000)) / 1000)
    replacement = asyncio.create_task(dep.add_replica(), name="bench-replacement-replica")
    code = await client.until_closed()
    if code != 1012:
        trial.notes.append(f"closed with {code}")
    last = client.events[-1]["event_id"]
    url = f"{gw.ws_url}?session_id={sid}&last_event_id={last}"
    resumed_client = await Client.open(url, additional_headers={"X-Omni-Resume-Token": token})
    resumed = await resumed_client.until("omni.session.resumed")
    trial.resumed_after_kill_s = time.monotonic() - killed
    trial.replayed = int(resumed.get("replay_count", 0))
    trial.resynced = "replay_unavailable" in resumed
    migrated = await resumed_client.until("omni.session.migrated")
    trial.migrated = migrated["from_replica"] == owner_id and migrated["to_replica"] != owner_id
    if in_flight is not None:
        done = next((e for e in resumed_client.events if e["type"] == "response.done"), None)
        if done is None:
            done = await resumed_client.until("response.done")
        details = done["response"].get("status_details") or {}
        trial.in_flight_failed_replica_lost = (
            done["response"]["id"] == in_flight
            and done["response"]["status"] == "failed"
            and (details.get("error") or {}).get("code") == "replica_lost"
        )
    await resumed_client.ask(f"after the failover of trial {index}")
    while True:
        done = await resumed_client.until("response.done")
        if done["response"]["id"] != in_flight:
            break
    trial.next_turn_done_after_kill_s = time.monotonic() - killed
    trial.within_target = trial.next_turn_done_after_kill_s <= trial.lapse_after_kill_s + 1.0
    # Committed items: all still there, unchanged.
    stored = {i["id"]: i for i in await SessionStore(redis).list_items(sid)}
    trial.committed_items = len(committed)
    trial.lost_items = sum(
        1
        for item_id, item in committed.items()
        if item_content(stored.get(item_id, {})) != item_content(item)
    )
    await resumed_client.ws.close()
    await replacement
    await dep.wait_registered(2)
    return trial


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="od-bench-failover-") as name:
        tmp = Path(name)
        pipeline = paced_null_pipeline(tmp, delay_ms=args.delay_ms, audio_ms=args.audio_ms)
        async with embedded_redis(tmp) as redis_url, redis_connection(redis_url) as redis:
            dep = Deployment(redis_url, redis, tmp, pipeline, args)
            trials: list[Trial] = []
            try:
                await dep.start()
                for i in range(args.trials):
                    try:
                        async with asyncio.timeout(120):
                            trial = await run_trial(dep, redis, i, rng)
                    except Exception as exc:  # recorded, the run goes on
                        where = traceback.extract_tb(exc.__traceback__)
                        step = next(
                            (f"line {f.lineno}: {f.line}" for f in reversed(where) if f.name == "run_trial"),
                            "",
                        )
                        trial = Trial(i, "error", error=f"{type(exc).__name__}: {exc} at {step}")
                        await dep.wait_registered(2)
                    trials.append(trial)
                    print(
                        f"trial {i:2d} {trial.phase:13s} lapse {trial.lapse_after_kill_s:5.2f} s, "
                        f"next turn done {trial.next_turn_done_after_kill_s:5.2f} s after the kill "
                        f"({'ok' if trial.within_target else 'LATE'}), lost {trial.lost_items}/"
                        f"{trial.committed_items} items{', ' + trial.error if trial.error else ''}",
                        flush=True,
                    )
            finally:
                dep.stop()
    ok = [t for t in trials if not t.error]
    margins = [t.next_turn_done_after_kill_s - t.lapse_after_kill_s for t in ok]
    resumed = [t.resumed_after_kill_s - t.lapse_after_kill_s for t in ok]
    return {
        "lease_s": args.lease_s,
        "refresh_s": args.refresh_s,
        "trials": len(trials),
        "errors": sum(1 for t in trials if t.error),
        "within_target": sum(1 for t in trials if t.within_target),
        "committed_items": sum(t.committed_items for t in trials),
        "lost_items": sum(t.lost_items for t in trials),
        "in_flight_failed_replica_lost": [
            t.in_flight_failed_replica_lost for t in trials if t.phase == "mid_response"
        ],
        "lapse_after_kill_s": summarize([t.lapse_after_kill_s for t in trials if not t.error], 2),
        "next_turn_done_after_kill_s": summarize(
            [t.next_turn_done_after_kill_s for t in trials if not t.error], 2
        ),
        "next_turn_done_after_lapse_s": summarize(margins, 2),
        "resumed_after_lapse_s": summarize(resumed, 3),
        "trial_details": [asdict(t) for t in trials],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--turns", type=int, default=2, help="completed turns before the kill")
    ap.add_argument("--mid-response-share", type=float, default=0.7, help="kills during a response")
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--refresh-s", type=float, default=2.0)
    ap.add_argument("--delay-ms", type=int, default=100, help="null pipeline: reply delay")
    ap.add_argument("--audio-ms", type=int, default=400, help="null pipeline: reply audio, real time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = asyncio.run(run(args))
    print(
        f"\n{out['trials']} trials ({out['errors']} errors), "
        f"lease {out['lease_s']} s / beat {out['refresh_s']} s: "
        f"next turn within lapse + 1 s in {out['within_target']}/{out['trials']}; "
        f"committed items lost: {out['lost_items']} of {out['committed_items']}"
    )
    keys = (
        "lapse_after_kill_s",
        "resumed_after_lapse_s",
        "next_turn_done_after_kill_s",
        "next_turn_done_after_lapse_s",
    )
    for key in keys:
        s = out[key]
        print(f"  {key}: p50 {s['p50']} s, p90 {s['p90']} s, max {s['max']} s")
    print(f"  in-flight responses ended failed/replica_lost: {out['in_flight_failed_replica_lost']}")
    write_json(args.json, out)
    failed = out["errors"] or out["lost_items"] or out["within_target"] < out["trials"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
