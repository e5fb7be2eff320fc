"""``speech.live_asr``: the user's words while they speak, on the session's live request.

The stage after the VAD stage on a voice-cascade pipeline's live entry (docs/CONTRACTS.md,
"Live voice requests"). The VAD stage hands on every scored 16 kHz frame with its position and
speech probability; the session marks its turns on that timeline with ``TurnControl``:

* ``speech_started`` (``ref``: the user item being spoken, ``start``, ``partials``): an
  utterance opens. With ``partials``, while the user is still speaking the utterance so far is
  transcribed again every ``partial_interval_ms`` of new audio and the words two successive
  hypotheses agree on (local agreement: a word is sent once a later pass confirms it) go out
  as ``Transcript(delta, final=False, ref=...)``; the session sends them as
  ``conversation.item.input_audio_transcription.delta``.
* ``transcribe`` (``ref``, ``start``, ``end``): one final ``Transcript`` of that stretch, e.g.
  the turn so far once a pause may end it (the response then starts on that text). One step
  makes one of them: of every session's, the newest with ``first`` (an end-of-turn decision
  waits on it, until its turn ends), else the oldest (a response waits on it). A ``first``
  one is answered with the short encode's words at once, as a draft (``final=False``) where
  the ASR's guard would redo them on the 30 s window (a third of this voice's pauses; the
  decision reads where the words stop, which the redo hardly ever changes); the final words
  follow from a later run, as a transcript only a response waits on. With the background lane
  (the default, :mod:`engines.speech.asr_lane`) a step makes only those a decision may wait on;
  the others, the final words after a draft and the partials run on the lane, one at a time
  (at a lower CPU priority only if ``background_nice`` > 0), and a later step of the request
  sends their words.
  ``transcribe_cancel`` (``ref``): the session stopped waiting; never made.
  One the session no longer needs is answered with no words and never transcribed: a pause of
  an utterance the user spoke past (``spoken_past``, ``start``, ``end``: the session saw them go
  on), or one a later pause of the same utterance (the same ``start``) replaced.
* ``speech_stopped`` / ``clear``: the utterance ends (``clear`` also forgets held audio).

Audio is held from the open utterance's start (at most ``max_audio_s``). With none open, the
last ``idle_audio_s``, and from ``idle_audio_s`` before the first voiced frame that no
utterance has claimed yet: the session marks a start (with prefix padding before it) only
once the VAD's scores have come back to it, and a client that streams faster than real time
(a file) has appended seconds more audio by then, so a window counted back from the newest
audio would lose the utterance's first words. ``speech_stopped`` names where the session's
commit ended (``end``), so voice after it stays unclaimed. A ``transcribe`` whose stretch has
not arrived yet waits for it. Whisper is the process's one model
(:func:`engines.speech.asr.shared_asr`, shared with the other ASR stages).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.speech.asr import SAMPLE_RATE, AsrConfig, WhisperAsr, shared_asr
from engines.speech.asr_lane import AsrLane, BackgroundLane, transcribe_on
from engines.speech.held_audio import held_span
from engines.speech.lane_process import ProcessLane, hold_background
from engines.speech.vad import FRAME_SAMPLES
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioInput, Payload, Transcript, TurnControl, VoiceActivity

_WORD = re.compile(r"[a-z0-9']+")
_SPEAKING_WINDOW = SAMPLE_RATE // 4  # a partial only while speech was heard in the last 250 ms
_LANE_POLL_S = 0.03  # a request waiting on the background lane is stepped again this soon (a VAD frame)


def word_key(word: str) -> str:
    """A word as two hypotheses are compared: case and punctuation do not count."""
    return "".join(_WORD.findall(word.lower()))


def agreed_words(previous: Sequence[str], current: Sequence[str]) -> list[str]:
    """The leading words two hypotheses share (taken from `current`)."""
    n = 0
    for a, b in zip(previous, current, strict=False):
        if word_key(a) != word_key(b):
            break
        n += 1
    return list(current[:n])


@dataclass(slots=True)
class _Utterance:
    ref: str
    start: int
    partials: bool
    next_at: int  # decode a partial once the audio reaches this sample
    previous: list[str] = field(default_factory=list)  # the last hypothesis, as words
    sent: int = 0  # words sent as deltas


@dataclass(slots=True)
class _Job:
    """A ``transcribe`` the session asked for: [start, end) of the request's timeline; ``seq``:
    its place among every session's jobs."""

    ref: str
    start: int
    end: int
    seq: int
    first: bool = False  # a decision waits on it (`first`): made before those without
    taken_at: float = field(default_factory=time.monotonic)  # for the stage's wait counter
    drafted: bool = False  # its decision has a draft: the words a response reads are still due
    needed: bool = False  # its decision's score is back and waits for these words

    @property
    def rank(self) -> tuple[int, int]:
        """The order jobs are made in: those a decision is known to wait on (its score is
        back: `transcribe_needed`), the oldest first; then the others a decision may wait on,
        the newest first (under load an old one is past its decision's maximum pause, a new
        one can still end its turn in time); then the rest, the oldest first (a response
        waits on each)."""
        if self.first and self.needed:
            return (0, self.seq)
        return (1, -self.seq) if self.first else (2, self.seq)


