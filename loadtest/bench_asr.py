"""Per-utterance ASR time and accuracy: whisper's padded 30 s window against the short encode.

For each utterance, :meth:`WhisperAsr.transcribe_full` (faster-whisper's path: every window
padded to 30 s and encoded whole: the "before") and :meth:`WhisperAsr.transcribe` (the short
encode with its guard and fallback: the "after") run on the same audio, one at a time, on the
calling thread, with the shipped :class:`AsrConfig` (int8, auto threads). Utterances: Piper
speech (deterministic voice, and the natural voice with its noise on, a few draws each) of the
test and load-test sentences, bare and with VAD-like silence around them (0.3 s before, 0.5 s
after), plus a longer three-sentence turn. Reports median / p90 ms per utterance for both paths,
how many short transcripts differ from the 30 s ones (strings, and words), how many of each
path's transcripts differ in words from the text Piper spoke, and the guard's fallbacks.
Prints the load average next to the figures: the box is shared.

    .venv/bin/python -m loadtest.bench_asr --repeats 3 --out /tmp/bench_asr.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.report import write_json
from loadtest.speech import SENTENCES as LOAD_SENTENCES

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today?",
    "Please send the report to Alice by Friday.",
    "What time does the train leave tomorrow morning?",
    "I would like a cup of coffee, please.",
    "Wait, stop please.",
    "Wait, stop. I have another question.",
    *LOAD_SENTENCES,  # the load generator's utterances
    "The quick brown fox jumps over the lazy dog, then the five boxing wizards jump quickly, "
    "and a lazy cat sleeps all afternoon.",
)
RATE = 16_000


@dataclass(frozen=True, slots=True)
class Utterance:
    label: str
    text: str
    audio: np.ndarray


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _speech(voices: int) -> list[Utterance]:
    import soxr

    from engines.speech.tts import TtsConfig, shared_tts

    deterministic = shared_tts(TtsConfig(noise_scale=0.0, noise_w_scale=0.0))
    natural = shared_tts(TtsConfig())

    def at16k(tts: Any, text: str) -> np.ndarray:
        audio = soxr.resample(tts.synthesize_all(text), tts.sample_rate, RATE)
        return np.asarray(audio, dtype=np.float32)

    before, after = np.zeros(int(0.3 * RATE), np.float32), np.zeros(int(0.5 * RATE), np.float32)
    out: list[Utterance] = []
    for text in SENTENCES:
        clean = at16k(deterministic, text)
        out.append(Utterance("piper", text, clean))
        out.append(Utterance("piper+silence", text, np.concatenate([before, clean, after])))
        out.extend(Utterance("natural", text, at16k(natural, text)) for _ in range(voices))
    long_text = " ".join(SENTENCES[7:10])
    out.append(Utterance("three sentences", long_text, at16k(deterministic, long_text)))
    return out


def _ms(fn: Any, audio: np.ndarray) -> tuple[str, float]:
    t0 = time.perf_counter()
    text = fn(audio)
    return text, (time.perf_counter() - t0) * 1000.0


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(statistics.median(ordered), 1),
        "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1),
        "mean_ms": round(statistics.fmean(ordered), 1),
    }


def run(repeats: int, voices: int) -> dict[str, Any]:
    from engines.speech.asr import AsrConfig, WhisperAsr

    t0 = time.perf_counter()
    asr = WhisperAsr(AsrConfig())  # not the shared one: fresh counters
    load_s = time.perf_counter() - t0
    utterances = _speech(voices)
    asr.transcribe(utterances[0].audio)  # warm both paths
    asr.transcribe_full(utterances[0].audio)
    load_before = os.getloadavg()
    full_ms: list[float] = []
    short_ms: list[float] = []
    differ: list[dict[str, str]] = []
    word_differ = 0
    wrong = {"full": 0, "short": 0}  # words differ from the text Piper spoke
    for _ in range(repeats):
        for u in utterances:
            full, f_ms = _ms(asr.transcribe_full, u.audio)
            short, s_ms = _ms(asr.transcribe, u.audio)
            wrong["full"] += _words(full) != _words(u.text)
            wrong["short"] += _words(short) != _words(u.text)
            full_ms.append(f_ms)
            short_ms.append(s_ms)
            if short != full:
                differ.append({"label": u.label, "full": full, "short": short})
                word_differ += _words(short) != _words(full)
    stats = asr.stats()
    audio_s = [u.audio.size / RATE for u in utterances]
    return {
        "load_s": round(load_s, 2),
        "utterances": len(utterances) * repeats,
        "audio_s": {"min": round(min(audio_s), 2), "max": round(max(audio_s), 2)},
        "full_30s": _summary(full_ms),
        "short": _summary(short_ms),
        "short_differs_from_full": len(differ),
        "short_words_differ_from_full": word_differ,
        "words_wrong_vs_spoken_text": wrong,
        "differences": differ[:20],
        "guard": stats,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="passes over the utterances")
    parser.add_argument("--voices", type=int, default=2, help="natural-voice draws per sentence")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    result = run(args.repeats, args.voices)
    f, s = result["full_30s"], result["short"]
    print(f"load average {result['loadavg_before']} -> {result['loadavg_after']} on {result['cpus']} CPUs")
    print(f"{result['utterances']} utterances, {result['audio_s']['min']}-{result['audio_s']['max']} s")
    print("| path | median ms | p90 ms | mean ms |\n|---|---:|---:|---:|")
    print(f"| 30 s window (before) | {f['median_ms']} | {f['p90_ms']} | {f['mean_ms']} |")
    print(f"| short encode + guard (after) | {s['median_ms']} | {s['p90_ms']} | {s['mean_ms']} |")
    print(
        f"short != full: {result['short_differs_from_full']} strings, "
        f"{result['short_words_differ_from_full']} in words; guard fallbacks to the 30 s window: "
        f"{sum(result['guard']['fallbacks'].values())} of {result['guard']['short']} short encodes "
        f"{result['guard']['fallbacks']}"
    )
    w = result["words_wrong_vs_spoken_text"]
    print(f"words differ from the spoken text: 30 s window {w['full']}, short {w['short']}")
    for d in result["differences"]:
        print(f"  [{d['label']}] full={d['full']!r} short={d['short']!r}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
