"""The contract between a stage and its engine.

A stage owns scheduling: it decides which live requests step next, batches them up to its
budget's ``max_batch`` and calls :meth:`Engine.step` on a worker (thread or process), never on
the event loop. An engine only computes: it keeps per-request state, consumes the inputs it is
handed and returns what it produced. It never schedules across requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.payloads import Conditioning, Payload


@dataclass(slots=True)
class EngineRequest:
    """What an engine learns about a request when the stage starts it."""

    request_id: str
    params: Mapping[str, Any]  # the submit() params (prompt, max_tokens, seed, ...)
    session_key: str | None = None  # sticky key (session id) for retained state such as KV


@dataclass(slots=True)
class EdgeChunk:
    """One hand-over on an edge: new items plus left context, in upstream order."""

    items: list[Payload]
    context: list[Payload] = field(default_factory=list)
    finished: bool = False  # no more chunks will follow on this edge for this request
    index: int = 0  # 0, 1, 2, ... per request and edge
    source: str = ""  # upstream stage name


@dataclass(slots=True)
class StepInput:
    """What one request brings to one engine step."""

    state: Any  # whatever Engine.start returned
    chunks: list[EdgeChunk] = field(default_factory=list)  # arrived since the last step
    inputs: list[Payload] = field(default_factory=list)  # streaming input (append_input)
    updates: list[Conditioning] = field(default_factory=list)  # update() calls since the last step
    upstream_finished: bool = False  # every upstream edge has delivered its finished chunk


@dataclass(slots=True)
class StepOutput:
    """What one request produced in one engine step."""

    downstream: list[Payload] = field(default_factory=list)  # to every outgoing edge
    client: list[Payload] = field(default_factory=list)  # client-visible output
    done: bool = False  # this stage has finished the request
    wait_for_input: bool = False  # do not step again until new chunks/inputs/updates arrive
    # Do not step again before this `time.monotonic()` unless new chunks/inputs/updates arrive:
    # a paced engine (real-time audio, a video frame rate) says when it next has work, so a
    # stage steps only the requests that are due instead of polling every live one.
    not_before: float | None = None
    # Engine counters to add up per stage (e.g. ``prompt`` and ``prompt_cached`` tokens of a
    # prefix-caching engine); the runtime sums them and exporters publish the totals.
    counters: dict[str, int] = field(default_factory=dict)


class Engine(ABC):
    """One model component's compute. Instances are built from the pipeline YAML."""

    #: True when step() profits from several requests at once (the stage then batches).
    batchable: bool = False
    #: What this engine's stage offers a session, for `Orchestrator.capabilities()`:
    #: "voice_activity" (VoiceActivity probabilities of appended audio), "turn_detection"
    #: (SpeechStarted/SpeechStopped), "input_transcription" (Transcript of the user's audio),
    #: "responses" (ResponseStarted/ResponseDone: the pipeline decides when to speak),
    #: "end_of_turn" (TurnScore: whether a pause ends the user's turn).
    provides: frozenset[str] = frozenset()

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    def load(self) -> None:  # noqa: B027 - optional hook
        """Load weights (runs on the worker, once, before the first request)."""

    @abstractmethod
    def start(self, request: EngineRequest) -> Any:
        """Create the per-request state. Called at admission (pre-warm) or at the first input."""

    @abstractmethod
    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        """Advance every request in ``batch`` by one unit of work; one output per input."""

    def finish(self, state: Any, *, cancelled: bool) -> None:  # noqa: B027 - optional hook
        """Release per-request resources (done, failed or cancelled)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``load`` acquired (an engine process, say) when the replica closes."""
