"""Re-running a request whose remote stage lost its host before anything reached the client.

A request qualifies when the failure is a lost host (``stage_unavailable: stage X lost its
host``), the request has not pushed one client-visible payload (no text, no audio), it was
submitted whole (no streamed inputs, conditioning updates or gated-edge changes since: those
are not replayed), it is not a re-run already (one retry at most), and another replica of that
stage is ready and serving. The orchestrator then ends the run on its replicas and opens it again, under a new
request id (so that the cleanup of the old run, which reaches the hosts asynchronously, cannot
touch the new one), with the same parameters and the same :class:`RequestHandle`: the client
never sees the first attempt. Calls by the old id (cancel, inputs, gates) follow the new one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.remote.worker import UNAVAILABLE

RERUN_SUFFIX = "~rerun"


def lost_host(stage: str, error: str) -> bool:
    """``error`` says ``stage`` lost its host (RemoteWorker.unavailable), not an engine error."""
    return f"{UNAVAILABLE}: stage {stage} lost its host" in error


@dataclass(slots=True)
class Origin:
    """What a request was submitted with: enough to run it again."""

    params: Mapping[str, Any]
    session_key: str | None
    streamed: bool = False  # inputs, updates or edge gates changed after the submit: not replayable
    rerun: bool = False  # this run is the re-run


class Reruns:
    """The bookkeeping of re-runs (on the loop): origins of live requests, and old id -> new id."""

    def __init__(self) -> None:
        self.origins: dict[str, Origin] = {}  # live request id -> its origin
        self.aliases: dict[str, str] = {}  # the id the caller holds -> the live re-run's id
        self.counts: Counter[str] = Counter()  # stage -> requests re-run after it lost a host

    def submitted(self, request_id: str, params: Mapping[str, Any], session_key: str | None) -> None:
        self.origins[request_id] = Origin(dict(params), session_key)

    def current(self, request_id: str) -> str:
        return self.aliases.get(request_id, request_id)

    def streamed(self, request_id: str) -> None:
        origin = self.origins.get(request_id)
        if origin is not None:
            origin.streamed = True

    def candidate(self, request_id: str, stage: str, error: str, reached_client: bool) -> Origin | None:
        origin = self.origins.get(request_id)
        if origin is None or origin.streamed or origin.rerun or reached_client or not lost_host(stage, error):
            return None
        return origin

    def moved(self, caller_id: str, old_id: str, new_id: str, stage: str) -> None:
        origin = self.origins.pop(old_id)
        self.origins[new_id] = Origin(origin.params, origin.session_key, rerun=True)
        self.aliases[caller_id] = new_id
        self.counts[stage] += 1

    def ended(self, caller_id: str, request_id: str) -> None:
        self.origins.pop(request_id, None)
        if self.aliases.get(caller_id) == request_id:
            del self.aliases[caller_id]
