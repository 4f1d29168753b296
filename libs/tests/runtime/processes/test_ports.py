"""Ports for the local stack and tests: chosen where outgoing connections never land."""

from __future__ import annotations

import socket

from inferplane.runtime.processes.ports import (
    LOWEST_PORT,
    ephemeral_range,
    free_port,
    free_port_run,
)


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    """A port handed out is bindable and lies below the kernel's ephemeral range, so no
    outgoing connection (whose local port the kernel draws from that range) can take it
    between the choice and the bind: an e2e run once lost Envoy's port that way."""
    low, _high = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert LOWEST_PORT <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    base = free_port_run(5)
    assert base >= LOWEST_PORT and base + 5 <= low


def test_a_run_skips_ports_in_use() -> None:
    """Every port of a run is free: one that something listens on is never part of it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        for _ in range(50):
            base = free_port_run(3)
            assert busy not in range(base, base + 3)
