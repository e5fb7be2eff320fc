"""Prometheus metrics of one server process (`GET /metrics`), on a per-app registry.

Hot paths pay one histogram observation or counter increment per *event* (a runtime step, a
response start/first audio/end, an error), never per audio frame. Gauges that describe state
(stage queue depth and live requests, active sessions) are read when scraped, so they cost
nothing between scrapes. Process CPU and memory come from prometheus-client's
``ProcessCollector`` (``process_cpu_seconds_total``, ``process_resident_memory_bytes``).

Server-side time to first audio runs from the response's start (the session core's
``StartResponse``: after server VAD's silence window, or at ``response.create``) to its first
audio chunk from the pipeline; turn latency from that start to the response's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from runtime.metrics import RuntimeMetrics
from session.voice.driver import RealtimeDriver

log = logging.getLogger(__name__)

PREFIX = "omniduplex"
LATENCY_BUCKETS = (
    0.025,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.175,
    0.2,
    0.225,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    30.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class _RuntimeStateCollector(Collector):
    """Stage queue depth and live requests, read from the runtime's counters at scrape time."""

    def __init__(self, runtime: RuntimeMetrics) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            f"{PREFIX}_stage_queue_depth",
            "Runnable requests waiting for a step, per stage replica.",
            labels=["stage", "replica"],
        )
        live = GaugeMetricFamily(
            f"{PREFIX}_stage_live_requests", "Requests open in a stage replica.", labels=["stage", "replica"]
        )
        counters = CounterMetricFamily(
            f"{PREFIX}_stage_engine",
            "Engine counters summed per stage: for LM stages 'prompt' (prompt tokens) and "
            "'prompt_cached' (of those, served from the prefix cache: vLLM's num_cached_tokens).",
            labels=["stage", "counter"],
        )
        for name, stage in list(self._runtime.stages.items()):
            for replica, value in enumerate(list(stage.queue_depth)):
                depth.add_metric([name, str(replica)], value)
            for replica, value in enumerate(list(stage.live)):
                live.add_metric([name, str(replica)], value)
            for counter, total in list(stage.counters.items()):
                counters.add_metric([name, counter], total)
        yield depth
        yield live
        yield counters


