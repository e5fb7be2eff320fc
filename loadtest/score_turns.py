"""End of turn offline: the decision rules of ``session.realtime.semantic_turn`` on the
evaluation set's cached clips (:mod:`loadtest.turn_set`), without a server.

Each clip is seen as the session sees it at its first candidate pause: a paused sentence's
first half (up to the inserted pause), a finished sentence whole, after 0.4 s of silence and
followed by silence. Silero VAD and the session's `SpeechDetector` find where the pause begins
(the VAD's silence onset, a frame or two after the speech ends); Smart Turn v3.2
(``engines.speech.smart_turn``) scores the speech up to `tail` ms after that onset, for each
tail in `TAILS` (what the end-of-turn stage is sent: 32 ms now, 200 ms before), and Whisper
tiny.en (``engines.speech.asr``, as the live ASR transcribes a pause ahead) transcribes the
speech. All of it is cached (``.omniduplex/loadtest-cache``). Then, per rule: false cut-offs
(paused clips the rule ends at the pause: the decision comes in the first tenth of a second of
the pause, so the same for every pause length) and finished sentences ended at once.

Held out: the threshold of the cues is tuned on half the sentences (s00-s09, all three
renditions) and every rule is reported on both halves (s10-s19 never seen by the tuning).

    python -m loadtest.score_turns [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.turn_set import CACHE, RATE, spec_key, turn_set
from session.realtime.semantic_turn import FINISHED, TAIL_MS, THRESHOLDS, TurnCues, transcript_cue

Row = dict[str, Any]
TAILS = (0, 32, 64, 200, 800)  # ms of silence after the VAD's onset the model hears
LEAD_S = 0.4
TUNE = range(0, 10)  # sentences the threshold is tuned on (s00-s09); s10-s19 are held out


def _pause_onset(audio: np.ndarray, speech_end: int) -> tuple[int, int]:
    """(speech start, silence onset) as the session's VAD finds them in `audio`."""
    from engines.speech.vad import SileroVad
    from session.realtime.turns import SpeechDetector

    n = len(audio) // 512
    probs = SileroVad().new_stream().speech_probs(audio[: n * 512])
    detector = SpeechDetector(0.5, 60_000)
    start = None
    for k, p in enumerate(probs):
        detector.feed(k * 512, p)
        if detector.speaking and start is None:
            start = k * 512
        onset = detector.silence_start
        if onset is not None and k * 512 >= speech_end - 2000:
            return start or 0, onset
    return start or 0, n * 512


def observations(cache_dir: Path = CACHE) -> list[Row]:
    """Per clip: voice, sentence, paused, the VAD's lag, P(finished) per tail, transcript."""
    path = cache_dir / f"turn-scores-vad-{spec_key()}.json"
    if path.exists():
        rows: list[Row] = json.loads(path.read_text())
        return rows
    from engines.speech.asr import AsrConfig, WhisperAsr
    from engines.speech.smart_turn import SmartTurn

    model, asr = SmartTurn(threads=1), WhisperAsr(AsrConfig(cpu_threads=1))
    lead = int(LEAD_S * RATE)
    rows = []
    for clip in turn_set(cache_dir):
        speech = clip.audio[: clip.pause_at] if clip.paused else clip.audio
        audio = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(RATE, np.float32)])
        start, onset = _pause_onset(audio, lead + len(speech))
        spans = [audio[max(0, start - 4800) : onset + t * RATE // 1000] for t in TAILS]
        rows.append(
            {
                "clip": clip.name,
                "sentence": int(clip.name[1:3]),
                "text": clip.text,
                "voice": clip.voice,
                "paused": clip.paused,
                "pause_s": clip.pause_s,
                "vad_lag_ms": (onset - lead - len(speech)) * 1000 // RATE,
                "probability": {str(t): float(p) for t, p in zip(TAILS, model.scores(spans), strict=True)},
                "transcript": asr.transcribe(speech),
            }
        )
    path.write_text(json.dumps(rows, indent=1))
    return rows


Rule = Callable[[Row], bool]


def _before(row: Row) -> bool:
    """The rule before (16e1128): asked 200 ms into the pause; open words never end the turn,
    a period ends it from 0.5, anything else from 0.5."""
    return row["probability"]["200"] >= FINISHED and transcript_cue(row["transcript"]) != "open"


def cues(threshold: float, tail: int = TAIL_MS) -> Rule:
    return lambda r: TurnCues(threshold).finished(r["probability"][str(tail)], r["transcript"])


def alone(threshold: float, tail: int = TAIL_MS) -> Rule:
    return lambda r: r["probability"][str(tail)] >= threshold


def rules(tuned: float) -> dict[str, Rule]:
    out: dict[str, Rule] = {
        "before: 200 ms, model alone, p >= 0.5": alone(0.5, 200),
        "before: 200 ms, cues (0.5, a period from 0.5)": _before,
    }
    for eagerness in ("high", "auto", "low"):
        t = THRESHOLDS[eagerness]
        out[f"now: {TAIL_MS} ms, model alone, p >= {t:g} ({eagerness}, no transcript)"] = alone(t)
        out[f"now: {TAIL_MS} ms, cues, p >= {t:g} ({eagerness})"] = cues(t)
    out[f"tuned on s00-s09: {TAIL_MS} ms, cues, p >= {tuned:g}"] = cues(tuned)
    out["re-scored at 800 ms, cues, p >= 0.7"] = cues(0.7, 800)
    return out


def score(rows: list[Row], rule: Rule) -> dict[str, Any]:
    paused = [r for r in rows if r["paused"]]
    finished = [r for r in rows if not r["paused"]]
    cut = sum(map(rule, paused))
    ended = sum(map(rule, finished))
    return {
        "false_cutoffs": f"{cut}/{len(paused)}",
        "false_cutoff_pct": round(100 * cut / max(1, len(paused)), 1),
        "finished_at_once": f"{ended}/{len(finished)}",
        "finished_pct": round(100 * ended / max(1, len(finished)), 1),
    }


def tune(rows: list[Row], target_pct: float = 5.0) -> float:
    """The cues' threshold on the rows: the most finished sentences ended at once with false
    cut-offs within `target_pct` (none within it: the fewest; ties: the higher threshold)."""
    grid = [round(x, 2) for x in np.arange(0.05, 0.96, 0.05)]
    results = [(t, score(rows, cues(t))) for t in grid]
    bound = max(target_pct, min(r["false_cutoff_pct"] for _, r in results))
    ok = [(r["finished_pct"], t) for t, r in results if r["false_cutoff_pct"] <= bound]
    return max(ok)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = observations()
    tune_rows = [r for r in rows if r["sentence"] in TUNE]
    held = [r for r in rows if r["sentence"] not in TUNE]
    threshold = tune(tune_rows)
    report: dict[str, Any] = {"tuned_threshold": threshold, "tuned_on": "s00-s09", "rules": {}}
    for name, rule in rules(threshold).items():
        report["rules"][name] = {"tuning": score(tune_rows, rule), "held_out": score(held, rule)}
    lags = [r["vad_lag_ms"] for r in rows]
    report["vad_lag_ms"] = {"p50": float(np.median(lags)), "max": max(lags)}
    report["curve"] = {
        f"{t:g}": {"tuning": score(tune_rows, cues(t)), "held_out": score(held, cues(t))}
        for t in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**report, "clips": rows}, indent=1))


if __name__ == "__main__":
    main()
