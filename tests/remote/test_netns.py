"""Stages on other hosts across real network stacks: the server and Redis in one network
namespace, the talker and code2wav hosts each in a namespace of its own, joined by veth pairs
to a bridge; addresses only inside the namespaces, all deleted afterwards (needs root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from session.store.embedded import find_redis_server
from tests.remote.hosts import KEY, ROOT, StageHostProcess, start_host, tiny_pipeline
from tests.remote.netns import Fabric, fabric

pytestmark = pytest.mark.system


def in_ns(ns: str, *cmd: str, **kwargs: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMNIDUPLEX_STAGE_KEY": KEY, "OMP_NUM_THREADS": "1"}
    env["NETNS_TURNS"] = "2"
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=ROOT, env=env, text=True, **kwargs)  # type: ignore[call-overload]


def start_redis(net: Fabric) -> subprocess.Popen[str]:
    """redis-server in the server's namespace, at its bridge address (empty each time)."""
    redis = in_ns(
        net.server_ns,
        find_redis_server(),
        "--port",
        "6379",
        "--bind",
        net.server_ip,
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",  # no password: reachable only inside the namespaces this test made
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return redis


def start_server(net: Fabric, pipeline: Path, tmp_path: Path, *remote: str) -> subprocess.Popen[str]:
    stages = [arg for stage in remote for arg in ("--remote-stage", stage)]
    return in_ns(
        net.server_ns,
        sys.executable,
        "-m",
        "web.cli",
        "serve",
        "--pipeline",
        str(pipeline),
        "--redis-url",
        f"redis://{net.server_ip}:6379/0",
        *stages,
        "--stage-transfer-host",
        net.server_ip,
        "--port",
        "8000",
        "--data-dir",
        str(tmp_path / "srv"),
        "--log-level",
        "warning",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_hosts_in_namespaces_of_their_own_serve_a_session_through_a_kill_and_a_replacement(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("ip netns needs root (CI runs as root)")
    pipeline = tiny_pipeline(tmp_path / "qwen3-omni-tiny.yaml", max_frames=250)
    procs: list[subprocess.Popen[str]] = []
    hosts: list[StageHostProcess] = []
    with fabric(2) as net:
        try:
            procs.append(start_redis(net))
            url = f"redis://{net.server_ip}:6379/0"
            for (ns, address), stage in zip(net.hosts.items(), ("talker", "code2wav"), strict=True):
                hosts.append(
                    start_host(pipeline, stage, url, prefix=net.exec_prefix(ns), extra=["--listen", address])
                )
            procs.append(start_server(net, pipeline, tmp_path, "talker", "code2wav"))
            client = in_ns(
                net.server_ns,
                sys.executable,
                "-m",
                "tests.remote.netns_client",
                "http://127.0.0.1:8000",
                "talker",
                "code2wav",
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert client.stdout is not None and client.stdin is not None
            talker_ns, talker_ip = next(iter(net.hosts.items()))
            lines = []
            for line in client.stdout:  # the client's own deadline bounds this
                lines.append(line.strip())
                if line.startswith("FIRST_AUDIO") and lines.count("FIRST_AUDIO") == 1:
                    hosts[0].kill()  # kill -9 the talker's host mid-response
                elif line.startswith("TURN_DONE") and lines.count("TURN_DONE") == 1:
                    hosts.append(  # a replacement host in the same namespace
                        start_host(
                            pipeline,
                            "talker",
                            url,
                            prefix=net.exec_prefix(talker_ns),
                            extra=["--listen", talker_ip],
                        )
                    )
                    client.stdin.write("next\n")
                    client.stdin.flush()
            client.wait(60)
            assert client.returncode == 0, client.stderr.read()[-3000:] if client.stderr else ""
            out = "\n".join(lines)
            result = json.loads(out.strip().splitlines()[-1])
        finally:
            for host in hosts:
                host.kill()
            for proc in procs:
                proc.kill()
                proc.wait(10)
    first = result["turns"][0]
    assert len(result["turns"]) == 2, result
    # the talker's host was killed mid-response: that response failed naming the stage
    assert first["response"]["status"] == "failed", first
    error = first["response"]["status_details"]["error"]
    assert error["message"] == "stage_unavailable: stage talker lost its host mid-request", error
    # the replacement host in the same namespace served the next turn of the same session
    assert result.get("status") == "completed", result
    assert result["audio_bytes"] > 24_000
    remote = {row["stage"]: row for row in result["rows"] if row["address"] != "local"}
    addresses = dict(zip(("talker", "code2wav"), net.hosts.values(), strict=True))
    for stage in ("talker", "code2wav"):
        assert remote[stage]["address"].startswith(f"tcp://{addresses[stage]}:"), remote
        assert str(remote[stage]["transfer_session"]).startswith(f"{addresses[stage]}:")
        assert remote[stage]["calls"] > 0 and remote[stage]["failures"] == 0
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.server_ns not in namespaces and not any(ns in namespaces for ns in net.hosts)


def test_across_namespaces_sessions_stick_to_their_talker_another_key_is_refused_and_redis_restarts(
    tmp_path: Path,
) -> None:
    """Two talker hosts, a code2wav host and an impostor talker (another stage key), each in a
    namespace of its own; the server and Redis in theirs (tests/remote/netns_scenario.py drives
    the sessions from inside it)."""
    if os.geteuid() != 0:
        pytest.skip("ip netns needs root (CI runs as root)")
    pipeline = tiny_pipeline(tmp_path / "qwen3-omni-tiny.yaml", max_frames=120)  # ~3 s of talker work
    procs: list[subprocess.Popen[str]] = []
    hosts: list[StageHostProcess] = []
    phases: dict[str, dict] = {}
    with fabric(4) as net:
        try:
            procs.append(start_redis(net))
            url = f"redis://{net.server_ip}:6379/0"
            (ns_a, ip_a), (ns_b, ip_b), (ns_c, ip_c), (ns_x, ip_x) = net.hosts.items()
            for ns, address, stage, key in (
                (ns_a, ip_a, "talker", KEY),
                (ns_b, ip_b, "talker", KEY),
                (ns_c, ip_c, "code2wav", KEY),
                (ns_x, ip_x, "talker", "another-stage-key-9876543210"),
            ):
                hosts.append(
                    start_host(
                        pipeline, stage, url, key=key, prefix=net.exec_prefix(ns), extra=["--listen", address]
                    )
                )
            procs.append(start_server(net, pipeline, tmp_path, "talker", "code2wav"))
            client = in_ns(
                net.server_ns,
                sys.executable,
                "-m",
                "tests.remote.netns_scenario",
                "http://127.0.0.1:8000",
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert client.stdout is not None and client.stdin is not None
            for line in client.stdout:  # the client's own deadline bounds this
                if line.startswith("{"):
                    phase = json.loads(line)
                    phases[phase["phase"]] = phase
                elif line.startswith("STOP_REDIS"):
                    procs[0].kill()
                    procs[0].wait(10)
                elif line.startswith("START_REDIS"):
                    procs[0] = start_redis(net)  # empty: the hosts register again on their next beat
                else:
                    continue
                if line.startswith(("STOP_REDIS", "START_REDIS")):
                    client.stdin.write("done\n")
                    client.stdin.flush()
            client.wait(60)
            assert client.returncode == 0, client.stderr.read()[-3000:] if client.stderr else ""
        finally:
            for host in hosts:
                host.kill()
            for proc in procs:
                proc.kill()
                proc.wait(10)
    # the impostor in its own namespace was refused at the handshake and never got work
    joined = phases["joined"]["listing"]
    (refused,) = joined["refused"]
    assert "another stage key" in refused["reason"], refused
    talkers = [r["address"] for r in joined["data"] if r["stage"] == "talker"]
    for ip in (ip_a, ip_b):  # the two talkers at their namespaces' addresses; not the impostor
        assert sum(a.startswith(f"tcp://{ip}:") for a in talkers) == 1, talkers
    assert len(talkers) == 2, talkers
    assert "work call" not in hosts[3].output
    # sticky: each session's turns stay on its own talker, across two namespaces
    sticky = phases["sticky"]
    assert all(t["status"] == "completed" and t["audio_bytes"] > 24_000 for t in sticky["turns"].values()), (
        sticky
    )
    replicas = sticky["replicas"]
    assert len(replicas["a1"]) == 1 and len(replicas["b1"]) == 1 and replicas["a1"] != replicas["b1"], (
        replicas
    )
    assert replicas["b2"] == replicas["b1"] and replicas["a2"] == replicas["a1"], replicas
    # Redis restarted empty: a clear registry error meanwhile, then the hosts back and a turn served
    redis = phases["redis"]
    assert "redis unavailable" in redis["registry_error"], redis
    assert redis["turn"]["status"] == "completed" and redis["turn"]["audio_bytes"] > 24_000, redis
    assert not redis["listing"]["refused"] or all(
        "another stage key" in r["reason"] for r in redis["listing"]["refused"]
    )
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.server_ns not in namespaces and not any(ns in namespaces for ns in net.hosts)
