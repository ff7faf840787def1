"""Merge the stacks that ranks dumped at a hang into one flame graph (xpu_timer style).

Input: ``{rank: folded text}``, one line per thread, frames outermost first,
separated by ``;`` (``ingest.exporter.folded_stacks``). Output: a tree whose
every frame knows the ranks that are in it; ``folded()`` writes it as folded
text where each frame is annotated with the ranks in it and the ranks that
are not (``frame [ranks 0-3,5 | not 4,6-7]``), so the odd rank out shows at a
glance; ``svg()`` draws it as a flame graph with the same labels.

Frame text carries a line number; it is kept, because two ranks at different
lines of the same function are in different places.
"""
from __future__ import annotations

import dataclasses
from html import escape

from core.layout import fold_ranks


@dataclasses.dataclass
class Frame:
    name: str
    ranks: set = dataclasses.field(default_factory=set)
    children: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class MergedStacks:
    root: Frame
    all_ranks: list[int]

    def _label(self, f: Frame) -> str:
        missing = sorted(set(self.all_ranks) - f.ranks)
        tail = f" | not {fold_ranks(missing)}" if missing else ""
        return f"{f.name} [ranks {fold_ranks(f.ranks)}{tail}]"

    def folded(self) -> str:
        """One line per leaf path: annotated frames joined by ';', then the number of ranks."""
        lines: list[str] = []

        def walk(f: Frame, path: list[str]) -> None:
            if not f.children:
                lines.append(f"{';'.join(path)} {len(f.ranks)}")
                return
            for child in sorted(f.children.values(), key=lambda c: (-len(c.ranks), c.name)):
                walk(child, path + [self._label(child)])
        walk(self.root, [])
        return "\n".join(lines)

    def svg(self, width: int = 1200, row_h: int = 18) -> str:
        """A flame graph: width of a frame = share of ranks in it; hover shows the label."""
        rects: list[str] = []
        depth = [0]

        def walk(f: Frame, x: float, w: float, d: int) -> None:
            depth[0] = max(depth[0], d)
            total = max(1, len(f.ranks))
            cx = x
            for child in sorted(f.children.values(), key=lambda c: c.name):
                cw = w * len(child.ranks) / total
                label = self._label(child)
                odd = len(child.ranks) < len(self.all_ranks)
                colour = "#e4572e" if odd else "#f2a541"
                text = escape(child.name if cw > 60 else "")
                rects.append(
                    f'<g><title>{escape(label)}</title><rect x="{cx:.1f}" y="{{y{d}}}" width="{max(cw - 1, 0.5):.1f}" '
                    f'height="{row_h - 1}" fill="{colour}" rx="2"/><text x="{cx + 3:.1f}" y="{{t{d}}}" '
                    f'font-size="11" font-family="monospace">{text[: int(cw / 7)]}</text></g>')
                walk(child, cx, cw, d + 1)
                cx += cw
        walk(self.root, 0.0, float(width), 0)
        height = (depth[0] + 1) * row_h + 4
        body = "\n".join(rects)
        for d in range(depth[0] + 1):  # flames grow upwards: depth 0 at the bottom
            y = height - (d + 1) * row_h
            body = body.replace(f"{{y{d}}}", str(y)).replace(f"{{t{d}}}", str(y + row_h - 5))
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                f'viewBox="0 0 {width} {height}">\n{body}\n</svg>')


def merge_stacks(stacks: dict[int, str], all_ranks: list[int] | None = None) -> MergedStacks:
    """One tree over every rank's threads; ``all_ranks`` names who should be there (default: who dumped)."""
    root = Frame("all")
    for rank, text in stacks.items():
        root.ranks.add(rank)
        for line in text.splitlines():
            node = root
            for name in filter(None, line.strip().split(";")):
                node = node.children.setdefault(name, Frame(name))
                node.ranks.add(rank)
    return MergedStacks(root, sorted(all_ranks if all_ranks is not None else stacks))
