"""Network namespaces for the cross-host tests: a server namespace with a bridge, and one
namespace per stage host joined to it by a veth pair. Every address lives inside a namespace
(the test machine's own interfaces are untouched); everything is deleted afterwards."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SUBNET = "10.29.{}.{}"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class Fabric:
    server_ns: str
    server_ip: str
    hosts: dict[str, str] = field(default_factory=dict)  # namespace -> its address

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


@contextmanager
def fabric(host_count: int) -> Iterator[Fabric]:
    """``host_count`` host namespaces bridged to a server namespace (10.29.N.0/24)."""
    tag = uuid.uuid4().hex[:6]
    net = int(tag, 16) % 200 + 20
    server = f"odx{tag}s"
    created: list[str] = []
    try:
        ip("netns", "add", server)
        created.append(server)
        ip("-n", server, "link", "set", "lo", "up")
        ip("-n", server, "link", "add", "br0", "type", "bridge")
        ip("-n", server, "addr", "add", f"{SUBNET.format(net, 1)}/24", "dev", "br0")
        ip("-n", server, "link", "set", "br0", "up")
        result = Fabric(server, SUBNET.format(net, 1))
        for i in range(host_count):
            ns = f"odx{tag}h{i}"
            ip("netns", "add", ns)
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
            # the pair is made inside the host namespace, its other end moved to the server's
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}")
            ip("-n", ns, "link", "set", f"v{i}", "netns", server)
            ip("-n", ns, "addr", "add", f"{SUBNET.format(net, 2 + i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", server, "link", "set", f"v{i}", "master", "br0")
            ip("-n", server, "link", "set", f"v{i}", "up")
            result.hosts[ns] = SUBNET.format(net, 2 + i)
        yield result
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
