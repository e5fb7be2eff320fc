from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from runtime.orchestrator import Orchestrator
from runtime.registry import register_engine, unregister_engine
from runtime.shm import NAME_PREFIX, SHM_DIR
from runtime.spec import parse_pipeline
from tests.runtime import fakes

FAKE_ENGINES = {
    "fake.gen": fakes.Gen,
    "fake.relay": fakes.Relay,
    "fake.sink": fakes.Sink,
    "fake.session": fakes.SessionCounter,
    "fake.explode": fakes.Explode,
}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments() -> Iterator[None]:
    yield
    prefix = f"{NAME_PREFIX}{os.getpid()}_"
    leaked = [p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix)]
    assert leaked == [], f"shared-memory segments left behind: {leaked}"


@pytest.fixture(autouse=True)
def fake_engines() -> Iterator[None]:
    for name, cls in FAKE_ENGINES.items():
        register_engine(name, cls)
    fakes.EVENTS.clear()
    yield
    for name in FAKE_ENGINES:
        unregister_engine(name)


@asynccontextmanager
async def running(yaml_text: str, **kwargs: Any) -> AsyncIterator[Orchestrator]:
    orch = Orchestrator.from_spec(parse_pipeline(yaml_text, source="test.yaml"), **kwargs)
    await orch.start()
    try:
        yield orch
    finally:
        await orch.close()


@pytest.fixture
def orchestrator() -> Callable[..., Any]:
    return running
