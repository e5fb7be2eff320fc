"""This process as one replica of a scaled-out deployment: registry lease, load, drain, binding.

Active only when the server runs with both ``--redis-url`` (a Redis shared with the other
replicas and the gateways) and ``--advertise-url`` (where gateways reach this process).
Then the lifespan starts a :class:`ReplicaMembership`:

* **Registration.** A lease in the registry (``session.affinity``) refreshed every
  ``refresh_s`` (2 s) that lapses after ``lease_s`` (5 s): id, advertised URL, capacity
  (``--max-sessions``), load (live sessions, voice and world, pushed within ~0.1 s of a
  change) and state.
* **Drain.** SIGTERM (:class:`DrainingServer`) marks the replica ``DRAINING``: pickers skip
  it, :class:`ReplicaGate` refuses new sessions here with 503 ``replica_draining`` (the gateway
  then tries another replica) while resumes of the sessions it holds still pass; once no
  session is left (or ``drain_timeout_s`` passed) it deregisters and uvicorn shuts down.
* **Binding.** :meth:`ReplicaMembership.claim` (``SessionHost.join_replica``) binds a new
  session to this replica (first writer wins, epoch 1) or, at a resume, takes it over when its
  owner's lease lapsed (epoch + 1; ``previous_replica`` says from where: the client is told
  ``omni.session.migrated``). The epoch goes into the session's ``SessionWriter``; a flush
  after the session moved elsewhere fails with ``StaleEpoch`` and the host ends its copy
  (close 1012: the client resumes on the new owner).
* **Coming back.** Each heartbeat returns the new lease deadline on Redis's clock; when the
  previous one had passed (the process was stopped, or cut off from Redis, for longer than
  the lease) the lease-regained hooks run: ``SessionHost.recheck_bindings`` flushes every live
  session at once, so the ones that moved meanwhile are fenced now, not at their next write.

Ids are random per process: a replica restarted at the same address is a new replica, so a
zombie of the old process can never share an epoch with its successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from redis.asyncio import Redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from session.affinity import Binding, ReplicaInfo, ReplicaLease, ReplicaRegistry, SessionBinding
from session.store.aio import cancel_and_wait, wait_event
from session.store.errors import StoreError
from web.edge.refusals import error_body
from web.settings import ServerSettings

log = logging.getLogger(__name__)

REPLICA_PREFIX = "rep_"
DRAINING_CODE = "replica_draining"

Json = dict[str, Any]
Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
Asgi = Callable[[Any, Receive, Send], Awaitable[None]]


def new_replica_id() -> str:
    return REPLICA_PREFIX + secrets.token_hex(6)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    url: str  # advertised http(s) base URL
    capacity: int
    replica_id: str = ""  # empty: a fresh random id
    lease_s: float = 5.0
    refresh_s: float = 2.0
    drain_timeout_s: float = 600.0
    load_poll_s: float = 0.1  # how often the live-session count is checked (pushed only on change)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--advertise-url must be an http(s) URL, got {self.url!r}")
        if not 0 < self.refresh_s < self.lease_s:
            raise ValueError(f"refresh {self.refresh_s} s must be shorter than the lease {self.lease_s} s")


def info_json(info: ReplicaInfo) -> Json:
    """The wire form of a registry entry (``GET /v1/replicas``)."""
    return {
        "id": info.replica_id,
        "url": info.url,
        "capacity": info.capacity,
        "load": info.load,
        "state": info.state,
        "lease_until_ms": info.lease_until_ms,
    }


async def owner_json(binding: SessionBinding, registry: ReplicaRegistry, session_id: str) -> Json | None:
    """``replica {id, url, epoch}`` of ``GET /v1/sessions/{id}``; None when unbound.

    ``url`` is empty (and ``alive`` false) once the owner's lease lapsed: the next resume moves it.
    """
    bound = await binding.get(session_id)
    if bound is None:
        return None
    live = {r.replica_id: r for r in await registry.live_replicas()}
    owner = live.get(bound.replica_id)
    return {
        "id": bound.replica_id,
        "url": owner.url if owner is not None else "",
        "epoch": bound.epoch,
        "alive": owner is not None,
    }


class ReplicaMembership:
    """Registration, load reporting, drain and session binding of this process."""

    def __init__(self, redis: Redis, config: ReplicaConfig, *, load: Callable[[], int]) -> None:
        self.config = config
        self.replica_id = config.replica_id or new_replica_id()
        self.registry = ReplicaRegistry(redis, lease_s=config.lease_s)
        self.binding = SessionBinding(redis)
        self.lease = ReplicaLease(
            self.registry,
            ReplicaInfo(self.replica_id, config.url.rstrip("/"), config.capacity),
            refresh_s=config.refresh_s,
        )
        self._load = load
        self._reporter: asyncio.Task[None] | None = None
        self._drain: asyncio.Task[None] | None = None
        self._stopped = False
        self.draining = False
        self.drained = asyncio.Event()
        self._idle = asyncio.Event()  # no live session (kept by the load reporter)
        self._regained_hooks: list[Callable[[], Awaitable[object]]] = []
        self._deadline_ms: int | None = None  # of the last lease Redis granted (Redis clock)

    @property
    def info(self) -> ReplicaInfo:
        return self.lease.info

    async def start(self) -> None:
        """Register (fails fast when Redis is down) and start heartbeats and load reports.

        The heartbeats are this object's own loop (not ``ReplicaLease.start``), so it sees
        each lease deadline Redis hands out and can tell when one lapsed.
        """
        self.lease.set_load(self._load())
        await self._beat()
        self._reporter = asyncio.create_task(self._heartbeats(), name=f"replica-lease:{self.replica_id}")
        info = self.info
        log.info("replica %s registered at %s (capacity %d)", info.replica_id, info.url, info.capacity)

    async def stop(self) -> None:
        """Stop heartbeating and deregister (idempotent; best effort when Redis is down)."""
        drain, self._drain = self._drain, None
        if drain is not None and drain is not asyncio.current_task():
            await cancel_and_wait(drain)
        reporter, self._reporter = self._reporter, None
        await cancel_and_wait(reporter)
        if not self._stopped:
            self._stopped = True
            try:
                await self.lease.stop(deregister=True)
            except StoreError:
                log.warning("replica %s: could not deregister (its lease lapses on its own)", self.replica_id)

    # --- binding -------------------------------------------------------------------------------

    async def claim(self, session_id: str) -> Binding:
        """Bind ``session_id`` here, or take it over from a lapsed owner; else its live owner.

        A binding whose ``replica_id`` is not this replica means: do not serve the session here.
        """
        return await self.binding.claim(session_id, self.replica_id, self.registry.is_alive)

    async def owner_json(self, session_id: str) -> Json | None:
        return await owner_json(self.binding, self.registry, session_id)

    # --- load and drain ------------------------------------------------------------------------

    def on_lease_regained(self, hook: Callable[[], Awaitable[object]]) -> None:
        """Call ``hook`` whenever the lease had (probably) lapsed and is held again: sessions
        may have moved meanwhile (e.g. ``SessionHost.recheck_bindings`` fences them now)."""
        self._regained_hooks.append(hook)

    async def _beat(self) -> None:
        """One heartbeat; notices (by Redis's clock) when the previous lease had lapsed."""
        deadline = await self.registry.heartbeat(self.lease.info)
        previous, self._deadline_ms = self._deadline_ms, deadline
        redis_now_ms = deadline - int(self.config.lease_s * 1000)
        if previous is not None and redis_now_ms >= previous:
            # Stopped (SIGSTOP, a stalled VM) or cut off from Redis for longer than the lease:
            # readers dropped this replica meanwhile, and its sessions may have moved.
            log.warning("replica %s: its lease had lapsed; registered again", self.replica_id)
            await self._run_regained_hooks()

    async def _heartbeats(self) -> None:
        """Every ``load_poll_s`` look at the load; beat every ``refresh_s``, or at once when the
        load changed (pickers see a new session within ~``load_poll_s``, not a whole beat)."""
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + self.config.refresh_s
        while True:
            await asyncio.sleep(self.config.load_poll_s)
            load = self._load()
            if load == 0:
                self._idle.set()
            else:
                self._idle.clear()
            if load == self.info.load and loop.time() < next_beat:
                continue
            self.lease.set_load(load)
            next_beat = loop.time() + self.config.refresh_s
            try:
                await self._beat()
                self.lease.failures = 0
            except StoreError:  # a blip: the lease covers ~2 missed beats
                self.lease.failures += 1

    async def _run_regained_hooks(self) -> None:
        for hook in self._regained_hooks:
            try:
                await hook()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replica %s: lease-regained hook failed", self.replica_id)

    def begin_drain(self, on_drained: Callable[[], None]) -> bool:
        """Start draining (from a signal handler on the loop's thread); False if already begun."""
        if self._drain is not None or self._stopped:
            return False
        self.draining = True
        self._drain = asyncio.get_running_loop().create_task(
            self._drain_then(on_drained), name=f"replica-drain:{self.replica_id}"
        )
        return True

    async def _drain_then(self, on_drained: Callable[[], None]) -> None:
        try:
            await self.drain()
        finally:
            on_drained()

    async def drain(self) -> None:
        """DRAINING: take no new sessions, wait for the live ones to end, then deregister."""
        self.draining = True
        with contextlib.suppress(StoreError):
            await self.lease.drain()
        log.info("replica %s draining: %d live session(s)", self.replica_id, self._load())
        if not await wait_event(self._idle, self.config.drain_timeout_s):
            log.warning("replica %s: drain timeout with %d session(s) left", self.replica_id, self._load())
        reporter, self._reporter = self._reporter, None
        await cancel_and_wait(reporter)
        if not self._stopped:
            self._stopped = True
            with contextlib.suppress(StoreError):
                await self.lease.stop(deregister=True)
        log.info("replica %s drained (%d session(s) left)", self.replica_id, self._load())
        self.drained.set()


def replica_config(settings: ServerSettings) -> ReplicaConfig | None:
    """The replica config of a server's settings, or None when it does not join a deployment."""
    if not settings.redis_url or not settings.advertise_url:
        return None
    return ReplicaConfig(
        url=settings.advertise_url,
        capacity=settings.max_sessions,
        replica_id=settings.replica_id or "",
        lease_s=settings.replica_lease_s,
        refresh_s=settings.replica_refresh_s,
        drain_timeout_s=settings.drain_timeout_s,
    )


@contextlib.asynccontextmanager
async def replica_membership(
    settings: ServerSettings, redis: Redis, *, load: Callable[[], int]
) -> AsyncIterator[ReplicaMembership | None]:
    """The lifespan hook: a started membership (None for a standalone server); stopped on exit."""
    config = replica_config(settings)
    if config is None:
        yield None
        return
    membership = ReplicaMembership(redis, config, load=load)
    await membership.start()
    try:
        yield membership
    finally:
        await membership.stop()


# --- ASGI: refuse new sessions while draining ----------------------------------------------------


def app_membership(app: object) -> ReplicaMembership | None:
    """The membership an app's lifespan set (``app.state.replica``, also the server context's
    ``replica``); None while standalone or before the lifespan ran."""
    replica = getattr(getattr(app, "state", None), "replica", None)
    return replica if isinstance(replica, ReplicaMembership) else None


def membership_of(scope: Scope) -> ReplicaMembership | None:
    return app_membership(scope.get("app"))


# voice, world, robot
SESSION_SOCKETS = frozenset(
    {"/v1/realtime", "/v1/realtime/video", "/v1/realtime/robot/openpi", "/v1/live/sessions"}
)
SESSION_CALLS = frozenset({"/v1/realtime/calls", "/v1/realtime/video/calls", "/v1/live/sessions"})


def opens_new_session(scope: Scope) -> bool:
    """A request that would start a session here, voice or world (a resume of a live one does not)."""
    path = scope.get("path", "")
    if scope["type"] == "websocket" and path in SESSION_SOCKETS:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return not query.get("session_id")
    return scope["type"] == "http" and scope.get("method") == "POST" and path in SESSION_CALLS


def _draining_body() -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(
        {
            "error": {
                "type": "server_error",
                "code": DRAINING_CODE,
                "message": "This replica is draining and takes no new sessions; try another.",
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
    ]
    return headers, body


class ReplicaGate:
    """ASGI middleware: while the replica drains, new sessions get 503 ``replica_draining``."""

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and opens_new_session(scope):
            replica = membership_of(scope)
            if replica is not None and replica.draining:
                await self._refuse(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
        headers, body = _draining_body()
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# --- uvicorn: SIGTERM drains instead of closing every connection ---------------------------------


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains the replica before the usual shutdown.

    Plain uvicorn closes every WebSocket (1012) at SIGTERM; a replica must first let its
    sessions finish. A second SIGTERM, or SIGINT, shuts down at once as usual.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        replica = self._replica()
        if sig == signal.SIGTERM and replica is not None and not self.should_exit:
            try:
                started = replica.begin_drain(self._drained)
            except RuntimeError:  # no running loop: not serving yet
                started = False
            if started:
                return
            if replica.draining and not replica.drained.is_set():
                log.warning("replica %s: second SIGTERM, shutting down now", replica.replica_id)
        super().handle_exit(sig, frame)

    def _drained(self) -> None:
        self.should_exit = True

    def _replica(self) -> ReplicaMembership | None:
        return app_membership(self.config.app)


# --- GET /v1/replicas (admin) ---------------------------------------------------------------------


def admin_denial(authorization: str | None, admin_key: str | None) -> tuple[int, str, str] | None:
    """Why an admin request is refused (status, code, message), or None when it may pass."""
    if not admin_key:
        return 403, "admin_disabled", "No admin key is configured (--admin-key / OMNIDUPLEX_ADMIN_KEY)."
    scheme, _, value = (authorization or "").strip().partition(" ")
    presented = value.strip() if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(presented.encode(), admin_key.encode()):
        return 401, "invalid_admin_key", "Missing or invalid admin key (Authorization: Bearer <admin key>)."
    return None


async def registry_json(registry: ReplicaRegistry) -> Json:
    replicas = sorted(await registry.live_replicas(), key=lambda r: r.replica_id)
    return {"object": "list", "data": [info_json(r) for r in replicas]}


async def replicas_endpoint(request: Request) -> Response:
    """`GET /v1/replicas` on a replica: the registry as this replica sees it (admin key)."""
    admin_key = request.app.state.ctx.settings.admin_key
    denied = admin_denial(request.headers.get("authorization"), admin_key)
    if denied is not None:
        return error_body(*denied)
    replica = membership_of(request.scope)
    if replica is None:
        return error_body(
            404, "not_a_replica", "This server is not part of a deployment (no --advertise-url)."
        )
    try:
        body = await registry_json(replica.registry)
    except StoreError as exc:
        return error_body(503, "store_unavailable", str(exc), retry_after_s=1)
    body["self"] = replica.replica_id
    return JSONResponse(body)


def replica_routes() -> list[BaseRoute]:
    return [Route("/v1/replicas", replicas_endpoint)]
