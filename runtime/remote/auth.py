"""The control plane's authentication: ZeroMQ CURVE with keys derived from one shared secret.

Every stage host and every server that uses them is given the same ``OMNIDUPLEX_STAGE_KEY``.
From it both sides derive two CURVE key pairs (one for hosts, one for clients). A client pins
the host's public key, so a host started with another key fails the handshake and never gets
work; a host's ZAP handler accepts only the client public key of its own secret, so nobody
without the key can send it a message. Messages are encrypted and authenticated per frame.
Without a key the control plane runs unauthenticated, which a stage host allows only on a
loopback address (:func:`check_listen`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

KEY_ENV = "OMNIDUPLEX_STAGE_KEY"
MIN_KEY_CHARS = 16


class StageKeyError(ValueError):
    """A key that is too short, or a non-loopback listen address without one."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    host_public: bytes
    host_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, key: str) -> CurveKeys:
        if len(key) < MIN_KEY_CHARS:
            raise StageKeyError(f"{KEY_ENV} must have at least {MIN_KEY_CHARS} characters")

        def pair(role: bytes) -> tuple[bytes, bytes]:
            secret = z85.encode(hashlib.sha256(b"omniduplex-stage-" + role + b"\0" + key.encode()).digest())
            return zmq.curve_public(secret), secret

        host_public, host_secret = pair(b"host")
        client_public, client_secret = pair(b"client")
        return cls(host_public, host_secret, client_public, client_secret)


def stage_key(explicit: str | None = None) -> str | None:
    """The shared key: an explicit one, else the environment's; None when neither is set."""
    key = explicit if explicit is not None else os.environ.get(KEY_ENV)
    return key or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(host: str, key: str | None) -> None:
    if key is None and not is_loopback(host):
        raise StageKeyError(
            f"refusing to listen on {host} without {KEY_ENV}: anyone who reaches the port could "
            "run work on this host; set the key (the same on the server) or listen on loopback"
        )


class _ClientKeyCheck:
    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


def secure_server(ctx: zmq.Context[Any], socket: zmq.Socket[Any], keys: CurveKeys | None) -> Any:
    """Make ``socket`` a CURVE server that admits only the key's clients; returns the ZAP
    authenticator (stop it on close), or None without a key."""
    if keys is None:
        return None
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_ClientKeyCheck(keys.client_public))
    socket.curve_secretkey = keys.host_secret
    socket.curve_publickey = keys.host_public
    socket.curve_server = True
    return auth


def secure_client(socket: zmq.Socket[Any], keys: CurveKeys | None) -> None:
    if keys is None:
        return
    socket.curve_serverkey = keys.host_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret
