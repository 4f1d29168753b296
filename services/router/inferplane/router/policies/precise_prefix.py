"""`precise_prefix`: send a request where its prompt's prefix is actually in the KV cache.

The router follows every replica's KV events (`replica_watch.py` → `kvindex.KvIndex`: block
content hash → replicas holding it) and, for a request the router tokenized
(`RequestFeatures.kv_hashes`, `router.tokenize`), knows per replica how many leading KV
blocks of its prompt are cached. Each candidate replica gets a cost, lower is better; the
rule is Dynamo's KV router's (`KvScheduler`'s default worker selector:
`overlap_score_weight × prefill blocks + active blocks`, ai-dynamo/dynamo, docs "KV Cache
Routing"):

    cost(r) = w × (queued_tokens(r) + prompt_tokens − cached_blocks(r) × block_size) / block_size
              + (total_kv_blocks(r) − free_kv_blocks(r))

- prefill: the prompt tokens r would still have to compute for this request, plus the prompt
  tokens this router already sent r that wait for their first token (`ReplicaState.
  queued_tokens`): the work ahead of this request's first token;
- active blocks: the KV blocks r's running requests hold now (its decode load, from r's
  state stream); `w` (`prefill_weight`, 1.0 as Dynamo's default) trades one for the other.

Candidates are the replicas holding at least the prompt's first block (from the index), plus
the least loaded replica (scored with nothing cached), so load overrides a cached prefix when
the cached replica is far busier. Like `prefix_affinity`, a replica is only chosen if it can
take a request (`can_take`) and is under the bounded-load cap ceil(c·(m+1)/n) (Mirrokni,
Thorup, Zadimoghaddam, arXiv:1608.01350): a popular prefix spills to a second replica.

Fallback to the approximate table (one `PrefixAffinity` inside, told of every decision so it
stays current): the request has no `kv_hashes` (the route has no tokenizer, it is still
loading, or the request is not a prompt), or no replica of the deployment that can take it
holds the first block with a fresh state whose `kv_events` is on (`EngineStates.get` is None
for a replica whose stream stopped; the watch has dropped its blocks too). The approximate
table also covers a prompt sent moments ago whose prefill is still running: its blocks are
not stored (nor announced) yet, but the table remembers where it went.

`choose` reads the index and the states only: no I/O, O(blocks × holders).
"""

from __future__ import annotations

from inferplane.router.engine_state import EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.kvindex import KvIndex
from inferplane.router.policies.prefix_affinity import PrefixAffinity
from inferplane.router.replicas import ReplicaSet

_IDS = "precise_prefix.ids"


def _by_id(replicas: ReplicaSet) -> dict[str, int]:
    """Replica id → index in `replicas` (cached per set: it depends on membership only)."""
    ids = replicas.cache.get(_IDS)
    if ids is None:
        ids = replicas.cache[_IDS] = {k[1]: i for i, k in enumerate(replicas.keys)}
    return ids


class PrecisePrefix:
    """Prefix-cache-aware routing from the replicas' KV events (module docstring).

    Args:
        states: the replicas' engine states (`replica_watch.py` fills them); None: none known,
            every decision falls back.
        index: the KV block index (`replica_watch.py` fills it); None: empty.
        load_factor: c of the bounded-load cap (> 1).
        prefill_weight: w, prefill blocks against active blocks (>= 0).
    """

    def __init__(
        self,
        states: EngineStates | None = None,
        index: KvIndex | None = None,
        load_factor: float = 1.25,
        prefill_weight: float = 1.0,
    ) -> None:
        self._states = states
        self._index = index if index is not None else KvIndex(1)
        self._c = load_factor
        self._w = prefill_weight
        self.approx = PrefixAffinity(load_factor)
        self.precise = 0
        self.fallen_back = 0

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        chosen = self._precise(replicas, request) if request.kv_hashes else None
        if chosen is None:
            self.fallen_back += 1
            return self.approx.choose(replicas, request)
        self.precise += 1
        self.approx.remember(request, replicas.keys[chosen])
        return chosen

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """The approximate policy's order (ring order from the conversation root)."""
        return self.approx.fallbacks(replicas, request, chosen, n)

    def cached_blocks(self, replicas: ReplicaSet, request: RequestFeatures) -> dict[int, int]:
        """Replica index → leading blocks of the request's prompt it holds (replicas of this
        set with a fresh state and KV events; others absent)."""
        states = self._states
        if states is None or not request.kv_hashes:
            return {}
        ids = _by_id(replicas)
        out: dict[int, int] = {}
        for rid, depth in self._index.longest_prefix(request.kv_hashes).items():
            i = ids.get(rid)
            if i is None:
                continue
            state = states.get(rid)
            if state is not None and state.kv_events:
                out[i] = depth
        return out

    def _precise(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        cached = self.cached_blocks(replicas, request)
        if not cached or request.kv_block_size <= 0:
            return None
        bound = replicas.bound(self._c)
        in_flight = replicas.in_flight
        block = request.kv_block_size
        best: tuple[float, int, int] | None = None
        for i, depth in cached.items():
            if not replicas.can_take(i) or in_flight[i] >= bound:
                continue
            key = (self._cost(replicas, i, request, depth * block), in_flight[i], i)
            if best is None or key < best:
                best = key
        if best is None:
            return None  # every holder is busy: the approximate table spills as it would
        least = replicas.least_loaded()
        if least is not None and least not in cached:
            key = (self._cost(replicas, least, request, 0), in_flight[least], least)
            if key < best:
                best = key
        return best[2]

    def _cost(self, replicas: ReplicaSet, i: int, request: RequestFeatures, cached: int) -> float:
        block = request.kv_block_size
        prefill = replicas.states[i].queued_tokens + max(0, request.prompt_tokens - cached)
        active = 0
        if self._states is not None:
            state = self._states.get(replicas.keys[i][1])
            if state is not None:
                active = max(0, state.total_kv_blocks - state.free_kv_blocks)
        return self._w * prefill / block + active
