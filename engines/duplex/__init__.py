"""Native full-duplex speech (Moshi family) as one frame-synchronous stage: ``duplex.moshi``.

``stages.DuplexEngine`` (the engine), ``lm.FrameLM`` (temporal + depth step over session
slots), ``codec.MimiStreams`` (streaming Mimi encode/decode per slot), ``slot_kv.SlotKV`` (the
per-session ring KV cache), ``text`` (text pieces and stretches of speech), ``config`` (the tiny
random-weight config, or a local checkpoint).

Why ``transformers`` and not Kyutai's ``moshi`` package: ``moshi`` (0.2.13) has the richer
streaming API (``LMGen.step``, Mimi in streaming mode, batch slots with reset masks), but it
pins ``torch<2.10`` and ``huggingface-hub<1.0`` (this project runs torch 2.13 and transformers
5.24, which needs hub >= 1.31) and pulls ``bitsandbytes`` and ``sounddevice``: it cannot be installed
beside them. ``transformers`` has the same architecture (``MoshiForConditionalGeneration``,
``MimiModel``) with a KV-cache hook and streaming Mimi *encode*; what it lacks is added here on
its modules: per-session KV slots (so sessions at different positions share a step), the
delayed token layout of ``LMGen.step``, and streaming Mimi *decode*.
"""
