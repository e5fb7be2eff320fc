"""Pipeline specs: YAML in, validated (by pydantic models of the YAML) frozen dataclasses out.

Every validation error is a :class:`PipelineSpecError` whose message names the file, the
field (``stages[1].budget.max_batch``) and the reason, so a bad YAML never starts anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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
    # Once woken with work, wait this long for more before stepping (0: step at once). For
    # stages whose steps are tiny and frequent (a VAD frame per session every 32 ms), so that
    # one step serves many sessions instead of one thread hand-off per frame.
    gather_ms: int = 0


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
    try:
        raw = _PipelineYaml.model_validate(data, context={"engines": set(known_engines)})
    except ValidationError as exc:
        raise _spec_error(source, exc) from None
    return raw.to_spec(source)


# ----------------------------------------------------------------------------- YAML shapes
# pydantic models of the YAML as written; each check raises a ``pipeline_spec`` error whose
# context holds the reason (and, for a check made on the enclosing mapping, the field below it),
# which :func:`_spec_error` turns into one PipelineSpecError naming the path.

_SPEC_ERROR = "pipeline_spec"


def _fail(reason: str, below: str = "") -> PydanticCustomError:
    return PydanticCustomError(_SPEC_ERROR, "{reason}", {"reason": reason, "below": below})


def _spec_error(source: str, exc: ValidationError) -> PipelineSpecError:
    """The first error pydantic found (fields are checked in declaration order)."""
    error = exc.errors(include_url=False)[0]
    path = ""
    for part in error["loc"]:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, str(part))
    ctx = error.get("ctx") or {}
    if error["type"] == _SPEC_ERROR:
        below = str(ctx.get("below", ""))
        if below:
            path = _join(path, below)
        reason = str(ctx["reason"])
    elif error["type"] == "missing":
        reason = "missing required field"
    else:  # not reached by the shapes below; pydantic's own words then
        reason = error["msg"]
    return PipelineSpecError(source, path or "<top>", reason)


def _integer(minimum: int) -> PlainValidator:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(f"expected an integer >= {minimum}, got {value!r}")
        if value < minimum:
            raise _fail(f"must be >= {minimum}, got {value}")
        return value

    return PlainValidator(check)


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(f"expected a non-empty string, got {value!r}")
    return value


def _choice(choices: tuple[str, ...]) -> PlainValidator:
    def check(value: Any) -> str:
        if value not in choices:
            raise _fail(f"must be one of {', '.join(choices)}, got {value!r}")
        return str(value)

    return PlainValidator(check)


def _mapping(value: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _fail("expected a mapping")
    return dict(value)


_Count = Annotated[int, _integer(0)]
_Positive = Annotated[int, _integer(1)]
_Name = Annotated[str, PlainValidator(_string)]


class _Shape(BaseModel):
    """A YAML mapping: only the declared keys; ``None`` (and for some keys any empty value)
    stands for an absent key, so the default applies."""

    model_config = ConfigDict(frozen=True)
    absent_if_none: ClassVar[frozenset[str]] = frozenset()
    absent_if_empty: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail(f"expected a mapping, got {type(data).__name__}")
        allowed = [info.alias or name for name, info in cls.model_fields.items()]
        for key in data:
            if key not in allowed:
                raise _fail(f"unknown field (expected one of {', '.join(allowed)})", str(key))
        return {
            key: value
            for key, value in data.items()
            if not (value is None and key in cls.absent_if_none)
            and not (not value and key in cls.absent_if_empty)
        }


class _ChunkYaml(_Shape):
    first: _Positive = 1
    steady: _Positive = 1
    left_context: _Count = 0

    def to_spec(self) -> ChunkPolicy:
        return ChunkPolicy(self.first, self.steady, self.left_context)


_BUDGET = BudgetSpec()


class _BudgetYaml(_Shape):
    max_concurrency: _Positive = _BUDGET.max_concurrency
    max_batch: _Positive = _BUDGET.max_batch
    worker: Annotated[WorkerKind, _choice(WORKER_KINDS)] = _BUDGET.worker
    workers: _Positive = _BUDGET.workers
    device: _Name = _BUDGET.device
    kv_bytes: _Count = _BUDGET.kv_bytes
    gather_ms: _Count = _BUDGET.gather_ms

    @model_validator(mode="after")
    def _one_step_per_process(self) -> _BudgetYaml:
        if self.worker == "process" and self.workers != 1:
            raise _fail("a process worker runs one step at a time (use replicas)", "workers")
        return self

    def to_spec(self) -> BudgetSpec:
        return BudgetSpec(
            self.max_concurrency,
            self.max_batch,
            self.worker,
            self.workers,
            self.device,
            self.kv_bytes,
            self.gather_ms,
        )


class _StageYaml(_Shape):
    absent_if_none = frozenset({"name", "engine"})
    absent_if_empty = frozenset({"options", "budget"})

    name: _Name
    engine: _Name
    options: Annotated[dict[Any, Any], PlainValidator(_mapping)] = Field(default_factory=dict)
    budget: _BudgetYaml = Field(default_factory=_BudgetYaml)
    replicas: _Positive = 1

    @field_validator("engine")
    @classmethod
    def _registered(cls, engine: str, info: ValidationInfo) -> str:
        engines: set[str] = (info.context or {}).get("engines", set())
        if engine not in engines and ":" not in engine:  # module:QualName: checked at start
            known = ", ".join(sorted(engines)) or "none"
            raise _fail(f"unknown engine {engine!r} (registered: {known})")
        return engine

    def to_spec(self) -> StageSpec:
        return StageSpec(self.name, self.engine, dict(self.options), self.budget.to_spec(), self.replicas)


class _EdgeYaml(_Shape):
    absent_if_none = frozenset({"from", "to", "max_ahead"})
    absent_if_empty = frozenset({"chunk"})

    source: _Name = Field(alias="from")
    target: _Name = Field(alias="to")
    mode: Annotated[EdgeMode, _choice(EDGE_MODES)] = "async_chunk"
    connector: Annotated[str, _choice(CONNECTORS)] = "inproc"
    chunk: _ChunkYaml = Field(default_factory=_ChunkYaml)
    max_ahead: Annotated[int | None, _integer(1)] = None

    @model_validator(mode="after")
    def _max_ahead_fits(self) -> _EdgeYaml:
        if self.max_ahead is None:
            return self
        if self.mode != "async_chunk":
            reason = "only for mode async_chunk (a full edge hands over nothing before the end)"
            raise _fail(reason, "max_ahead")
        chunk = self.chunk
        if self.max_ahead < max(chunk.first, chunk.steady):
            raise _fail(
                f"must be >= the chunk sizes (first {chunk.first}, steady {chunk.steady}), "
                f"got {self.max_ahead}: the upstream stage could never complete a chunk",
                "max_ahead",
            )
        return self

    def to_spec(self) -> EdgeSpec:
        chunk = self.chunk.to_spec()
        return EdgeSpec(self.source, self.target, self.mode, self.connector, chunk, self.max_ahead)


class _EntriesYaml(_Shape):
    live: Annotated[str | None, PlainValidator(_string)] = None
    transcribe: Annotated[str | None, PlainValidator(_string)] = None

    def named(self) -> dict[str, str]:
        return {key: stage for key, stage in (("live", self.live), ("transcribe", self.transcribe)) if stage}


def _stage_list(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise _fail("expected a non-empty list of stages")
    return value


def _edge_list(value: Any) -> Any:
    if not isinstance(value, list):
        raise _fail("expected a list of edges")
    return value


class _PipelineYaml(_Shape):
    absent_if_none = frozenset({"name", "stages", "entry", "max_concurrency"})
    absent_if_empty = frozenset({"edges", "entries"})

    name: _Name
    entry: _Name | None = None  # default: the first stage
    stages: Annotated[list[_StageYaml], BeforeValidator(_stage_list)]
    edges: Annotated[list[_EdgeYaml], BeforeValidator(_edge_list)] = Field(default_factory=list)
    max_concurrency: Annotated[int | None, _integer(1)] = None
    entries: _EntriesYaml = Field(default_factory=_EntriesYaml)
    input_rate: Annotated[int, _integer(8000)] = 16000

    @model_validator(mode="after")
    def _references(self) -> _PipelineYaml:
        names = [s.name for s in self.stages]
        for i, stage_name in enumerate(names):
            if stage_name in names[:i]:
                raise _fail(f"duplicate stage name {stage_name!r}", f"stages[{i}].name")
        stages = ", ".join(names)
        entry = self.entry or names[0]
        if entry not in names:
            raise _fail(f"unknown stage {entry!r} (stages: {stages})", "entry")
        by_name = {s.name: s for s in self.stages}
        for i, edge in enumerate(self.edges):
            for key, end in (("from", edge.source), ("to", edge.target)):
                if end not in by_name:
                    raise _fail(f"unknown stage {end!r} (stages: {stages})", f"edges[{i}].{key}")
            if edge.source == edge.target:
                raise _fail(f"cycle: edge from {edge.source!r} to itself", f"edges[{i}]")
            for end in (edge.source, edge.target):
                if by_name[end].budget.worker == "process" and edge.connector != "shm":
                    raise _fail(
                        f"stage {end!r} runs in a worker process, so its edges need connector: shm",
                        f"edges[{i}].connector",
                    )
        entries = self.entries.named()
        for key, stage_name in entries.items():
            if stage_name not in names:
                raise _fail(f"unknown stage {stage_name!r} (stages: {stages})", f"entries.{key}")
        _check_topology([entry, *entries.values()], names, [e.to_spec() for e in self.edges])
        return self

    def to_spec(self, source: str) -> PipelineSpec:
        return PipelineSpec(
            name=self.name,
            entry=self.entry or self.stages[0].name,
            stages=tuple(s.to_spec() for s in self.stages),
            edges=tuple(e.to_spec() for e in self.edges),
            max_concurrency=self.max_concurrency,
            source=source,
            entries=self.entries.named(),
            input_rate=self.input_rate,
        )


def _check_topology(entries: list[str], names: list[str], edges: list[EdgeSpec]) -> None:
    seen: set[str] = set()
    for i, edge in enumerate(edges):
        if edge.key in seen:
            raise _fail(f"duplicate edge {edge.key}", f"edges[{i}]")
        seen.add(edge.key)
        if edge.target in entries:
            raise _fail(f"the entry stage {edge.target!r} cannot have incoming edges", f"edges[{i}].to")
    cycle = find_cycle(names, lambda n: [e.target for e in edges if e.source == n])
    if cycle:
        raise _fail(f"cycle: {' -> '.join(cycle)}", "edges")
    for i, name in enumerate(names):
        if name not in entries and not any(e.target == name for e in edges):
            raise _fail(f"stage {name!r} is unreachable: no incoming edge and not an entry", f"stages[{i}]")


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
