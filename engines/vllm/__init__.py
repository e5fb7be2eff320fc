"""vLLM stage engines (see stages.py) and the engine process they drive (host.py)."""
