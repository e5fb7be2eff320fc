"""End of turn offline: the decision rules of ``session.realtime.semantic_turn`` on the
evaluation set's cached clips (:mod:`loadtest.turn_set`), without a server.

Each clip is seen as the session sees it at its first candidate pause: a paused sentence's
first half (up to the inserted pause), a finished sentence whole, each followed by the 200 ms
of silence the session waits before asking. For each it takes Smart Turn v3.2's probability
(``engines.speech.smart_turn``, over the half/whole plus the silence, as the end-of-turn stage
scores it) and Whisper's transcript of the speech (``engines.speech.asr``, tiny.en, as the live
ASR transcribes a pause ahead); both are cached (``.omniduplex/loadtest-cache``). Then, per
rule: false cut-offs (paused clips the rule ends at the pause) and finished sentences ended at
once, on the two voices a threshold is tuned on and on the held-out third.

    python -m loadtest.score_turns [--tune joe-0.85,joe-1.0] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.turn_set import CACHE, RATE, spec_key, turn_set
from session.realtime.semantic_turn import CANDIDATE_MS, FINISHED, TurnCues, transcript_cue

Row = dict[str, Any]


def observations(cache_dir: Path = CACHE) -> list[Row]:
    """(clip, voice, paused, probability, transcript) per clip, made once and cached."""
    path = cache_dir / f"turn-scores-{spec_key()}.json"
    if path.exists():
        rows: list[Row] = json.loads(path.read_text())
        return rows
    from engines.speech.asr import AsrConfig, WhisperAsr
    from engines.speech.smart_turn import SmartTurn

    model, asr = SmartTurn(threads=1), WhisperAsr(AsrConfig(cpu_threads=1))
    silence = np.zeros(CANDIDATE_MS * RATE // 1000, np.float32)
    rows = []
    for clip in turn_set(cache_dir):
        speech = clip.audio[: clip.pause_at] if clip.paused else clip.audio
        p = model.scores([np.concatenate([speech, silence])])[0]
        text = asr.transcribe(speech)
        rows.append(
            {
                "clip": clip.name,
                "text": clip.text,
                "voice": clip.voice,
                "paused": clip.paused,
                "pause_s": clip.pause_s,
                "probability": float(p),
                "transcript": text,
            }
        )
    path.write_text(json.dumps(rows, indent=1))
    return rows


def rules(threshold: float) -> dict[str, Callable[[float, str | None], bool]]:
    """Each rule: (probability, transcript) -> end the turn at this pause?"""
    return {
        "model alone (p >= 0.5)": lambda p, t: p >= 0.5,
        f"model alone (p >= {threshold:.2f})": lambda p, t: p >= threshold,
        "transcript alone (closed)": lambda p, t: transcript_cue(t) == "closed",
        f"cues (TurnCues {FINISHED:g}: the default)": lambda p, t: TurnCues().finished(p, t),
        f"cues (TurnCues {threshold:g}: tuned)": lambda p, t: TurnCues(threshold).finished(p, t),
    }


def score(rows: list[Row], rule: Callable[[float, str | None], bool]) -> dict[str, Any]:
    paused = [r for r in rows if r["paused"]]
    finished = [r for r in rows if not r["paused"]]
    cut = sum(rule(r["probability"], r["transcript"]) for r in paused)
    ended = sum(rule(r["probability"], r["transcript"]) for r in finished)
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
    results = [(t, score(rows, TurnCues(t).finished)) for t in grid]
    bound = max(target_pct, min(r["false_cutoff_pct"] for _, r in results))
    ok = [(r["finished_pct"], t) for t, r in results if r["false_cutoff_pct"] <= bound]
    return max(ok)[1]


def curve(rows: list[Row]) -> dict[str, dict[str, str]]:
    """The cues at each threshold: (false cut-offs, finished at once)."""
    out = {}
    for t in (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95):
        s = score(rows, TurnCues(t).finished)
        out[f"{t:g}"] = {"false_cutoffs": s["false_cutoffs"], "finished_at_once": s["finished_at_once"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tune", default="joe-0.85,joe-1.0", help="voices the threshold is tuned on")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = observations()  # the decision comes 200 ms into a pause: the same for every length
    tuned_on = set(args.tune.split(","))
    tune_rows = [r for r in rows if r["voice"] in tuned_on]
    held = [r for r in rows if r["voice"] not in tuned_on]
    threshold = tune(tune_rows)
    report: dict[str, Any] = {"threshold": threshold, "tuned_on": sorted(tuned_on), "rules": {}}
    for name, rule in rules(threshold).items():
        report["rules"][name] = {
            "tuned": score(tune_rows, rule),
            "held_out": score(held, rule),
            "all": score(rows, rule),
        }
    cues: dict[str, int] = {}
    for r in rows:
        key = f"{'paused' if r['paused'] else 'finished'}:{transcript_cue(r['transcript'])}"
        cues[key] = cues.get(key, 0) + 1
    report["transcript_cues"] = cues
    report["curve"] = {"tuned": curve(tune_rows), "held_out": curve(held)}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**report, "clips": rows}, indent=1))


if __name__ == "__main__":
    main()
