"""`thin`: the one gap-thinning rule of router, replica and telemetry."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inferplane.runtime.time.gaps import MAX_GAPS, thin


def test_at_most_limit_values_are_kept_as_they_are() -> None:
    assert thin([0.5, 0.25], 4) == (0.5, 0.25)
    assert thin([], 4) == ()
    assert thin(range(3)) == (0.0, 1.0, 2.0)


def test_evenly_spaced_positions_keep_the_first_and_the_last() -> None:
    assert thin(range(10), 4) == (0.0, 3.0, 6.0, 9.0)
    assert thin(range(5), 3) == (0.0, 2.0, 4.0)
    assert thin(range(10), 1) == (9.0,)
    assert thin(range(10), 0) == ()


def test_the_default_bound_is_the_records_bound() -> None:
    kept = thin([0.01 * i for i in range(1000)])
    assert len(kept) == MAX_GAPS == 128
    assert kept[0] == 0.0 and kept[-1] == 0.01 * 999


@given(st.lists(st.floats(0, 10), max_size=400), st.integers(1, 200))
def test_a_thinned_list_is_an_ordered_sub_sequence_of_bounded_length(
    values: list[float], limit: int
) -> None:
    kept = thin(values, limit)
    assert len(kept) == min(len(values), limit)
    position = 0
    for value in kept:  # each kept value appears, in order, in the input
        position = values.index(value, position) + 1
