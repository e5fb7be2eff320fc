"""Pipeline specs: YAML in, validated frozen pydantic models out (one set of types).

The spec types are the YAML's own shapes: pydantic checks the fields (``extra="forbid"``, strict
integers with bounds, literal choices, non-empty names), and the checks that span fields (an
edge's ``max_ahead`` against its chunk sizes, process workers on shm edges, references between
stages, the topology) are model validators. Every validation error is a
:class:`PipelineSpecError` whose message names the file, the field
(``stages[1].budget.max_batch``) and the reason, so a bad YAML never starts anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

EdgeMode = Literal["async_chunk", "full"]
WorkerKind = Literal["thread", "process"]
ConnectorKind = Literal["inproc", "shm"]
# live: a voice session's live request; transcribe: one audio item; responses: the text model a
# GPT-Live session's `responses` delegation runs on (session/live/delegation.py)
EntryName = Literal["live", "transcribe", "responses"]

EDGE_MODES: tuple[str, ...] = get_args(EdgeMode)
CONNECTORS: tuple[str, ...] = get_args(ConnectorKind)
WORKER_KINDS: tuple[str, ...] = get_args(WorkerKind)
PIPELINES_DIR = Path(__file__).with_name("pipelines")

Count = Annotated[int, Strict(), Field(ge=0)]
Positive = Annotated[int, Strict(), Field(ge=1)]
Name = Annotated[str, Strict(), Field(min_length=1)]


class PipelineSpecError(ValueError):
    """A pipeline that cannot run: which file, which field, and why."""

    def __init__(self, source: str, field_path: str, reason: str) -> None:
        self.source = source
        self.field = field_path
        self.reason = reason
        where = f"{source}: {field_path}" if field_path else source
        super().__init__(f"{where}: {reason}")


class _Spec(BaseModel):
    """A YAML mapping: only the declared keys; ``None`` (and for some keys any empty value)
    stands for an absent key, so the default applies."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    absent_if_none: ClassVar[frozenset[str]] = frozenset()
    absent_if_empty: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _absent_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic's own model_type error names it
        return {
            key: value
            for key, value in data.items()
            if not (value is None and key in cls.absent_if_none)
            and not (not value and key in cls.absent_if_empty)
        }


class ChunkPolicy(_Spec):
    """async_chunk hand-over policy: first chunk size, steady chunk size, left context."""

    first: Positive = 1
    steady: Positive = 1
    left_context: Count = 0


class BudgetSpec(_Spec):
    max_concurrency: Positive = 16  # live requests per replica
    max_batch: Positive = 1  # requests per engine.step call
    worker: WorkerKind = "thread"
    workers: Positive = 1  # concurrent step calls per replica (thread workers only)
    device: Name = "cpu"
    kv_bytes: Count = 256 * 1024 * 1024  # per-replica session KV retention budget (runtime.kv)
    # Once woken with work, wait this long for more before stepping (0: step at once). For
    # stages whose steps are tiny and frequent (a VAD frame per session every 32 ms), so that
    # one step serves many sessions instead of one thread hand-off per frame.
    gather_ms: Count = 0

    @model_validator(mode="after")
    def _one_step_per_process(self) -> BudgetSpec:
        if self.worker == "process" and self.workers != 1:
            raise _fail("a process worker runs one step at a time (use replicas)", "workers")
        return self


class StageSpec(_Spec):
    absent_if_none = frozenset({"name", "engine"})
    absent_if_empty = frozenset({"options", "budget"})

    name: Name
    engine: Name
    options: Mapping[str, Any] = Field(default_factory=dict)
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    replicas: Positive = 1

    @field_validator("engine")
    @classmethod
    def _registered(cls, engine: str, info: ValidationInfo) -> str:
        engines: set[str] | None = (info.context or {}).get("engines")
        if engines is not None and engine not in engines and ":" not in engine:  # module:QualName: at start
            known = ", ".join(sorted(engines)) or "none"
            raise _fail(f"unknown engine {engine!r} (registered: {known})")
        return engine


