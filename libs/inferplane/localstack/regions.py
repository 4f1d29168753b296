"""Several regions, each a whole local stack, behind one global tier (issue 31; docs/regions.md).

A region here is a `Stack` of its own (orchestrator, auth, routers, telemetry, node-agents,
the region's Envoy edge) started with the region's name: its auth mints secrets homed there
(`ip-<region>.`), follows the other regions' auths for their keys and month totals
(`--region`, `--peer REGION=HOST:PORT`), and its edge answers the global tier's health checks
(`regions.REGION_READY_PATH`) and names itself in `x-inferplane-region`. The global tier is
one more Envoy (`inferplane.edge.render_global_bootstrap`), in front of the regions' edges.

What the regions share, as a real deployment would:
- the pepper (auth and every router hash secrets with it, so a key hashes alike everywhere);
- the certificate authority (`<data_dir>/pki` of each region holds a copy of one CA, and each
  region issues its own leaves from it), so the auths' calls to each other use mutual TLS;
- the internal token the auths present to each other (and the routers to their auth).

Used by tests/regions (on network namespaces) and bench/regions.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from inferplane.edge import EnvoyProcess, EnvoyStartError, GlobalTierConfig, render_global_bootstrap
from inferplane.localstack._config import EDGE_PROCESS, Progress, StackConfig, StackError, StackHost
from inferplane.localstack._launch import ensure_auth_pepper
from inferplane.localstack._process import HostedEnvoy
from inferplane.localstack._stack import Stack
from inferplane.regions import validate_region
from inferplane.runtime.security.pki import LocalCA


@dataclasses.dataclass(frozen=True, slots=True)
class RegionsConfig:
    """The regions and the global tier in front of them.

    Attributes:
        regions: region name → that region's stack (its own `data_dir`, ports and hosts);
            the first is the global tier's default region (keys whose secret names none).
        data_dir: the global tier's folder (its Envoy bootstrap and log) and the shared CA.
        internal_token: what every auth accepts from internal callers (routers, the other
            regions' auths) and presents to its peers.
        fallback: home region → the regions to fail over to, in order; absent: the other
            regions in `regions` order.
        global_host: where the global tier's Envoy runs (None: 127.0.0.1 here).
        global_port / global_admin_port: its listener and admin ports.
    """

    regions: Mapping[str, StackConfig]
    data_dir: Path
    internal_token: str
    fallback: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    global_host: StackHost | None = None
    global_port: int = 8090
    global_admin_port: int = 9911

    @property
    def global_address(self) -> str:
        return self.global_host.address if self.global_host is not None else "127.0.0.1"

    @property
    def base_url(self) -> str:
        """The global tier's OpenAI base URL."""
        return f"http://{self.global_address}:{self.global_port}/v1"

    def fallback_of(self, region: str) -> list[str]:
        if region in self.fallback:
            return list(self.fallback[region])
        return [name for name in self.regions if name != region]

    def region_config(self, name: str) -> StackConfig:
        """Region `name`'s stack configuration with the region's flags added: its auth's
        region, peers and internal token, its routers' token, its edge's region."""
        cfg = self.regions[name]
        peers: list[str] = []
        for other, other_cfg in self.regions.items():
            if other != name:
                peers += ["--peer", f"{other}={other_cfg.address('auth')}"]
        args = {key: tuple(value) for key, value in cfg.service_args.items()}
        args["auth"] = (
            *args.get("auth", ()),
            "--region",
            name,
            "--internal-token",
            self.internal_token,
            *peers,
        )
        args["router"] = (*args.get("router", ()), "--auth-internal-token", self.internal_token)
        return dataclasses.replace(cfg, service_args=args, region=name)


@dataclasses.dataclass(slots=True)
class Regions:
    """Running regions and their global tier (`running_regions`)."""

    config: RegionsConfig
    stacks: dict[str, Stack] = dataclasses.field(default_factory=dict)
    global_tier: EnvoyProcess | None = None

    @property
    def base_url(self) -> str:
        return self.config.base_url

    def start(self, progress: Progress = lambda _m: None) -> None:
        """Starts each region's stack in order, then the global tier.

        Raises:
            StackError: a region did not start (its message names the component), or the
                global tier's Envoy did not.
        """
        cfg = self.config
        for name in cfg.regions:
            validate_region(name)
        self._share_secrets()
        try:
            for name in cfg.regions:
                progress(f"region {name}: starting its stack")
                stack = Stack(cfg.region_config(name))
                self.stacks[name] = stack
                stack.start(_prefixed(progress, name))
            self._start_global(progress)
        except BaseException:
            self.stop()
            raise

    def _share_secrets(self) -> None:
        """One pepper and one CA for every region (copied before any region starts)."""
        first, *others = self.config.regions.values()
        pepper = ensure_auth_pepper(first.data_dir / "auth")
        ca = LocalCA.ensure(self.config.data_dir / "ca")
        for region in (first, *others):
            region.data_dir.mkdir(parents=True, exist_ok=True)
            auth_dir = region.data_dir / "auth"
            auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if region is not first:
                shutil.copy2(pepper, auth_dir / pepper.name)
            pki = region.pki_dir
            pki.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not (pki / ca.cert_path.name).exists():
                shutil.copy2(ca.cert_path, pki / ca.cert_path.name)
                shutil.copy2(ca.key_path, pki / ca.key_path.name)

    def _start_global(self, progress: Progress) -> None:
        cfg = self.config
        edges = {name: [_edge(stack)] for name, stack in self.stacks.items()}
        tier = GlobalTierConfig(
            regions=edges,
            fallbacks={name: cfg.fallback_of(name) for name in cfg.regions},
            default_region=next(iter(cfg.regions)),
            listen_host=cfg.global_address,
            listen_port=cfg.global_port,
            admin_host=cfg.global_address,
            admin_port=cfg.global_admin_port,
        )
        bootstrap = render_global_bootstrap(tier)
        where: dict[str, Any] = {
            "data_dir": cfg.data_dir / "global-envoy",
            "admin_url": f"http://{cfg.global_address}:{cfg.global_admin_port}",
        }
        progress(f"starting the global tier on {cfg.base_url}")
        self.global_tier = (
            EnvoyProcess(bootstrap, **where)
            if cfg.global_host is None
            else HostedEnvoy(bootstrap, host=cfg.global_host, **where)
        )
        try:
            self.global_tier.start()
        except EnvoyStartError as exc:
            raise StackError(f"global tier: {exc}") from exc
        self.wait_regions_healthy(timeout=60.0)

    def healthy_regions(self) -> set[str]:
        """The regions whose edge the global tier's health checks hold healthy now."""
        assert self.global_tier is not None
        url = self.global_tier.admin_url + "/clusters?format=json"
        with urllib.request.urlopen(url, timeout=2) as response:
            data = json.load(response)
        healthy_hosts: set[str] = set()
        for status in data.get("cluster_statuses", []):
            for host in status.get("host_statuses", []):
                health = host.get("health_status", {})
                failed = any(
                    value is True for key, value in health.items() if key != "eds_health_status"
                )
                if not failed and health.get("eds_health_status", "HEALTHY") == "HEALTHY":
                    socket = host["address"]["socket_address"]
                    healthy_hosts.add(f"{socket['address']}:{socket['port_value']}")
        return {name for name, stack in self.stacks.items() if _edge(stack) in healthy_hosts}

    def wait_regions_healthy(self, timeout: float, regions: Sequence[str] = ()) -> None:
        """Waits until the global tier holds `regions` (default: all) healthy.

        Raises:
            StackError: not within `timeout` seconds.
        """
        wanted = set(regions or self.stacks)
        deadline = time.monotonic() + timeout
        while not wanted <= self._healthy_or_none():
            if time.monotonic() > deadline:
                raise StackError(
                    f"the global tier did not hold {sorted(wanted - self.healthy_regions())} "
                    f"healthy within {timeout:.0f} s"
                )
            time.sleep(0.2)

    def _healthy_or_none(self) -> set[str]:
        with contextlib.suppress(OSError):
            return self.healthy_regions()
        return set()

    def stop(self) -> None:
        """Stops the global tier, then every region's stack (each however far it got)."""
        if self.global_tier is not None:
            with contextlib.suppress(Exception):
                self.global_tier.stop()
        for stack in reversed(list(self.stacks.values())):
            with contextlib.suppress(Exception):
                stack.stop()


def _prefixed(progress: Progress, region: str) -> Progress:
    """`progress` with each line prefixed by `[region]`."""
    return lambda line: progress(f"[{region}] {line}")


def _edge(stack: Stack) -> str:
    """`host:port` of a region's edge listener."""
    return f"{stack.config.host_address(EDGE_PROCESS)}:{stack.config.http_port}"


#: The host names of `namespace_layout`: per region `<region>ctl` and `<region>w`, then this.
GLOBAL_HOST = "glb"


def control_host(region: str) -> str:
    """The name of `region`'s control host in `namespace_layout`."""
    return f"{region}ctl"


def worker_host(region: str) -> str:
    """The name of `region`'s worker host in `namespace_layout`."""
    return f"{region}w"


def layout_host_names(regions: Sequence[str]) -> tuple[str, ...]:
    """The hosts `namespace_layout` places on, in address order (for `netns.Hosts`)."""
    return (*(h for r in regions for h in (control_host(r), worker_host(r))), GLOBAL_HOST)


def namespace_layout(
    hosts: Mapping[str, StackHost],
    regions: Sequence[str],
    root: Path,
    *,
    internal_token: str,
    fake_engine_token_delay: float,
) -> RegionsConfig:
    """Regions on separate hosts (network namespaces, `netns.Hosts`): per region a control
    host (orchestrator, auth, router, telemetry, the edge) and a worker (its node-agent, one
    kimi-tiny replica process around the fake vLLM HTTP engine, one token every
    `fake_engine_token_delay` s), the global tier on `GLOBAL_HOST`; folders under `root`.

    Args:
        hosts: host name (`layout_host_names`) → the `StackHost` it is.
    """
    stacks: dict[str, StackConfig] = {}
    for region in regions:
        control, worker = hosts[control_host(region)], hosts[worker_host(region)]
        placement = {name: control for name in ("orchestrator", "auth", "router", "telemetry")}
        placement |= {EDGE_PROCESS: control, "node_agent": worker}
        stacks[region] = StackConfig(
            data_dir=root / region,
            hosts=placement,
            nodes=(worker_host(region),),
            transport="http-completions",
            fake_engine_token_delay=fake_engine_token_delay,
            max_model_len=2048,
            startup_timeout_seconds=600,
            service_args={
                # Telemetry takes the edge's overhead log and the routers' records from
                # other hosts by this token.
                "orchestrator": ("--edge-telemetry-internal-token", internal_token),
                "telemetry": ("--internal-token", internal_token),
            },
        )
    return RegionsConfig(
        regions=stacks,
        data_dir=root / "global",
        internal_token=internal_token,
        global_host=hosts[GLOBAL_HOST],
    )


@contextlib.contextmanager
def running_regions(
    config: RegionsConfig, progress: Progress = lambda _m: None
) -> Iterator[Regions]:
    """Starts the regions and the global tier; stops them when the block ends, however."""
    regions = Regions(config)
    regions.start(progress)
    try:
        yield regions
    finally:
        regions.stop()
