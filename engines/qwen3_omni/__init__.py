"""Qwen3-Omni thinker / talker / code2wav engines over transformers (tiny or local weights)."""
