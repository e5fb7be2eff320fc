"""Started orchestrators for world pipelines, one per pipeline, built on first use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from runtime.orchestrator import Orchestrator


class OrchestratorPool:
    """``await pool(name)`` → the started orchestrator of pipeline ``name`` (a RuntimeProvider)."""

    def __init__(self, factory: Callable[[str], Orchestrator] = Orchestrator.from_pipeline) -> None:
        self._factory = factory
        self._running: dict[str, Orchestrator] = {}
        self._starting: dict[str, asyncio.Task[Orchestrator]] = {}
        self._closed = False

    async def __call__(self, pipeline: str) -> Orchestrator:
        running = self._running.get(pipeline)
        if running is not None:
            return running
        if self._closed:
            raise RuntimeError("the orchestrator pool is closed")
        task = self._starting.get(pipeline)
        if task is None:
            task = asyncio.create_task(self._start(pipeline), name=f"orchestrator-start-{pipeline}")
            self._starting[pipeline] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._starting.pop(pipeline, None)

    async def _start(self, pipeline: str) -> Orchestrator:
        orchestrator = await asyncio.to_thread(self._factory, pipeline)  # reads and validates YAML
        await orchestrator.start()
        self._running[pipeline] = orchestrator
        return orchestrator

    async def warm(self, pipelines: Iterable[str]) -> None:
        await asyncio.gather(*(self(name) for name in pipelines))

    @property
    def running(self) -> dict[str, Orchestrator]:
        return dict(self._running)

    async def close(self) -> None:
        self._closed = True
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        self._starting.clear()
        running, self._running = list(self._running.values()), {}
        await asyncio.gather(*(o.close() for o in running), return_exceptions=True)
