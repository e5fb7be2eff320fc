"""Tiny fake engines for the runtime tests (importable by worker processes: no test globals).

Values flow as ``CodecCodes([[v]])`` items. ``Gen`` (entry) emits ``offset + i`` for i < n, or,
in stream mode, one item per ``Action("emit", k)`` input until ``Action("end")``. ``Relay``
passes items on. ``params["take"][tag] = k`` makes a ``Relay`` or ``Sink`` finish after
``k`` items, before its upstream is done. ``Sink`` turns each chunk into an ``AudioChunk`` whose sample j is
``v_j + 0.5 * v_{j-1}`` where the previous value comes from the chunk itself or its left
context, so outputs only match the full-payload decode when context is delivered right.
Thread-worker engines record what happened in :data:`EVENTS`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.kv import current_kv_store
from runtime.payloads import Action, AudioChunk, CodecCodes, Payload, TextDelta

EVENTS: list[tuple[Any, ...]] = []
_events_lock = threading.Lock()


def record(*event: Any) -> None:
    with _events_lock:
        EVENTS.append(event)


def events(kind: str, request_id: str | None = None) -> list[tuple[Any, ...]]:
    with _events_lock:
        return [e for e in EVENTS if e[0] == kind and (request_id is None or e[2] == request_id)]


def item(value: int) -> CodecCodes:
    return CodecCodes(np.array([[value]], dtype=np.int64))


def value_of(payload: Payload) -> int:
    assert isinstance(payload, CodecCodes)
    return int(payload.codes[0, 0])


class _Fake(Engine):
    @property
    def tag(self) -> str:
        return str(self.options.get("tag", type(self).__name__))

    def _take(self, request: EngineRequest) -> int | None:
        """Items after which this stage is done, upstream finished or not (None: no limit)."""
        take = (request.params.get("take") or {}).get(self.tag)
        return None if take is None else int(take)

    def _done(self, inp: StepInput, count: int) -> bool:
        s = inp.state
        s["seen"] += count
        return inp.upstream_finished or (s["take"] is not None and s["seen"] >= s["take"])

    def _pause(self) -> None:
        delay = float(self.options.get("step_s", 0.0))
        if delay:
            time.sleep(delay)

    def _updates(self, inp: StepInput, out: StepOutput) -> None:
        for update in inp.updates:
            inp.state["updates"].append(dict(update.values))
            out.client.append(TextDelta(f"update@{self.tag}:{update.values.get('v')}"))

    def _state(self, request: EngineRequest, **extra: Any) -> dict[str, Any]:
        record("start", self.tag, request.request_id, time.monotonic())
        return {"rid": request.request_id, "params": dict(request.params), "updates": [], **extra}

    def finish(self, state: Any, *, cancelled: bool) -> None:
        record("finish", self.tag, state["rid"], cancelled)


class Gen(_Fake):
    def start(self, request: EngineRequest) -> Any:
        p = request.params
        return self._state(
            request,
            i=0,
            n=int(p.get("n", 10)),
            offset=int(p.get("offset", 0)),
            fail_at=p.get("fail_at"),
            stream=bool(p.get("stream", False)),
            client=bool(p.get("client", True)),
        )

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs = []
        for inp in batch:
            s = inp.state
            record("step", self.tag, s["rid"], time.monotonic())
            self._pause()
            out = StepOutput()
            self._updates(inp, out)
            for update in inp.updates:
                if "offset" in update.values:
                    s["offset"] = int(update.values["offset"])
            if s["stream"]:
                for x in inp.inputs:
                    if isinstance(x, Action) and x.name == "emit":
                        self._emit(s, out, int(x.value))
                    elif isinstance(x, Action) and x.name == "end":
                        out.done = True
                out.wait_for_input = not out.done
            else:
                if s["fail_at"] is not None and s["i"] == int(s["fail_at"]):
                    raise ValueError(f"boom at item {s['i']}")
                self._emit(s, out, s["offset"] + s["i"])
                s["i"] += 1
                out.done = s["i"] >= s["n"]
            outputs.append(out)
        return outputs

    def _emit(self, s: dict[str, Any], out: StepOutput, value: int) -> None:
        out.downstream.append(item(value))
        if s["client"]:
            out.client.append(TextDelta(str(value)))


class Relay(_Fake):
    def start(self, request: EngineRequest) -> Any:
        return self._state(request, pid=os.getpid(), take=self._take(request), seen=0)

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs = []
        for inp in batch:
            record("step", self.tag, inp.state["rid"], time.monotonic())
            self._pause()
            out = StepOutput()
            self._updates(inp, out)
            for chunk in inp.chunks:
                out.downstream.extend(item(value_of(p)) for p in chunk.items)
            out.done = self._done(inp, sum(len(c.items) for c in inp.chunks))
            out.wait_for_input = not out.done
            outputs.append(out)
        return outputs


class Sink(_Fake):
    batchable = True

    def start(self, request: EngineRequest) -> Any:
        return self._state(
            request, fail_value=request.params.get("sink_fail_value"), take=self._take(request), seen=0
        )

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        record("batch", self.tag, len(batch))
        self._pause()
        outputs = []
        for inp in batch:
            s = inp.state
            record("step", self.tag, s["rid"], time.monotonic())
            out = StepOutput()
            self._updates(inp, out)
            for chunk in inp.chunks:
                values = [value_of(p) for p in chunk.items]
                if s["fail_value"] is not None and int(s["fail_value"]) in values:
                    raise RuntimeError(f"poisoned value {s['fail_value']}")
                context = [value_of(p) for p in chunk.context]
                record("chunk", self.tag, s["rid"], len(values), len(context), chunk.finished, chunk.index)
                seen = context + values
                base = len(context)
                samples = [
                    v + 0.5 * (seen[base + j - 1] if base + j > 0 else 0) for j, v in enumerate(values)
                ]
                if values:
                    out.client.append(AudioChunk(np.asarray(samples, dtype=np.float32), sample_rate=16000))
            out.done = self._done(inp, sum(len(c.items) for c in inp.chunks))
            out.wait_for_input = not out.done
            outputs.append(out)
        return outputs


class SessionCounter(_Fake):
    """Counts a session's turns in the replica's KV store and says which replica it ran on."""

    def start(self, request: EngineRequest) -> Any:
        store = current_kv_store()
        key = request.session_key or request.request_id
        turns = int(store.get(key) or 0) + 1
        store.put(key, turns, nbytes=8)
        return self._state(request, turns=turns)

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        thread = threading.current_thread().name.split("_")[0]
        return [
            StepOutput(client=[TextDelta(f"turn{inp.state['turns']}@{thread}")], done=True) for inp in batch
        ]


class Explode(_Fake):
    """An engine whose constructor fails (worker start errors)."""

    def __init__(self, options: Any) -> None:
        raise RuntimeError("cannot load weights")

    def start(self, request: EngineRequest) -> Any:  # pragma: no cover - never constructed
        return None

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:  # pragma: no cover
        return []