@dataclass(slots=True)
class _LaneRun:
    """A run on the background lane for one request: a transcript (`job`) or a partial of
    `utterance`. ``cancelled``: the session stopped waiting for it; its words are not sent."""

    future: Future[str]
    job: _Job | None = None
    utterance: _Utterance | None = None
    cancelled: bool = False


@dataclass(slots=True)
class LiveAsrState:
    audio: deque[tuple[int, np.ndarray]] = field(default_factory=deque)  # (start sample, samples)
    end: int = 0  # the sample after the last audio received
    voiced_at: int = -1  # the end of the last frame whose speech probability passed the threshold
    runs: deque[int] = field(default_factory=deque)  # where each run of voiced frames began
    claimed_to: int = 0  # the session's turns cover the timeline up to here
    utterance: _Utterance | None = None
    jobs: list[_Job] = field(default_factory=list)  # "transcribe" not made yet, in order
    dropped: list[str] = field(default_factory=list)  # refs of jobs no longer needed, to answer ""
    lane: _LaneRun | None = None  # its run on the background lane, until a step collects it

    def held_from(self) -> int:
        return self.audio[0][0] if self.audio else self.end

    def span(self, start: int, end: int) -> np.ndarray:
        """The held audio in [start, end) (what is not held any more is left out)."""
        return held_span(self.audio, start, end, np.float32)

    def trim(self, keep_from: int) -> None:
        while self.audio and self.audio[0][0] + len(self.audio[0][1]) <= keep_from:
            self.audio.popleft()


