"""Admission by predicted KV fit (`kvfit`), on a fake clock with hand-fed `EngineStates`: the
sizing rule, the fit rule (reservations since the last report, released ones), unknown
capacity (slots only), a request too big for any replica, and the admission queue (a request
that does not fit waits, is granted when a report shows room, else 429 `kv_cache_full`)."""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf.struct_pb2 import Value

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.kvfit import KV_CACHE_FULL, KvDemand, KvFit, demand_of
from inferplane.router.policies import default_registry
from inferplane.router.routes import ModelRoute, RouteTable
from inferplane.runtime import InvalidArgumentError, ResourceExhaustedError
from inferplane.testing.clock import FakeClock

from .fakes import FakeScheduler, replica_set, route

BLOCK = 16


def state(
    replica_id: str, free: int, total: int = 100, block: int = BLOCK, running: int = 0
) -> EngineState:
    return EngineState(
        replica_id,
        block_size=block,
        total_kv_blocks=total,
        free_kv_blocks=free,
        running_requests=running,
    )


def blocks(n: int, prompt: int = 0) -> KvDemand:
    """A demand of exactly `n` blocks (`prompt` of them the prompt's)."""
    return KvDemand(prompt * BLOCK, (n - prompt) * BLOCK)


def fit(lag: float = 0.25) -> tuple[KvFit, EngineStates, FakeClock]:
    clock = FakeClock()
    engines = EngineStates(clock.monotonic, stale_after_seconds=3.0)
    return KvFit(engines, clock.monotonic, report_lag_seconds=lag), engines, clock


# -- sizing ----------------------------------------------------------------------------------


def test_sizing_prompt_plus_the_output_limit_the_replica_honours() -> None:
    r = ModelRoute("m", (), max_model_len=4096)
    f = RequestFeatures(prompt_tokens=1000)
    both = pb.ChatCompletionRequest(max_tokens=50, max_completion_tokens=200)
    assert demand_of(both, f, r, default_output_tokens=512) == KvDemand(1000, 200)
    assert demand_of(
        pb.ChatCompletionRequest(max_tokens=50), f, r, default_output_tokens=512
    ) == KvDemand(1000, 50)
    # No limit: the rest of the context, capped by the default output reservation.
    assert demand_of(pb.ChatCompletionRequest(), f, r, default_output_tokens=512).tokens == 1512
    assert demand_of(pb.ChatCompletionRequest(), f, r, default_output_tokens=8192).tokens == 4096
    # A text completion without max_tokens: OpenAI's 16; an embedding: the prompt only.
    assert demand_of(pb.CompletionRequest(), f, r, default_output_tokens=512).tokens == 1016
    assert demand_of(pb.EmbeddingRequest(), f, r, default_output_tokens=512).tokens == 1000
    # Never more than the context: a larger max_tokens is the replica's context-length 400.
    huge = pb.ChatCompletionRequest(max_tokens=10_000_000)
    assert demand_of(huge, f, r, default_output_tokens=512) == KvDemand(1000, 3096)
    assert demand_of(huge, RequestFeatures(prompt_tokens=9000), r, default_output_tokens=512) == (
        KvDemand(4096, 0)
    )
    # An unknown max_model_len: the default; audio (an HttpBody) is not sized.
    unknown = ModelRoute("m", ())
    assert demand_of(pb.ChatCompletionRequest(), f, unknown, default_output_tokens=512).tokens == (
        1512
    )
    assert demand_of(object(), f, r, default_output_tokens=512) is None


def test_the_prompt_count_is_exact_when_the_router_tokenized_it() -> None:
    r = ModelRoute("m", (), max_model_len=4096)
    estimated = demand_of(
        pb.ChatCompletionRequest(max_tokens=1),
        RequestFeatures(prompt_tokens=10),
        r,
        default_output_tokens=1,
    )
    tokenized = RequestFeatures(prompt_tokens=12, kv_hashes=(1,), kv_block_size=128)
    exact = demand_of(pb.ChatCompletionRequest(max_tokens=1), tokenized, r, default_output_tokens=1)
    assert estimated is not None and not estimated.exact
    assert exact is not None and exact.exact and exact.prompt_tokens == 12
    # The estimate (bytes / 4) recounted at a small vocabulary's 2 bytes per token; never an
    # exact count.
    small = {"default_output_tokens": 1, "bytes_per_token": 2.0}
    request = pb.ChatCompletionRequest(max_tokens=1)
    recounted = demand_of(request, RequestFeatures(prompt_tokens=10), r, **small)
    assert recounted is not None and recounted.prompt_tokens == 20
    assert demand_of(request, tokenized, r, **small) == exact


