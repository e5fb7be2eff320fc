"""The delegation side of one GPT-Live session: its target, the delegations the model opened,
and the ``response.item.create`` items waiting for ``response.create``.

``client``: the model's delegation is announced (``session.delegation.created``); the client's
answer (a commentary naming it, or items then ``response.create``) goes to the model as the
delegation's result. ``responses``: the delegation (and items a client adds) runs on the
pipeline's text model (:class:`~session.live.effects.RunDelegation`, session/live/delegation.py).
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any, Final

from session.live import events as ev
from session.live.effects import Condition, Effect, Emit, RunDelegation
from session.live.events import DelegationTarget, ItemCreate, LiveProtocolError, ResponseCreate, SessionUpdate

MAX_OPEN_DELEGATIONS: Final = 64  # answers to older ones are refused as unknown


class Delegations:
    """Delegation state of one session (module docstring)."""

    def __init__(self, model: str, max_pending: int) -> None:
        self.model = model
        self.max_pending = max_pending
        self.target: DelegationTarget = "client"
        self.responses: dict[str, Any] = {}  # the `responses` settings (kept; tools are not run)
        self.open: deque[str] = deque(maxlen=MAX_OPEN_DELEGATIONS)
        self.pending: list[dict[str, Any]] = []

    def start(self, target: DelegationTarget, responses: dict[str, Any]) -> None:
        self.target = target
        self.responses = dict(responses)

    def created(self, task: str) -> list[Effect]:
        """The model hands work off: announce it, and run it on the text model (``responses``)."""
        delegation_id = f"dlg_{uuid.uuid4().hex[:20]}"
        self.open.append(delegation_id)
        out: list[Effect] = [Emit(ev.delegation_created(delegation_id, self.target))]
        if self.target == "responses":
            out.append(RunDelegation(delegation_id, task))
        return out

    def check(self, delegation_id: str | None, event_id: str | None) -> None:
        """An answer names an open delegation (or none)."""
        if delegation_id is not None and delegation_id not in self.open:
            raise LiveProtocolError(
                ev.UNKNOWN_DELEGATION,
                f"No open delegation '{delegation_id[:64]}'.",
                param="delegation_id",
                event_id=event_id,
            )

    def update(self, event: SessionUpdate) -> list[Effect]:
        if event.delegation != self.target:
            raise LiveProtocolError(
                ev.DELEGATION_FIXED,
                f"The delegation type is fixed for the session ('{self.target}'); only its "
                "responses settings can change.",
                param="session.delegation.type",
                event_id=event.event_id,
            )
        self.responses.update({k: v for k, v in event.responses.items() if v is not None})
        ack = ev.ack("session.updated", event.event_id)
        return [Emit({**ack, "session": {"delegation": {"type": self.target}}})]

    def queue(self, event: ItemCreate) -> list[Effect]:
        """An item for the next ``response.create`` (its text is counted by the core)."""
        if len(self.pending) >= self.max_pending:
            raise LiveProtocolError(
                ev.CONTEXT_FULL,
                f"At most {self.max_pending} items may wait for response.create.",
                param="item",
                event_id=event.event_id,
            )
        self.pending.append(event.item)
        return [Emit(ev.ack("response.item.created", event.event_id))]

    def deliver(self, event: ResponseCreate) -> tuple[list[Effect], str | None]:
        """The waiting items go to the delegation they answer (the newest open one): to the text
        model with them (``responses``), or to the voice model as its result; with the result's
        text (for the session's context), if any."""
        items, self.pending = self.pending, []
        delegation_id = self.open[-1] if self.open else None
        if self.target == "responses" and delegation_id is not None:
            return [RunDelegation(delegation_id, "", items)], None
        if not items:
            raise LiveProtocolError(
                ev.INVALID_VALUE,
                "response.create has no items to deliver: send response.item.create first.",
                event_id=event.event_id,
            )
        text = "\n".join(item_text(item) for item in items)
        result = {"kind": "result", "text": text, "delegation_id": delegation_id}
        response = {"id": f"resp_{uuid.uuid4().hex[:20]}", "model": self.model}
        return [
            Condition({"append": result}),
            Emit(ev.response_event(delegation_id, {"type": "response.created", "response": response})),
            Emit(ev.response_event(delegation_id, {"type": "response.completed", "response": response})),
        ], text


def item_text(item: dict[str, Any]) -> str:
    """The text a Responses input item carries (a function call's output, a message's text)."""
    output = item.get("output")
    if isinstance(output, str):
        return output
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""