class LiveAsrEngine(Engine):
    """``speech.live_asr``. Options: ``partial_interval_ms`` (700), ``speech_threshold`` (0.5),
    ``max_audio_s`` (30), ``idle_audio_s`` (3), ``background_nice`` (0: how much lower the
    background lane's CPU priority is, :mod:`engines.speech.asr_lane`; at 10 a response's
    words starved beside other processes' work: a server_vad turn's answer waited 6.6 s in a
    CI trial), ``background_lane`` (true; false: every run on the stage's step, as before),
    ``background_process`` (false; true: the lane's model in a process of its own, which a
    decision's draft holds still while it runs, :mod:`engines.speech.lane_process`), and the
    Whisper options of ``speech.asr`` (``model``, ``compute_type``, ``cpu_threads``,
    ``num_workers``, ``short_encode``)."""

    provides = frozenset({"input_transcription"})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        opts = self.options
        self.config = AsrConfig(
            model_path=str(opts.get("model") or ""),
            compute_type=str(opts.get("compute_type", "int8")),
            cpu_threads=int(opts.get("cpu_threads", 0)),
            num_workers=int(opts.get("num_workers", 1)),
            short_encode=bool(opts.get("short_encode", True)),
        )
        self.partial_interval = int(float(opts.get("partial_interval_ms", 700)) * SAMPLE_RATE / 1000)
        self.threshold = float(opts.get("speech_threshold", 0.5))
        self.max_audio = int(float(opts.get("max_audio_s", 30)) * SAMPLE_RATE)
        self.idle_audio = int(float(opts.get("idle_audio_s", 3)) * SAMPLE_RATE)
        self.background_lane = bool(opts.get("background_lane", True))
        self.background_nice = int(opts.get("background_nice", 0))
        self.background_process = bool(opts.get("background_process", False))
        self._asr: WhisperAsr | None = None
        self._lane: BackgroundLane | None = None  # None: every run on the step (no lane)
        self._seq = itertools.count()  # the order jobs arrived in, across requests

    def load(self) -> None:
        self._asr = shared_asr(self.config)
        if self.background_lane:  # a model of its own: its threads run at the lane's priority
            config = dataclasses.replace(self.config, num_workers=1)
            if self.background_process:
                self._lane = ProcessLane(config)
            else:
                self._lane = AsrLane(lambda: WhisperAsr(config), nice=self.background_nice)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()

    def start(self, request: EngineRequest) -> LiveAsrState:
        return LiveAsrState()

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        """Every request's new input first (all of it: a coalescing edge hands over whatever
        came during the last Whisper run at once); then one Whisper run on the step: a pause
        transcript whose audio is here (``_Job.rank``: an end-of-turn decision's first, the
        newest of them; then the oldest of those a response waits on), or, in a step with none
        anywhere, the partials. A request left with a transcript to make is stepped again at
        once (``wait_for_input`` False), so each transcript goes out as soon as it is made
        rather than at the end of a step that makes several.

        With the background lane (:mod:`engines.speech.asr_lane`) the step makes only the
        transcripts a decision may wait on (``first``); the others, the 30 s redo of a draft
        and the partials go to the lane when it is idle (the oldest job first, else a partial),
        and a later step of the request sends their words: a request with a run there, or with
        work waiting for it, is stepped again within ``_LANE_POLL_S``."""
        for item in batch:
            state: LiveAsrState = item.state
            for chunk in item.chunks:
                for payload in chunk.items:
                    self._take(state, payload)
        lane = self._lane
        ready = [
            (job.rank, i)
            for i, item in enumerate(batch)
            for job in item.state.jobs
            if job.end <= item.state.end and (lane is None or job.first)
        ]
        first = min(ready, default=None)
        outputs = []
        for i, item in enumerate(batch):
            state = item.state
            out: list[Payload] = [Transcript("", final=True, ref=ref) for ref in state.dropped]
            counters = {"transcripts_dropped": len(state.dropped)} if state.dropped else {}
            state.dropped = []
            if state.lane is not None and state.lane.future.done():
                counters.update(self._collect(state, state.lane, out))
                state.lane = None
            if first is not None and first[1] == i:
                job = min(
                    (j for j in state.jobs if j.end <= state.end and (lane is None or j.first)),
                    key=lambda j: j.rank,
                )
                state.jobs.remove(job)
                counters.update(self._make(state, job, out))
            elif lane is None and first is None:  # a partial skipped here is due again at the next step
                self._partial(state, out)
            outputs.append(StepOutput(client=out, counters=counters))
        if lane is not None:
            self._offer(lane, batch)
        for item, output in zip(batch, outputs, strict=True):
            state = item.state
            self._trim(state)
            now_ready = [job for job in state.jobs if job.end <= state.end]
            if any(lane is None or job.first for job in now_ready):
                output.wait_for_input = False  # stepped again at once
            elif state.lane is not None or now_ready:  # words due from the lane, or work for it
                output.not_before = time.monotonic() + _LANE_POLL_S
            else:
                output.wait_for_input = True
        return outputs

    def _offer(self, lane: BackgroundLane, batch: Sequence[StepInput]) -> None:
        """Hand the lane one run if it is idle: the oldest ready transcript no decision waits
        on, else a due partial (of the requests in this step with no run there yet)."""
        if not lane.idle:
            return
        free = [item.state for item in batch if item.state.lane is None]
        jobs = [
            (job.rank, k, job)
            for k, st in enumerate(free)
            for job in st.jobs
            if job.end <= st.end and not job.first
        ]
        if jobs:
            _rank, k, job = min(jobs, key=lambda x: x[:2])
            state = free[k]
            audio = state.span(job.start, job.end)
            future = lane.try_run(functools.partial(transcribe_on, audio=audio, full=job.drafted))
            if future is not None:
                state.jobs.remove(job)
                state.lane = _LaneRun(future, job=job)
            return
        for state in free:
            utt = state.utterance
            if utt is None or not self._partial_due(state, utt):
                continue
            audio = state.span(utt.start, state.end)
            future = lane.try_run(functools.partial(transcribe_on, audio=audio))
            if future is not None:
                utt.next_at = state.end + self.partial_interval
                state.lane = _LaneRun(future, utterance=utt)
            return

    def _collect(self, state: LiveAsrState, run: _LaneRun, out: list[Payload]) -> dict[str, int]:
        """A lane run's words (its error is the step's, as a run on the step would be)."""
        text = run.future.result()
        job = run.job
        if job is None:
            if run.utterance is not None and run.utterance is state.utterance:
                self._agree(run.utterance, text.split(), out)
            return {}
        if run.cancelled:
            return {}
        out.append(Transcript(text, final=True, ref=job.ref))
        if job.drafted:
            return {"transcripts": 1}
        return {"transcripts": 1, "transcript_wait_ms": round((time.monotonic() - job.taken_at) * 1000)}

    def _make(self, state: LiveAsrState, job: _Job, out: list[Payload]) -> dict[str, int]:
        """One Whisper run for `job`. A decision's (`first`) gets the short encode's words at
        once: final when the guard finds them sound, else a draft (`final=False`) for the
        decision, and the job stays, as one only a response waits on, for the 30 s window's
        words (the final) in a later step."""
        audio = state.span(job.start, job.end)
        waited = {"transcript_wait_ms": round((time.monotonic() - job.taken_at) * 1000)}
        if job.drafted:
            out.append(Transcript(self._asr_model().transcribe_full(audio), final=True, ref=job.ref))
            return {"transcripts": 1}
        if not job.first:
            out.append(Transcript(self._transcribe(audio), final=True, ref=job.ref))
            return {"transcripts": 1, **waited}
        began = time.monotonic()
        # Background Whisper runs under way in a process of their own (this stage's lane, a
        # speech.asr stage's) are held still while the decision drafts.
        with hold_background() as held:
            text, final = self._asr_model().draft(audio) if len(audio) else ("", True)
        out.append(Transcript(text, final=final, ref=job.ref))
        # A decision's words: how long they waited to start, and the run (wall time).
        waited |= {"decision_words": 1, "decision_wait_ms": round((began - job.taken_at) * 1000)}
        waited["decision_run_ms"] = round((time.monotonic() - began) * 1000)
        if held:
            waited["lane_holds"] = 1  # it held a background run still
        if final:
            return {"transcripts": 1, **waited}
        job.first, job.drafted = False, True
        state.jobs.append(job)
        return {"transcript_drafts": 1, **waited}

    def _asr_model(self) -> WhisperAsr:
        if self._asr is None:
            raise RuntimeError("LiveAsrEngine.load() must run before the first step")
        return self._asr

    def _trim(self, state: LiveAsrState) -> None:
        utt = state.utterance
        starts = [job.start for job in state.jobs]
        runs = state.runs
        while runs and runs[0] < state.claimed_to:
            runs.popleft()
        if utt is not None:
            starts.append(utt.start)
        elif runs:  # voice the session has not marked yet (its start is still to come)
            starts.append(runs[0] - self.idle_audio)
        # What an open utterance or a waiting job needs, never more than max_audio_s.
        keep_from = max(min([state.end - self.idle_audio, *starts]), state.end - self.max_audio)
        state.trim(keep_from)
        while runs and runs[0] < keep_from:
            runs.popleft()

    def _take(self, state: LiveAsrState, payload: Payload) -> None:
        if isinstance(payload, AudioInput):
            samples = np.asarray(payload.samples, dtype=np.float32).reshape(-1)
            start = state.end if payload.start_sample is None else payload.start_sample
            state.audio.append((start, samples))
            state.end = start + len(samples)
        elif isinstance(payload, VoiceActivity):
            for k, p in enumerate(payload.probs):
                if p >= self.threshold:
                    frame = payload.start_sample + k * FRAME_SAMPLES
                    if frame != state.voiced_at:
                        state.runs.append(frame)
                    state.voiced_at = frame + FRAME_SAMPLES
        elif isinstance(payload, TurnControl):
            self._control(state, payload)

    def _control(self, state: LiveAsrState, control: TurnControl) -> None:
        params = control.params
        if control.kind == "speech_started":
            start = int(params.get("start", state.end))
            state.claimed_to = max(state.claimed_to, start)
            state.utterance = _Utterance(
                str(params.get("ref")), start, bool(params.get("partials")), start + self.partial_interval
            )
        elif control.kind == "transcribe":
            start, end = int(params.get("start", 0)), int(params["end"])
            job = _Job(str(params.get("ref")), start, end, next(self._seq), bool(params.get("first")))
            # An earlier pause of the same utterance (same start) was spoken past: this one
            # came after it. Its transcript is not needed any more.
            self._drop(state, lambda old: old.start == start and old.end <= end)
            state.jobs.append(job)
        elif control.kind == "spoken_past":
            # The session heard the user go on after the pause at `end` of the utterance that
            # began at `start`: that pause did not end the turn.
            start, end = int(params.get("start", -1)), int(params.get("end", -1))
            self._drop(state, lambda old: old.start == start and old.end <= end)
        elif control.kind == "transcribe_needed":  # the decision's score is back, waiting for it
            for job in state.jobs:
                job.needed = job.needed or job.ref == params.get("ref")
        elif control.kind == "transcribe_cancel":  # the session stopped waiting for it
            state.jobs = [job for job in state.jobs if job.ref != params.get("ref")]
            run = state.lane
            if run is not None and run.job is not None and run.job.ref == params.get("ref"):
                run.cancelled = True
        elif control.kind == "speech_stopped":
            if state.utterance is not None and state.utterance.ref == params.get("ref"):
                for job in state.jobs:  # the turn has ended: only its response waits now
                    job.first = job.first and job.start != state.utterance.start
                state.utterance = None
            state.claimed_to = max(state.claimed_to, int(params.get("end", state.end)))
        elif control.kind == "clear":
            state.utterance = None
            state.audio.clear()
            state.runs.clear()
            state.end = max(state.end, int(params.get("at", state.end)))
            state.claimed_to = state.end

    @staticmethod
    def _drop(state: LiveAsrState, stale: Callable[[_Job], bool]) -> None:
        """Jobs not worth a Whisper run: answered with no words (the session then decides
        without them, as when a transcript fails) at the end of this step."""
        for job in [job for job in state.jobs if stale(job)]:
            state.jobs.remove(job)
            state.dropped.append(job.ref)

    def _partial_due(self, state: LiveAsrState, utt: _Utterance) -> bool:
        """A partial of `utt` is due: asked for, enough new audio, and the user still speaking."""
        return utt.partials and state.end >= utt.next_at and state.voiced_at >= state.end - _SPEAKING_WINDOW

    def _partial(self, state: LiveAsrState, out: list[Payload]) -> None:
        """While the user speaks: the words two passes agree on that were not sent yet."""
        utt = state.utterance
        if utt is None or not self._partial_due(state, utt):
            return
        utt.next_at = state.end + self.partial_interval
        self._agree(utt, self._transcribe(state.span(utt.start, state.end)).split(), out)

    @staticmethod
    def _agree(utt: _Utterance, words: list[str], out: list[Payload]) -> None:
        """Send the words this hypothesis and the previous one agree on, past those sent."""
        agreed = agreed_words(utt.previous, words)
        utt.previous = words
        if len(agreed) > utt.sent:
            delta = " ".join(agreed[utt.sent :])
            out.append(Transcript(delta if utt.sent == 0 else " " + delta, final=False, ref=utt.ref))
            utt.sent = len(agreed)

    def _transcribe(self, audio: np.ndarray) -> str:
        return self._asr_model().transcribe(audio) if len(audio) else ""
