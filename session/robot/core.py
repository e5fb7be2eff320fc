"""The robot session core, sans-I/O: one robot's frames in, frames and effects out.

It speaks openpi's policy-server wire (see :mod:`session.robot.wire`) in two dialects:

* ``openpi`` (what ``openpi_client.WebsocketClientPolicy`` expects, exactly): the metadata map
  first, then one msgpack map answered per observation with ``actions`` and
  ``server_timing``; any error is a text frame followed by close 1011, as openpi's
  ``websocket_policy_server`` does.
* ``vllm-omni`` (vLLM-Omni's ``/v1/realtime/robot/openpi``): the same, plus
  ``{"endpoint": "reset"}`` → ``{"status": "reset successful"}``, ``{"endpoint": "update",
  "prompt": ...}``, a ``session_id`` field in observations, and errors as a binary
  ``{"type": "error", "code", "message"}`` map with the socket kept open.

A connection starts in the dialect its route implies (or ``?dialect=``); a client that uses
a vLLM-Omni addition (an ``endpoint`` message, a ``session_id`` field) is switched to the
``vllm-omni`` dialect unless it asked for ``openpi`` explicitly. Observations are checked
against the policy's metadata (image keys, image shape, state dimension) before anything
reaches the runtime. The core also keeps the session's policy context (prompt, previous
chunk, inference count): what retention stores and a rebuilt session starts from.

Why these checks are written out rather than pydantic models (as the realtime and world
events are): a robot frame is not a tagged JSON event but a msgpack map whose keys, image
shape and state size come from the policy's metadata at connection time, with ``a/b`` keys
flat or nested, and whose values are numpy arrays checked (and decoded zero-copy) by the
msgpack object hook in :mod:`session.robot.wire` as they are read; a model would have to be
built per policy and would re-walk arrays already checked.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from runtime.payloads import Observation
from session.robot.wire import MAX_PAYLOAD_BYTES, WireError, pack, unpack

OPENPI_CLOSE = (1011, "Internal server error. Traceback included in previous frame.")
MAX_PROMPT_CHARS = 2000
CONTROL_KEYS = ("endpoint", "__ctrl__")


class Dialect(StrEnum):
    OPENPI = "openpi"
    VLLM_OMNI = "vllm-omni"


@dataclass(frozen=True, slots=True)
class PolicyShape:
    """What an observation must look like, from the policy's metadata frame."""

    image_keys: tuple[str, ...]
    image_shape: tuple[int, int, int]  # H, W, 3
    state_key: str
    state_dim: int
    prompt_key: str
    horizon: int
    action_dim: int

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> PolicyShape:
        h, w, c = (int(n) for n in meta["image_shape"])
        return cls(
            image_keys=tuple(meta["image_keys"]),
            image_shape=(h, w, c),
            state_key=str(meta["state_key"]),
            state_dim=int(meta["state_dim"]),
            prompt_key=str(meta.get("prompt_key", "prompt")),
            horizon=int(meta["action_horizon"]),
            action_dim=int(meta["action_dim"]),
        )


@dataclass(slots=True)
class PolicyContext:
    """A session's policy context: kept across reconnects, stored for a rebuild elsewhere."""

    prompt: str = ""
    previous: np.ndarray | None = None  # float32 [horizon, action_dim]: the last chunk made
    step: int = 0  # inferences made (seeds the next chunk's noise)
    seed: int = 0

    def to_record(self) -> dict[str, Any]:
        prev = None
        if self.previous is not None:
            prev = {
                "shape": list(self.previous.shape),
                "f32": base64.b64encode(np.ascontiguousarray(self.previous, "<f4").tobytes()).decode(),
            }
        return {"prompt": self.prompt, "previous": prev, "step": self.step, "seed": self.seed}

    @classmethod
    def from_record(cls, data: dict[str, Any] | None) -> PolicyContext:
        if not data:
            return cls()
        prev = data.get("previous")
        previous = None
        if prev:
            raw = base64.b64decode(prev["f32"])
            previous = np.frombuffer(raw, "<f4").reshape(prev["shape"]).astype(np.float32)
        return cls(str(data.get("prompt", "")), previous, int(data.get("step", 0)), int(data.get("seed", 0)))

    def submit_params(self) -> dict[str, Any]:
        return {"seed": self.seed, "prompt": self.prompt, "previous": self.previous, "step": self.step}


# --- outputs -------------------------------------------------------------------------------


@dataclass(slots=True)
class SendFrame:
    data: bytes | str  # bytes: a binary frame; str: a text frame


