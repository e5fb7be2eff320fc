"""Stages on other hosts: the pure parts (slice pool, keys, listen checks, edge rewriting,
sticky assignment over remote replicas, the re-run rules, the registry watcher, cancels)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any, Literal, cast

import pytest

from runtime.metrics import RuntimeMetrics
from runtime.progress import AdmissionError
from runtime.remote import stages as remote_stages
from runtime.remote.auth import CurveKeys, StageKeyError, check_listen
from runtime.remote.host import HostInfo
from runtime.remote.orchestrator import with_remote_stages
from runtime.remote.rerun import Reruns
from runtime.remote.slices import PoolFull, SlicePool
from runtime.remote.stages import Member, Registered, RemoteStage, RemoteStages
from runtime.remote.transfer import TransferError, check_local_address, check_peer
from runtime.remote.worker import RemoteWorker
from runtime.spec import load_pipeline
from runtime.stage import Replica
from web.deploy.stages import _serve_until, split_listen

pytestmark = pytest.mark.unit


def test_slice_pool_is_bounded_by_bytes_and_merges_freed_runs() -> None:
    pool = SlicePool(1024)
    a, b, c = pool.alloc(100), pool.alloc(64), pool.alloc(1)
    assert (a, b, c) == (0, 128, 192) and pool.used_bytes == 256
    with pytest.raises(PoolFull):
        pool.alloc(800)
    assert pool.free(b) and not pool.free(b)
    assert pool.alloc(64) == 128  # first fit reuses the hole
    for offset in (a, 128, c):
        pool.free(offset)
    assert pool.used_bytes == 0 and pool.alloc(1024) == 0  # the runs merged back into one


def test_keys_derive_from_the_shared_key_and_differ_between_keys() -> None:
    one, again, other = CurveKeys.derive("k" * 20), CurveKeys.derive("k" * 20), CurveKeys.derive("x" * 20)
    assert one == again and one.host_public != other.host_public and one.client_public != other.client_public
    assert one.host_public != one.client_public
    with pytest.raises(StageKeyError):
        CurveKeys.derive("short")


def test_a_non_loopback_listen_needs_a_key() -> None:
    check_listen("127.0.0.1", None)
    check_listen("::1", None)
    check_listen("10.0.0.5", "k" * 20)
    with pytest.raises(StageKeyError, match=r"refusing to listen on 10\.0\.0\.5"):
        check_listen("10.0.0.5", None)
    with pytest.raises(StageKeyError):
        check_listen("0.0.0.0", None)


def test_transfer_addresses_are_checked_before_the_engine_sees_them() -> None:
    assert check_local_address("10.1.2.3") == "10.1.2.3"
    for bad in ("host.example", "0.0.0.0", "224.0.0.1", "", "1.2.3.4:5"):
        with pytest.raises(TransferError):
            check_local_address(bad)
    assert check_peer("10.1.2.3:15000") == ("10.1.2.3", 15000)
    for bad in ("10.1.2.3", "10.1.2.3:x", "10.1.2.3:0", "name:80"):
        with pytest.raises(TransferError):
            check_peer(bad)


def test_listen_addresses_split_into_host_and_port() -> None:
    assert split_listen("127.0.0.1") == ("127.0.0.1", 0)
    assert split_listen("10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert split_listen("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ValueError):
        split_listen("10.0.0.2:http")


def test_edges_touching_a_remote_stage_carry_mooncake_handles() -> None:
    spec = with_remote_stages(load_pipeline("qwen3-omni-tiny"), ["code2wav"])
    connectors = {e.key: e.connector for e in spec.edges}
    assert connectors == {"thinker->talker": "inproc", "talker->code2wav": "mooncake"}
    with pytest.raises(ValueError, match="no stage 'nope'"):
        with_remote_stages(spec, ["nope"])


def _member(
    stage: RemoteStage, rid: str, index: int, *, ready: bool = True, state: str = "SERVING"
) -> SimpleNamespace:
    """A stand-in for a Replica: assignment reads only its ``ready``, ``load`` and ``index``."""
    replica = SimpleNamespace(ready=ready, load=0, index=index)
    member = Member(cast(Any, replica), cast(Any, None), Registered(rid, f"tcp://10.0.0.{index}:1/0", state))
    stage.add(member)
    return replica


def assigned(stage: RemoteStage, session_key: str) -> object:
    return stage.assign(session_key)


def test_remote_replicas_are_sticky_by_session_and_skip_dead_or_draining_ones() -> None:
    spec = load_pipeline("qwen3-omni-tiny").stage("talker")
    stage = RemoteStage(spec, RuntimeMetrics())
    with pytest.raises(AdmissionError, match="stage_unavailable: stage talker has no live replica"):
        stage.assign("s1")
    a = _member(stage, "a", 0)
    b = _member(stage, "b", 1)
    assert assigned(stage, "s1") is a
    a.load = 3  # busier, but s1 stays where its KV is
    assert assigned(stage, "s1") is a
    assert assigned(stage, "s2") is b  # a new session goes to the least loaded
    a.ready = False  # its host was lost: s1 moves, and sticks to its new replica
    assert assigned(stage, "s1") is b and stage.replica_id_for("s1") == "b"
    a.ready = True
    assert assigned(stage, "s1") is b
    stage.members["b"].entry = Registered("b", "tcp://10.0.0.1:1/0", "DRAINING")
    assert assigned(stage, "s3") is a  # a draining host takes nothing new
    a.load = b.load = spec.budget.max_concurrency
    with pytest.raises(AdmissionError):
        stage.assign("s4")


def test_a_request_is_re_run_once_only_when_nothing_reached_the_client_and_nothing_was_streamed() -> None:
    reruns = Reruns()
    lost = "stage talker (connection closed): stage_unavailable: stage talker lost its host mid-request"
    reruns.submitted("req_a", {"items": [1]}, "sess_1")
    # an engine error, another stage's loss, or output already sent: no re-run
    assert reruns.candidate("req_a", "talker", "stage talker: worker error: boom", False) is None
    assert reruns.candidate("req_a", "code2wav", lost, False) is None
    assert reruns.candidate("req_a", "talker", lost, True) is None
    origin = reruns.candidate("req_a", "talker", lost, False)
    assert origin is not None and origin.params == {"items": [1]} and origin.session_key == "sess_1"
    reruns.moved("req_a", "req_a", "req_a~rerun", "talker")
    assert reruns.current("req_a") == "req_a~rerun" and reruns.counts == {"talker": 1}
    assert reruns.candidate("req_a~rerun", "talker", lost, False) is None  # one retry at most
    reruns.ended("req_a", "req_a~rerun")
    assert reruns.current("req_a") == "req_a" and not reruns.origins
    reruns.submitted("req_b", {}, None)
    reruns.streamed("req_b")  # an input, an update or a gate change since the submit
    assert reruns.candidate("req_b", "talker", lost, False) is None


class _NotConnected:
    """A control client to a host that is gone: every request answers ``lost`` at the test's word."""

    def __init__(self) -> None:
        self.replies: list[Any] = []
        self.refused = False

    def request(self, kind: str, body: bytes, on_reply: Any) -> None:
        self.replies.append(on_reply)

    def close(self) -> None:
        pass


