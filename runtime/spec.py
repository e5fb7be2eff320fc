"""Pipeline specs: YAML in, validated frozen dataclasses out.

Every validation error is a :class:`PipelineSpecError` whose message names the file, the
field (``stages[1].budget.max_batch``) and the reason, so a bad YAML never starts anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

EdgeMode = Literal["async_chunk", "full"]
WorkerKind = Literal["thread", "process"]

EDGE_MODES: tuple[str, ...] = ("async_chunk", "full")
CONNECTORS: tuple[str, ...] = ("inproc", "shm")
WORKER_KINDS: tuple[str, ...] = ("thread", "process")
PIPELINES_DIR = Path(__file__).with_name("pipelines")


class PipelineSpecError(ValueError):
    """A pipeline that cannot run: which file, which field, and why."""

    def __init__(self, source: str, field_path: str, reason: str) -> None:
        self.source = source
        self.field = field_path
        self.reason = reason
        where = f"{source}: {field_path}" if field_path else source
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """async_chunk hand-over policy: first chunk size, steady chunk size, left context."""

    first: int = 1
    steady: int = 1
    left_context: int = 0


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    max_concurrency: int = 16  # live requests per replica
    max_batch: int = 1  # requests per engine.step call
    worker: WorkerKind = "thread"
    workers: int = 1  # concurrent step calls per replica (thread workers only)
    device: str = "cpu"
    kv_bytes: int = 256 * 1024 * 1024  # per-replica session KV retention budget (runtime.kv)


@dataclass(frozen=True, slots=True)
class StageSpec:
    name: str
    engine: str
    options: Mapping[str, Any] = field(default_factory=dict)
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    replicas: int = 1


@dataclass(frozen=True, slots=True)
class EdgeSpec:
    source: str  # YAML `from`
    target: str  # YAML `to`
    mode: EdgeMode = "async_chunk"
    connector: str = "inproc"
    chunk: ChunkPolicy = field(default_factory=ChunkPolicy)
    # Flow credits (async_chunk only): the upstream stage is stepped for a request only while
    # fewer than ``max_ahead`` of the items it put on this edge have not yet been taken in by a
    # downstream step. None: no credit limit (only the orchestrator's inbox_limit applies).
    max_ahead: int | None = None

    @property
    def key(self) -> str:
        return f"{self.source}->{self.target}"


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    name: str
    entry: str
    stages: tuple[StageSpec, ...]
    edges: tuple[EdgeSpec, ...] = ()
    max_concurrency: int | None = None  # pipeline admission limit; default: tightest stage
    source: str = "<memory>"
    # Named extra entries (YAML `entries: {live: vad, transcribe: transcribe}`): a request
    # submitted with `entry=<stage>` runs only the stages reachable from that stage. `live` is
    # where a voice session opens its live request; `transcribe` transcribes one audio item.
    entries: Mapping[str, str] = field(default_factory=dict)
    input_rate: int = 16000  # sample rate of the AudioInput a session appends to a live request

    def stage(self, name: str) -> StageSpec:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def incoming(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.target == name]

    def outgoing(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.source == name]

    def reachable(self, entry: str) -> list[str]:
        """Stage names a request entering at `entry` runs, in declaration order."""
        seen = {entry}
        todo = [entry]
        while todo:
            for edge in self.outgoing(todo.pop()):
                if edge.target not in seen:
                    seen.add(edge.target)
                    todo.append(edge.target)
        return [s.name for s in self.stages if s.name in seen]

    def capacity(self) -> int:
        if self.max_concurrency is not None:
            return self.max_concurrency
        main = set(self.reachable(self.entry))  # other entries' stages bound their own requests
        return min(s.budget.max_concurrency * s.replicas for s in self.stages if s.name in main)

    def with_stage(
        self,
        engine: str,
        *,
        options: Mapping[str, Any] | None = None,
        new_engine: str | None = None,
        budget: Mapping[str, Any] | None = None,
    ) -> PipelineSpec:
        """This pipeline with every stage of ``engine`` given extra ``options`` and ``budget``
        fields (merged over its own) and, with ``new_engine``, run by another engine
        (``speech.responder`` → ``vllm.responder``)."""
        if not any(stage.engine == engine for stage in self.stages):
            raise ValueError(f"pipeline {self.name!r} has no stage with engine {engine!r}")
        stages = tuple(
            replace(
                stage,
                engine=new_engine or stage.engine,
                options={**stage.options, **(options or {})},
                budget=replace(stage.budget, **(budget or {})),
            )
            if stage.engine == engine
            else stage
            for stage in self.stages
        )
        return replace(self, stages=stages)

    def with_edge_modes(self, edge_modes: Mapping[str, str] | None) -> PipelineSpec:
        """This pipeline with some edges' modes overridden (``{"talker->code2wav": "full"}``);
        an edge switched to ``full`` drops its ``max_ahead`` (nothing is handed over early)."""
        if not edge_modes:
            return self
        keys = {e.key for e in self.edges}
        for key, mode in edge_modes.items():
            if key not in keys:
                raise ValueError(
                    f"edge_modes: unknown edge {key!r} in pipeline {self.name!r} "
                    f"(edges: {', '.join(sorted(keys)) or 'none'})"
                )
            if mode not in EDGE_MODES:
                raise ValueError(f"edge_modes[{key!r}]: mode must be one of {', '.join(EDGE_MODES)}")
        edges = tuple(
            replace(
                e,
                mode=edge_modes[e.key],  # type: ignore[arg-type]
                max_ahead=e.max_ahead if edge_modes[e.key] == "async_chunk" else None,
            )
            if e.key in edge_modes
            else e
            for e in self.edges
        )
        return replace(self, edges=edges)


def available_pipelines() -> list[str]:
    return sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml"))


def load_pipeline(
    name_or_path: str | Path, *, known_engines: Iterable[str] | None = None
) -> PipelineSpec:
    """Load a pipeline by bare name (``runtime/pipelines/<name>.yaml``) or by path."""
    text_path = str(name_or_path)
    looks_like_path = isinstance(name_or_path, Path) or "/" in text_path or text_path.endswith(
        (".yaml", ".yml")
    )
    if looks_like_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise PipelineSpecError(str(path), "", "no such file")
    else:
        path = PIPELINES_DIR / f"{text_path}.yaml"
        if not path.is_file():
            raise PipelineSpecError(
                text_path,
                "",
                f"unknown pipeline (available: {', '.join(available_pipelines()) or 'none'})",
            )
    return parse_pipeline(path.read_text(encoding="utf-8"), source=str(path), known_engines=known_engines)


def parse_pipeline(
    text: str, *, source: str = "<string>", known_engines: Iterable[str] | None = None
) -> PipelineSpec:
    """Parse and validate YAML text. ``known_engines`` defaults to the engine registry."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise PipelineSpecError(source, where, f"invalid YAML: {problem}") from None
    if known_engines is None:
        from runtime.registry import available_engines

        known_engines = available_engines()
    return _Validator(source, set(known_engines)).pipeline(data)


