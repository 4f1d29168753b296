"""Routing policies with small fakes: what each one promises a user of the platform."""

from __future__ import annotations

import collections
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.policies import (
    LeastLoad,
    PrefixAffinity,
    RoundRobin,
    SessionAffinity,
    default_registry,
)
from inferplane.router.policies.hashring import bounded_choice, ring_of
from inferplane.runtime import ConfigError

from .fakes import endpoints, replica_set, set_load

NONE = RequestFeatures()


def test_unknown_policy_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        default_registry().create("fastest")
    message = info.value.message
    for name in ("least_load", "prefix_affinity", "round_robin", "session_affinity"):
        assert name in message
    with pytest.raises(ConfigError):
        default_registry(default="nope")


def test_round_robin_cycles_and_skips_replicas_that_cannot_take_more() -> None:
    s = replica_set(endpoints(3), cap=2)
    policy = RoundRobin()
    assert [policy.choose(s, NONE) for _ in range(4)] == [0, 1, 2, 0]
    set_load(s, 1, 2)  # at its cap
    assert [policy.choose(s, NONE) for _ in range(3)] == [2, 0, 2]
    for i in range(3):
        set_load(s, i, 2)
    assert policy.choose(s, NONE) is None


def test_least_load_prefers_fewest_in_flight_then_fewest_queued_tokens() -> None:
    s = replica_set(endpoints(3))
    set_load(s, 0, 3)
    set_load(s, 1, 1)
    set_load(s, 2, 1)
    s.states[1].queued_tokens = 5000  # replica 1 still has a long prefill ahead
    s.states[1].changed(0.0)
    assert LeastLoad().choose(s, NONE) == 2


def _conversation(turns: int, tag: str) -> pb.ChatCompletionRequest:
    messages = [pb.ChatMessage(role="system")]
    messages[0].content.string_value = "You are a helpful assistant. " * 20
    for t in range(turns):
        user = pb.ChatMessage(role="user")
        user.content.string_value = f"{tag} question {t}: " + "tell me more " * 30
        messages.append(user)
        if t < turns - 1:
            answer = pb.ChatMessage(role="assistant")
            answer.content.string_value = f"answer {t} " * 40
            messages.append(answer)
    return pb.ChatCompletionRequest(model="m", messages=messages)


def test_prefix_affinity_keeps_a_multi_turn_conversation_on_one_replica() -> None:
    """Every turn of a conversation lands where its earlier turns' prefix is cached, even when
    other conversations interleave, as long as that replica is under the load bound."""
    s = replica_set(endpoints(8))
    policy = PrefixAffinity()
    extract = FeatureExtractor()
    homes: dict[str, set[int]] = collections.defaultdict(set)
    for turn in range(1, 6):
        for tag in ("alpha", "bravo", "charlie", "delta"):
            chosen = policy.choose(s, extract.chat(_conversation(turn, tag), {}))
            assert chosen is not None
            homes[tag].add(chosen)
    assert all(len(h) == 1 for h in homes.values()), homes


def test_prefix_features_are_prefix_stable_across_turns() -> None:
    extract = FeatureExtractor(block_bytes=64)
    one = extract.chat(_conversation(1, "x"), {})
    three = extract.chat(_conversation(3, "x"), {})
    assert one.prefix_blocks and three.prefix_blocks[: len(one.prefix_blocks)] == one.prefix_blocks
    assert one.root == three.root
    assert extract.chat(_conversation(1, "y"), {}).root != one.root


def test_prefix_affinity_spills_over_when_the_preferred_replica_is_over_its_bound() -> None:
    s = replica_set(endpoints(4))
    policy = PrefixAffinity(load_factor=1.25)
    features = FeatureExtractor().chat(_conversation(2, "hot"), {})
    home = policy.choose(s, features)
    assert home is not None
    set_load(s, home, 10)  # bound = ceil(1.25 * 11 / 4) = 4 < 10
    other = policy.choose(s, features)
    assert other is not None and other != home


