"""The end-of-turn stage's feed: a session's audio goes to it only while the session uses it.

The live request's VAD stage hands its scored audio on to every stage after it; the pipeline
marks the edge into its end-of-turn stage ``gated`` (closed for every request at admission;
`PipelineCapabilities.end_of_turn_gate`), and this opens it for the live request of a session
whose turn detection is ``semantic_vad``, closes it again when a ``session.update`` leaves it.
A ``server_vad`` session's frames then never reach that stage: no step, no int16 copy, no 8 s
of held audio (~256 KB) per session. Checked before each input is appended to the request (a
comparison; the switch itself is one dict lookup in the orchestrator, on the loop).
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.orchestrator import Orchestrator


class TurnModelFeed:
    """Opens the gated edge ``source -> target`` of one session's live request while `wanted()`."""

    def __init__(self, orch: Orchestrator, edge: tuple[str, str], wanted: Callable[[], bool]) -> None:
        self._orch = orch
        self._edge = edge
        self._wanted = wanted
        self._open_for: str | None = None  # the live request the edge is open for
        self.switches = 0  # opens and closes

    @property
    def open_for(self) -> str | None:
        return self._open_for

    def sync(self, request_id: str) -> None:
        """Before an input goes into `request_id`: open or close the edge as the session needs."""
        want = self._wanted()
        if want == (self._open_for == request_id):
            return
        source, target = self._edge
        if self._orch.open_edge(request_id, source, target, want):
            self.switches += 1
            self._open_for = request_id if want else None
