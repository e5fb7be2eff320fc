"""Routes of robot policy sessions: ``WS /v1/realtime/robot/openpi`` and the bare openpi port.

I/O only: bytes ⇄ :class:`~session.robot.driver.RobotDriver`. Two ways in, one handler:

* ``/v1/realtime/robot/openpi`` on the main port (vLLM-Omni's path; dialect ``vllm-omni``
  unless ``?dialect=openpi``);
* the root path of ``omniduplex serve --openpi-port N``, since
  ``openpi_client.WebsocketClientPolicy(host, port)`` connects to ``ws://host:port`` (dialect
  ``openpi``, exactly openpi's server; ``GET /healthz`` → 200 there too).

Identity as for voice sessions: ``Authorization: Api-Key <key>`` (what openpi's client sends
for ``api_key``) or ``Bearer <key>`` → tenant; open mode (no keys) is tenant ``default``.
Every refusal comes before the upgrade, as JSON with an HTTP status (401, 403, 404, 409, 429,
503). A new session gets ``X-Omni-Session-Id`` / ``X-Omni-Resume-Token`` on its upgrade
response, and, when it asks for the extensions (``?omni_extensions=1`` or
``X-Omni-Extensions: 1``, web/transports/omni_extensions.py), the same in the metadata map's
``omni_session`` entry (openpi's client exposes only the metadata, and takes a URL with a
query as its host); a dropped robot resumes with ``?session_id=…`` and the token in
``X-Omni-Resume-Token`` or ``?resume_token=`` (openpi's client cannot set headers but a URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from session.identity import RESUME_HEADER, Principal
from session.robot.core import Dialect, PolicyContext, RobotSessionCore
from session.robot.driver import RobotDriver, RobotObserver, RuntimeProvider, TransportClosed
from session.robot.hosting import RobotHost, RobotSession
from session.robot.wire import MAX_PAYLOAD_BYTES, pack
from web.deploy.workers import reuseport_socket
from web.edge.refusals import Denial, authorize_resume, identified, open_admitted
from web.transports.frame_ws import WebSocketFrameTransport, serve_until_closed
from web.transports.omni_extensions import SESSION_ID_HEADER, raw_headers, resume_headers, wants_extensions

log = logging.getLogger(__name__)

ROBOT_PATH = "/v1/realtime/robot/openpi"
IDLE_TIMEOUT_S = 30.0  # vLLM-Omni's: a vllm-omni-dialect link silent this long is closed
FRAME_SLACK = 1 << 20  # a bare-port frame up to this much over the cap is read and refused clearly

# Who is calling (None: no valid key → 401); may raise StoreUnavailable.
Identify = Callable[[HTTPConnection], Awaitable[Principal | None]]


def robot_api_key(connection: HTTPConnection) -> str | None:
    """``Authorization: Api-Key <key>`` (openpi's client) or ``Bearer <key>``."""
    scheme, _, value = connection.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() in ("api-key", "bearer") and value.strip():
        return value.strip()
    return None


class RobotService:
    """Robot sessions of this process: the handler of both ways in (see the module docstring)."""

    def __init__(
        self,
        runtimes: RuntimeProvider,
        metadata: dict[str, Any] | None,
        *,
        pipeline: str,
        identify: Identify | None = None,
        observer: RobotObserver | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        self.runtimes = runtimes
        self.metadata = metadata
        self.pipeline = pipeline
        self.identify = identify
        self.observer = observer
        self.idle_timeout_s = idle_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.host: RobotHost | None = None  # set by the app once the session layer is up

    def new_driver(self, session_id: str, context: PolicyContext, dialect: Dialect) -> RobotDriver:
        if self.metadata is None:
            raise RuntimeError("no robot policy is configured")
        core = RobotSessionCore(
            self.metadata, session_id, dialect=dialect, context=context, max_bytes=self.max_payload_bytes
        )
        return RobotDriver(core, self.runtimes, self.pipeline, observer=self.observer)

    def routes(self) -> list[BaseRoute]:
        """The main port's route."""
        return [WebSocketRoute(ROBOT_PATH, self.omni_endpoint, name="realtime_robot_openpi")]

    def bare_routes(self) -> list[BaseRoute]:
        """The ``--openpi-port`` app: openpi's root path and health check (and the main path)."""
        return [
            Route("/healthz", _healthz),
            WebSocketRoute("/", self.openpi_endpoint, name="openpi_root"),
            WebSocketRoute(ROBOT_PATH, self.omni_endpoint, name="openpi_realtime_robot"),
        ]

    async def omni_endpoint(self, websocket: WebSocket) -> None:
        await self._endpoint(websocket, Dialect.VLLM_OMNI)

    async def openpi_endpoint(self, websocket: WebSocket) -> None:
        await self._endpoint(websocket, Dialect.OPENPI)

    # --- one connection ------------------------------------------------------------------------

    async def _endpoint(self, websocket: WebSocket, default: Dialect) -> None:
        host = self.host
        if self.metadata is None:
            denial = Denial(503, "robot_unavailable", "This server has no robot policy (see its log).")
            await websocket.send_denial_response(denial.response())
            return
        if host is None:
            await websocket.send_denial_response(
                Denial(503, "not_ready", "The server is starting.", 1).response()
            )
            return
        asked = websocket.query_params.get("dialect")
        if asked is not None and asked not in (Dialect.OPENPI.value, Dialect.VLLM_OMNI.value):
            denial = Denial(400, "invalid_dialect", "dialect must be 'openpi' or 'vllm-omni'.")
            await websocket.send_denial_response(denial.response())
            return
        dialect = Dialect(asked) if asked else default
        principal = await self._principal(websocket)
        if isinstance(principal, Denial):
            await websocket.send_denial_response(principal.response())
            return
        opened: tuple[RobotSession, str | None] | Denial
        if websocket.query_params.get("session_id") is not None:
            opened = await self._resume(host, websocket, principal, dialect)
        else:
            opened = await self._open(host, principal, dialect)
        if isinstance(opened, Denial):
            await websocket.send_denial_response(opened.response())
            return
        rs, token = opened
        rs.driver.core.explicit_dialect = asked is not None
        rs.driver.core.dialect = dialect
        transport = WebSocketFrameTransport(websocket)
        # a resume asks for the extensions by itself (only a resume-aware client holds a token)
        extensions = token is None or wants_extensions(websocket.query_params, websocket.headers)
        headers = (
            resume_headers(rs.session_id, token) if token is not None else {SESSION_ID_HEADER: rs.session_id}
        )
        try:
            await websocket.accept(headers=raw_headers(headers))
            opening = self._opening(rs, token, extensions)
            attached = await (
                host.open(rs, transport, opening) if token else host.resume(rs, transport, opening)
            )
            if attached:
                await self._serve(websocket, rs, transport)
        finally:
            await asyncio.shield(host.connection_ended(rs, transport, transport.disconnect_code))

    def _opening(self, rs: RobotSession, token: str | None, extensions: bool) -> bytes:
        """The metadata frame; ``omni_session`` (the resume data) only for a client that asks
        (web/transports/omni_extensions.py): a stock openpi client gets the policy's metadata alone."""
        assert self.metadata is not None  # checked before the upgrade
        if not extensions:
            return pack(self.metadata)
        info: dict[str, Any] = {"session_id": rs.session_id, "expires_at": int(rs.record.expires_at)}
        if token is not None:
            info["resume_token"] = token
        else:
            info["resumed"] = True
            info["inferences"] = rs.driver.core.context.step
        return pack({**self.metadata, "omni_session": info})

    async def _principal(self, connection: HTTPConnection) -> Principal | Denial:
        return await identified(self.identify, connection)

    async def _open(
        self, host: RobotHost, principal: Principal, dialect: Dialect
    ) -> tuple[RobotSession, str] | Denial:
        return await open_admitted(
            host, principal.tenant, lambda session_id: host.create(session_id, principal.tenant, dialect)
        )

    async def _resume(
        self, host: RobotHost, websocket: WebSocket, principal: Principal, dialect: Dialect
    ) -> tuple[RobotSession, None] | Denial:
        session_id = websocket.query_params.get("session_id", "")
        token = websocket.headers.get(RESUME_HEADER) or websocket.query_params.get("resume_token")

        async def authorize(token: str) -> tuple[RobotSession, None]:
            return await host.authorize(principal.tenant, session_id, token, dialect), None

        return await authorize_resume(session_id, token, authorize)

    async def _serve(
        self, websocket: WebSocket, rs: RobotSession, transport: WebSocketFrameTransport
    ) -> None:
        """Frames into the driver until the client leaves or the server closes the link."""
        driver = rs.driver
        await serve_until_closed(
            self._receive(websocket, driver, transport),
            driver.connection_closed.wait(),
            f"robot-{rs.session_id}",
        )

    async def _receive(
        self, websocket: WebSocket, driver: RobotDriver, transport: WebSocketFrameTransport
    ) -> None:
        try:
            while True:
                idle = self.idle_timeout_s if driver.dialect is Dialect.VLLM_OMNI else None
                try:
                    async with asyncio.timeout(idle):
                        message = await websocket.receive()
                except TimeoutError:
                    await driver.perform(driver.core.error("idle_timeout", f"no message for {idle:.0f} s"))
                    with contextlib.suppress(TransportClosed):
                        await transport.close(1000, "idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    transport.disconnect_code = int(message.get("code") or 1005)
                    return
                data = message.get("bytes")
                if data is None:
                    data = message.get("text")
                if data is not None:
                    await driver.handle_frame(data)
        except (WebSocketDisconnect, RuntimeError, OSError):
            transport.disconnect_code = transport.disconnect_code or 1006


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


class RobotFrameLimit(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol with the robot path's own frame limit.

    The server-wide limit (``max_message_bytes``, 2 MiB) suits JSON voice and world events; a
    robot observation may be up to the 64 MiB payload cap. websockets reads ``max_size`` per
    frame, so raising it once the handshake named the robot path gives that one route its
    limit (plus slack: a payload just over the cap is read and refused with a clear error)
    while every other connection keeps the small one."""

    robot_max_size = MAX_PAYLOAD_BYTES + FRAME_SLACK

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if str(event.path).partition("?")[0] == ROBOT_PATH and self.conn.max_size is not None:
            self.conn.max_size = max(self.conn.max_size, self.robot_max_size)


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside another's lifespan: the outer server owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def openpi_port(
    service: RobotService, host: str, port: int | None, log_level: str = "warning", *, shared: bool = False
) -> AsyncIterator[None]:
    """``serve --openpi-port N``: the bare openpi endpoint on its own port while inside (None:
    nothing). Its frame limit is the 64 MiB payload cap (plus slack, so a payload a little over
    it is read and refused with a clear error rather than cut off by the transport)."""
    if port is None:
        yield
        return
    from starlette.applications import Starlette

    config = uvicorn.Config(
        Starlette(routes=service.bare_routes()),
        host=host,
        port=port,
        ws="websockets-sansio",
        ws_max_size=service.max_payload_bytes + FRAME_SLACK,
        ws_per_message_deflate=False,
        log_level=log_level,
        lifespan="off",
    )
    server = _EmbeddedServer(config)
    # `serve --workers N`: every worker listens on the port (SO_REUSEPORT), like the main one
    sockets = [reuseport_socket(host, port)] if shared else None
    task = asyncio.create_task(server.serve(sockets=sockets), name=f"openpi-port-{port}")
    try:
        while not server.started:
            if task.done():
                task.result()  # raises why it could not start (e.g. the port is taken)
                raise RuntimeError(f"the openpi port {port} did not start")
            await asyncio.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel of this task that
        # lands as the server ends, and the caller would go on as if it had not been cancelled
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await task
