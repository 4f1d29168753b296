"""`precise_prefix`: send a request where its prompt's prefix is actually in the KV cache.

The router follows every replica's KV events (`replica_watch.py` → `kvindex.KvIndex`: block
content hash → replicas holding it) and, for a request the router tokenized
(`RequestFeatures.kv_hashes`, `router.tokenize`), knows per replica how many leading KV
blocks of its prompt are cached. Each candidate replica gets a weighted score, the highest
wins; the weights are llm-d's precise prefix-cache profile's (`precise-prefix-cache-scorer` 3,
`kv-cache-utilization-scorer` 2, `queue-scorer` 2; llm-d/llm-d,
guides/precise-prefix-cache-aware):

    score(r) = 3 × cached_blocks(r) / prompt_blocks  +  2 × (1 − kv_usage(r))  +  2 / (1 + q(r))

- prefix: the share of the prompt's hashed blocks r holds (from the index);
- free KV: 1 − the share of r's KV blocks its running requests hold (r's state stream);
- queue: q(r) = r's engine running + waiting requests (its state), at least this router's
  own requests in flight to r (the state is up to ~50 ms old).

The queue term is 1 / (1 + q), not llm-d's min-max normalisation over the candidates: with
a few replicas min-max turns a one-request difference into the whole weight, and on
bench/kv_routing.py a session then left the replica holding its 13k-token history for an
idle one whenever a second session ran there (hit rate 0.73-0.82 against the approximate
table's 0.82). Here a replica holding ~90 % of the prompt keeps it whatever its queue (the
bounded-load cap below limits that), unless its KV cache is nearly full; one holding a third
of it loses to an idle replica. Ties: fewer in flight, then the lower index. (Dynamo's cost,
prefill blocks left + active KV blocks, was tried first: it moved sessions whenever another
session's prompt, mostly cached, was counted as prefill queued there, and hit the cache less
than least load.)

Candidates are the replicas holding at least the prompt's first block (from the index), plus
the least loaded replica (scored with nothing cached), so load overrides a short cached prefix
on a busy replica. Like `prefix_affinity`, a replica is only chosen if it can take a request
(`can_take`) and is under the bounded-load cap ceil(c·(m+1)/n) (Mirrokni, Thorup,
Zadimoghaddam, arXiv:1608.01350): a popular prefix spills to a second replica. A holder at
the cap stays a candidate while its engine batches every request this router sent it and
queues none (fresh state: `waiting_requests` 0, `running_requests` ≥ this router's in flight
to it): at low load the cap is 1 as soon as one request runs anywhere (m = 1, n = 3:
ceil(2.5/3)), which sent a session away from the replica holding its whole history because
another session's request ran there, though the engine would batch it at once
(bench/kv_routing.py: 17 % of the later turns recomputed their history). Within the state's
~50 ms a burst cannot pile up there: each decision raises the in-flight count above the
engine's last running count, and the cap applies again.

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

from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.kvindex import KvIndex
from inferplane.router.policies.prefix_affinity import PrefixAffinity
from inferplane.router.replicas import ReplicaSet

_IDS = "precise_prefix.ids"
#: The scorers' weights (prefix, free KV, queue): llm-d's precise prefix-cache profile's.
WEIGHTS = (3.0, 2.0, 2.0)


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
        weights: the scorers' weights (prefix, free KV, queue), llm-d's by default.
    """

    def __init__(
        self,
        states: EngineStates | None = None,
        index: KvIndex | None = None,
        load_factor: float = 1.25,
        weights: tuple[float, float, float] = WEIGHTS,
    ) -> None:
        self._states = states
        self._index = index if index is not None else KvIndex(1)
        self._c = load_factor
        self._wp, self._wk, self._wq = weights
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
        if not cached:
            return None
        bound = replicas.bound(self._c)
        in_flight = replicas.in_flight
        candidates = [
            i
            for i in cached
            if replicas.can_take(i) and (in_flight[i] < bound or self._batching(replicas, i))
        ]
        if not candidates:
            return None  # every holder is busy: the approximate table spills as it would
        least = replicas.least_loaded()
        if least is not None and least not in cached:
            candidates.append(least)
        blocks = len(request.kv_hashes)
        best: tuple[float, int, int] | None = None
        for i in candidates:
            prefix = cached.get(i, 0) / blocks
            free_kv = 1.0 - self._kv_usage(replicas, i)
            idle = 1.0 / (1.0 + self._queue(replicas, i))
            score = self._wp * prefix + self._wk * free_kv + self._wq * idle
            key = (-score, in_flight[i], i)
            if best is None or key < best:
                best = key
        assert best is not None
        return best[2]

    def _state(self, replicas: ReplicaSet, i: int) -> EngineState | None:
        return None if self._states is None else self._states.get(replicas.keys[i][1])

    def _batching(self, replicas: ReplicaSet, i: int) -> bool:
        """Replica i's engine runs all of this router's requests to it and queues none (its
        fresh state says so): one more joins its batch without waiting."""
        state = self._state(replicas, i)
        return (
            state is not None
            and state.waiting_requests == 0
            and replicas.in_flight[i] <= state.running_requests
        )

    def _queue(self, replicas: ReplicaSet, i: int) -> int:
        """Requests ahead on replica i: the engine's running and waiting ones, at least this
        router's own in flight (the state is up to ~50 ms old)."""
        state = self._state(replicas, i)
        engine = 0 if state is None else state.running_requests + state.waiting_requests
        return max(replicas.in_flight[i], engine)

    def _kv_usage(self, replicas: ReplicaSet, i: int) -> float:
        state = self._state(replicas, i)
        return 0.0 if state is None else state.kv_usage
