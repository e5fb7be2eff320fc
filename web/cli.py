"""The `omniduplex` command line: serve, run, stage, gateway (the load generator is `omniduplex-loadtest`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the realtime session server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--pipeline", default="voice-cascade", help="pipeline name or YAML path")
    p.add_argument(
        "--responder",
        choices=("llm", "echo"),
        default=None,
        help="voice-cascade responder: llm (default: SmolLM2-135M-Instruct, or --llm) or echo",
    )
    p.add_argument("--llm", default=None, help="causal LM dir for the responder (default: bundled SmolLM2)")
    p.add_argument(
        "--llm-engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="run the responder LM on transformers (in process) or vLLM (an engine process, .venv-vllm)",
    )
    p.add_argument("--redis-url", default=None, help="external Redis; default: an embedded redis-server")
    p.add_argument("--data-dir", default="./.omniduplex", help="embedded Redis data directory")
    _access_args(p)
    p.add_argument("--advertise-url", default=None, help="URL other replicas/gateways reach this one at")
    # scale-out (web/deploy/replica.py)
    p.add_argument("--replica-id", default=None, help="registry id (default: random per process)")
    p.add_argument("--replica-lease-s", type=float, default=5.0, help="registry lease; lapses without beats")
    p.add_argument("--replica-refresh-s", type=float, default=2.0, help="registry heartbeat interval")
    p.add_argument("--drain-timeout-s", type=float, default=600.0, help="SIGTERM: max wait for sessions")
    p.add_argument("--max-sessions", type=int, default=64)
    # worker processes on one port (web/deploy/workers.py)
    p.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (SO_REUSEPORT)")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        help="glibc: blocks of this many bytes and more are mmapped and given back when freed (e.g. "
        "131072; default 0: the allocator's own rising threshold). Bounds what an abusive session leaves "
        "behind, but costs in-process models throughput (web/deploy/allocator.py, docs/benchmarks.md)",
    )
    p.add_argument(
        "--malloc-trim-interval-s",
        type=float,
        default=0.0,
        help="glibc: this often, give the heap's free pages back (malloc_trim) when 16 MiB or more are "
        "free, from a thread of its own (default 0: never; it stalled the event loop at 200 sessions: "
        "runtime/heap_trim.py, docs/benchmarks.md)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the parent
    # sessions (session/voice/hosting.py)
    p.add_argument("--idle-ttl-s", type=float, default=600.0, help="session idle TTL (deleted after)")
    p.add_argument("--max-lifetime-s", type=float, default=3600.0, help="session maximum lifetime")
    p.add_argument(
        "--disconnect-grace-s", type=float, default=30.0, help="a dropped session runs on this long"
    )
    p.add_argument("--tenant-max-sessions", type=int, default=None, help="per-tenant slots (default: max)")
    p.add_argument("--admission-queue-s", type=float, default=10.0, help="max wait in the admission queue")
    p.add_argument("--event-log-maxlen", type=int, default=4096, help="events kept per session for replay")
    p.add_argument(
        "--audio-retention-s",
        type=float,
        default=10.0,
        help="seconds of item audio a conversation keeps (newest items; older ones keep transcripts)",
    )
    p.add_argument(
        "--audio-spool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep retained audio that no prompt needs in files under --data-dir, not in memory",
    )
    p.add_argument("--max-generating", type=int, default=None, help="responses at once (default: pipeline)")
    p.add_argument("--turn-queue-s", type=float, default=2.0, help="how long a turn waits for a slot")
    # abuse limits (docs/sessions.md "Limits")
    p.add_argument(
        "--max-conversation-bytes", type=int, default=8 * 1024 * 1024, help="text of a session's items"
    )
    p.add_argument(
        "--max-instructions-bytes", type=int, default=512 * 1024, help="session/response instructions"
    )
    p.add_argument(
        "--max-input-audio-s", type=float, default=300.0, help="uncommitted input audio per session"
    )
    p.add_argument(
        "--outbox-max-bytes", type=int, default=8 * 1024 * 1024, help="unsent events per connection"
    )
    p.add_argument(
        "--event-log-max-bytes", type=int, default=4 * 1024 * 1024, help="logged events per session"
    )
    p.add_argument(
        "--audio-replay-max-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="audio deltas a session's process keeps for a resume there",
    )
    p.add_argument(
        "--http-timeout-s", type=float, default=10.0, help="request headers/body must arrive within"
    )
    p.add_argument(
        "--keep-alive-s", type=float, default=5.0, help="idle keep-alive HTTP connections closed after"
    )
    p.add_argument("--ws-ping-interval-s", type=float, default=20.0, help="WebSocket ping interval")
    p.add_argument("--ws-ping-timeout-s", type=float, default=20.0, help="WebSocket pong deadline")
    p.add_argument(
        "--ws-send-timeout-s", type=float, default=15.0, help="a full WebSocket send buffer: closed"
    )
    p.add_argument("--stun", action="append", default=[], help="STUN server URL (repeatable)")
    p.add_argument("--turn", action="append", default=[], help="TURN server URL user:pass@host (repeatable)")
    p.add_argument(
        "--edge-mode",
        action="append",
        default=[],
        metavar="FROM->TO=MODE",
        help="override an edge's mode for every request, e.g. 'talker->code2wav=full'",
    )
    p.add_argument(
        "--remote-stage",
        action="append",
        default=[],
        metavar="STAGE",
        help="run this stage on `omniduplex stage` hosts only, found through --redis-url (repeatable; "
        "the hosts and this server share OMNIDUPLEX_STAGE_KEY)",
    )
    p.add_argument(
        "--stage-transfer-host",
        default="127.0.0.1",
        help="IP address of this server's transfer engine, reachable by the stage hosts (private network)",
    )
    p.add_argument("--stage-pool-mb", type=int, default=256, help="this server's registered transfer pool")
    p.add_argument("--robot-pipeline", default="robot-pi0-tiny", help="policy pipeline of robot sessions")
    p.add_argument(
        "--openpi-port", type=int, default=None, help="also serve the openpi policy endpoint at ws://HOST:PORT/"
    )
    p.add_argument("--log-level", default="info")


def _run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run one request through a pipeline and write a WAV")
    p.add_argument("--pipeline", default="qwen3-omni-tiny")
    p.add_argument("--text", required=True)
    p.add_argument("--out", default="out.wav")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--max-frames", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--edge-mode",
        action="append",
        default=[],
        metavar="FROM->TO=MODE",
        help="override an edge's mode, e.g. 'talker->code2wav=full'",
    )


def _stage_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stage", help="run one pipeline stage for servers on other hosts (a stage host)")
    p.add_argument("--pipeline", required=True, help="pipeline name or YAML path (the server's)")
    p.add_argument("--stage", required=True, help="the stage this host runs")
    p.add_argument("--redis-url", required=True, help="the Redis the server finds its stage hosts in")
    p.add_argument(
        "--listen",
        default="127.0.0.1",
        metavar="ADDR[:PORT]",
        help="control address (IP literal; port 0 or none: any free one); a non-loopback address "
        "needs OMNIDUPLEX_STAGE_KEY",
    )
    p.add_argument("--advertise", default=None, help="IP the server reaches this host at (default: --listen)")
    p.add_argument("--replicas", type=int, default=None, help="engine replicas (default: the stage's)")
    p.add_argument("--pool-mb", type=int, default=256, help="registered transfer pool (bounds what it holds)")
    p.add_argument("--lease-s", type=float, default=5.0, help="registry lease; lapses without heartbeats")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="SIGTERM: max wait for its requests")
    p.add_argument("--log-level", default="info")


def _access_args(p: argparse.ArgumentParser) -> None:
    """Who may call a server or a gateway: API keys, browser origins, the admin key, and
    whether it may bind beyond loopback without keys."""
    p.add_argument("--api-keys", default=None, help="key:tenant,... (or env OMNIDUPLEX_API_KEYS)")
    p.add_argument(
        "--cors-origins",
        default=None,
        help="browser origins allowed to call the server (comma-separated, or *); default: none but "
        "the server's own, plus loopback origins while running open (no API keys)",
    )
    p.add_argument("--admin-key", default=None, help="admin API key (or env OMNIDUPLEX_ADMIN_KEY)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without API keys")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniduplex")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _run_parser(sub)
    _stage_parser(sub)
    g = sub.add_parser("gateway", help="run a stateless gateway in front of replicas")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--redis-url", required=True)
    _access_args(g)
    g.add_argument("--log-level", default="info")
    return parser


def _in_process_lm(args: argparse.Namespace) -> bool:
    """Whether `serve` will run a transformers LM responder in this process."""
    if args.responder == "echo" or args.llm_engine == "vllm":
        return False
    try:
        from runtime.spec import load_pipeline

        stages = load_pipeline(args.pipeline).stages
    except Exception:
        return False  # serve reports a bad pipeline itself
    return any(s.engine == "speech.responder" and s.options.get("responder") != "echo" for s in stages)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(args_list)
    args.argv = args_list  # `serve --workers N` starts its workers with these arguments
    if args.command == "serve":
        if _in_process_lm(args):
            # An in-process LM (the default responder) next to the other torch users (VAD,
            # transcription): OpenMP's spinning idle threads oversubscribed the cores, end of
            # speech -> first audio 9.4 s against 2.3 s with passive waits (docs/benchmarks.md).
            # Read once when torch loads, so it is set before anything imports it.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from web.commands.serve import serve

        return serve(args)
    if args.command == "run":
        from web.commands.run_once import run_once

        return run_once(args)
    if args.command == "stage":
        from web.deploy.stages import run_stage_host

        return run_stage_host(args)
    if args.command == "gateway":
        from web.gateway.app import run_gateway

        return run_gateway(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
