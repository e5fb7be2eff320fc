"""The policy metadata a robot gets on connect (openpi's first frame), from the pipeline YAML.

The session layer loads no model, so it reads what an observation must look like from the
entry stage's options in the pipeline spec (the same options the engine is built from):
``image_keys``, ``image_size``, ``state_key``, ``state_dim``, ``prompt_key``, ``horizon``,
``action_dim``, ``num_steps``. A pipeline that does not declare them is not a robot policy.
"""

from __future__ import annotations

from typing import Any

from runtime.spec import PipelineSpec

REQUIRED = ("image_keys", "image_size", "state_key", "state_dim", "horizon", "action_dim")


def policy_metadata(spec: PipelineSpec) -> dict[str, Any]:
    """The metadata map of the policy that pipeline ``spec`` serves; ``ValueError`` if its
    entry stage does not declare the observation and action shapes."""
    entry = next(stage for stage in spec.stages if stage.name == spec.entry)
    options = entry.options
    missing = [name for name in REQUIRED if name not in options]
    if missing:
        raise ValueError(f"pipeline {spec.name}: stage {entry.name} does not declare {', '.join(missing)}")
    size = int(options["image_size"])
    return {
        "policy": spec.name,
        "engine": entry.engine,
        "random_weights": bool(options.get("random_weights", True)),
        "image_keys": [str(k) for k in options["image_keys"]],
        "image_shape": [size, size, 3],
        "state_key": str(options["state_key"]),
        "state_dim": int(options["state_dim"]),
        "prompt_key": str(options.get("prompt_key", "prompt")),
        "action_horizon": int(options["horizon"]),
        "action_dim": int(options["action_dim"]),
        "num_steps": int(options.get("num_steps", 0)),
    }
