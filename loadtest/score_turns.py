"""End of turn offline: the decision rules of ``session.realtime.semantic_turn`` on the
evaluation set's cached clips (:mod:`loadtest.turn_set`), without a server.

Each clip is seen as the session sees it at its first candidate pause: a paused sentence's
first half (up to the inserted pause), a finished sentence whole, after 0.4 s of silence and
followed by silence. Silero VAD and the session's `SpeechDetector` find where the pause begins
(the VAD's silence onset, a frame or two after the speech ends); Smart Turn v3.2
(``engines.speech.smart_turn``) scores the speech up to `tail` ms after that onset, for each
tail in `TAILS` (what the end-of-turn stage is sent: 32 ms now; later tails for a second look),
and Whisper tiny.en (``engines.speech.asr``) transcribes what the live ASR transcribes at the
pause: from the VAD's speech start less the 300 ms prefix padding up to the silence onset. All
of it is cached (``.omniduplex/loadtest-cache``). Then, per rule: false cut-offs (paused clips
the rule ends at the pause: the decision comes in the first tenth of a second of the pause, so
the same for every pause length) and finished sentences ended at once.

Held out: the threshold of the words-closed bar is tuned on half the sentences (s00-s09, all
three renditions) and every rule is reported on both halves (s10-s19 never seen by the tuning).
With ``--lm``, SmolLM2-135M-Instruct's probability of ending the user's message after the
transcript (P(<|im_end|>), lowercased without punctuation as LiveKit's turn detector reads
it; the end-of-turn stage's own words model, :class:`engines.speech.words_turn.WordsTurn`) is
measured as a third cue, and the words cue's bar (``session.realtime.words_turn``: closed
words the model left open end the turn from it) is tuned on s00-s09 as above.

    python -m loadtest.score_turns [--lm] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.turn_set import CACHE, RATE, spec_key, turn_set
from session.realtime.semantic_turn import (
    CLOSED_THRESHOLDS,
    MIN_PAUSE_MS,
    OPEN_WORDS,
    SENTENCE_END,
    TAIL_MS,
    THRESHOLDS,
    TurnCues,
    transcript_cue,
)

Row = dict[str, Any]
TAILS = (0, 32, 64, 100, 150, 200, 250, 300, 800)  # ms of silence after the VAD's onset the model hears
LEAD_S = 0.4
PREFIX = 4800  # the session's prefix padding (300 ms) before the VAD's speech start
TUNE = range(0, 10)  # sentences the threshold is tuned on (s00-s09); s10-s19 are held out


def vad_pauses(audio: np.ndarray, speech_end: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(speech start, silence onset, earlier pauses) as the session's VAD finds them in `audio`:
    the pause at `speech_end`, and every silence of at least one VAD frame before it (where
    the session asks too) as (onset, length in samples)."""
    from engines.speech.vad import SileroVad
    from session.realtime.turns import SpeechDetector

    n = len(audio) // 512
    probs = SileroVad().new_stream().speech_probs(audio[: n * 512])
    detector = SpeechDetector(0.5, 60_000)
    start = None
    inner: dict[int, int] = {}
    for k, p in enumerate(probs):
        detector.feed(k * 512, p)
        if detector.speaking and start is None:
            start = k * 512
        onset = detector.silence_start
        if onset is not None and k * 512 >= speech_end - 2000:
            return start or 0, onset, sorted(inner.items())
        if onset is not None:
            inner[onset] = (k + 1) * 512 - onset
    return start or 0, n * 512, sorted(inner.items())