# -- the fit rule ----------------------------------------------------------------------------


def test_fits_within_the_reported_free_blocks_never_beyond_the_total() -> None:
    kv, engines, _ = fit()
    engines.put(state("r0", free=10, total=20))
    assert kv.fits("r0", blocks(10))
    assert not kv.fits("r0", blocks(11))
    engines.put(state("r0", free=30, total=20))  # a nonsense report: the total still bounds
    assert not kv.fits("r0", blocks(21))


def test_unknown_capacity_fits_by_slots_only() -> None:
    kv, engines, clock = fit()
    assert kv.fits("r0", blocks(10_000))  # never reported
    engines.put(state("r0", free=0, total=0))  # capacity not known yet
    assert kv.fits("r0", blocks(10_000))
    engines.put(state("r0", free=1))
    assert not kv.fits("r0", blocks(2))
    clock.advance(3.1)  # the report went stale: unknown again
    assert kv.fits("r0", blocks(2)) and kv.free_blocks("r0") is None


def test_reservations_since_the_report_count_whole_then_only_their_output() -> None:
    kv, engines, clock = fit(lag=0.25)
    engines.put(state("r0", free=50))
    first = kv.reserve("r0", blocks(20, prompt=15))  # admitted after the report: all 20
    assert kv.free_blocks("r0") == 30
    assert kv.fits("r0", blocks(30)) and not kv.fits("r0", blocks(31))
    clock.advance(0.1)
    engines.put(state("r0", free=35, running=1))  # admitted 0.1 s before: within the lag
    assert kv.free_blocks("r0") == 15
    clock.advance(0.3)
    engines.put(state("r0", free=34, running=1))  # reflects its prompt: its output only
    assert kv.free_blocks("r0") == 34 - 5
    second = kv.reserve("r0", blocks(10, prompt=8))
    assert kv.free_blocks("r0") == 34 - 5 - 10
    clock.advance(0.3)
    engines.put(state("r0", free=34, running=1))  # the second is not running yet: whole
    assert kv.free_blocks("r0") == 34 - 5 - 10
    engines.put(state("r0", free=26, running=2))  # now it is: its output only
    assert kv.free_blocks("r0") == 26 - 5 - 2
    first.release()
    assert kv.free_blocks("r0") == 26 - 10 + 8  # a freed request releases its reservation
    first.release()  # idempotent
    second.release()
    assert kv.free_blocks("r0") == 26


def test_a_request_the_engine_does_not_run_yet_keeps_its_whole_reservation() -> None:
    """On a loaded machine a request may not have reached the engine long after its
    admission: a report showing nothing running credits no prompt."""
    kv, engines, clock = fit(lag=0.25)
    engines.put(state("r0", free=16, total=17))
    kv.reserve("r0", blocks(9, prompt=6))
    clock.advance(1.0)
    engines.put(state("r0", free=16, total=17, running=0))
    assert kv.free_blocks("r0") == 16 - 9
    assert not kv.fits("r0", blocks(9))


def test_a_new_block_size_recounts_the_reservations() -> None:
    kv, engines, _ = fit()
    kv.reserve("r0", KvDemand(100, 28))  # admitted while capacity was unknown: 128 tokens
    engines.put(state("r0", free=100, block=16))
    assert kv.free_blocks("r0") == 100 - 8
    engines.put(state("r0", free=100, block=128))
    assert kv.free_blocks("r0") == 100 - 1


def test_place_takes_the_choice_else_a_fitting_candidate_else_none() -> None:
    kv, engines, _ = fit()
    s = replica_set(route(3).endpoints)
    for i, free in enumerate((5, 50, 8)):
        engines.put(state(f"r{i}", free=free))
    demand = blocks(8)
    assert kv.place(s, 1, lambda n: [0, 2], demand, frozenset()) == 1
    assert kv.place(s, 0, lambda n: [2, 1], demand, frozenset()) == 2  # first that fits
    assert not demand.refused
    assert kv.place(s, 0, lambda n: [2, 1], demand, frozenset({s.keys[2]})) == 1  # excluded
    assert kv.place(s, 0, lambda n: [0], blocks(60), frozenset()) is None
    assert KvDemand(0, 0).blocks(BLOCK) == 0


# -- admission -------------------------------------------------------------------------------

KV_ROUTE = route(1, cap=8)


