"""Bind-address checks for the open (keyless) mode. Credentials live in `session.identity`."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