def _look(model: Any, asr: Any, audio: np.ndarray, start: int, onset: int, length: int) -> Row:
    """What the session sees at a pause: P(finished) per tail the pause lasts, the words."""
    tails = [t for t in TAILS if t * RATE // 1000 < length]
    spans = [audio[max(0, start - PREFIX) : onset + t * RATE // 1000] for t in tails]
    return {
        "probability": {str(t): float(p) for t, p in zip(tails, model.scores(spans), strict=True)},
        "transcript": asr.transcribe(audio[max(0, start - PREFIX) : onset]),
    }


def observations(cache_dir: Path = CACHE) -> list[Row]:
    """Per clip: voice, sentence, paused, the VAD's lag, P(finished) per tail and the transcript
    at the pause that ends the speech, and the same at every earlier pause ("inner": the
    commas and word gaps of the speech, where the session asks too)."""
    path = cache_dir / f"turn-scores-vad6-{spec_key()}.json"
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
        start, onset, inner = vad_pauses(audio, lead + len(speech))
        rows.append(
            {
                "clip": clip.name,
                "sentence": int(clip.name[1:3]),
                "text": clip.text,
                "voice": clip.voice,
                "paused": clip.paused,
                "pause_s": clip.pause_s,
                "vad_lag_ms": (onset - lead - len(speech)) * 1000 // RATE,
                **_look(model, asr, audio, start, onset, len(audio)),
                "inner": [
                    {
                        "at_ms": (at - lead) * 1000 // RATE,
                        "ms": n * 1000 // RATE,
                        **_look(model, asr, audio, start, at, n),
                    }
                    for at, n in inner
                ],
            }
        )
    path.write_text(json.dumps(rows, indent=1))
    return rows


def with_drafts(rows: list[Row], cache_dir: Path = CACHE) -> None:
    """Each look's ``draft``: what the live ASR hands a decision (``WhisperAsr.draft``: the
    short encode's words, also where its guard would redo them on the 30 s window, which is
    what ``transcript`` holds). Cached beside the observations."""
    path = cache_dir / f"turn-drafts-{spec_key()}.json"
    if path.exists():
        drafts: dict[str, list[str]] = json.loads(path.read_text())
    else:
        from engines.speech.asr import AsrConfig, WhisperAsr

        asr, lead, drafts = WhisperAsr(AsrConfig(cpu_threads=1)), int(LEAD_S * RATE), {}
        for clip in turn_set(cache_dir):
            speech = clip.audio[: clip.pause_at] if clip.paused else clip.audio
            audio = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(RATE, np.float32)])
            start, onset, inner = vad_pauses(audio, lead + len(speech))
            ats = [onset, *(at for at, _ in inner)]
            drafts[clip.name] = [asr.draft(audio[max(0, start - PREFIX) : at])[0] for at in ats]
        path.write_text(json.dumps(drafts, indent=1))
    for row in rows:
        texts = drafts[row["clip"]]
        row["draft"] = texts[0]
        for look, text in zip(row["inner"], texts[1:], strict=True):
            look["draft"] = text


Rule = Callable[[Row], bool]


def _before_cue(text: str | None) -> str:
    """The words' cue before this round (4bbd1b1): "open" on a word a clause cannot end on."""
    stripped = (text or "").strip().rstrip("\"')\u201d")
    words = stripped.lower().replace("...", " ").split()
    last = words[-1].strip(".,;:!?-\u2014") if words else ""
    if not stripped:
        return "unknown"
    if not last or last in OPEN_WORDS or stripped.endswith(("...", "\u2026", ",", "-", "\u2014")):
        return "open"
    return "closed" if stripped.endswith(SENTENCE_END) else "plain"


def before(threshold: float, tail: int = TAIL_MS) -> Rule:
    """The rule before this round: the model decides (p >= threshold), open words veto."""
    return lambda r: _p(r, tail) >= threshold and _before_cue(r["transcript"]) != "open"


def cues(closed: float, threshold: float = THRESHOLDS["auto"], tail: int = TAIL_MS) -> Rule:
    return lambda r: TurnCues(threshold, closed).finished(_p(r, tail), r["transcript"])


def alone(threshold: float, tail: int = TAIL_MS) -> Rule:
    return lambda r: _p(r, tail) >= threshold


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _p(row: Row, tail: int) -> float:
    """P(finished) `tail` ms into the pause (0 when the pause ended sooner: never asked)."""
    return float(row["probability"].get(str(tail), 0.0))


def second_look(first: Rule, tail: int, threshold: float) -> Rule:
    """`first`, or else a second score `tail` ms into the pause at a stricter bar (words veto)."""
    return lambda r: first(r) or before(threshold, tail)(r)


def on_draft(closed: float, threshold: float = THRESHOLDS["auto"], tail: int = TAIL_MS) -> Rule:
    """The cues on the live ASR's draft of the words rather than its final transcript."""
    return lambda r: TurnCues(threshold, closed).finished(_p(r, tail), r["draft"])


def second_closed(tail: int, bar: float) -> Rule:
    """auto's rule at the first look, or else a second score `tail` ms into the pause that ends
    the turn when the words end a sentence and p >= `bar`. Only a pause longer than `tail` is
    looked at twice (a shorter one is over before), so a paused clip counts as cut at it only
    if its pause is longer (the clips' pauses: 0.6-2 s)."""
    first = cues(CLOSED_THRESHOLDS["auto"])

    def rule(r: Row) -> bool:
        lasts = r.get("ms") or (1000 * r["pause_s"] if r.get("paused") else 10_000)
        second = lasts > tail and transcript_cue(r["transcript"]) == "closed" and _p(r, tail) >= bar
        return first(r) or second

    return rule


def rules(tuned: float) -> dict[str, Rule]:
    out: dict[str, Rule] = {
        "before (main): 32 ms, p >= 0.7 (auto), open words veto": before(0.7),
        "before (main): 32 ms, p >= 0.5 (high), open words veto": before(0.5),
        "before (main): 32 ms, p >= 0.9 (low), open words veto": before(0.9),
    }
    for eagerness in ("high", "auto", "low"):
        closed, t = CLOSED_THRESHOLDS[eagerness], THRESHOLDS[eagerness]
        name = f"now, {eagerness}: closed words from p >= {closed:g}, else p >= {t:g}"
        out[name] = cues(closed, t)
    out[f"now, auto, no transcript (model alone, p >= {THRESHOLDS['auto']:g})"] = alone(THRESHOLDS["auto"])
    low = CLOSED_THRESHOLDS["auto"]
    out["now, auto, words cue without the pronoun rule"] = lambda r: (
        _before_cue(r["transcript"]) == "closed" and _p(r, TAIL_MS) >= low
    )
    out[f"tuned on s00-s09: closed words from p >= {tuned:g}"] = cues(tuned)
    for tail, t2 in ((150, 0.9), (200, 0.9), (250, 0.9), (300, 0.95)):
        out[f"not adopted: before (0.7), second look at {tail} ms, p >= {t2:g}"] = second_look(
            before(0.7), tail, t2
        )
    out["not adopted: re-scored at 800 ms, p >= 0.7, open words veto"] = before(0.7, 800)
    out["now, auto, on the live ASR's draft of the words"] = on_draft(CLOSED_THRESHOLDS["auto"])
    for tail, bar in ((250, 0.7), (250, 0.9), (300, 0.7), (300, 0.9), (800, 0.7), (800, 0.9), (800, 0.95)):
        name = f"not adopted: auto + second look at {tail} ms, closed words, p >= {bar:g}"
        out[name] = second_closed(tail, bar)
    return out


def score(rows: list[Row], rule: Rule, shortest_ms: int = 0) -> dict[str, Any]:
    """A paused clip is cut off if the rule ends its turn at the inserted pause or at an
    earlier one; a finished sentence is ended at once if the rule ends it at its end and at
    none of its earlier pauses (those it ends early, answered twice through the server).
    An earlier pause counts whatever its length (a decision made as the pause begins), or,
    with `shortest_ms`, only one of at least that much silence (the session ends no turn on
    less: `semantic_turn.MIN_PAUSE_MS`)."""
    paused = [r for r in rows if r["paused"]]
    finished = [r for r in rows if not r["paused"]]

    def early(r: Row) -> bool:
        return any(rule(p) for p in r.get("inner", ()) if p["ms"] >= shortest_ms)

    cut = sum(rule(r) or early(r) for r in paused)
    upto = [r for r in paused if r["pause_s"] <= 1.5]
    ended_early = sum(early(r) for r in finished)
    ended = sum(rule(r) and not early(r) for r in finished)
    return {
        "false_cutoffs": f"{cut}/{len(paused)}",
        "false_cutoffs_upto_1.5s": f"{sum(rule(r) or early(r) for r in upto)}/{len(upto)}",
        "false_cutoff_pct": round(100 * cut / max(1, len(paused)), 1),
        "finished_at_once": f"{ended}/{len(finished)}",
        "finished_pct": round(100 * ended / max(1, len(finished)), 1),
        "finished_ended_early": f"{ended_early}/{len(finished)}",
    }


def tune(rows: list[Row], target_pct: float = 5.0) -> float:
    """The words-closed bar on the rows: the most finished sentences ended at once with false
    cut-offs within `target_pct` (none within it: the fewest; ties: the higher threshold)."""
    grid = [0.05, *(round(x, 2) for x in np.arange(0.1, 0.96, 0.05))]
    results = [(t, score(rows, cues(t))) for t in grid]
    bound = max(target_pct, min(r["false_cutoff_pct"] for _, r in results))
    ok = [(r["finished_pct"], t) for t, r in results if r["false_cutoff_pct"] <= bound]
    return max(ok)[1]


def lm_scores(rows: list[Row]) -> None:
    """Each look's ``lm_logp_end``: log P(the user's message ends) after its transcript, as the
    end-of-turn stage's words model reads it (:class:`engines.speech.words_turn.WordsTurn`)."""
    from engines.speech.words_turn import WordsTurn

    model = WordsTurn()
    for row in [*rows, *(p for r in rows for p in r["inner"])]:
        row["lm_logp_end"] = round(model.logp_end([row["transcript"]])[0], 2)


def rescued(bar: float, closed: float = CLOSED_THRESHOLDS["auto"]) -> Rule:
    """auto's rule, or else words that end a sentence and whose log P(end) >= `bar` (whatever
    the model heard): ``session.realtime.words_turn``."""
    first = cues(closed)
    return lambda r: first(r) or (transcript_cue(r["transcript"]) == "closed" and r["lm_logp_end"] >= bar)


def tune_rescue(rows: list[Row], target_pct: float = 5.0) -> float:
    """The words bar on the rows: the most finished sentences ended at once with false cut-offs
    within `target_pct` and no more sentences ended early than auto's rule alone (ties: the
    higher bar)."""
    early = int(score(rows, cues(CLOSED_THRESHOLDS["auto"]))["finished_ended_early"].split("/")[0])
    grid = [b / 2 for b in range(-40, 0)]
    ok = []
    for bar in grid:
        r = score(rows, rescued(bar))
        if r["false_cutoff_pct"] <= target_pct and int(r["finished_ended_early"].split("/")[0]) <= early:
            ok.append((r["finished_pct"], bar))
    return max(ok)[1] if ok else 0.0


def lm_report(rows: list[Row], tune_rows: list[Row], held: list[Row]) -> dict[str, Any]:
    """How the LM cue separates the groups the words cannot (closed first halves from finished
    sentences), and the auto rule with an LM bar tuned on s00-s09."""
    closed_halves = [r for r in rows if r["paused"] and transcript_cue(r["transcript"]) != "open"]
    finished = [r for r in rows if not r["paused"]]

    def spread(rs: list[Row]) -> dict[str, float]:
        xs = [r["lm_logp_end"] for r in rs]
        return {"min": min(xs), "p50": float(np.median(xs)), "max": max(xs)} if xs else {}

    def with_lm(bar: float) -> Rule:
        return lambda r: cues(CLOSED_THRESHOLDS["auto"])(r) and r["lm_logp_end"] >= bar

    scored = [(b, score(tune_rows, with_lm(b))) for b in (float(x) for x in range(-20, 0))]
    best = max((r["finished_pct"], b) for b, r in scored if r["false_cutoff_pct"] <= 5.0)[1]
    bar = tune_rescue(tune_rows)
    undecided = [r for r in finished if not cues(CLOSED_THRESHOLDS["auto"])(r)]
    return {
        "logp_end_finished": spread(finished),
        "logp_end_finished_auto_leaves_open": spread(undecided),
        "logp_end_closed_first_halves": spread(closed_halves),
        "logp_end_inner_pauses": spread([p for r in rows for p in r["inner"]]),
        f"not adopted: auto and log P(end) >= {best:g} (tuned on s00-s09)": {
            "tuning": score(tune_rows, with_lm(best)),
            "held_out": score(held, with_lm(best)),
        },
        "words bar (tuned on s00-s09)": bar,
        f"auto, or closed words with log P(end) >= {bar:g}": {
            "tuning": score(tune_rows, rescued(bar)),
            "held_out": score(held, rescued(bar)),
        },
        f"now: auto, or closed words with log P(end) >= {bar:g}; no turn ends on less than "
        f"{MIN_PAUSE_MS['auto']} ms of silence": {
            "tuning": score(tune_rows, rescued(bar), MIN_PAUSE_MS["auto"]),
            "held_out": score(held, rescued(bar), MIN_PAUSE_MS["auto"]),
        },
        "curve_words_bar": {
            f"{b:g}": {"tuning": score(tune_rows, rescued(b)), "held_out": score(held, rescued(b))}
            for b in (-14.0, -12.0, -11.0, -10.0, -9.5, -9.0, -8.0, -7.0)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lm", action="store_true", help="also the SmolLM2 end-of-message cue (offline)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = observations()
    with_drafts(rows)
    tune_rows = [r for r in rows if r["sentence"] in TUNE]
    held = [r for r in rows if r["sentence"] not in TUNE]
    threshold = tune(tune_rows)
    report: dict[str, Any] = {"tuned_closed_threshold": threshold, "tuned_on": "s00-s09", "rules": {}}
    for name, rule in rules(threshold).items():
        report["rules"][name] = {"tuning": score(tune_rows, rule), "held_out": score(held, rule)}
    looks = [*rows, *(q for r in rows for q in r["inner"])]
    report["drafts"] = {
        "looks": len(looks),
        "words_differ": sum(_words(q["draft"]) != _words(q["transcript"]) for q in looks),
        "cue_differs": sum(transcript_cue(q["draft"]) != transcript_cue(q["transcript"]) for q in looks),
    }
    lags = [r["vad_lag_ms"] for r in rows]
    report["vad_lag_ms"] = {"p50": float(np.median(lags)), "max": max(lags)}
    report["curve_closed_threshold"] = {
        f"{t:g}": {"tuning": score(tune_rows, cues(t)), "held_out": score(held, cues(t))}
        for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
    }
    if args.lm:
        lm_scores(rows)
        report["lm"] = lm_report(rows, tune_rows, held)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**report, "clips": rows}, indent=1))


if __name__ == "__main__":
    main()