@dataclass(slots=True)
class CloseConnection:
    code: int
    reason: str


@dataclass(slots=True)
class Infer:
    """Run the policy on ``observation``; ``prompt``: a changed prompt to send first."""

    observation: Observation
    prompt: str | None = None
    received_at: float = 0.0


@dataclass(slots=True)
class ResetPolicy:
    """An episode reset: the policy forgets its previous chunk."""


@dataclass(slots=True)
class UpdatePrompt:
    prompt: str


Output = SendFrame | CloseConnection | Infer | ResetPolicy | UpdatePrompt


@dataclass(slots=True)
class CoreStats:
    observations: int = 0
    answered: int = 0
    errors: int = 0
    resets: int = 0
    prompt_updates: int = 0


@dataclass(slots=True)
class RobotSessionCore:
    """One robot session's protocol state (see the module docstring)."""

    metadata: dict[str, Any]
    session_id: str
    dialect: Dialect = Dialect.OPENPI
    explicit_dialect: bool = False  # the client chose it (?dialect=): never switched
    context: PolicyContext = field(default_factory=PolicyContext)
    max_bytes: int = MAX_PAYLOAD_BYTES
    stats: CoreStats = field(default_factory=CoreStats)
    shape: PolicyShape = field(init=False)
    seq: int = 0
    _prev_total_ms: float | None = None

    def __post_init__(self) -> None:
        self.shape = PolicyShape.from_metadata(self.metadata)

    # --- connection ------------------------------------------------------------------------

    def opening(self) -> bytes:
        """The first frame of every connection: the policy's metadata map."""
        return pack(self.metadata)

    # --- frames in -------------------------------------------------------------------------

    def decode(self, data: bytes | str) -> Any:
        """Pure and thread-safe (a large frame is decoded off the event loop); raises WireError."""
        if isinstance(data, str):
            raise WireError("invalid_frame", "expected a binary msgpack frame, got a text frame")
        return unpack(data, max_bytes=self.max_bytes)

    def handle_frame(self, data: bytes | str, now: float) -> list[Output]:
        try:
            return self.handle_message(self.decode(data), now)
        except WireError as exc:
            return self.error(exc.code, exc.message)

    def handle_message(self, message: Any, now: float) -> list[Output]:
        """A decoded frame (from :meth:`decode`) → what to do."""
        if not isinstance(message, dict):
            return self.error("invalid_message", f"expected a msgpack map, got {type(message).__name__}")
        try:
            if "endpoint" in message:
                self._switch()
                return self._endpoint(message, now)
            if "__ctrl__" in message:
                return self._ctrl(message)
            return self._observation(message, now)
        except WireError as exc:
            return self.error(exc.code, exc.message)

    def _switch(self) -> None:
        if not self.explicit_dialect:
            self.dialect = Dialect.VLLM_OMNI

    def _endpoint(self, message: dict[str, Any], now: float) -> list[Output]:
        endpoint = message.get("endpoint")
        if endpoint == "reset":  # the driver clears the context when the runtime gets it
            self.stats.resets += 1
            return [ResetPolicy(), SendFrame(pack({"status": "reset successful"}))]
        if endpoint == "update":
            prompt = self._prompt(message.get("prompt"))
            if prompt is None:
                raise WireError("missing_prompt", "endpoint 'update' needs a 'prompt' string")
            return [
                *self._prompt_change(prompt),
                SendFrame(pack({"status": "update successful", "prompt": prompt})),
            ]
        if endpoint == "infer":
            return self._observation({k: v for k, v in message.items() if k != "endpoint"}, now)
        if endpoint == "metadata":
            return [SendFrame(self.opening())]
        raise WireError(
            "unknown_endpoint", f"unknown endpoint {endpoint!r} (expected reset, update, infer, metadata)"
        )

    def _ctrl(self, message: dict[str, Any]) -> list[Output]:
        """openpi's unmerged episode markers: acknowledged; an episode start resets."""
        ctrl = message.get("__ctrl__")
        out: list[Output] = []
        if ctrl == "episode_start":
            self.stats.resets += 1
            out.append(ResetPolicy())
        out.append(SendFrame(pack({"__ack__": ctrl})))
        return out

    def _prompt(self, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        if isinstance(value, np.ndarray) and value.dtype.kind in "US" and value.size == 1:
            value = str(value.reshape(()).item())
        if isinstance(value, np.str_):
            value = str(value)
        if not isinstance(value, str):
            raise WireError("invalid_prompt", f"prompt must be a string, got {type(value).__name__}")
        if len(value) > MAX_PROMPT_CHARS:
            raise WireError(
                "invalid_prompt", f"prompt is {len(value)} characters; the limit is {MAX_PROMPT_CHARS}"
            )
        return value

    def _prompt_change(self, prompt: str) -> list[Output]:
        if prompt == self.context.prompt:
            return []
        self.context.prompt = prompt
        self.stats.prompt_updates += 1
        return [UpdatePrompt(prompt)]

    def _observation(self, message: dict[str, Any], now: float) -> list[Output]:
        sid = message.get("session_id")
        if sid is not None:
            self._switch()
            if sid != self.session_id:
                raise WireError(
                    "session_mismatch",
                    f"session_id {sid!r} is not this connection's session ({self.session_id}); "
                    "reconnect with ?session_id= and the resume token to resume another session",
                )
        images = {key: self._image(message, key) for key in self.shape.image_keys}
        state = self._state(message)
        prompt = self._prompt(_lookup(message, self.shape.prompt_key))
        changed = None
        if prompt is not None and prompt != self.context.prompt:
            self.context.prompt = changed = prompt
            self.stats.prompt_updates += 1
        self.seq += 1
        self.stats.observations += 1
        return [Infer(Observation(images, state, seq=self.seq), changed, now)]

    def _image(self, message: dict[str, Any], key: str) -> np.ndarray:
        value = _lookup(message, key)
        if value is None:
            raise WireError(
                "missing_image",
                f"observation has no image {key!r} (the metadata lists {list(self.shape.image_keys)})",
            )
        if not isinstance(value, np.ndarray):
            raise WireError("invalid_image", f"image {key!r} must be an array, got {type(value).__name__}")
        h, w, c = self.shape.image_shape
        if value.shape == (c, h, w) and value.shape != (h, w, c):
            value = value.transpose(1, 2, 0)  # CHW, as some openpi clients send it
        if value.shape != (h, w, c):
            raise WireError(
                "invalid_shape",
                f"image {key!r} has shape {list(value.shape)}; the policy takes [{h}, {w}, {c}] (HWC)",
            )
        if value.dtype == np.uint8:
            return value
        if value.dtype.kind == "f":  # floats in [0, 1]
            return (np.clip(value, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
        raise WireError(
            "invalid_dtype", f"image {key!r} has dtype {value.dtype.str}; expected uint8 or float"
        )

    def _state(self, message: dict[str, Any]) -> np.ndarray:
        key = self.shape.state_key
        value = _lookup(message, key)
        if value is None:
            raise WireError("missing_state", f"observation has no state {key!r}")
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
            raise WireError("invalid_state", f"state {key!r} must be a numeric array")
        if value.shape != (self.shape.state_dim,):
            raise WireError(
                "invalid_shape",
                f"state {key!r} has shape {list(value.shape)}; the policy takes [{self.shape.state_dim}]",
            )
        state = value.astype(np.float32)
        if not np.isfinite(state).all():
            raise WireError("invalid_state", f"state {key!r} has NaN or infinite values")
        return state

    # --- frames out ------------------------------------------------------------------------

    def on_actions(self, actions: np.ndarray, infer_ms: float, *, dropped: int = 0) -> bytes:
        """The answer to the newest observation: openpi's map (plus the session for vLLM-Omni)."""
        self.context.previous = actions
        self.context.step += 1
        self.stats.answered += 1
        timing: dict[str, float] = {"infer_ms": infer_ms}
        if self._prev_total_ms is not None:
            timing["prev_total_ms"] = self._prev_total_ms
        reply: dict[str, Any] = {"actions": actions, "server_timing": timing}
        if self.dialect is Dialect.VLLM_OMNI:
            reply["session_id"] = self.session_id
            reply["dropped_observations"] = dropped
        return pack(reply)

    def on_answered(self, total_ms: float) -> None:
        """The answer went out ``total_ms`` after its observation arrived (openpi's prev_total_ms)."""
        self._prev_total_ms = total_ms

    def error(self, code: str, message: str) -> list[Output]:
        """A clear error in the client's dialect."""
        self.stats.errors += 1
        if self.dialect is Dialect.VLLM_OMNI:
            return [SendFrame(pack({"type": "error", "code": code, "message": message}))]
        return [SendFrame(f"{code}: {message}"), CloseConnection(*OPENPI_CLOSE)]


def _lookup(message: dict[str, Any], key: str) -> Any:
    """``message[key]``, or for ``a/b`` keys the nested ``message["a"]["b"]`` (openpi clients
    send both flat ``observation/image`` keys and nested maps)."""
    if key in message:
        return message[key]
    node: Any = message
    for part in key.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
