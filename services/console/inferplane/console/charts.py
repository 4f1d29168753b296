"""Server-rendered SVG charts (no JavaScript, no external assets): bars, and steps over time.

A chart is an `<svg role="img">` with a `<title>` naming what it shows and one `<rect>` per
bar (or one marker per step), each with its own `<title>` (the value, shown on hover and read
by screen readers); pages print the same numbers in a table beside it. Labels and titles are
XML-escaped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime

from markupsafe import Markup, escape


@dataclasses.dataclass(frozen=True, slots=True)
class Bar:
    """One bar: its label under the axis and its value (>= 0; negatives draw as 0)."""

    label: str
    value: float


def _fmt(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1_000:.0f}k"
    if value == int(value):
        return f"{int(value)}"
    return f"{value:.2f}"


def bar_chart(
    bars: Sequence[Bar],
    *,
    title: str,
    unit: str,
    width: int = 640,
    height: int = 220,
    chart_id: str = "chart",
) -> Markup:
    """An SVG bar chart of `bars` in order, scaled to the largest value.

    Args:
        bars: the bars, left to right; an empty sequence draws "no data".
        title: the chart's accessible name (`<title>`).
        unit: appended to each value in the bar titles ("tokens", "requests").
        width / height: the SVG's size in CSS pixels (the `viewBox` scales with the page).
        chart_id: the id of the `<title>` element (unique within a page).

    Returns: safe markup (every label and title escaped).
    """
    top, bottom, left, right = 16, 40, 48, 8
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
        f'aria-labelledby="{escape(chart_id)}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}">',
        f'<title id="{escape(chart_id)}">{escape(title)}</title>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'class="axis"/>',
    ]
    if not bars:
        parts.append(
            f'<text x="{width / 2:.0f}" y="{top + plot_h / 2:.0f}" text-anchor="middle">'
            "no data</text>"
        )
        parts.append("</svg>")
        return Markup("".join(parts))
    peak = max(max(b.value, 0.0) for b in bars) or 1.0
    parts.append(f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(peak)}</text>')
    parts.append(f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>')
    slot = plot_w / len(bars)
    bar_w = max(slot * 0.7, 1.0)
    for i, bar in enumerate(bars):
        value = max(bar.value, 0.0)
        h = plot_h * value / peak
        x = left + i * slot + (slot - bar_w) / 2
        y = top + plot_h - h
        label = escape(bar.label)
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}">'
            f"<title>{label}: {_fmt(value)} {escape(unit)}</title></rect>"
        )
        parts.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle" '
            f'class="label">{label}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One step of a step chart: from `time` (seconds since the epoch) on, the series is
    `value` (>= 0), until the next step."""

    time: float
    value: float


def _clock_label(seconds: float) -> str:
    return f"{datetime.fromtimestamp(seconds, UTC):%H:%M:%S}"


def step_chart(
    steps: Sequence[Step],
    *,
    end: float,
    title: str,
    unit: str,
    width: int = 640,
    height: int = 160,
    chart_id: str = "steps",
) -> Markup:
    """An SVG step chart: a value held from each step to the next, the last one up to `end`
    (e.g. a deployment's replicas after each autoscaler decision, up to now).

    Args:
        steps: the steps, any order (drawn sorted by time); empty draws "no data".
        end: the right edge, seconds since the epoch (a step later than it moves it).
        title: the chart's accessible name (`<title>`).
        unit: appended to each value in the steps' titles ("replicas").
        width / height: the SVG's size in CSS pixels (the `viewBox` scales with the page).
        chart_id: the id of the `<title>` element (unique within a page).

    Returns: safe markup (titles escaped); each step has a marker whose `<title>` reads
    `HH:MM:SS UTC: <value> <unit>`, and the time axis is labelled at both ends.
    """
    top, bottom, left, right = 16, 28, 48, 8
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
        f'aria-labelledby="{escape(chart_id)}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}">',
        f'<title id="{escape(chart_id)}">{escape(title)}</title>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'class="axis"/>',
    ]
    if not steps:
        parts.append(
            f'<text x="{width / 2:.0f}" y="{top + plot_h / 2:.0f}" text-anchor="middle">'
            "no data</text></svg>"
        )
        return Markup("".join(parts))
    ordered = sorted(steps, key=lambda s: s.time)
    start, stop = ordered[0].time, max(end, ordered[-1].time)
    span = (stop - start) or 1.0
    peak = max(max(s.value, 0.0) for s in ordered) or 1.0

    def x(t: float) -> float:
        return left + plot_w * (t - start) / span

    def y(v: float) -> float:
        return top + plot_h - plot_h * max(v, 0.0) / peak

    path = [f"M{x(start):.1f},{y(ordered[0].value):.1f}"]
    for step in ordered[1:]:
        path.append(f"H{x(step.time):.1f}V{y(step.value):.1f}")
    path.append(f"H{x(stop):.1f}")
    parts.append(f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(peak)}</text>')
    parts.append(f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>')
    parts.append(f'<path class="line" fill="none" d="{"".join(path)}"/>')
    for step in ordered:
        parts.append(
            f'<circle class="point" cx="{x(step.time):.1f}" cy="{y(step.value):.1f}" r="3">'
            f"<title>{_clock_label(step.time)} UTC: {_fmt(max(step.value, 0.0))} "
            f"{escape(unit)}</title></circle>"
        )
    for at, anchor in ((start, "start"), (stop, "end")):
        parts.append(
            f'<text x="{x(at):.1f}" y="{top + plot_h + 14}" text-anchor="{anchor}" '
            f'class="label">{_clock_label(at)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
