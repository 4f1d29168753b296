"""Hosts made of Linux network namespaces, for tests and benches that need real networking
between the stack's processes (tests/multihost, tests/regions, bench/regions.py).

One run makes a bridge namespace (`ipm-<run>-net`: a bridge and nothing else, so the machine's
firewall never sees the traffic between hosts), one namespace per host (`ipm-<run>-<name>`, its
own loopback and one veth into the bridge, address `10.77.N.2`, `.3`... in `names` order) and
the client's cable (this namespace gets `10.77.N.1`). Names carry a random run id, so a crashed
run never blocks the next. `Hosts.cut(name)` sets the host's bridge port down (the cable
pulled: its packets vanish, no reset reaches anyone); `Hosts.restore(name)` sets it up again.

Needs root and iproute2's `ip` (`namespaces_unavailable` says why not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import secrets
import shutil
import subprocess

from inferplane.localstack._config import StackHost


class NamespaceError(Exception):
    """An `ip` command failed; the message holds the command and its stderr."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.77.N.0/24 that no interface of this namespace uses."""
    used = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False
    ).stdout
    for _ in range(64):
        third = secrets.randbelow(250) + 1
        if f"inet 10.77.{third}." not in used:
            return ipaddress.IPv4Network(f"10.77.{third}.0/24")
    raise NamespaceError("no free 10.77.N.0/24 subnet")


@dataclasses.dataclass
class Hosts:
    """The namespaces of one run: `host(name)` gives a `StackHost` (namespace and address).

    `names` are the hosts, in address order (the first gets `.2`); each at most 5 characters
    (an interface name is at most 15: `ipm<run><name>`).
    """

    run: str
    subnet: ipaddress.IPv4Network
    names: tuple[str, ...]
    _made_netns: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def fresh(cls, names: tuple[str, ...]) -> Hosts:
        """A run with a random id and a free subnet (not created yet: `create`)."""
        return cls(run=secrets.token_hex(2), subnet=free_subnet(), names=names)

    @property
    def bridge_netns(self) -> str:
        return f"ipm-{self.run}-net"

    @property
    def client_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def host(self, name: str) -> StackHost:
        index = self.names.index(name)
        return StackHost(
            netns=f"ipm-{self.run}-{name}", address=str(self.subnet.network_address + 2 + index)
        )

    def _port(self, name: str) -> str:
        """The bridge-side end of host `name`'s cable (`ipm<run><name>`, ≤ 15 characters)."""
        return f"ipm{self.run}{name}"

    def create(self) -> None:
        """Builds the bridge namespace, the client's cable and one namespace per host.

        Raises: NamespaceError (the caller skips or fails on it), after removing what it made.
        """
        try:
            bridge, prefix = "br0", self.subnet.prefixlen
            self._add_netns(self.bridge_netns)
            _ip("-n", self.bridge_netns, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.bridge_netns, "link", "set", bridge, "up")
            # The client's cable: this namespace's end holds the client address.
            client = f"ipm{self.run}cli"
            _ip("link", "add", client, "type", "veth", "peer", "name", "cli", "netns",
                self.bridge_netns)  # fmt: skip
            _ip("-n", self.bridge_netns, "link", "set", "cli", "master", bridge, "up")
            _ip("addr", "add", f"{self.client_address}/{prefix}", "dev", client)
            _ip("link", "set", client, "up")
            for name in self.names:
                host = self.host(name)
                self._add_netns(host.netns)
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", self.bridge_netns, "link", "add", self._port(name), "type", "veth",
                    "peer", "name", "eth0", "netns", host.netns)  # fmt: skip
                _ip("-n", self.bridge_netns, "link", "set", self._port(name), "master", bridge)
                _ip("-n", self.bridge_netns, "link", "set", self._port(name), "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
        except BaseException:
            self.delete()
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made_netns.append(name)

    def cut(self, name: str) -> None:
        """Pulls host `name`'s cable: its bridge port goes down, its packets are dropped."""
        _ip("-n", self.bridge_netns, "link", "set", self._port(name), "down")

    def restore(self, name: str) -> None:
        """Plugs host `name`'s cable back in."""
        _ip("-n", self.bridge_netns, "link", "set", self._port(name), "up")

    def delete(self) -> None:
        """Removes every namespace this run made (their veths go with them; the client's
        cable too: deleted at once rather than when the kernel frees the bridge namespace)."""
        with contextlib.suppress(NamespaceError):
            _ip("link", "del", f"ipm{self.run}cli")
        for name in reversed(self._made_netns):
            with contextlib.suppress(NamespaceError):
                _ip("netns", "del", name)
        self._made_netns.clear()


def namespaces_unavailable() -> str:
    """Why this machine cannot make network namespaces, or "" when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as scripts/test.sh in CI"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    return ""