class EdgeSpec(_Spec):
    absent_if_none = frozenset({"from", "to", "max_ahead", "inbox_limit"})
    absent_if_empty = frozenset({"chunk"})

    source: Name = Field(alias="from")
    target: Name = Field(alias="to")
    mode: EdgeMode = "async_chunk"
    connector: ConnectorKind = "inproc"
    chunk: ChunkPolicy = Field(default_factory=ChunkPolicy)
    # Flow credits (async_chunk only): the upstream stage is stepped for a request only while
    # fewer than ``max_ahead`` of the items it put on this edge have not yet been taken in by a
    # downstream step. None: no credit limit (only the orchestrator's inbox_limit applies).
    max_ahead: Positive | None = None
    # A gated edge hands a request's items over only while that request has opened it
    # (`Orchestrator.open_edge`; closed at admission): a branch only some requests need (a
    # voice session's end-of-turn stage, for sessions on semantic_vad) gets nothing of the rest.
    gated: bool = False
    # Chunks the target may hold for a request before the upstream stage pauses (None: the
    # orchestrator's `inbox_limit`, 32); on a coalescing edge, items (None: 2048).
    inbox_limit: Positive | None = None
    # Coalescing (async_chunk, no max_ahead): what arrives while the target still holds a chunk
    # of this edge for the request joins that chunk, and the upstream goes on. For a branch whose
    # steps can take long and that takes all it is given at its next step (a live ASR's Whisper
    # run, whose input is the VAD's audio of the same sessions): the stage before it never waits
    # for it. `inbox_limit` then bounds the items held (a last resort against a target that
    # stopped stepping: the upstream pauses there).
    coalesce: bool = False

    @property
    def key(self) -> str:
        return f"{self.source}->{self.target}"

    @model_validator(mode="after")
    def _coalesce_fits(self) -> EdgeSpec:
        if not self.coalesce:
            return self
        if self.mode != "async_chunk":
            raise _fail("only for mode async_chunk (a full edge hands over one chunk at the end)", "coalesce")
        if self.max_ahead is not None:
            raise _fail("not with max_ahead (credits pause the upstream; coalescing never does)", "coalesce")
        return self

    @model_validator(mode="after")
    def _max_ahead_fits(self) -> EdgeSpec:
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


class PipelineSpec(_Spec):
    absent_if_none = frozenset({"name", "stages", "entry", "max_concurrency"})
    absent_if_empty = frozenset({"edges", "entries"})

    name: Name
    entry: Name = ""  # default: the first stage (filled in by validation)
    stages: tuple[StageSpec, ...] = Field(min_length=1)
    edges: tuple[EdgeSpec, ...] = ()
    max_concurrency: Positive | None = None  # pipeline admission limit; default: tightest stage
    source: str = "<memory>"  # the loader's, never the YAML's
    # Named extra entries (YAML `entries: {live: vad, transcribe: transcribe}`): a request
    # submitted with `entry=<stage>` runs only the stages reachable from that stage. `live` is
    # where a voice session opens its live request; `transcribe` transcribes one audio item.
    entries: Mapping[EntryName, Name] = Field(default_factory=dict)
    input_rate: Annotated[int, Strict(), Field(ge=8000)] = 16000  # AudioInput rate a session appends
    # per_stage: every stage schedules its own calls. critical_path: a call of a stage whose
    # request still waits for its first output is held while such a call of a stage downstream
    # of it runs (runtime/priority.py): on a host with fewer cores than stages, the work on the
    # path to a new request's first audio goes first instead of sharing the cores.
    scheduling: Literal["per_stage", "critical_path"] = "per_stage"

    @model_validator(mode="after")
    def _references(self) -> PipelineSpec:
        names = [s.name for s in self.stages]
        for i, stage_name in enumerate(names):
            if stage_name in names[:i]:
                raise _fail(f"duplicate stage name {stage_name!r}", f"stages[{i}].name")
        stages = ", ".join(names)
        if not self.entry:
            self.__dict__["entry"] = names[0]
        if self.entry not in names:
            raise _fail(f"unknown stage {self.entry!r} (stages: {stages})", "entry")
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
        for key, stage_name in self.entries.items():
            if stage_name not in names:
                raise _fail(f"unknown stage {stage_name!r} (stages: {stages})", f"entries.{key}")
        _check_topology([self.entry, *self.entries.values()], names, self.edges)
        return self

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
            stage.model_copy(
                update={
                    "engine": new_engine or stage.engine,
                    "options": {**stage.options, **(options or {})},
                    "budget": stage.budget.model_copy(update=dict(budget or {})),
                }
            )
            if stage.engine == engine
            else stage
            for stage in self.stages
        )
        return self.model_copy(update={"stages": stages})

    def with_edge_modes(self, edge_modes: Mapping[str, str] | None) -> PipelineSpec:
        """This pipeline with some edges' modes overridden (``{"talker->code2wav": "full"}``);
        an edge switched to ``full`` drops its ``max_ahead`` and ``coalesce`` (nothing is handed
        over early)."""
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
            e.model_copy(
                update={
                    "mode": edge_modes[e.key],
                    "max_ahead": e.max_ahead if edge_modes[e.key] == "async_chunk" else None,
                    "coalesce": e.coalesce and edge_modes[e.key] == "async_chunk",
                }
            )
            if e.key in edge_modes
            else e
            for e in self.edges
        )
        return self.model_copy(update={"edges": edges})


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
    if isinstance(data, dict) and "source" in data:  # set by the loader, never by the YAML
        raise PipelineSpecError(source, "source", f"unknown field (expected one of {_allowed(PipelineSpec)})")
    try:
        spec = PipelineSpec.model_validate(data, context={"engines": set(known_engines)})
    except ValidationError as exc:
        raise _spec_error(source, exc) from None
    return spec.model_copy(update={"source": source})