def kv_admission(
    table: RouteTable, queue_timeout: float = 5.0
) -> tuple[Admission, KvFit, EngineStates, FakeClock, FakeScheduler]:
    clock = FakeClock()
    scheduler = FakeScheduler(clock)
    engines = EngineStates(clock.monotonic, stale_after_seconds=3.0)
    kv = KvFit(engines, clock.monotonic)
    a = Admission(
        default_registry(),
        AdmissionSettings(queue_timeout_seconds=queue_timeout, retry_after_seconds=2),
        clock,
        scheduler,
        kv,
    )
    a.apply(table)
    engines.subscribe(a.engine_changed)  # as the app wires it
    return a, kv, engines, clock, scheduler


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_request_that_does_not_fit_waits_and_is_granted_when_a_report_shows_room() -> None:
    async def scenario() -> None:
        a, kv, engines, _, scheduler = kv_admission(RouteTable.of([KV_ROUTE]))
        engines.put(state("r0", free=30))
        one = await a.acquire(KV_ROUTE, RequestFeatures(), demand=blocks(20))
        waiting = asyncio.ensure_future(a.acquire(KV_ROUTE, RequestFeatures(), demand=blocks(20)))
        await _settle()
        assert not waiting.done() and a.queue_length("d") == 1  # a slot is free, KV is not
        scheduler.advance(1.0)
        engines.put(state("r0", free=12))  # reflects the first; its 20 output blocks may come
        a.engine_changed("r0")
        await _settle()
        assert not waiting.done()
        one.release()  # the reservation goes with the slot, but the report still counts it
        await _settle()
        assert not waiting.done()
        engines.put(state("r0", free=30))
        a.engine_changed("r0")
        await _settle()
        two = waiting.result()
        assert kv.free_blocks("r0") == 10
        two.release()
        assert kv.free_blocks("r0") == 30

    asyncio.run(scenario())


def test_no_room_within_the_queue_timeout_is_a_429_kv_cache_full() -> None:
    async def scenario() -> None:
        a, _, engines, _, scheduler = kv_admission(RouteTable.of([KV_ROUTE]), queue_timeout=3)
        engines.put(state("r0", free=10))
        waiting = asyncio.ensure_future(a.acquire(KV_ROUTE, RequestFeatures(), demand=blocks(11)))
        await _settle()
        for _ in range(2):  # heartbeats keep the state fresh, the room does not come
            scheduler.advance(1.5)
            engines.put(state("r0", free=10))
            a.engine_changed("r0")
        await _settle()
        error = waiting.exception()
        assert isinstance(error, ResourceExhaustedError)
        assert error.code == KV_CACHE_FULL and error.retry_after_seconds == 2
        assert a.refused("d")[KV_CACHE_FULL] == 1 and a.refused("d")["timeout"] == 0

    asyncio.run(scenario())


def test_a_full_slot_cap_still_times_out_as_model_overloaded() -> None:
    async def scenario() -> None:
        r = route(1, cap=1)
        a, _, engines, _, scheduler = kv_admission(RouteTable.of([r]), queue_timeout=1)
        engines.put(state("r0", free=100))
        held = await a.acquire(r, RequestFeatures(), demand=blocks(1))
        waiting = asyncio.ensure_future(a.acquire(r, RequestFeatures(), demand=blocks(1)))
        await _settle()
        scheduler.advance(1.0)
        await _settle()
        error = waiting.exception()
        assert isinstance(error, ResourceExhaustedError) and error.code == "model_overloaded"
        held.release()

    asyncio.run(scenario())


def test_a_request_larger_than_every_replicas_kv_cache_is_a_400_at_once() -> None:
    async def scenario() -> None:
        r = route(2, cap=8)
        a, _, engines, _, _ = kv_admission(RouteTable.of([r]))
        engines.put(state("r0", free=100, total=100))
        engines.put(state("r1", free=10, total=120))
        with pytest.raises(InvalidArgumentError) as refused:
            await a.acquire(r, RequestFeatures(), demand=blocks(121))
        assert refused.value.code == "context_length_exceeded"
        assert a.queue_length("d") == 0
        slot = await a.acquire(r, RequestFeatures(), demand=blocks(100))  # fits r0 only
        assert slot.key == r.endpoints[0].key
        slot.release()

    asyncio.run(scenario())


def test_unknown_engine_state_admits_by_slots_as_before() -> None:
    async def scenario() -> None:
        r = route(1, cap=2)
        a, _, _, _, _ = kv_admission(RouteTable.of([r]))
        first = await a.acquire(r, RequestFeatures(), demand=blocks(10**6))
        second = await a.acquire(r, RequestFeatures(), demand=blocks(10**6))
        assert a.replicas("d").total_in_flight == 2
        first.release()
        second.release()

    asyncio.run(scenario())


