"""`precise_prefix` with a hand-fed KV index and engine states (no replica, no stream)."""

from __future__ import annotations

import dataclasses

from inferplane.kvblocks import chain
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.kvindex import KvIndex
from inferplane.router.policies import PrecisePrefix, default_registry

from .fakes import endpoints, replica_set, set_load

BLOCK = 128
TOKENS = list(range(10, 10 + 16 * BLOCK))  # a 2,048-token prompt: 16 blocks
HASHES = tuple(chain(TOKENS, BLOCK))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(tokens: list[int] = TOKENS, **kw: object) -> RequestFeatures:
    base = RequestFeatures(
        prefix_blocks=(1, 2, 3),
        root=42,
        prompt_tokens=len(tokens),
        kv_hashes=tuple(chain(tokens, BLOCK)),
        kv_block_size=BLOCK,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def world(n: int = 3, events: bool = True, cap: int = 1 << 20):  # type: ignore[no-untyped-def]
    clock = Clock()
    states = EngineStates(clock)
    for i in range(n):
        states.put(
            EngineState(
                f"r{i}",
                block_size=BLOCK,
                total_kv_blocks=1000,
                free_kv_blocks=1000,
                kv_events=events,
            )
        )
    index = KvIndex()
    s = replica_set(endpoints(n), cap=cap)
    return clock, states, index, s, PrecisePrefix(states, index)


def test_prefers_the_replica_with_the_longest_cached_prefix() -> None:
    _, _, index, s, policy = world()
    index.store("r0", HASHES[:4])
    index.store("r2", HASHES[:12])
    index.store("r1", HASHES[:12][::-1][:6])  # the prompt's later blocks only: unusable
    assert policy.cached_blocks(s, request()) == {0: 4, 2: 12}
    assert policy.choose(s, request()) == 2
    assert policy.precise == 1 and policy.fallen_back == 0


def loads(s, *values: int) -> None:  # type: ignore[no-untyped-def]
    for i, load in enumerate(values):
        set_load(s, i, load)


def usage(states: EngineStates, replica: str, share: float) -> None:
    free = round(1000 * (1 - share))
    states.put(
        EngineState(
            replica, block_size=BLOCK, total_kv_blocks=1000, free_kv_blocks=free, kv_events=True
        )
    )


def test_a_whole_cached_prompt_beats_an_idle_replica_a_short_one_does_not() -> None:
    # 3 x prefix share + 2 x free KV + 2 / (1 + queue).
    _, _, index, s, policy = world(4)
    loads(s, 2, 2, 0, 2)  # bounded-load cap 3; r2 idle, the least loaded
    index.store("r0", HASHES)
    assert policy.choose(s, request()) == 0  # 3 + 2 + 2/3 against r2's 0 + 2 + 2
    index.reset("r0", HASHES[:4])
    assert policy.choose(s, request()) == 2  # 0.75 + 2 + 2/3 against 4: load wins


def test_a_session_stays_with_its_history_when_a_second_one_runs_there() -> None:
    # bench/kv_routing.py's failure with llm-d's min-max queue score: r0 holds 15 of the 16
    # blocks and runs one other request holding 45 % of its KV; r2 is idle. Min-max made r0's
    # queue score 0 (2.81 + 1.1 + 0 < r2's 4) and the session moved, recomputing its history.
    _, states, index, s, policy = world(3)
    index.store("r0", HASHES[:15])
    loads(s, 1, 1, 0)
    usage(states, "r0", 0.45)
    assert policy.choose(s, request()) == 0  # 2.81 + 1.1 + 2/2 against 4


def test_load_breaks_ties_between_holders_and_kv_usage_counts() -> None:
    _, states, index, s, policy = world(4)
    index.store("r0", HASHES)
    index.store("r1", HASHES)
    loads(s, 2, 1, 2, 2)
    assert policy.choose(s, request()) == 1  # same prefix: the shorter queue
    loads(s, 1, 1, 2, 2)
    usage(states, "r1", 0.9)
    assert policy.choose(s, request()) == 0  # r1's KV is nearly full
    usage(states, "r1", 0.0)
    usage(states, "r0", 0.9)
    assert policy.choose(s, request()) == 1
    # The engine's own queue counts (requests from other routers), not only this router's.
    usage(states, "r0", 0.0)
    states.put(
        EngineState(
            "r0",
            block_size=BLOCK,
            total_kv_blocks=1000,
            free_kv_blocks=1000,
            kv_events=True,
            waiting_requests=6,
        )
    )
    assert policy.choose(s, request()) == 1


def test_past_the_bounded_load_cap_a_holder_is_not_a_candidate() -> None:
    _, _, index, s, policy = world(4)
    index.store("r0", HASHES)
    loads(s, 4, 2, 2, 2)  # cap ceil(1.25 x 11 / 4) = 4: r0 is at it
    assert s.in_flight[0] >= s.bound(1.25)
    assert policy.cached_blocks(s, request()) == {0: 16}
    chosen = policy.choose(s, request())
    assert chosen not in (None, 0)
    assert policy.fallen_back == 1  # the approximate table spilled it


def running(states: EngineStates, replica: str, n: int, waiting: int = 0) -> None:
    states.put(
        EngineState(
            replica,
            block_size=BLOCK,
            total_kv_blocks=1000,
            free_kv_blocks=1000,
            running_requests=n,
            waiting_requests=waiting,
            kv_events=True,
        )
    )


def test_at_low_load_a_holder_batching_another_request_keeps_the_session() -> None:
    # bench/kv_routing.py: one request in flight anywhere makes the cap ceil(1.25 x 2 / 3) = 1,
    # so r0, holding the whole prompt and running one other session's request, was skipped and
    # the session recomputed its history on an idle replica.
    _, states, index, s, policy = world(3)
    index.store("r0", HASHES)
    loads(s, 1, 0, 0)
    assert s.in_flight[0] >= s.bound(1.25)
    running(states, "r0", 1)
    assert policy.choose(s, request()) == 0
    assert policy.fallen_back == 0


def test_a_holder_at_the_cap_that_queues_or_lags_its_state_spills() -> None:
    _, states, index, s, policy = world(3)
    index.store("r0", HASHES)
    loads(s, 1, 0, 0)
    running(states, "r0", 1, waiting=1)  # the engine queues: the cap holds
    assert policy.choose(s, request()) != 0
    loads(s, 2, 0, 0)
    running(states, "r0", 1)  # a request sent since the state: the cap holds
    assert policy.choose(s, request()) != 0


def test_never_picks_a_replica_that_cannot_take_the_request() -> None:
    _, _, index, s, policy = world(cap=2)
    index.store("r1", HASHES)
    set_load(s, 1, 2)  # at its cap
    chosen = policy.choose(s, request())
    assert chosen is not None and chosen != 1 and s.can_take(chosen)
    for i in range(3):
        set_load(s, i, 2)
    assert policy.choose(s, request()) is None


def test_falls_back_to_the_approximate_table_when_events_stop() -> None:
    clock, states, index, s, policy = world()
    index.store("r2", HASHES)
    first = request()
    assert policy.choose(s, first) == 2
    # The approximate table was told: with no events it sends the same prefix to r2.
    clock.now += 60  # every state is stale now (the streams stopped)
    assert policy.cached_blocks(s, first) == {}
    assert policy.choose(s, first) == 2
    assert policy.fallen_back == 1
    # A replica whose stream says kv_events off is not trusted either.
    clock.now += 1
    for i in range(3):
        states.put(EngineState(f"r{i}", block_size=BLOCK, kv_events=False))
    assert policy.cached_blocks(s, first) == {}
    # Without hashes (the route has no tokenizer) the decision is the approximate one.
    approx = PrecisePrefix(states, index)
    assert approx.choose(s, dataclasses.replace(first, kv_hashes=())) is not None
    assert approx.precise == 0 and approx.fallen_back == 1


def test_a_new_prefix_goes_where_the_approximate_table_sends_it() -> None:
    # Nobody holds the prompt yet (its prefill may still run): the approximate table's
    # choice, so two requests of one new conversation land together.
    _, _, _, s, policy = world()
    a = policy.choose(s, request())
    b = policy.choose(s, request())
    assert a == b
    assert policy.precise == 0


def test_the_registry_names_it_and_real_features_reach_it() -> None:
    registry = default_registry(engine_states=EngineStates(Clock()), kv_index=KvIndex())
    assert "precise_prefix" in registry.names
    assert isinstance(registry.create("precise_prefix"), PrecisePrefix)
    # A router without states (no watch) still answers, by the approximate table.
    bare = default_registry().create("precise_prefix")
    s = replica_set(endpoints(2))
    assert bare.choose(s, request()) is not None
