"""``responses`` delegation: work the live model hands off, run on the pipeline's text model.

A pipeline that names a ``responses`` entry (a text-model stage in the same orchestrator, e.g.
``speech.responder``, the voice cascade's responder) runs each delegation as one request on it:
``params = {"respond_to": the task (and the client's items), "instructions", "history"}``. Its text
streams to the client as Responses events in ``response.event`` envelopes (``response.created``,
``response.output_text.delta`` ..., ``response.output_item.done`` with the message,
``response.completed``; ``response.failed`` when the request fails), and the whole answer goes
back to the voice model as the delegation's result (``Conditioning``), for it to speak in its
own words. One request per delegation at a time per session; the driver owns the task.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from runtime.orchestrator import Orchestrator
from runtime.payloads import TextDelta
from runtime.progress import RequestStatus
from session.live.driver import LiveDriver
from session.live.effects import RunDelegation
from session.live.handoff import item_text

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 4000  # what goes back to the voice model (the rest is still streamed)


class ResponsesRunner:
    """Runs ``responses`` delegations on ``entry`` of ``orch`` (a :class:`DelegationRunner`)."""

    def __init__(self, orch: Orchestrator, entry: str, *, model: str) -> None:
        self.orch = orch
        self.entry = entry
        self.model = model

    async def run(self, driver: LiveDriver, effect: RunDelegation) -> None:
        core = driver.core
        did = effect.delegation_id
        response: dict[str, Any] = {"id": f"resp_{uuid.uuid4().hex[:20]}", "model": self.model}

        def emit(event: dict[str, Any]) -> None:
            driver.apply(core.on_delegation_event(did, event))

        task = "\n".join([effect.task, *(item_text(item) for item in effect.items)]).strip()
        history = [{"role": role, "text": text} for role, text in _history(core.conditioning())]
        params = {
            "respond_to": task,
            "instructions": str(core.delegations.responses.get("instructions") or core.instructions_text()),
            "history": history,
        }
        emit({"type": "response.created", "response": response})
        try:
            handle = await self.orch.submit(params, session_key=core.session_id, entry=self.entry)
        except Exception as exc:
            emit({"type": "response.failed", "response": {**response, "error": {"message": str(exc)}}})
            return
        parts: list[str] = []
        status: RequestStatus | None = None
        try:
            async for out in handle:
                if isinstance(out, TextDelta) and out.text:
                    parts.append(out.text)
                    emit({"type": "response.output_text.delta", "delta": out.text})
                elif isinstance(out, RequestStatus):
                    status = out
        finally:
            if status is None:  # cancelled: the session ends
                await self.orch.cancel(handle.request_id)
        if status is None or status.status != "completed":
            error = {"message": status.error if status is not None else "cancelled"}
            emit({"type": "response.failed", "response": {**response, "error": error}})
            return
        text = "".join(parts)
        item = {
            "id": f"msg_{uuid.uuid4().hex[:20]}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
        emit({"type": "response.output_item.done", "item": item})
        usage = {"input_tokens": 0, "output_tokens": len(parts), "total_tokens": len(parts)}
        emit({"type": "response.completed", "response": {**response, "usage": usage}})
        driver.apply(core.on_delegation_result(did, text[:MAX_ANSWER_CHARS]))


def _history(conditioning: dict[str, Any]) -> list[tuple[str, str]]:
    """The startup history as (role, text), for the text model's context."""
    out: list[tuple[str, str]] = []
    for entry in conditioning.get("history") or ():
        role = "assistant" if entry.get("role") == "assistant" else "user"
        if entry.get("text"):
            out.append((role, str(entry["text"])))
    return out
