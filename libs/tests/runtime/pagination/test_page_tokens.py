"""Page tokens: a cursor round-trips with its filters; a token of other filters or not ours is
INVALID_ARGUMENT naming page_token."""

from __future__ import annotations

import pytest

from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.pagination.page_tokens import decode_page_token, encode_page_token


def test_a_cursor_round_trips_with_its_filters() -> None:
    token = encode_page_token({"t": "2026-11-26T00:00:00+00:00", "k": "abc"}, {"tenant": "acme"})
    assert "=" not in token and "/" not in token and "+" not in token
    assert decode_page_token(token, {"tenant": "acme"}) == {
        "t": "2026-11-26T00:00:00+00:00",
        "k": "abc",
    }
    assert decode_page_token(encode_page_token({"offset": 3})) == {"offset": 3}


@pytest.mark.parametrize("token", ["x", "e30", "not base64 !", encode_page_token({})[:-2] + "@@"])
def test_a_token_that_is_not_ours_is_refused(token: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        decode_page_token(token)
    assert info.value.param == "page_token" and "not valid" in info.value.message


def test_a_token_of_other_filters_is_refused_naming_them() -> None:
    token = encode_page_token({"after": "b"}, {"tenant": "acme", "show_inactive": False})
    with pytest.raises(InvalidArgumentError) as info:
        decode_page_token(token, {"tenant": "other", "show_inactive": False})
    assert "other filters (show_inactive, tenant)" in info.value.message
    with pytest.raises(InvalidArgumentError):
        decode_page_token(token)  # issued with filters, used without
