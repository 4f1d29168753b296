"""Free loopback ports for the node-agent's engines, the local stack and tests.

Ports are drawn at random from below the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), not by binding port 0:
port 0 hands out an ephemeral port, exactly the kind the kernel also gives every outgoing
connection, so between choosing a port and a server binding it, a client socket of any process
could take it (an e2e run failed on that: Envoy's `cannot bind '127.0.0.1:44207': Address
already in use`). Below that range only a process that binds a fixed port can collide.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 10000  # below: well-known and commonly configured service ports
_EPHEMERAL_DEFAULT = (32768, 60999)
_ATTEMPTS = 200


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (inclusive)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on `host:port` right now (it can be bound)."""
    return _is_free(port, host)


def _is_free(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports on `host` that nothing listens on right now.

    Another process may still bind one before the caller does; callers that can bind port 0
    themselves should do that instead.
    """
    low, _high = ephemeral_range()
    top = low - count  # the run ends below the ephemeral range
    rng = random.SystemRandom()
    if top > LOWEST_PORT:
        for _ in range(_ATTEMPTS):
            base = rng.randrange(LOWEST_PORT, top)
            if all(_is_free(base + i, host) for i in range(count)):
                return base
    while True:  # no room below the ephemeral range (an unusual kernel setting): the old way
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            base = int(sock.getsockname()[1])
        if base + count < 65536 and all(_is_free(base + i, host) for i in range(count)):
            return base


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (see `free_port_run`)."""
    return free_port_run(1, host)