class _RuntimeHook:
    """A `runtime.metrics.MetricsHook`: one observation per step and per finished request."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._step: dict[str, Any] = {}
        self._batch: dict[str, Any] = {}

    def on_step(self, stage: str, replica: int, batch: int, step_s: float) -> None:
        step = self._step.get(stage)
        if step is None:
            step = self._step[stage] = self._m.stage_step_seconds.labels(stage=stage)
            self._batch[stage] = self._m.stage_batch_size.labels(stage=stage)
        step.observe(step_s)
        self._batch[stage].observe(batch)

    def on_request(self, stage: str, seconds: float, outcome: str) -> None:
        self._m.stage_request_seconds.labels(stage=stage, outcome=outcome).observe(seconds)

    def on_queue(self, stage: str, replica: int, depth: int) -> None:
        """Queue depth is read at scrape time (see `_RuntimeStateCollector`)."""


class ServerMetrics:
    """All metrics of one app. Implements the session driver's `DriverObserver`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)

        def histogram(
            name: str, doc: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
        ) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=r)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=r)

        self.stage_step_seconds = histogram(
            "stage_step_seconds", "Duration of one engine step.", ["stage"], buckets=STEP_BUCKETS
        )
        self.stage_batch_size = histogram(
            "stage_batch_size", "Requests per engine step.", ["stage"], buckets=BATCH_BUCKETS
        )
        self.stage_request_seconds = histogram(
            "stage_request_seconds",
            "Time a request spent in a stage, admission to finish.",
            ["stage", "outcome"],
            buckets=LATENCY_BUCKETS,
        )
        self.time_to_first_audio = histogram(
            "time_to_first_audio_seconds",
            "Response start to its first audio from the pipeline.",
            buckets=LATENCY_BUCKETS,
        )
        self.turn_latency = histogram(
            "turn_latency_seconds",
            "Response start to response end, by final status.",
            ["status"],
            buckets=LATENCY_BUCKETS,
        )
        self.responses = counter("responses", "Responses started.")
        # The total stays unlabelled (dashboards and the load generator read it as is); the
        # split by kind is a second family, so summing either never counts a session twice.
        self.active_sessions = gauge("active_sessions", "Open sessions, voice and world together.")
        self.active_sessions_by_kind = gauge(
            "active_sessions_by_kind",
            "Open sessions by kind: voice (realtime), world (world-model video) or robot (policy).",
            ["kind"],
        )
        self.conversation_audio_bytes = gauge(
            "conversation_audio_bytes",
            "Audio the conversations of open sessions hold in process memory (input PCM16 16 kHz, "
            "output as sent; audio spooled to disk is not counted).",
        )
        self.held_audio_bytes = gauge(
            "held_audio_bytes",
            "Audio deltas of open sessions this process keeps for a resume here (their PCM, and "
            "the JSON around it once per response; Redis does not keep them), at most "
            "--audio-replay-max-bytes per session.",
        )
        self.conversation_audio_spooled_bytes = gauge(
            "conversation_audio_spooled_bytes",
            "Conversation audio this process keeps in its disk spool (off the heap).",
        )
        self.admissions = counter(
            "admissions", "Session opens by outcome (admitted, or the refusal code).", ["outcome"]
        )
        self.resumes = counter("resumes", "Session resumes by outcome.", ["outcome"])
        self.errors = counter("errors", "Error events sent to clients, by code.", ["code"])
        self.robot_observations_dropped = counter(
            "robot_observations_dropped",
            "Robot observations replaced by a newer one before the policy saw them (flooding robots).",
        )
        self.robot_infer_seconds = histogram(
            "robot_infer_seconds",
            "Robot observation handed to the policy to its action chunk back (batching included).",
            buckets=STEP_BUCKETS,
        )
        self.robot_infer_batch = histogram(
            "robot_infer_batch_size",
            "Robots' observations in the policy step that answered one.",
            buckets=BATCH_BUCKETS,
        )
        self.live_frame_seconds = histogram(
            "live_frame_seconds",
            "GPT-Live sessions: a client event's handling on the event loop (decode, checks, queue).",
            buckets=STEP_BUCKETS,
        )
        self.loop_lag = histogram(
            "event_loop_lag_seconds",
            "How late a periodic event-loop timer fires (a busy loop delays every session).",
            buckets=LAG_BUCKETS,
        )
        self.gc_pause = histogram(
            "gc_pause_seconds",
            "Cyclic garbage collector pauses (they stop the event loop), by generation.",
            ["generation"],
            buckets=LAG_BUCKETS,
        )
        self._voice_sessions: Callable[[], int] = lambda: 0
        self._world_sessions: Callable[[], int] = lambda: 0
        self._robot_sessions: Callable[[], int] = lambda: 0
        self._live_sessions: Callable[[], int] = lambda: 0
        self.active_sessions.set_function(lambda: float(sum(self.session_counts().values())))
        self.active_sessions_by_kind.labels(kind="voice").set_function(lambda: float(self._voice_sessions()))
        self.active_sessions_by_kind.labels(kind="world").set_function(lambda: float(self._world_sessions()))
        self.active_sessions_by_kind.labels(kind="robot").set_function(lambda: float(self._robot_sessions()))
        self.active_sessions_by_kind.labels(kind="live").set_function(lambda: float(self._live_sessions()))
        self._gc_started: float | None = None
        self._runtime_bound = False
        self._ttfa = self.time_to_first_audio
        self._turn: dict[str, Any] = {}

    # --- binding -------------------------------------------------------------------------------

    def bind_runtime(self, runtime: RuntimeMetrics) -> None:
        """Export a runtime's per-stage metrics (once per app)."""
        if self._runtime_bound:
            raise RuntimeError("a runtime is already bound to these metrics")
        self._runtime_bound = True
        self.registry.register(_RuntimeStateCollector(runtime))
        runtime.add_hook(_RuntimeHook(self))

    def bind_sessions(self, sessions: Callable[[], Iterable[Any]]) -> None:
        """Open sessions (live drivers), read at scrape time: their count, and the audio their
        conversations hold (what grows server memory turn after turn)."""
        self._voice_sessions = lambda: sum(1 for _ in sessions())
        self.conversation_audio_bytes.set_function(lambda: float(conversation_audio_bytes(sessions())))
        self.held_audio_bytes.set_function(lambda: float(held_audio_bytes(sessions())))

    def bind_audio_spool(self, spooled_bytes: Callable[[], int]) -> None:
        """The process's audio spool: bytes in its files, read at scrape time."""
        self.conversation_audio_spooled_bytes.set_function(lambda: float(spooled_bytes()))

    def bind_worlds(self, count: Callable[[], int]) -> None:
        """Live world-model sessions (detached ones too: they hold a slot and a runtime
        request), read at scrape time like the voice ones."""
        self._world_sessions = count

    def bind_robots(self, count: Callable[[], int]) -> None:
        """Live robot policy sessions (detached ones too), read at scrape time."""
        self._robot_sessions = count

    def bind_live(self, count: Callable[[], int]) -> None:
        """Live GPT-Live sessions (detached ones too), read at scrape time."""
        self._live_sessions = count

    def session_counts(self) -> dict[str, int]:
        """Live sessions by kind: what ``/readyz`` reports and a replica's load counts."""
        return {
            "voice": self._voice_sessions(),
            "world": self._world_sessions(),
            "robot": self._robot_sessions(),
            "live": self._live_sessions(),
        }

    # --- RobotObserver (session/robot/driver.py) -------------------------------------------------

    def robot_observation_dropped(self) -> None:
        self.robot_observations_dropped.inc()

    def robot_inferred(self, seconds: float, batch: int) -> None:
        self.robot_infer_seconds.observe(seconds)
        self.robot_infer_batch.observe(batch)

    def robot_error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    # --- LiveObserver (session/live/driver.py) ----------------------------------------------------

    def live_frame(self, seconds: float) -> None:
        self.live_frame_seconds.observe(seconds)

    # --- DriverObserver --------------------------------------------------------------------------

    def response_started(self) -> None:
        self.responses.inc()

    def first_audio(self, seconds: float) -> None:
        self._ttfa.observe(seconds)

    def response_finished(self, status: str, seconds: float) -> None:
        child = self._turn.get(status)
        if child is None:
            child = self._turn[status] = self.turn_latency.labels(status=status)
        child.observe(seconds)

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    # --- transports ------------------------------------------------------------------------------

    def admission(self, outcome: str) -> None:
        self.admissions.labels(outcome=outcome).inc()

    def resume(self, outcome: str) -> None:
        self.resumes.labels(outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- event-loop lag and GC pauses -------------------------------------------------------------

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """A `gc.callbacks` entry: time each collection."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            pause = time.perf_counter() - self._gc_started
            self._gc_started = None
            self.gc_pause.labels(generation=str(info.get("generation", "?"))).observe(pause)

    async def watch_loop_lag(
        self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Run until cancelled: observe how late each `interval_s` sleep wakes up."""
        while True:
            before = clock()
            await asyncio.sleep(interval_s)
            self.loop_lag.observe(max(0.0, clock() - before - interval_s))


def conversation_audio_bytes(drivers: Iterable[Any]) -> int:
    """Bytes of audio the conversations of realtime drivers hold in memory (each driver says,
    `RealtimeDriver.audio_bytes_in_memory`; other session kinds count 0)."""
    return sum(d.audio_bytes_in_memory() for d in list(drivers) if isinstance(d, RealtimeDriver))


def held_audio_bytes(drivers: Iterable[Any]) -> int:
    """Bytes of audio-delta JSON the logs of realtime drivers keep in this process."""
    return sum(d.held_event_bytes() for d in list(drivers) if isinstance(d, RealtimeDriver))


@contextlib.asynccontextmanager
async def loop_lag_watcher(metrics: ServerMetrics) -> Any:
    """Own the lag-watching task and the GC timing callback for the lifetime of the block."""
    task = asyncio.create_task(metrics.watch_loop_lag(), name="metrics:loop-lag")
    gc.callbacks.append(metrics.on_gc)
    try:
        yield task
    finally:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(metrics.on_gc)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- one exposition for several processes (`serve --workers N`, `/metrics?scope=all`) ----------

GaugeMerge = Literal["sum", "worker"]
# How a gauge of several worker processes becomes one. "sum": the gauge counts something each
# process holds apart from the others, so the host's total is meaningful (sessions, bytes,
# queue depths, RSS). "worker": a per-process reading (a time, a limit, a max, a ratio) that a
# sum would turn into nonsense; each worker's sample is kept with a ``worker`` label.
# A gauge missing here is kept per worker: the safe default. Counters and histograms always sum.
GAUGE_MERGE: dict[str, GaugeMerge] = {
    f"{PREFIX}_active_sessions": "sum",
    f"{PREFIX}_active_sessions_by_kind": "sum",
    f"{PREFIX}_conversation_audio_bytes": "sum",
    f"{PREFIX}_conversation_audio_spooled_bytes": "sum",
    f"{PREFIX}_held_audio_bytes": "sum",
    f"{PREFIX}_stage_queue_depth": "sum",  # each worker runs its own stage replicas
    f"{PREFIX}_stage_live_requests": "sum",
    "process_resident_memory_bytes": "sum",
    "process_virtual_memory_bytes": "sum",
    "process_open_fds": "sum",
    "process_max_fds": "worker",  # a per-process limit
    "process_start_time_seconds": "worker",
}
SUMMED_TYPES = frozenset({"counter", "histogram", "gaugehistogram"})
WORKER_LABEL = "worker"


@dataclass(slots=True)
class _Family:
    """One metric family of the merged exposition: its samples in first-seen order, a summed
    series at the index where it first came."""

    metric: Metric
    index: dict[tuple[str, tuple[tuple[str, str], ...]], int] = field(default_factory=dict)

    def summed(self, sample: Sample) -> bool:
        kind = self.metric.type
        if kind in SUMMED_TYPES:
            return True
        if kind == "gauge":
            return GAUGE_MERGE.get(self.metric.name, "worker") == "sum"
        # a summary's _sum and _count add up; its quantiles are per-process readings
        return kind == "summary" and "quantile" not in sample.labels

    def add(self, worker: str, sample: Sample) -> None:
        sample = sample._replace(timestamp=None, exemplar=None)  # generate_latest writes none
        if not self.summed(sample):
            self.metric.samples.append(sample._replace(labels={**sample.labels, WORKER_LABEL: worker}))
            return
        key = (sample.name, tuple(sorted(sample.labels.items())))
        at = self.index.get(key)
        if at is None:
            self.index[key] = len(self.metric.samples)
            self.metric.samples.append(sample)
        else:
            held = self.metric.samples[at]
            self.metric.samples[at] = held._replace(value=held.value + sample.value)


class _Merged(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_worker_metrics(texts: Sequence[tuple[str, str]]) -> str:
    """Prometheus texts of several worker processes, as ``(worker, text)`` → one exposition.

    Each text is read by prometheus-client's parser and the result written by its exposition.
    Counters and histograms (``_bucket``/``_sum``/``_count``) are summed series by series;
    gauges by :data:`GAUGE_MERGE` (summed, or each worker's sample with a ``worker`` label).
    Each family comes out once, its HELP and TYPE first and its samples together (valid text
    format, unlike a line-by-line merge when only some workers have a series); families and
    series keep the order in which they first appear. A text the parser refuses is left out
    (logged), as a worker that did not answer is."""
    families: dict[str, _Family] = {}
    for worker, text in texts:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.warning("worker metrics: worker %s: not a Prometheus text: %s", worker, exc)
            continue
        for metric in parsed:
            fam = families.get(metric.name)
            if fam is None:
                fam = families[metric.name] = _Family(Metric(metric.name, metric.documentation, metric.type))
            for sample in metric.samples:
                fam.add(worker, sample)
    merged = _Merged(fam.metric for fam in families.values())
    return generate_latest(merged).decode("utf-8")
