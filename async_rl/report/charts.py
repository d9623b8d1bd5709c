"""Inline SVG charts for the report page (no script, no dependency): each function returns one <svg>."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#bab0ac")
LABEL_W, BAR_H, GAP, CHART_W = 150, 18, 6, 520


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 11) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">{escape(s)}</text>'


def _rect(x: float, y: float, w: float, h: float, color: str, title: str) -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.2f}" height="{h:.1f}" fill="{color}">'
            f"<title>{escape(title)}</title></rect>")


def _svg(width: float, height: float, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'font-family="sans-serif">{"".join(body)}</svg>')


def legend(parts: Sequence[str], y: float) -> list[str]:
    out, x = [], LABEL_W
    for i, part in enumerate(parts):
        out += [_rect(x, y - 9, 10, 10, COLORS[i % len(COLORS)], part), _text(x + 14, y, part)]
        x += 24 + 7 * len(part)
    return out


def stacked_bars(rows: Sequence[tuple[str, Mapping[str, float]]], parts: Sequence[str], unit: str,
                 scale_max: float | None = None, show_legend: bool = True) -> str:
    """One horizontal bar per row, its `parts` stacked in order (values in `unit`), a legend below."""
    top = scale_max or max([sum(v.get(p, 0.0) for p in parts) for _, v in rows] + [1e-9])
    body, y = [], 4.0
    for label, values in rows:
        body.append(_text(LABEL_W - 6, y + BAR_H - 5, label, "end"))
        x = float(LABEL_W)
        for i, part in enumerate(parts):
            w = CHART_W * values.get(part, 0.0) / top
            body.append(_rect(x, y, w, BAR_H, COLORS[i % len(COLORS)], f"{label}: {part} {values.get(part, 0.0):.3g} {unit}"))
            x += w
        body.append(_text(x + 4, y + BAR_H - 5, f"{sum(values.get(p, 0.0) for p in parts):.3g} {unit}"))
        y += BAR_H + GAP
    if show_legend:
        body += legend(parts, y + 12)
    return _svg(LABEL_W + CHART_W + 90, y + (22 if show_legend else 0), body)


def bars(items: Sequence[tuple[str, float]], unit: str) -> str:
    """One horizontal bar per (label, value in `unit`)."""
    return stacked_bars([(label, {unit: value}) for label, value in items], [unit], unit, show_legend=False)


def lines(series: Mapping[str, Sequence[tuple[float, float]]], x_label: str, y_label: str, height: int = 200) -> str:
    """Line chart of each named series of (x, y) points, axes from the data's range."""
    points = [p for s in series.values() for p in s]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(0.0, min(p[1] for p in points)), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, width = 50, CHART_W + LABEL_W - 50
    fx = lambda x: left + width * (x - x0) / (x1 - x0)  # noqa: E731
    fy = lambda y: 10 + (height - 40) * (1 - (y - y0) / (y1 - y0))  # noqa: E731
    body = [f'<line x1="{left}" y1="{fy(y0):.1f}" x2="{left + width}" y2="{fy(y0):.1f}" stroke="#999"/>',
            f'<line x1="{left}" y1="10" x2="{left}" y2="{fy(y0):.1f}" stroke="#999"/>',
            _text(left - 4, fy(y1) + 4, f"{y1:.3g}", "end"), _text(left - 4, fy(y0) + 4, f"{y0:.3g}", "end"),
            _text(left, height - 14, f"{x0:g}"), _text(left + width, height - 14, f"{x1:g}", "end"),
            _text(left + width / 2, height - 2, x_label, "middle"), _text(left + 4, 20, y_label)]
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in pts)
        body.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"><title>{escape(name)}'
                    "</title></polyline>")
        body.append(_text(left + width - 4, 24 + 14 * i, name, "end"))
        body.append(_rect(left + width, 15 + 14 * i, 8, 8, color, name))
    return _svg(left + width + 20, height, body)


def gantt(lanes: Mapping[str, Sequence[tuple[float, float, str]]], window_s: float, height_per_lane: int = 16) -> str:
    """The timeline as lanes of spans (start s, end s, title) from 0 to `window_s` seconds."""
    scale = (CHART_W + 200) / max(window_s, 1e-9)
    body, y = [], 4.0
    for i, (lane, spans) in enumerate(lanes.items()):
        body.append(_text(LABEL_W - 6, y + height_per_lane - 4, lane, "end"))
        color = COLORS[i % len(COLORS)]
        body += [_rect(LABEL_W + start * scale, y, (end - start) * scale, height_per_lane - 2, color, title)
                 for start, end, title in spans]
        y += height_per_lane
    body.append(_text(LABEL_W, y + 14, "0 s"))
    body.append(_text(LABEL_W + window_s * scale, y + 14, f"{window_s:.1f} s", "end"))
    return _svg(LABEL_W + CHART_W + 220, y + 20, body)