class _Validator:
    def __init__(self, source: str, engines: set[str]) -> None:
        self.source = source
        self.engines = engines

    def fail(self, path: str, reason: str) -> PipelineSpecError:
        return PipelineSpecError(self.source, path, reason)

    def mapping(self, value: Any, path: str, allowed: Iterable[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path or "<top>", f"expected a mapping, got {type(value).__name__}")
        allowed = tuple(allowed)
        for key in value:
            if key not in allowed:
                expected = ", ".join(allowed)
                raise self.fail(_join(path, str(key)), f"unknown field (expected one of {expected})")
        return value

    def required(self, data: dict[str, Any], key: str, path: str) -> Any:
        if key not in data or data[key] is None:
            raise self.fail(_join(path, key), "missing required field")
        return data[key]

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"expected a non-empty string, got {value!r}")
        return value

    def integer(self, value: Any, path: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer >= {minimum}, got {value!r}")
        if value < minimum:
            raise self.fail(path, f"must be >= {minimum}, got {value}")
        return value

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str:
        if value not in choices:
            raise self.fail(path, f"must be one of {', '.join(choices)}, got {value!r}")
        return str(value)

    def pipeline(self, data: Any) -> PipelineSpec:
        data = self.mapping(
            data, "", ("name", "entry", "stages", "edges", "max_concurrency", "entries", "input_rate")
        )
        name = self.string(self.required(data, "name", ""), "name")
        raw_stages = self.required(data, "stages", "")
        if not isinstance(raw_stages, list) or not raw_stages:
            raise self.fail("stages", "expected a non-empty list of stages")
        stages = tuple(self.stage(s, f"stages[{i}]") for i, s in enumerate(raw_stages))
        names = [s.name for s in stages]
        for i, stage_name in enumerate(names):
            if stage_name in names[:i]:
                raise self.fail(f"stages[{i}].name", f"duplicate stage name {stage_name!r}")
        entry = self.string(data.get("entry", names[0]), "entry")
        if entry not in names:
            raise self.fail("entry", f"unknown stage {entry!r} (stages: {', '.join(names)})")
        raw_edges = data.get("edges") or []
        if not isinstance(raw_edges, list):
            raise self.fail("edges", "expected a list of edges")
        by_name = {s.name: s for s in stages}
        edges = tuple(self.edge(e, f"edges[{i}]", by_name) for i, e in enumerate(raw_edges))
        max_conc = data.get("max_concurrency")
        if max_conc is not None:
            max_conc = self.integer(max_conc, "max_concurrency", 1)
        raw_entries = self.mapping(data.get("entries") or {}, "entries", ("live", "transcribe"))
        entries: dict[str, str] = {}
        for key, value in raw_entries.items():
            stage_name = self.string(value, f"entries.{key}")
            if stage_name not in names:
                known = ", ".join(names)
                raise self.fail(f"entries.{key}", f"unknown stage {stage_name!r} (stages: {known})")
            entries[key] = stage_name
        input_rate = self.integer(data.get("input_rate", 16000), "input_rate", 8000)
        self.topology([entry, *entries.values()], names, edges)
        return PipelineSpec(name, entry, stages, edges, max_conc, self.source, entries, input_rate)

    def stage(self, data: Any, path: str) -> StageSpec:
        data = self.mapping(data, path, ("name", "engine", "options", "budget", "replicas"))
        name = self.string(self.required(data, "name", path), _join(path, "name"))
        engine = self.string(self.required(data, "engine", path), _join(path, "engine"))
        if engine not in self.engines and ":" not in engine:  # module:QualName: checked at start
            raise self.fail(
                _join(path, "engine"),
                f"unknown engine {engine!r} (registered: {', '.join(sorted(self.engines)) or 'none'})",
            )
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise self.fail(_join(path, "options"), "expected a mapping")
        budget = self.budget(data.get("budget") or {}, _join(path, "budget"))
        replicas = self.integer(data.get("replicas", 1), _join(path, "replicas"), 1)
        return StageSpec(name, engine, dict(options), budget, replicas)

    def budget(self, data: Any, path: str) -> BudgetSpec:
        data = self.mapping(data, path, BudgetSpec.__dataclass_fields__)  # type: ignore[attr-defined]
        base = BudgetSpec()
        worker = self.choice(data.get("worker", base.worker), _join(path, "worker"), WORKER_KINDS)
        workers = self.integer(data.get("workers", base.workers), _join(path, "workers"), 1)
        if worker == "process" and workers != 1:
            raise self.fail(_join(path, "workers"), "a process worker runs one step at a time (use replicas)")
        device = data.get("device", base.device)
        return BudgetSpec(
            max_concurrency=self.integer(
                data.get("max_concurrency", base.max_concurrency), _join(path, "max_concurrency"), 1
            ),
            max_batch=self.integer(data.get("max_batch", base.max_batch), _join(path, "max_batch"), 1),
            worker=worker,  # type: ignore[arg-type]
            workers=workers,
            device=self.string(device, _join(path, "device")),
            kv_bytes=self.integer(data.get("kv_bytes", base.kv_bytes), _join(path, "kv_bytes"), 0),
        )

    def edge(self, data: Any, path: str, stages: Mapping[str, StageSpec]) -> EdgeSpec:
        data = self.mapping(data, path, ("from", "to", "mode", "connector", "chunk", "max_ahead"))
        ends = []
        for key in ("from", "to"):
            value = self.string(self.required(data, key, path), _join(path, key))
            if value not in stages:
                raise self.fail(_join(path, key), f"unknown stage {value!r} (stages: {', '.join(stages)})")
            ends.append(value)
        source, target = ends
        if source == target:
            raise self.fail(path, f"cycle: edge from {source!r} to itself")
        mode = self.choice(data.get("mode", "async_chunk"), _join(path, "mode"), EDGE_MODES)
        connector = self.choice(data.get("connector", "inproc"), _join(path, "connector"), CONNECTORS)
        for end in (source, target):
            if stages[end].budget.worker == "process" and connector != "shm":
                raise self.fail(
                    _join(path, "connector"),
                    f"stage {end!r} runs in a worker process, so its edges need connector: shm",
                )
        chunk = self.chunk(data.get("chunk") or {}, _join(path, "chunk"))
        max_ahead = self.max_ahead(data.get("max_ahead"), _join(path, "max_ahead"), mode, chunk)
        return EdgeSpec(source, target, mode, connector, chunk, max_ahead)  # type: ignore[arg-type]

    def max_ahead(self, value: Any, path: str, mode: str, chunk: ChunkPolicy) -> int | None:
        if value is None:
            return None
        limit = self.integer(value, path, 1)
        if mode != "async_chunk":
            raise self.fail(path, "only for mode async_chunk (a full edge hands over nothing before the end)")
        needed = max(chunk.first, chunk.steady)
        if limit < needed:
            raise self.fail(
                path,
                f"must be >= the chunk sizes (first {chunk.first}, steady {chunk.steady}), got {limit}: "
                "the upstream stage could never complete a chunk",
            )
        return limit

    def chunk(self, data: Any, path: str) -> ChunkPolicy:
        data = self.mapping(data, path, ("first", "steady", "left_context"))
        return ChunkPolicy(
            first=self.integer(data.get("first", 1), _join(path, "first"), 1),
            steady=self.integer(data.get("steady", 1), _join(path, "steady"), 1),
            left_context=self.integer(data.get("left_context", 0), _join(path, "left_context"), 0),
        )

    def topology(self, entries: list[str], names: list[str], edges: tuple[EdgeSpec, ...]) -> None:
        seen: set[str] = set()
        for i, edge in enumerate(edges):
            if edge.key in seen:
                raise self.fail(f"edges[{i}]", f"duplicate edge {edge.key}")
            seen.add(edge.key)
            if edge.target in entries:
                raise self.fail(
                    f"edges[{i}].to", f"the entry stage {edge.target!r} cannot have incoming edges"
                )
        cycle = find_cycle(names, lambda n: [e.target for e in edges if e.source == n])
        if cycle:
            raise self.fail("edges", f"cycle: {' -> '.join(cycle)}")
        for i, name in enumerate(names):
            if name not in entries and not any(e.target == name for e in edges):
                raise self.fail(
                    f"stages[{i}]", f"stage {name!r} is unreachable: no incoming edge and not an entry"
                )


def find_cycle(nodes: Iterable[str], successors: Callable[[str], list[str]]) -> list[str] | None:
    """A cycle as a path ``[a, b, ..., a]``, or None for a DAG."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in successors(node):
            if color.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in color:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    for node in nodes:
        if node not in color:
            found = visit(node)
            if found:
                return found
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
