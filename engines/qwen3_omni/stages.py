"""Entry points of the Qwen3-Omni engines (``qwen3_omni.thinker/talker/code2wav`` in pyproject)."""

from __future__ import annotations

from engines.qwen3_omni.code2wav import Code2WavEngine
from engines.qwen3_omni.talker import TalkerEngine
from engines.qwen3_omni.thinker import ThinkerEngine

__all__ = ["Code2WavEngine", "TalkerEngine", "ThinkerEngine"]