# ----------------------------------------------------------------------------- errors
# A check that spans fields raises a ``pipeline_spec`` error whose context holds the reason (and,
# for a check made on the enclosing mapping, the field below it); pydantic's own errors are put
# in the same words. :func:`_spec_error` turns the first into one PipelineSpecError naming the path.

_SPEC_ERROR = "pipeline_spec"


def _fail(reason: str, below: str = "") -> PydanticCustomError:
    return PydanticCustomError(_SPEC_ERROR, "{reason}", {"reason": reason, "below": below})


def _spec_error(source: str, exc: ValidationError) -> PipelineSpecError:
    """The first error pydantic found (fields are checked in declaration order)."""
    error = exc.errors(include_url=False)[0]
    loc = [part for part in error["loc"] if part != "[key]"]
    path = ""
    for part in loc:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, str(part))
    ctx = error.get("ctx") or {}
    kind, value = error["type"], error.get("input")
    if kind == _SPEC_ERROR:
        below = str(ctx.get("below", ""))
        if below:
            path = _join(path, below)
        reason = str(ctx["reason"])
    elif kind == "missing":
        reason = "missing required field"
    elif kind == "extra_forbidden":
        reason = f"unknown field (expected one of {_allowed(_model_at(loc[:-1]))})"
    elif kind == "literal_error" and "[key]" in error["loc"]:  # entries: {live: ..., transcribe: ...}
        reason = f"unknown field (expected one of {', '.join(get_args(EntryName))})"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        reason = f"expected an integer, got {value!r}"
    elif kind == "greater_than_equal":
        reason = f"must be >= {ctx['ge']}, got {value}"
    elif kind in ("string_type", "string_too_short"):
        reason = f"expected a non-empty string, got {value!r}"
    elif kind == "literal_error":
        reason = f"must be one of {', '.join(_choices(loc))}, got {value!r}"
    elif kind in ("model_type", "model_attributes_type", "dict_type", "mapping_type"):
        reason = f"expected a mapping, got {type(value).__name__}"
    elif kind in ("tuple_type", "too_short") and loc[-1:] == ["stages"]:
        reason = "expected a non-empty list of stages"
    elif kind == "tuple_type" and loc[-1:] == ["edges"]:
        reason = "expected a list of edges"
    else:  # pydantic's own words
        reason = error["msg"]
    return PipelineSpecError(source, path or "<top>", reason)


def _model_of(annotation: Any) -> type[_Spec] | None:
    """The spec model in a field's annotation (``tuple[StageSpec, ...]``, ``BudgetSpec | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, _Spec):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _model_at(loc: list[Any]) -> type[_Spec]:
    """The model whose fields sit at ``loc`` (a path of field aliases and list indices)."""
    model: type[_Spec] = PipelineSpec
    for part in loc:
        if isinstance(part, str):
            info = _field(model, part)
            inner = _model_of(info.annotation) if info is not None else None
            if inner is None:
                break
            model = inner
    return model


def _field(model: type[_Spec], alias: str) -> Any:
    return next((i for n, i in model.model_fields.items() if (i.alias or n) == alias), None)


def _allowed(model: type[_Spec] | None) -> str:
    if model is None:
        return ""
    if model is PipelineSpec:
        return ", ".join(i.alias or n for n, i in model.model_fields.items() if n != "source")
    return ", ".join(i.alias or n for n, i in model.model_fields.items())


def _choices(loc: list[Any]) -> tuple[str, ...]:
    """The literal choices of the field at ``loc``."""
    info = _field(_model_at(loc[:-1]), str(loc[-1])) if loc else None
    annotation = info.annotation if info is not None else None
    while annotation is not None and get_origin(annotation) is not Literal:
        args = get_args(annotation)
        annotation = args[0] if args else None
    return get_args(annotation) if annotation is not None else ()


def _check_topology(entries: list[str], names: list[str], edges: tuple[EdgeSpec, ...]) -> None:
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
