"""Runs the real ``openpi-client`` (PyPI) against a server; prints one JSON line per result.

Not a test module: ``tests/robot/test_openpi_client.py`` runs it with the interpreter of the
openpi-client virtual environment (openpi-client pins numpy<2, the server's env has numpy 2),
so it imports nothing from this repository.

    python openpi_client_script.py URI_OR_HOST PORT API_KEY MODE [STEPS]

MODE ``infer``: metadata, then STEPS observations built from it (seeded), each result's
actions (as a list), server_timing keys and dtype. MODE ``bad``: one observation with a wrong
image shape: the RuntimeError text the client raises, then the close code.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from openpi_client import websocket_client_policy
from websockets.exceptions import ConnectionClosed


def observation(meta: dict, index: int, prompt: str = "pick up the cup") -> dict:
    rng = np.random.default_rng(index)
    obs = {key: rng.integers(0, 256, meta["image_shape"], dtype=np.uint8) for key in meta["image_keys"]}
    obs[meta["state_key"]] = rng.standard_normal(meta["state_dim"]).astype(np.float32)
    obs[meta["prompt_key"]] = prompt
    return obs


def main() -> None:
    host, port, key, mode = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    first = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    policy = websocket_client_policy.WebsocketClientPolicy(
        host=host, port=int(port) if port != "-" else None, api_key=key if key != "-" else None
    )
    meta = policy.get_server_metadata()
    print(json.dumps({"metadata": {k: v for k, v in meta.items()}}), flush=True)
    if mode == "infer":
        for i in range(first, first + steps):
            result = policy.infer(observation(meta, i))
            actions = result["actions"]
            print(
                json.dumps(
                    {
                        "index": i,
                        "shape": list(actions.shape),
                        "dtype": str(actions.dtype),
                        "timing": sorted(result["server_timing"]),
                        "keys": sorted(result),
                        "actions": actions.tolist(),
                    }
                ),
                flush=True,
            )
    elif mode == "bad":
        obs = observation(meta, 0)
        obs[meta["image_keys"][0]] = np.zeros((5, 5, 3), np.uint8)
        try:
            policy.infer(obs)
            print(json.dumps({"error": None}), flush=True)
        except RuntimeError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
        try:
            policy._ws.recv(timeout=10)
            code = None
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
        print(json.dumps({"close_code": code}), flush=True)


if __name__ == "__main__":
    main()