def test_the_policy_choice_that_does_not_fit_gives_way_to_one_that_does() -> None:
    async def scenario() -> None:
        r = route(3, cap=8)
        a, _, engines, _, _ = kv_admission(RouteTable.of([r]))
        for i, free in enumerate((4, 4, 40)):
            engines.put(state(f"r{i}", free=free))
        slots = [await a.acquire(r, RequestFeatures(), demand=blocks(10)) for _ in range(4)]
        assert {s.key for s in slots} == {r.endpoints[2].key}  # least load would spread them
        waiting = asyncio.ensure_future(a.acquire(r, RequestFeatures(), demand=blocks(10)))
        await _settle()
        assert not waiting.done()  # 40 - 4 × 10 = 0 left on r2, 4 on the others
        slots[0].release()
        await _settle()
        assert waiting.result().key == r.endpoints[2].key
        for s in slots[1:]:
            s.release()

    asyncio.run(scenario())


# -- the director: the typed request sized and sent where it fits ---------------------------


def test_the_director_sizes_the_typed_request_and_refuses_one_no_cache_holds() -> None:
    from inferplane.router.picker.codec import METHODS
    from inferplane.router.picker.director import Director, RequestFacts

    chat = METHODS["/inferplane.inference.v1.InferenceService/StreamChatCompletionEvents"]

    def facts(max_tokens: int) -> RequestFacts:
        request = pb.ChatCompletionRequest(
            model="m",
            messages=[pb.ChatMessage(role="user", content=Value(string_value="x" * 400))],
            max_completion_tokens=max_tokens,
        )
        wrapped = pb.StreamChatCompletionEventsRequest(request=request)
        return RequestFacts.of(chat, wrapped, {})

    async def scenario() -> None:
        r = route(2, cap=8)
        table = RouteTable.of([r])
        a, kv, engines, _, _ = kv_admission(table)
        director = Director(lambda: table, a, fallbacks=1)
        engines.put(state("r0", free=5, total=100))  # 80 tokens
        engines.put(state("r1", free=40, total=100))  # 640 tokens
        decision = await director.decide(facts(300))  # ~400 tokens: 25-26 blocks, only r1
        assert decision.slot.endpoint.replica_id == "r1"
        assert kv.free_blocks("r1") is not None and kv.free_blocks("r1") < 40 - 24
        decision.slot.release()
        with pytest.raises(InvalidArgumentError) as refused:  # 1,700 tokens > 100 blocks
            await director.decide(facts(1600))
        assert refused.value.code == "context_length_exceeded"

    asyncio.run(scenario())


def test_a_decision_reads_a_bounded_number_of_engine_states_at_10000_replicas() -> None:
    """No scan: the policy's choice and at most `candidates` more are checked, even when
    no replica fits (the request then waits)."""

    async def scenario() -> None:
        r = route(10_000, cap=8)
        a, kv, engines, _, _ = kv_admission(RouteTable.of([r]), queue_timeout=1)
        for i in range(10_000):
            engines.put(state(f"r{i}", free=4))
        reads = 0
        get = engines.get

        def counting(replica_id: str) -> EngineState | None:
            nonlocal reads
            reads += 1
            return get(replica_id)

        engines.get = counting  # type: ignore[method-assign]
        slot = await a.acquire(r, RequestFeatures(), demand=blocks(4))
        assert reads <= 3  # the choice fits: its state read to check (twice) and to reserve
        slot.release()
        reads = 0
        waiting = asyncio.ensure_future(a.acquire(r, RequestFeatures(), demand=blocks(5)))
        await _settle()
        assert not waiting.done()
        assert reads <= 2 * (1 + kv.candidates)  # fits() reads twice per replica at most
        waiting.cancel()

    asyncio.run(scenario())


def test_the_largest_cache_follows_the_reports_and_is_rebuilt_when_it_shrinks() -> None:
    kv, engines, _ = fit()
    s = replica_set(route(2).endpoints)
    r = route(2)
    for replica_id, total in (("r0", 100), ("r1", 120)):
        engines.put(state(replica_id, free=0, total=total))
        kv.observe("d", replica_id)
    with pytest.raises(InvalidArgumentError):
        kv.check_size(r, s, blocks(121))
    kv.check_size(r, s, blocks(120))
    engines.put(state("r1", free=0, total=90))  # restarted smaller: rebuilt from the reports
    kv.observe("d", "r1")
    kv.check_size(r, s, blocks(121))  # unknown meanwhile: never refused as too large
    engines.put(state("r0", free=0, total=100))
    kv.observe("d", "r0")
    kv.observe("d", "r1")
    with pytest.raises(InvalidArgumentError):
        kv.check_size(r, s, blocks(101))