def test_session_affinity_is_sticky_by_session_and_least_load_without_one() -> None:
    s = replica_set(endpoints(5))
    policy = SessionAffinity()
    extract = FeatureExtractor()
    request = pb.ChatCompletionRequest(model="m", messages=[pb.ChatMessage(role="user")])
    by_header = {
        policy.choose(s, extract.chat(request, {"x-session-id": "s-42"})) for _ in range(5)
    }
    assert len(by_header) == 1
    request.user = "user-7"
    by_user = {policy.choose(s, extract.chat(request, {})) for _ in range(5)}
    assert len(by_user) == 1
    set_load(s, 0, 1)
    set_load(s, 1, 1)
    set_load(s, 2, 1)
    set_load(s, 3, 1)
    request.ClearField("user")
    assert policy.choose(s, extract.chat(request, {})) == 4


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(min_value=0, max_value=2**64 - 1)),
        min_size=1,
        max_size=120,
    ),
    c=st.sampled_from([1.1, 1.25, 1.5, 2.0]),
)
def test_bounded_loads_never_put_a_replica_over_its_bound(
    n: int, ops: list[tuple[bool, int]], c: float
) -> None:
    """Whatever arrives and leaves, a chosen replica ends at most at ceil(c·(m+1)/n)
    (Mirrokni et al., SODA 2018): the bound of consistent hashing with bounded loads."""
    s = replica_set(endpoints(n))
    live: list[int] = []
    policy = PrefixAffinity(load_factor=c)
    for arrive, key in ops:
        if arrive or not live:
            bound = s.bound(c)
            chosen = policy.choose(s, RequestFeatures(root=key))
            assert chosen is not None
            set_load(s, chosen, s.in_flight[chosen] + 1)
            assert s.in_flight[chosen] <= bound
            live.append(chosen)
        else:
            gone = live.pop(key % len(live))
            set_load(s, gone, s.in_flight[gone] - 1)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=20),
    keys=st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=200),
    leaving=st.integers(min_value=0),
)
def test_only_the_keys_of_a_leaving_replica_move(n: int, keys: list[int], leaving: int) -> None:
    """Consistent hashing's promise: when a replica leaves, keys held by the others stay."""
    eps = endpoints(n)
    gone = leaving % n
    before = replica_set(eps)
    after = replica_set(tuple(e for i, e in enumerate(eps) if i != gone))
    for key in keys:
        old = before.keys[ring_of(before).first(key)]
        new = after.keys[ring_of(after).first(key)]
        if old != eps[gone].key:
            assert new == old
        # With no load, bounded choice is the plain owner.
        assert bounded_choice(before, key, 1.25) == ring_of(before).first(key)


@pytest.mark.parametrize(
    "name", ["round_robin", "least_load", "prefix_affinity", "session_affinity"]
)
def test_fallbacks_skip_the_primary_draining_and_broken_replicas_and_change_nothing(
    name: str,
) -> None:
    """The endpoint picker's fallbacks never repeat the primary, never name a draining
    replica or one whose breaker is open, and asking for them does not move the policy (the
    request goes to the primary: a round-robin cursor or a prefix table stays as it was)."""
    eps = list(endpoints(5))
    eps[1] = dataclasses.replace(eps[1], draining=True)
    s = replica_set(tuple(eps))
    for _ in range(5):  # the default threshold: its breaker opens
        s.states[2].breaker.on_failure(0.0)
    s.states[2].changed(0.0)
    policy = default_registry().create(name)
    request = FeatureExtractor(block_bytes=16).chat(_conversation(2, "x"), {"x-session-id": "s"})
    chosen = policy.choose(s, request)
    assert chosen is not None
    before = [policy.choose(s, request) for _ in range(3)]
    policy = default_registry().create(name)
    assert policy.choose(s, request) == chosen
    fallbacks = policy.fallbacks(s, request, chosen, 4)
    assert set(fallbacks) == {0, 3, 4} - {chosen}
    assert [policy.choose(s, request) for _ in range(3)] == before
