from __future__ import annotations

from pathlib import Path

import pytest

from runtime.registry import UnknownEngineError, available_engines, engine_class, register_engine
from runtime.spec import PipelineSpecError, available_pipelines, load_pipeline, parse_pipeline
from tests.runtime import fakes

pytestmark = pytest.mark.unit

GOOD = """
name: demo
entry: a
stages:
  - {name: a, engine: fake.gen, budget: {max_batch: 1}}
  - {name: b, engine: fake.relay}
  - {name: c, engine: fake.sink, budget: {max_batch: 8}, replicas: 2}
edges:
  - {from: a, to: b, mode: async_chunk, connector: inproc, chunk: {first: 1, steady: 1, left_context: 0}}
  - {from: b, to: c, mode: async_chunk, connector: inproc, chunk: {first: 4, steady: 25, left_context: 25}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def expect_error(tmp_path: Path, text: str, field: str, reason: str) -> PipelineSpecError:
    path = write(tmp_path, text)
    with pytest.raises(PipelineSpecError) as info:
        load_pipeline(path)
    err = info.value
    message = str(err)
    assert str(path) in message, message
    assert field in message and err.field.startswith(field), message
    assert reason in message, message
    return err


def test_good_pipeline_parses_into_dataclasses() -> None:
    spec = parse_pipeline(GOOD, source="good.yaml")
    assert spec.name == "demo" and spec.entry == "a"
    assert [s.name for s in spec.stages] == ["a", "b", "c"]
    assert spec.stage("c").budget.max_batch == 8 and spec.stage("c").replicas == 2
    edge = spec.outgoing("b")[0]
    assert (edge.key, edge.mode, edge.connector) == ("b->c", "async_chunk", "inproc")
    assert (edge.chunk.first, edge.chunk.steady, edge.chunk.left_context) == (4, 25, 25)
    assert spec.capacity() == 16  # tightest stage: default max_concurrency 16 x 1 replica


def test_edge_mode_override_and_its_errors() -> None:
    spec = parse_pipeline(GOOD)
    full = spec.with_edge_modes({"b->c": "full"})
    assert full.outgoing("b")[0].mode == "full" and spec.outgoing("b")[0].mode == "async_chunk"
    with pytest.raises(ValueError, match=r"unknown edge 'x->y'.*a->b, b->c"):
        spec.with_edge_modes({"x->y": "full"})
    with pytest.raises(ValueError, match="mode must be one of"):
        spec.with_edge_modes({"a->b": "sometimes"})


def test_unknown_engine(tmp_path: Path) -> None:
    text = GOOD.replace("fake.relay", "fake.nope")
    expect_error(tmp_path, text, "stages[1].engine", "unknown engine 'fake.nope'")


def test_unknown_stage_in_edge(tmp_path: Path) -> None:
    text = GOOD.replace("{from: b, to: c", "{from: b, to: d")
    expect_error(tmp_path, text, "edges[1].to", "unknown stage 'd'")


def test_cycle(tmp_path: Path) -> None:
    text = GOOD + "  - {from: c, to: b}\n"
    err = expect_error(tmp_path, text, "edges", "cycle: ")
    assert "b -> c -> b" in str(err)


def test_self_loop(tmp_path: Path) -> None:
    expect_error(tmp_path, GOOD + "  - {from: c, to: c}\n", "edges[2]", "cycle")


def test_missing_field(tmp_path: Path) -> None:
    expect_error(tmp_path, GOOD.replace("{name: b, engine: fake.relay}", "{name: b}"), "stages[1].engine",
                 "missing required field")
    text = GOOD.replace("{from: a, to: b,", "{to: b,")
    expect_error(tmp_path, text, "edges[0].from", "missing required field")
    expect_error(tmp_path, "stages: []\n", "name", "missing required field")


@pytest.mark.parametrize(
    ("chunk", "field", "reason"),
    [
        ("{first: 0, steady: 25, left_context: 25}", "edges[1].chunk.first", "must be >= 1"),
        ("{first: 4, steady: 0, left_context: 25}", "edges[1].chunk.steady", "must be >= 1"),
        ("{first: 4, steady: 25, left_context: -1}", "edges[1].chunk.left_context", "must be >= 0"),
        ("{first: 4.5, steady: 25, left_context: 25}", "edges[1].chunk.first", "expected an integer"),
        ("{first: '4', steady: 25, left_context: 25}", "edges[1].chunk.first", "expected an integer"),
        ("{first: 4, steady: 25, left: 25}", "edges[1].chunk.left", "unknown field"),
    ],
)
def test_bad_chunk_sizes(tmp_path: Path, chunk: str, field: str, reason: str) -> None:
    expect_error(tmp_path, GOOD.replace("{first: 4, steady: 25, left_context: 25}", chunk), field, reason)


def test_bad_budget_mode_and_connector(tmp_path: Path) -> None:
    expect_error(tmp_path, GOOD.replace("max_batch: 8", "max_batch: 0"), "stages[2].budget.max_batch", ">= 1")
    expect_error(tmp_path, GOOD.replace("max_batch: 8", "worker: fiber"), "stages[2].budget.worker",
                 "must be one of thread, process")
    expect_error(tmp_path, GOOD.replace("mode: async_chunk, connector: inproc, chunk: {first: 1",
                                        "mode: streaming, connector: inproc, chunk: {first: 1"),
                 "edges[0].mode", "must be one of async_chunk, full")
    text = GOOD.replace("connector: inproc, chunk: {first: 1", "connector: rdma, chunk: {first: 1")
    expect_error(tmp_path, text, "edges[0].connector", "must be one of inproc, shm")
    expect_error(tmp_path, GOOD.replace("max_batch: 8", "worker: process"), "edges[1].connector",
                 "need connector: shm")


def test_max_ahead_parses_and_is_validated(tmp_path: Path) -> None:
    first_edge = "chunk: {first: 1, steady: 1, left_context: 0}}"
    spec = parse_pipeline(GOOD.replace(first_edge, first_edge[:-1] + ", max_ahead: 2}"))
    assert spec.outgoing("a")[0].max_ahead == 2 and spec.outgoing("b")[0].max_ahead is None
    assert spec.with_edge_modes({"a->b": "full"}).outgoing("a")[0].max_ahead is None  # no early hand-over
    assert spec.with_edge_modes({"a->b": "async_chunk"}).outgoing("a")[0].max_ahead == 2
    second_edge = "chunk: {first: 4, steady: 25, left_context: 25}}"
    bad = (("0", "must be >= 1"), ("1.5", "expected an integer"), ("true", "expected an integer"))
    for value, reason in bad:
        text = GOOD.replace(first_edge, first_edge[:-1] + f", max_ahead: {value}}}")
        expect_error(tmp_path, text, "edges[0].max_ahead", reason)
    text = GOOD.replace(second_edge, second_edge[:-1] + ", max_ahead: 24}")
    expect_error(tmp_path, text, "edges[1].max_ahead", "must be >= the chunk sizes (first 4, steady 25)")
    text = GOOD.replace(
        "mode: async_chunk, connector: inproc, chunk: {first: 1",
        "mode: full, connector: inproc, max_ahead: 4, chunk: {first: 1",
    )
    expect_error(tmp_path, text, "edges[0].max_ahead", "only for mode async_chunk")


def test_invalid_yaml_names_line(tmp_path: Path) -> None:
    err = expect_error(tmp_path, "name: x\nstages: [a, b\n", "line 3", "invalid YAML")
    assert err.field.startswith("line ")


def test_unreachable_stage_and_entry_errors(tmp_path: Path) -> None:
    unreachable = GOOD.split("edges:")[0] + "edges:\n  - {from: a, to: c}\n  - {from: b, to: c}\n"
    expect_error(tmp_path, unreachable, "stages[1]", "stage 'b' is unreachable")
    text = GOOD + "  - {from: c, to: a}\n"
    expect_error(tmp_path, text, "edges[2].to", "entry stage 'a' cannot have incoming")
    expect_error(tmp_path, GOOD.replace("entry: a", "entry: z"), "entry", "unknown stage 'z'")


def test_load_by_name_and_unknown_name() -> None:
    names = available_pipelines()
    assert "qwen3-omni-tiny" in names
    spec = load_pipeline("qwen3-omni-tiny")
    assert spec.reachable(spec.entry) == ["thinker", "talker", "code2wav"]
    assert spec.entries == {"live": "vad", "transcribe": "transcribe"}  # the session's VAD and ASR
    talker_edge = spec.outgoing("talker")[0]
    assert (talker_edge.chunk.first, talker_edge.chunk.steady, talker_edge.chunk.left_context) == (4, 25, 25)
    unknown = r"no-such-pipeline: unknown pipeline \(available: .*qwen3-omni-tiny"
    with pytest.raises(PipelineSpecError, match=unknown):
        load_pipeline("no-such-pipeline")


def test_registry_entry_points_are_lazy_and_unknown_names_listed() -> None:
    names = available_engines()
    assert "qwen3_omni.thinker" in names and "fake.gen" in names  # entry point + registered
    assert engine_class("fake.gen") is fakes.Gen
    with pytest.raises(UnknownEngineError, match=r"unknown engine 'nope'.*fake.gen"):
        engine_class("nope")
    with pytest.raises(TypeError):
        register_engine("bad", object)  # type: ignore[arg-type]
