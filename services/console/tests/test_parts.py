"""The console's pure parts: the SVG bar and step charts, the session store's expiry and
eviction, and the key form's parsing."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from multidict import MultiDict

from inferplane.console.charts import Bar, Step, bar_chart, step_chart
from inferplane.console.pages.keys import key_from_form
from inferplane.console.sessions import Identity, SessionStore
from inferplane.console.web import FormError
from inferplane.testing.clock import FakeClock

SVG = "{http://www.w3.org/2000/svg}"


def test_bar_chart_is_valid_accessible_svg_scaled_to_the_peak() -> None:
    svg = bar_chart(
        [Bar("a<b", 50), Bar("c", 100), Bar("d", -3)], title="Tokens & more", unit="tokens"
    )
    root = ET.fromstring(str(svg))  # well-formed XML: labels were escaped
    assert root.get("role") == "img" and root.get("aria-labelledby") == "chart"
    assert root.find(f"{SVG}title").text == "Tokens & more"
    rects = root.findall(f"{SVG}rect")
    heights = [float(r.get("height")) for r in rects]
    assert heights[1] == 220 - 16 - 40  # the peak fills the plot
    assert heights[0] == pytest.approx(heights[1] / 2)
    assert heights[2] == 0  # negatives draw as 0
    assert [r.find(f"{SVG}title").text for r in rects] == [
        "a<b: 50 tokens",
        "c: 100 tokens",
        "d: 0 tokens",
    ]
    empty = ET.fromstring(str(bar_chart([], title="t", unit="u")))
    assert "no data" in "".join(empty.itertext())


def test_step_chart_holds_each_value_until_the_next_step_and_the_end() -> None:
    """Steps given out of order are drawn in time order: a horizontal run to each step's time,
    then a vertical move to its value, the last value held to `end`; the peak fills the plot."""
    t0 = 1_790_000_000.0
    svg = step_chart(
        [Step(t0 + 60, 3), Step(t0, 0), Step(t0 + 30, 1)],
        end=t0 + 120, title="Replicas <of> kimi", unit="replicas", chart_id="c",
    )  # fmt: skip
    root = ET.fromstring(str(svg))
    assert root.get("role") == "img" and root.find(f"{SVG}title").text == "Replicas <of> kimi"
    left, right, top, bottom = 48.0, 632.0, 16.0, 132.0  # width 640, height 160
    third = (right - left) / 4  # 30 s of the 120 s span
    path = root.find(f"{SVG}path").get("d")
    assert path == (
        f"M{left:.1f},{bottom:.1f}H{left + third:.1f}V{bottom - (bottom - top) / 3:.1f}"
        f"H{left + 2 * third:.1f}V{top:.1f}H{right:.1f}"
    )
    titles = [c.find(f"{SVG}title").text for c in root.findall(f"{SVG}circle")]
    assert titles == [
        "14:13:20 UTC: 0 replicas",
        "14:13:50 UTC: 1 replicas",
        "14:14:20 UTC: 3 replicas",
    ]
    # A step after `end` (clocks apart) moves the right edge instead of leaving the plot.
    late = ET.fromstring(str(step_chart([Step(t0, 1), Step(t0 + 10, 2)], end=t0, title="t",
                                        unit="u")))  # fmt: skip
    xs = [float(c.get("cx")) for c in late.findall(f"{SVG}circle")]
    assert xs == [left, right]
    empty = ET.fromstring(str(step_chart([], end=t0, title="t", unit="u")))
    assert "no data" in "".join(empty.itertext())


def test_sessions_expire_when_idle_or_too_old_and_evict_least_recent() -> None:
    clock = FakeClock()
    store = SessionStore(clock, ttl_seconds=10, max_age_seconds=25, max_sessions=2)
    a, _ = store.new()
    signed = store.sign_in(a, Identity("ip-x" * 5, "acme", is_admin=False), client=None)
    assert signed.session_id != a.session_id and signed.csrf_token != a.csrf_token
    assert store.get(a.session_id)[0] is None  # the pre-sign-in id is gone
    for _ in range(2):
        clock.advance(9)
        assert store.get(signed.session_id)[0] is signed  # sliding expiry
    clock.advance(9)  # 27 s after creation: past the maximum age although used 9 s ago
    found, expired = store.get(signed.session_id)
    assert found is None and expired == [signed]

    b, _ = store.new()
    c, _ = store.new()
    store.get(b.session_id)  # b is now the most recent
    _, evicted = store.new()
    assert evicted == [c] and len(store) == 2


def test_csrf_comparison() -> None:
    session, _ = SessionStore(FakeClock()).new()
    assert session.csrf_ok(session.csrf_token)
    assert not session.csrf_ok("") and not session.csrf_ok(None)
    assert not session.csrf_ok(session.csrf_token[:-1])


def test_identity_repr_never_shows_the_key() -> None:
    identity = Identity("ip-very-secret-key-0000000000", "acme", is_admin=False)
    assert "ip-very-secret" not in repr(identity) and identity.label == "tenant acme"


def test_key_form_parsing() -> None:
    admin = Identity("k" * 20, "", is_admin=True)
    form = MultiDict(
        [("scopes", "inference"), ("allowed_models", "a, b c"), ("tokens_per_minute", "10")]
    )
    key = key_from_form(form, admin)
    assert list(key.allowed_models) == ["a", "b", "c"] and key.limits.tokens_per_minute == 10
    with pytest.raises(FormError, match="unknown scope"):
        key_from_form(MultiDict([("scopes", "root")]), admin)
    with pytest.raises(FormError, match="expiry"):
        key_from_form(MultiDict([("expire_days", "1.5")]), admin)
