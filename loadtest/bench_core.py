"""Process CPU per call of the realtime core's two hot paths (issue 34's before/after check of
the core's split): an `input_audio_buffer.append` (40 ms of 24 kHz PCM16, server VAD on, its
`DetectSpeech` frames scored as silence) and a response's `on_response_audio` (40 ms at 48 kHz).

No I/O, no event loop: only the core. Process CPU time, not wall time, so a busy neighbour
moves it less. It uses only the core's public calls: run it on two checkouts to compare them,

    PYTHONPATH=. .venv/bin/python -m loadtest.bench_core --sessions 50 --appends 500
"""

from __future__ import annotations

import argparse
import base64
import json
import time

import numpy as np

from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import DetectSpeech

VAD_FRAME = 512  # samples of one scored frame at 16 kHz


def append_us(sessions: int, appends: int) -> float:
    """Microseconds of process CPU per append (and the VAD scores it asks for)."""
    pcm = (np.sin(np.arange(960) / 10) * 3000).astype(np.int16).tobytes()  # 40 ms at 24 kHz
    message = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    cores = [RealtimeSessionCore(CoreOptions(session_id=f"sess_{i}")) for i in range(sessions)]
    for core in cores:
        core.start(0.0, 0.0)
    now, start = 0.0, time.process_time()
    for _ in range(appends):
        now += 0.04
        for core in cores:
            for effect in core.handle_client_event(message, now).effects:
                if isinstance(effect, DetectSpeech):
                    scores = [0.0] * (len(effect.samples) // VAD_FRAME)
                    core.feed_vad(scores, now, start_sample=effect.start_sample)
    return (time.process_time() - start) / (sessions * appends) * 1e6


def response_audio_us(sessions: int, responses: int, chunks: int) -> float:
    """Microseconds of process CPU per `on_response_audio` call (responses made on demand)."""
    audio = np.zeros(1920, dtype=np.float32)  # 40 ms at 48 kHz
    no_vad = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    manual = json.dumps({"type": "session.update", "session": no_vad})
    create = json.dumps({"type": "response.create"})
    cores = [RealtimeSessionCore(CoreOptions(session_id=f"sess_{i}")) for i in range(sessions)]
    now, calls, start = 0.0, 0, time.process_time()
    for core in cores:
        core.start(now, 0.0)
        core.handle_client_event(manual, now)
        for _ in range(responses):
            core.handle_client_event(create, now)
            response_id = core.active_response_id
            assert response_id is not None
            for _ in range(chunks):
                now += 0.04
                core.on_response_audio(response_id, audio, 48000, now)
                calls += 1
            core.on_response_done(response_id, "completed", now=now)
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--appends", type=int, default=500)
    parser.add_argument("--responses", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=100, help="audio chunks per response")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the fastest is reported")
    args = parser.parse_args()
    appends = [append_us(args.sessions, args.appends) for _ in range(args.repeat)]
    audio = [response_audio_us(args.sessions, args.responses, args.chunks) for _ in range(args.repeat)]
    print(json.dumps({"append_us": round(min(appends), 2), "response_audio_us": round(min(audio), 2)}))


if __name__ == "__main__":
    main()
