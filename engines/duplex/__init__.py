"""Native full-duplex speech (Moshi family) as one frame-synchronous stage: ``duplex.moshi``.

``stages.DuplexEngine`` (the engine), ``lm.FrameLM`` (temporal + depth step over session
slots), ``codec.MimiStreams`` (streaming Mimi encode/decode per slot), ``slot_kv.SlotKV`` (the
per-session ring KV cache), ``text`` (text pieces and stretches of speech), ``config`` (the tiny
random-weight config, or a local checkpoint).
"""
