"""Inline SVG pictures for the HTML report: one step's timeline. Every label is escaped here.

Segments narrower than a pixel are merged with their neighbours of the same kind (a step can hold
thousands of kernels), so the picture stays small whatever the profile holds; tooltips (`<title>`) carry
the exact times.
"""

from __future__ import annotations

import hashlib
from html import escape

from opadvisor.report.timeline import Segment, StepTimeline
from opadvisor.rules.overview import fmt_ms

WIDTH = 1000.0
LABEL_W = 150.0
LANE_H = 26.0
LANE_GAP = 10.0
AXIS_H = 22.0
MARK_ROW = 13.0
MARK_ROWS = 3  # numbers closer than MARK_SPACE px stack up to this many rows
MARK_SPACE = 14.0

KIND_COLOURS = {"busy": "#3b7dd8", "idle": "#e4572e", "cpu": "#b8c2cc", "data": "#f3a712"}
KIND_WORDS = {"busy": "GPU busy", "idle": "GPU idle", "cpu": "CPU", "data": "data loading"}


def _op_colour(name: str) -> str:
    """A stable colour per op name (so the same op looks the same in every lane and report)."""
    h = int(hashlib.sha1(name.encode()).hexdigest()[:6], 16)
    return f"hsl({h % 360}, 55%, {55 + (h >> 9) % 20}%)"


def _colour(seg: Segment) -> str:
    return KIND_COLOURS.get(seg.kind) or _op_colour(seg.label or "")


def _merged(segments: list[Segment], us_per_px: float) -> list[tuple[Segment, int]]:
    """Consecutive segments of one kind (and label, for ops) closer than a pixel drawn as one."""
    out: list[tuple[Segment, int]] = []
    for seg in sorted(segments, key=lambda s: s.start_us):
        if out:
            last, count = out[-1]
            same = last.kind == seg.kind and (seg.kind != "op" or last.label == seg.label)
            if same and seg.start_us - last.end_us < us_per_px and seg.end_us - last.start_us < 3 * us_per_px:
                out[-1] = (
                    Segment(last.start_us, max(last.end_us, seg.end_us), last.kind, last.label),
                    count + 1,
                )
                continue
        out.append((seg, 1))
    return out


def _tooltip(seg: Segment, count: int, origin: float) -> str:
    what = seg.label or KIND_WORDS.get(seg.kind, seg.kind)
    if count > 1:
        what = f"{count} x {what}" if seg.kind == "op" else f"{what} ({count} stretches)"
    start = fmt_ms((seg.start_us - origin) / 1000.0)
    return f"{what}: {fmt_ms((seg.end_us - seg.start_us) / 1000.0)} from {start}"


def timeline_svg(tl: StepTimeline) -> str:
    """The step as lanes of segments over a time axis, the longest items numbered above their lane."""
    span = max(tl.end_us - tl.start_us, 1e-3)
    plot_w = WIDTH - LABEL_W
    us_per_px = span / plot_w

    def x(t: float) -> float:
        return LABEL_W + (t - tl.start_us) / span * plot_w

    parts: list[str] = []
    y = MARK_ROW * MARK_ROWS + 4
    marks = _marks(tl, x, y)
    for lane in tl.lanes:
        parts.append(
            f'<text x="{LABEL_W - 8}" y="{y + LANE_H * 0.68:.1f}" text-anchor="end" class="lane">'
            f"{escape(lane.name)}</text>"
        )
        parts.append(f'<rect x="{LABEL_W}" y="{y}" width="{plot_w}" height="{LANE_H}" class="lanebg"/>')
        # idle first, so that short busy stretches stay visible on top of it
        drawn = sorted(_merged(lane.segments, us_per_px), key=lambda sc: sc[0].kind != "idle")
        parts += [_segment(seg, count, x, y, tl.start_us) for seg, count in drawn]
        y += LANE_H + LANE_GAP
    parts.append(_axis(tl, x, y))
    height = y + AXIS_H
    return (
        f'<svg class="timeline" viewBox="0 0 {WIDTH:.0f} {height:.0f}" width="100%" role="img" '
        f'aria-label="timeline of step {tl.step}" xmlns="http://www.w3.org/2000/svg">'
        + marks
        + "".join(parts)
        + "</svg>"
    )


def _segment(seg: Segment, count: int, x, y: float, origin: float) -> str:
    """One rectangle (data loading as a half-height band), labelled inside when there is room."""
    x0, x1 = x(seg.start_us), x(seg.end_us)
    h, top = (LANE_H * 0.5, y + LANE_H * 0.5) if seg.kind == "data" else (LANE_H, y)
    out = (
        f'<rect x="{x0:.2f}" y="{top:.1f}" width="{max(x1 - x0, 0.6):.2f}" height="{h:.1f}" '
        f'fill="{_colour(seg)}"><title>{escape(_tooltip(seg, count, origin))}</title></rect>'
    )
    label = seg.label if seg.kind == "op" and count == 1 else None
    if label and x1 - x0 > 7 * len(label) + 8:
        out += f'<text x="{x0 + 4:.2f}" y="{y + LANE_H * 0.68:.1f}" class="seglabel">{escape(label)}</text>'
    return out


def _marks(tl: StepTimeline, x, y: float) -> str:
    """Numbers above the first lane at the middle of each of the longest items; close ones stack up."""
    out = []
    last_x = [-1e9] * MARK_ROWS
    placed = sorted(enumerate(tl.longest, 1), key=lambda e: e[1].start_us)
    for i, item in placed:
        cx = x(item.start_us + item.duration_us / 2)
        row = next((r for r in range(MARK_ROWS) if cx - last_x[r] >= MARK_SPACE), MARK_ROWS - 1)
        last_x[row] = cx
        ty = y - 4 - row * MARK_ROW
        tip = escape(f"#{i} {item.name}: {fmt_ms(item.duration_us / 1000.0)}")
        out.append(
            f'<g class="mark"><line x1="{cx:.2f}" x2="{cx:.2f}" y1="{ty + 1}" y2="{y + LANE_H}"/>'
            f'<text x="{cx:.2f}" y="{ty - 1}" text-anchor="middle">{i}</text><title>{tip}</title></g>'
        )
    return "".join(out)


def _axis(tl: StepTimeline, x, y: float) -> str:
    out = [f'<line x1="{x(tl.start_us):.1f}" x2="{x(tl.end_us):.1f}" y1="{y}" y2="{y}" class="axis"/>']
    for i in range(5):
        t = tl.start_us + (tl.end_us - tl.start_us) * i / 4
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        out.append(
            f'<text x="{x(t):.1f}" y="{y + 15}" text-anchor="{anchor}" class="tick">'
            f"{escape(fmt_ms((t - tl.start_us) / 1000.0) if i else '0')}</text>"
        )
    return "".join(out)