async def test_a_replica_removed_while_its_worker_says_hello_again_stops_restarting() -> None:
    """The host of a replica died, its worker retries the handshake; the replica leaves the
    registry and is closed in the one loop turn where a hello's answer is in but not yet taken.
    The close ends the restart (it used to swallow the cancel and retry forever, and the
    registry watcher, waiting on the close, never adopted a replacement host)."""
    spec = load_pipeline("qwen3-omni-tiny").stage("talker")
    worker = RemoteWorker("qwen3-omni-tiny", "talker", "tcp://127.0.0.1:9", 0, None, cast(Any, None))
    await worker.close()  # the real connection: not used
    client = _NotConnected()
    worker.client = cast(Any, client)
    replica = Replica(
        spec,
        0,
        worker,
        sink=cast(Any, None),
        metrics=RuntimeMetrics(),
        connectors={},
        clock=time.monotonic,
    )
    replica._loop = asyncio.get_running_loop()
    worker._loop = replica._loop
    worker.watch(replica._on_worker_died)
    worker._lost("stage host tcp://127.0.0.1:9 lost (connection closed)")
    await asyncio.sleep(0)  # the death reaches the loop: the restart begins with a hello
    await asyncio.sleep(0)
    assert not replica.ready and len(client.replies) == 1
    client.replies[0]("lost", b"stage host tcp://127.0.0.1:9 not connected")
    await asyncio.sleep(0)  # the answer is settled; the restart has not taken it yet
    await asyncio.wait_for(replica.close(), 2)
    assert not replica.ready and replica.restarts == 0
    assert len(client.replies) == 1  # no hello after the close


