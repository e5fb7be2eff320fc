"""End of turn offline: pauses after a word that *can* end a clause, which the evaluation set lacks.

Every first half of :mod:`loadtest.turn_set` ends on a word a clause cannot end on (a
preposition, an article, a conjunction), the very cue ``semantic_vad``'s words veto reads
(``session.realtime.semantic_turn.transcript_cue``), so the set's false cut-offs say nothing of a
pause after a complete-looking clause ("I would like to book a flight | to Madrid ..."). This cuts
the same 20 sentences there instead (the word counts in ``CUTS``), the same way the set does
(Piper's whole-sentence audio cut at its own word break, so the first half keeps its mid-sentence
intonation; the three renditions of ``VOICES``), and reports how often each rule would end the
turn at that pause on its first look (32 ms into the silence, the words as the live ASR's draft
makes them), for s00-s09 and s10-s19 apart. Some of these first halves are complete requests in
their own right ("Could you play some relaxing music?"): an end there is not always wrong, but
every one is a pause inside the speaker's sentence.

    python -m loadtest.clause_cuts [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.score_turns import LEAD_S, PREFIX, TUNE, vad_pauses
from loadtest.turn_set import CACHE, RATE, SENTENCES, VOICES, paused_clip, spec_key
from session.realtime.semantic_turn import CLOSED_THRESHOLDS, TAIL_MS, THRESHOLDS, TurnCues, transcript_cue

# Words of each sentence of `SENTENCES` before the pause: each first half ends on a word that can
# end a clause (a noun, a verb's object, a complete question).
CUTS = (7, 12, 7, 12, 9, 10, 6, 9, 8, 9, 6, 4, 10, 5, 9, 8, 5, 8, 8, 6)


def observations(cache_dir: Path = CACHE) -> list[dict[str, Any]]:
    """Per first half: P(finished) `TAIL_MS` after the VAD's silence onset and the draft words
    of the turn so far (cached beside the set's)."""
    path = cache_dir / f"clause-cuts-{spec_key()}-{'-'.join(map(str, CUTS))}.json"
    if path.exists():
        rows: list[dict[str, Any]] = json.loads(path.read_text())
        return rows
    from engines.speech.asr import AsrConfig, WhisperAsr
    from engines.speech.smart_turn import SmartTurn

    model, asr, lead = SmartTurn(threads=1), WhisperAsr(AsrConfig(cpu_threads=1)), int(LEAD_S * RATE)
    rows = []
    for voice in VOICES:
        for i, ((text, _), cut) in enumerate(zip(SENTENCES, CUTS, strict=True)):
            clip = paused_clip(text, cut, 1.0, voice)
            speech = clip.audio[: clip.pause_at]
            audio = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(RATE, np.float32)])
            start, onset, _ = vad_pauses(audio, lead + len(speech))
            (p,) = model.scores([audio[max(0, start - PREFIX) : onset + TAIL_MS * RATE // 1000]])
            words = asr.draft(audio[max(0, start - PREFIX) : onset])[0]
            rows.append({"clip": f"s{i:02d}-{voice.name}-clause", "sentence": i, "p": p, "draft": words})
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return rows


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per half: first halves each rule ends at their pause, and those whose words end a sentence."""
    rules = {
        f"{e}: closed words from p >= {CLOSED_THRESHOLDS[e]:g}, else p >= {THRESHOLDS[e]:g}": (
            TurnCues.for_eagerness(e)
        )
        for e in ("high", "auto", "low")
    }
    halves = {
        "s00-s09": [r for r in rows if r["sentence"] in TUNE],
        "s10-s19": [r for r in rows if r["sentence"] not in TUNE],
    }
    out: dict[str, Any] = {}
    for half, sel in halves.items():
        ended = {name: sum(cues.finished(r["p"], r["draft"]) for r in sel) for name, cues in rules.items()}
        closed = sum(transcript_cue(r["draft"]) == "closed" for r in sel)
        out[half] = {"first_halves": len(sel), "ended_at_the_pause": ended, "words_end_a_sentence": closed}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = observations()
    result = report(rows)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**result, "clips": rows}, indent=1))


if __name__ == "__main__":
    main()
