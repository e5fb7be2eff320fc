"""CPU speech engines: Silero VAD, faster-whisper ASR, a text responder, Piper TTS."""
