"""The router's KV block index against a naive model (replica → set of hashes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.kvblocks import chain
from inferplane.router.kvindex import KvIndex


def naive_longest(model: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    out = {}
    for replica, held in model.items():
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        if n:
            out[replica] = n
    return out


def test_longest_prefix_counts_leading_blocks_per_replica() -> None:
    tokens = list(range(1000))
    blocks = chain(tokens, 128)  # 7 full blocks
    index = KvIndex()
    index.store("a", blocks[:5])
    index.store("b", blocks[:2])
    index.store("c", blocks[1:])  # no first block: nothing of the prefix is usable
    assert index.longest_prefix(blocks) == {"a": 5, "b": 2}
    assert index.longest_prefix([]) == {}
    assert index.longest_prefix(chain(list(range(1, 1001)), 128)) == {}
    # An adapter's blocks are other hashes: the base model's cache does not count for it.
    assert index.longest_prefix(chain(tokens, 128, adapter="fr")) == {}


def test_remove_reset_and_drop() -> None:
    index = KvIndex()
    index.store("a", [1, 2, 3])
    index.store("b", [1, 2])
    index.remove("a", [2, 99])
    assert index.longest_prefix([1, 2, 3]) == {"a": 1, "b": 2}
    assert len(index) == 4
    index.reset("b", [7])
    assert index.holders(1) == {"a"}
    assert index.blocks("b") == 1
    index.drop("a")
    index.drop("nobody")
    assert index.longest_prefix([1, 2, 3]) == {}
    assert len(index) == 1
    assert set(index.replicas()) == {"b"}


def test_the_cap_drops_the_least_recently_stored_or_matched_hash_with_its_holders() -> None:
    index = KvIndex(max_entries=4)
    index.store("a", [1, 2])
    index.store("b", [1])  # 3 pairs
    index.longest_prefix([2])  # 2 is now more recent than 1
    index.store("a", [3])  # 4 pairs: at the cap
    assert len(index) == 4
    index.store("b", [4])  # over: hash 1 (a and b) goes
    assert index.holders(1) == frozenset()
    assert index.longest_prefix([2]) == {"a": 1}
    assert len(index) == 3
    assert index.evicted == 1
    with pytest.raises(ValueError):
        KvIndex(max_entries=0)


_replica = st.sampled_from(["r0", "r1", "r2", "r3"])
_hash = st.integers(0, 12)
_op = st.one_of(
    st.tuples(st.just("store"), _replica, st.lists(_hash, max_size=6)),
    st.tuples(st.just("remove"), _replica, st.lists(_hash, max_size=6)),
    st.tuples(st.just("reset"), _replica, st.lists(_hash, max_size=6)),
    st.tuples(st.just("drop"), _replica, st.just([])),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=40), query=st.lists(_hash, max_size=8))
def test_matches_a_naive_model_without_the_cap(ops: list, query: list[int]) -> None:
    index = KvIndex()
    model: dict[str, set[int]] = {}
    for op, replica, hashes in ops:
        held = model.setdefault(replica, set())
        if op == "store":
            index.store(replica, hashes)
            held.update(hashes)
        elif op == "remove":
            index.remove(replica, hashes)
            held.difference_update(hashes)
        elif op == "reset":
            index.reset(replica, hashes)
            held.clear()
            held.update(hashes)
        else:
            index.drop(replica)
            held.clear()
    assert index.longest_prefix(query) == naive_longest(model, query)
    assert len(index) == sum(len(v) for v in model.values())
    for replica, held in model.items():
        assert index.blocks(replica) == len(held)
    for h in range(13):
        assert index.holders(h) == {r for r, held in model.items() if h in held}


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=40), cap=st.integers(1, 6))
def test_with_the_cap_the_index_stays_bounded_and_never_invents_a_block(
    ops: list, cap: int
) -> None:
    index = KvIndex(max_entries=cap)
    model: dict[str, set[int]] = {}
    for op, replica, hashes in ops:
        held = model.setdefault(replica, set())
        getattr(index, op)(replica, *([hashes] if op != "drop" else []))
        if op == "store":
            held.update(hashes)
        elif op == "remove":
            held.difference_update(hashes)
        elif op == "reset":
            held.clear()
            held.update(hashes)
        else:
            held.clear()
        assert len(index) <= cap
        # Whatever the index still says is true (evictions only forget).
        for h in range(13):
            assert index.holders(h) <= {r for r, held in model.items() if h in held}
        assert len(index) == sum(index.blocks(r) for r in model)
