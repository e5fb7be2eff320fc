"""No-network units of session/lifecycle.py: what a kind's ``KindSpec`` switches change in the
shared lifecycle (park or end past the grace, TTL refresh on activity), with in-memory fakes
of the store, the admission controller and the writer."""

from __future__ import annotations

from typing import Any

import pytest

from session.affinity import Binding
from session.lifecycle import HostedSession, KindSpec, SessionLifecycle
from session.retention import RetentionPolicy, RetentionTimer
from session.store.errors import StoreError

pytestmark = pytest.mark.unit

POLICY = RetentionPolicy(idle_ttl_s=600.0, max_lifetime_s=3600.0, disconnect_grace_s=30.0)
T0 = 1_800_000_000.0
Session = HostedSession[Any, Any]


class FakeWriter:
    def __init__(self) -> None:
        self.states: list[str] = []
        self.closed_with_flush: bool | None = None
        self.activity_marks = 0

    def set_state(self, state: str) -> None:
        self.states.append(state)

    def mark_activity(self) -> None:
        self.activity_marks += 1

    async def close(self, *, flush: bool = True) -> None:
        self.closed_with_flush = flush


class FakeShared:
    """The store, admission controller and binding of SharedParts, recording what they were told."""

    def __init__(self) -> None:
        self.store = self
        self.admission = self
        self.binding: Any = None
        self.policy = POLICY
        self.claim = None
        self.replica_id = "replica-a"
        self.settings = self
        self.sweep_s = 1.0
        self.released: list[str] = []
        self.deleted: list[str] = []

    async def release(self, session_id: str) -> None:
        self.released.append(session_id)

    async def delete_session(self, session_id: str) -> None:
        self.deleted.append(session_id)

    async def bind_new(self, session_id: str) -> int:
        return 0

    async def take_binding(self, session_id: str) -> Binding:
        raise AssertionError("no rebuilds here")


class Hooks:
    """A kind whose driver was last active at ``active_at`` (monotonic)."""

    def __init__(self) -> None:
        self.active_at = 0.0
        self.stopped: list[tuple[int, str] | None] = []

    def last_activity(self, s: Session) -> float:
        return self.active_at

    def checkpoint(self, s: Session) -> None:
        pass

    def closed_by_itself(self, s: Session) -> str | None:
        return None

    async def stop(self, s: Session, close: tuple[int, str] | None, expiry: str | None) -> None:
        self.stopped.append(close)

    def store_failed(self, s: Session, error: StoreError) -> tuple[int, str]:
        return (1011, "session store error")


def lifecycle(spec: KindSpec, wall: list[float]) -> tuple[SessionLifecycle[Session], FakeShared, Hooks]:
    shared, hooks = FakeShared(), Hooks()
    life: SessionLifecycle[Session] = SessionLifecycle(
        shared,  # type: ignore[arg-type]  # fakes of the store and admission controller
        spec,
        hooks,
        wall=lambda: wall[0],
        clock=lambda: wall[0] - T0,  # monotonic = seconds since T0
    )
    return life, shared, hooks


def detached_session(life: SessionLifecycle[Session]) -> tuple[Session, FakeWriter]:
    writer = FakeWriter()
    timer = RetentionTimer(POLICY, created_at=T0, now=T0)
    timer.on_disconnect(T0)
    record: Any = None
    s = Session("sess_1", "tenant-a", None, writer, timer, record, "digest")  # type: ignore[arg-type]
    life.add(s)
    return s, writer


@pytest.mark.parametrize("parks", [True, False])
async def test_past_the_grace_a_parking_kind_keeps_the_record_and_another_deletes_it(parks: bool) -> None:
    wall = [T0]
    life, shared, hooks = lifecycle(KindSpec("k", expire_when_gone=False, parks=parks), wall)
    s, writer = detached_session(life)
    wall[0] = T0 + POLICY.disconnect_grace_s + 1
    await life.sweep()
    assert life.sessions == {} and life.leaving == {} and s.ending
    assert life.counts["grace_expired"] == 1
    assert hooks.stopped == [None]  # no close frame: nothing is attached
    assert shared.released == ["sess_1"]
    if parks:
        assert writer.states == ["parked"] and writer.closed_with_flush is True
        assert shared.deleted == []
    else:
        assert writer.states == [] and writer.closed_with_flush is False
        assert shared.deleted == ["sess_1"]


@pytest.mark.parametrize("touch", [True, False])
async def test_activity_a_sweep_sees_refreshes_the_ttls_only_when_the_kind_says(touch: bool) -> None:
    wall = [T0]
    life, _shared, hooks = lifecycle(KindSpec("k", expire_when_gone=False, touch_on_activity=touch), wall)
    s, writer = detached_session(life)
    wall[0] = T0 + 10
    hooks.active_at = 5.0  # the driver was active at T0 + 5
    await life.sweep()
    assert s.timer.last_active == T0 + 5  # the idle clock follows the driver either way
    assert writer.activity_marks == (1 if touch else 0)
    await life.sweep()  # no new activity: no new mark
    assert writer.activity_marks == (1 if touch else 0)
