"""World-model video sessions (``/v1/realtime/video``): protocol core, pacing, async driver."""
