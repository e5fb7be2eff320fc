"""What a pipeline offers a session, asked of the runtime (never read off engine names).

The composition root (web/) builds sessions from this: whether the session opens a live
request and at what input rate, whether server VAD has speech probabilities to work on,
whether the response requests transcribe their audio, whether the pipeline decides turns and
responses itself (a native full-duplex model). Engines declare what their stage provides with
the class attribute `Engine.provides`; named entries come from the pipeline YAML (`entries`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

VOICE_ACTIVITY = "voice_activity"  # VoiceActivity probabilities of the live request's audio
TURN_DETECTION = "turn_detection"  # SpeechStarted / SpeechStopped from the live request
INPUT_TRANSCRIPTION = "input_transcription"  # Transcript of the user's audio
END_OF_TURN = "end_of_turn"  # TurnScore: whether the user's speech so far ends their turn
END_OF_TURN_WORDS = "end_of_turn_words"  # TurnScore of a "score_words": does the message end there
RESPONSES = "responses"  # ResponseStarted / ResponseDone: the live request speaks by itself


@dataclass(frozen=True, slots=True)
class PipelineCapabilities:
    """`Orchestrator.capabilities()`: per entry, what its reachable stages provide."""

    live_entry: str | None = None  # where a voice session opens its live request (None: none)
    transcribe_entry: str | None = None  # a request transcribing one audio item
    input_rate: int = 16000  # AudioInput rate for the live request
    live: frozenset[str] = field(default_factory=frozenset)  # provided through the live entry
    responses: frozenset[str] = field(default_factory=frozenset)  # ... through the main entry
    # The gated edge (source, target) into the live entry's end-of-turn stage: a session opens
    # it while it uses semantic_vad (session.voice.turn_feed). None: no such gate.
    end_of_turn_gate: tuple[str, str] | None = None

    @property
    def voice_activity(self) -> bool:
        return VOICE_ACTIVITY in self.live

    @property
    def turn_detection(self) -> bool:
        """The pipeline detects the user's turns itself (SpeechStarted/SpeechStopped)."""
        return TURN_DETECTION in self.live

    @property
    def live_responses(self) -> bool:
        """The live request produces responses itself: no per-turn response requests."""
        return RESPONSES in self.live

    @property
    def response_transcribes_input(self) -> bool:
        """A response request's `Transcript` transcribes the audio it was given."""
        return INPUT_TRANSCRIPTION in self.responses

    @property
    def end_of_turn(self) -> bool:
        """The live request scores the user's pauses with an end-of-turn model (semantic_vad)."""
        return END_OF_TURN in self.live

    @property
    def end_of_turn_words(self) -> bool:
        """... and scores the words of a turn so far too (semantic_vad's words cue)."""
        return END_OF_TURN_WORDS in self.live

    @property
    def live_transcribes_input(self) -> bool:
        return INPUT_TRANSCRIPTION in self.live

    @property
    def can_transcribe(self) -> bool:
        """Committed audio items can be transcribed on their own (the transcribe entry)."""
        return self.transcribe_entry is not None