class _Host:
    """A stand-in for a RemoteWorker: its host answers the hello at once; its close waits until
    the test lets it end (``may_close``), then fails with ``fails`` if set."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.info: HostInfo | None = None
        self.kv_moves: dict[str, Any] = {}
        self.lost: str | None = None
        self.may_close = asyncio.Event()
        self.fails: Exception | None = None
        self.closed = False

    async def open(self) -> None:
        self.info = HostInfo("qwen3-omni-tiny", "talker", "fake", 0, 1, f"{self.endpoint}#pool", 1, "h")

    def watch(self, on_death: Any) -> None:
        pass

    def report_lost(self, reason: str) -> None:
        self.lost = reason

    async def close(self) -> None:
        await self.may_close.wait()
        if self.fails is not None:
            raise self.fails
        self.closed = True


def _watched(
    monkeypatch: pytest.MonkeyPatch, registry: list[Registered]
) -> tuple[RemoteStages, dict[str, _Host]]:
    """A registry watcher over one remote stage whose hosts are :class:`_Host` s; a replica that
    leaves the registry is removed at once (no grace)."""
    hosts: dict[str, _Host] = {}

    def connect(pipeline: str, stage: str, endpoint: str, index: int, keys: Any, connector: Any) -> _Host:
        hosts[endpoint] = _Host(endpoint)
        return hosts[endpoint]

    async def lister(stage: str) -> list[Registered]:
        return list(registry)

    monkeypatch.setattr(remote_stages, "RemoteWorker", connect)
    stage = RemoteStage(load_pipeline("qwen3-omni-tiny").stage("talker"), RuntimeMetrics())
    watcher = RemoteStages("qwen3-omni-tiny", lister, None, missing_grace_s=0.0, stages={"talker": stage})
    watcher.connector = cast(Any, SimpleNamespace(kind="mooncake"))
    watcher.sink = cast(Any, SimpleNamespace())
    return watcher, hosts


async def _refreshed(watcher: RemoteStages) -> None:
    """One poll of the registry, and the adoptions it began, ended."""
    async with asyncio.timeout(5):  # a guard: the old watcher waited here on a close for ever
        await watcher.refresh()
        await asyncio.gather(*watcher._tasks)


async def test_a_replica_whose_close_hangs_does_not_hold_up_adopting_a_new_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The host of replica a left the registry and does not answer its close; b registered.
    The next poll adopts b while a is still closing (the watcher used to await a's close first,
    and every stage's adoptions waited on it); the server's close awaits a's close, and an
    error there is logged, not raised."""
    caplog.set_level(logging.WARNING, logger="runtime.remote.stages")
    registry = [Registered("a", "tcp://10.0.0.1:7000/0")]
    watcher, hosts = _watched(monkeypatch, registry)
    stage = watcher.stages["talker"]
    await _refreshed(watcher)
    assert set(stage.members) == {"a"}
    a = hosts["tcp://10.0.0.1:7000"]
    registry[:] = [Registered("b", "tcp://10.0.0.2:7000/0")]
    await _refreshed(watcher)
    assert set(stage.members) == {"b"} and [r.index for r in stage.replicas] == [1]
    assert a.lost is not None and "left the registry" in a.lost and not a.closed
    assert len(watcher._closing) == 1  # a's close, tracked
    a.fails = RuntimeError("control socket gone")
    a.may_close.set()
    hosts["tcp://10.0.0.2:7000"].may_close.set()
    await watcher.close()
    assert not watcher._closing and hosts["tcp://10.0.0.2:7000"].closed
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["stage talker: closing replica a failed"]


async def test_a_removed_replica_that_never_closes_is_given_up_after_its_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing removed replicas is bounded: one still closing after ``CLOSE_WITHIN_S`` (here 0)
    is left, with a warning, and the server's close does not wait on it for ever."""
    caplog.set_level(logging.WARNING, logger="runtime.remote.stages")
    monkeypatch.setattr(remote_stages, "CLOSE_WITHIN_S", 0.0)
    registry = [Registered("a", "tcp://10.0.0.1:7000/0")]
    watcher, hosts = _watched(monkeypatch, registry)
    await _refreshed(watcher)
    registry.clear()
    await _refreshed(watcher)
    async with asyncio.timeout(5):  # a guard, as above
        await watcher.close()
    assert not watcher.stages["talker"].members and not hosts["tcp://10.0.0.1:7000"].closed
    assert "stage talker: replica a did not close within 0 s" in [r.getMessage() for r in caplog.records]


class _StopCancelling(asyncio.Event):
    """A stage host's stop that cancels the task waiting on it in the turn it arrives."""

    waiter: asyncio.Task[None] | None = None

    async def wait(self) -> Literal[True]:
        await super().wait()
        assert self.waiter is not None
        self.waiter.cancel()
        return True


async def test_a_stage_host_cancelled_as_its_stop_arrives_is_cancelled() -> None:
    """``omniduplex stage``'s serve loop is cancelled in the turn its stop arrives: the cancel
    ends it (3.11's wait_for swallowed it, and the host went on to drain as if only stopped)."""
    host = SimpleNamespace(replicas=[], reap=lambda: None)
    stop = _StopCancelling()
    stop.waiter = serving = asyncio.create_task(_serve_until(stop, host, []))
    await asyncio.sleep(0)  # waiting on the stop
    stop.set()
    await asyncio.gather(serving, return_exceptions=True)
    assert serving.cancelled()
