"""API keys, tenants and the credentials a request carries (headers or browser subprotocols)."""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
RESUME_SUBPROTOCOL_PREFIX = "omni-resume-token."


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """API key → tenant. Empty means the server runs open (loopback only)."""

    tenants: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str | None) -> ApiKeys:
        """`key1:tenantA,key2:tenantB` (a key without `:tenant` is its own tenant `default`)."""
        spec = spec if spec is not None else os.environ.get("OMNIDUPLEX_API_KEYS", "")
        tenants: dict[str, str] = {}
        for raw in spec.split(","):
            raw = raw.strip()
            if not raw:
                continue
            key, _, tenant = raw.partition(":")
            tenants[key.strip()] = tenant.strip() or "default"
        return cls(tenants)

    @property
    def open(self) -> bool:
        return not self.tenants

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant of ``key`` (constant-time compare), or None."""
        if self.open:
            return "default"
        if not key:
            return None
        found: str | None = None
        for known, tenant in self.tenants.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def subprotocol_value(subprotocols: Iterable[str], prefix: str) -> str | None:
    for proto in subprotocols:
        if proto.startswith(prefix):
            return proto[len(prefix):]
    return None


def is_loopback_host(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
