"""The picture of a hang: the job's ranks laid out by DP x PP (x TP), coloured by their state, with who waits on whom.

An on-call engineer looking at a hung job asks three things: where is
everyone, who never arrived, and who waits on whom. A table of the wait chain
answers them for ten ranks, not for a thousand. The picture answers them at
a glance, as MegaScale's on-call tooling does: one cell per rank (per worker
when the job is too wide to draw every rank), placed by its DP rank (columns),
pipeline stage (rows) and TP/CP rank (sub-columns inside a worker); the
colour says its state at the hang (waiting inside collective n, never
entered it, lost, busy in another op); the culprits are outlined; arrows go
from the waiting ranks to the ranks they wait for.

Everything comes from the stored HANG row (its stuck and missing ranks and its
evidence's wait chain) and the job's registration (the sizes that place a
rank). Pure (no Streamlit): the page shows the SVG this returns, and unit
tests read it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from html import escape

from analyzers.explain import duration, layout_sizes, parse_ranks, rank_coords, where
from core.layout import fold_ranks

# state -> (fill, text colour, legend label, severity: the worst state of a folded worker shows)
STATES = {
    "never_entered": ("#d62728", "#ffffff", "never entered {coll}", 7),
    "lost": ("#5b2a86", "#ffffff", "lost (heartbeats stopped)", 7),
    "suspect": ("#d62728", "#ffffff", "in {op} the longest", 7),
    "waiting": ("#f0a500", "#1b1b1b", "waiting in {coll}", 4),
    "waiting_other": ("#f7dc6f", "#1b1b1b", "waiting in another collective", 3),
    "busy": ("#85c1e9", "#1b1b1b", "in another op", 2),
    "idle": ("#d5d8dc", "#1b1b1b", "no op in flight", 1),
    "unknown": ("#ffffff", "#7b7d7d", "no report", 0),
}
MAX_COLUMNS = 96
"""Wider than this (DP x TP x CP cells) the ranks of a worker are folded into one cell: a cell must stay visible."""
MAX_TOOLTIPS = 4096
"""More cells than this (a DP-only job of thousands of ranks, nothing to fold) and only the culprits keep their
hover text: every tooltip would make the page's SVG megabytes."""
MAX_ARROWS = 16
"""More waiting workers than this and only an even sample of them gets an arrow: a fan of hundreds hides the grid."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of the grid: a rank, or a worker (its TP/CP ranks folded) in a wide job."""

    ranks: tuple[int, ...]
    dp: int
    pp: int
    sub: int  # position inside the worker: cp x tp + tp (0 when folded)
    state: str
    culprit: bool
    detail: str  # the tooltip: who, where, what
    waits_for: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Picture:
    cells: list[Cell]
    sizes: dict[str, int]
    folded: bool
    collective: str  # 'all_reduce #767 (world)', '' for a hang outside collectives

    @property
    def culprits(self) -> list[int]:
        return sorted(r for c in self.cells if c.culprit for r in c.ranks if c.state in
                      ("never_entered", "lost", "suspect"))


def _evidence(hang: Mapping) -> dict:
    raw = hang.get("evidence_json") or "{}"
    try:
        ev = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except ValueError:
        return {}
    return ev if isinstance(ev, dict) else {}


def picture(hang: Mapping, registration: Mapping | None = None, max_columns: int = MAX_COLUMNS) -> Picture:
    """Each rank's state at the hang, placed by the job's layout (or one row of ranks without a registration)."""
    kind = str(hang.get("kind") or "")
    stuck = set(parse_ranks(str(hang.get("stuck_ranks") or "")))
    missing = set(parse_ranks(str(hang.get("missing_ranks") or "")))
    rows = [r for r in (_evidence(hang).get("wait_chain") or {}).get("rows") or [] if isinstance(r, dict)]
    doing: dict[int, dict] = {}
    for r in rows:
        for rank in parse_ranks(str(r.get("ranks", ""))):
            doing[rank] = r
    seen = stuck | missing | set(doing)
    sizes = layout_sizes(registration, max(seen, default=-1) + 1)
    world = sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"]
    if seen and max(seen) >= world:  # ranks beyond the registered layout: it is wrong, show every rank anyway
        sizes = layout_sizes(None, max(seen) + 1)
        world = sizes["dp"]
    group, seq, op = str(hang.get("group") or ""), hang.get("seq"), str(hang.get("op") or "")
    if not group:
        # A node loss or a hang outside collectives names none: the collective most ranks wait in is
        # still the one the picture is about (the lost ranks never reached it).
        common: dict[tuple, int] = {}
        for r in doing.values():
            if r.get("group"):
                key = (str(r["group"]), r.get("seq"), str(r.get("op") or ""))
                common[key] = common.get(key, 0) + 1
        if common and kind == "node_loss":
            group, seq, op = max(common, key=common.get)
    coll = f"{op} #{seq} ({group})" if group else ""
    age = duration(hang.get("duration_s"))

    per_rank: list[tuple[int, str, bool, str, tuple[int, ...]]] = []
    for rank in range(world):
        row = doing.get(rank) or {}
        r_op, r_group, r_seq = row.get("last_op") or row.get("op") or "", row.get("group") or "", row.get("seq")
        waits = tuple(parse_ranks(str(row.get("waits_for") or "")))
        r_age = duration(row["age_s"]) if row.get("age_s") is not None else age
        last = (f"; last seen in {r_op}" + (f" #{r_seq} ({r_group})" if r_group else "")
                if r_op and r_op != "(none)" else "")
        gone = f" ({row['state']})" if row.get("state") else ""  # stopped, exited, finished, silent (its watch)
        if kind == "comm_hang" and rank in missing:
            state, culprit, what = "never_entered", True, f"never entered {coll or op}{gone}{last}"
        elif kind == "node_loss" and rank in missing:
            state, culprit, what = "lost", True, f"lost{gone}: gone for {age}{last}"
        elif rank in missing:
            state, culprit, what = "lost", True, f"gone{gone}: the others wait for it{last}"
        elif kind == "noncomm_hang" and rank in stuck and op:
            state, culprit, what = "suspect", True, f"in {op} the longest, for {r_age} (the suspect)"
        elif r_group and group and (r_group, r_seq) == (group, seq):
            state, culprit, what = "waiting", False, f"waiting in {coll} for {r_age}"
        elif r_group:
            state, culprit, what = "waiting_other", False, f"waiting in {r_op} #{r_seq} ({r_group})"
        elif r_op and r_op != "(none)":
            state, culprit, what = "busy", False, f"in {r_op}"
        elif row:
            state, culprit, what = "idle", False, "no op in flight"
        else:
            state, culprit, what = "unknown", False, "sent no report"
        if waits and state.startswith("waiting"):
            what += f", for rank{'s' if len(waits) > 1 else ''} {row.get('waits_for')}"
        per_rank.append((rank, state, culprit, what, waits))

    inner = sizes["tp"] * sizes["cp"]
    folded = sizes["dp"] * inner > max_columns and inner > 1
    cells: list[Cell] = []
    if not folded:
        for rank, state, culprit, what, waits in per_rank:
            c = rank_coords(rank, sizes)
            cells.append(Cell((rank,), c["dp"], c["pp"], c["cp"] * sizes["tp"] + c["tp"], state, culprit,
                              f"rank {rank} ({where(rank, sizes)}): {what}", waits))
    else:
        by_worker: dict[tuple[int, int], list] = {}
        for item in per_rank:
            c = rank_coords(item[0], sizes)
            by_worker.setdefault((c["dp"], c["pp"]), []).append(item)
        for (dp, pp), items in sorted(by_worker.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            worst = max(items, key=lambda it: (STATES[it[1]][3], it[2]))
            counts: dict[str, int] = {}
            for it in items:
                counts[it[1]] = counts.get(it[1], 0) + 1
            parts = ", ".join(f"{n} {STATES[s][2].format(coll=coll or op, op=op)}" for s, n in
                              sorted(counts.items(), key=lambda kv: -STATES[kv[0]][3]))
            ranks = tuple(it[0] for it in items)
            waits = tuple(sorted({w for it in items for w in it[4]}))
            cells.append(Cell(ranks, dp, pp, 0, worst[1], any(it[2] for it in items),
                              f"dp {dp}, pp {pp} (ranks {fold_ranks(ranks)}): {parts}; worst: {worst[3]}", waits))
    return Picture(cells, sizes, folded, coll)


# -- drawing --------------------------------------------------------------------------------------

def _legend_label(state: str, pic: Picture, op: str) -> str:
    return STATES[state][2].format(coll=pic.collective or op or "the collective", op=op or "an op")


def grid_svg(pic: Picture, op: str = "", width: int = 640) -> str:
    """The picture as SVG: cells, culprits outlined, wait arrows, axis labels and a legend with counts."""
    sz = pic.sizes
    inner = 1 if pic.folded else sz["tp"] * sz["cp"]
    n_dp, n_pp = sz["dp"], sz["pp"]
    gap = 5 if inner > 1 else 2
    plan = _arrow_plan(pic)
    arcs_up = any(_far(g, t) and g[0].pp < n_pp / 2 for g, t in plan)
    arcs_down = any(_far(g, t) and g[0].pp >= n_pp / 2 for g, t in plan)
    left, top = 46, 30 + (ARC_ROOM if arcs_up else 0)
    cw = max(3.0, min(96.0, (width - left - gap * (n_dp - 1)) / (n_dp * inner)))
    ch = max(3.0, min(96.0, max(cw, 30.0), 420.0 / n_pp))
    group_w = inner * cw
    grid_w = n_dp * group_w + (n_dp - 1) * gap
    grid_h = n_pp * ch + (n_pp - 1) * 3

    def xy(c: Cell) -> tuple[float, float]:
        return left + c.dp * (group_w + gap) + c.sub * cw, top + c.pp * (ch + 3)

    parts = [('<defs><marker id="ss-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
              'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#34495e"/>'
              '</marker></defs>')]
    # Axes: DP above the columns, PP left of the rows (stage 0 on top, as a pipeline is drawn).
    every = max(1, math.ceil(34 / (group_w + gap)))
    for d in range(0, n_dp, every):
        x = left + d * (group_w + gap) + group_w / 2
        parts.append(f'<text x="{x:.1f}" y="{top - 9}" font-size="11" text-anchor="middle" fill="#444">dp {d}</text>')
    every = max(1, math.ceil(14 / (ch + 3)))
    for p in range(0, n_pp, every):
        y = top + p * (ch + 3) + ch / 2 + 4
        parts.append(f'<text x="{left - 6}" y="{y:.1f}" font-size="11" text-anchor="end" fill="#444">pp {p}</text>')

    culprit_rects = []
    for c in pic.cells:
        x, y = xy(c)
        fill, ink, _, _ = STATES[c.state]
        cls = "cell culprit" if c.culprit else "cell"
        stroke = ' stroke="#b3b6b7" stroke-dasharray="2,2"' if c.state == "unknown" else ' stroke="#ffffff"'
        body = (f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" fill="{fill}"{stroke} '
                f'stroke-width="1"/>')
        if not pic.folded and cw >= 16 and ch >= 14:
            fs = min(12.0, cw / 2.6)
            body += (f'<text x="{x + cw / 2:.1f}" y="{y + ch / 2 + fs / 3:.1f}" font-size="{fs:.1f}" '
                     f'text-anchor="middle" fill="{ink}">{c.ranks[0]}</text>')
        if len(pic.cells) > MAX_TOOLTIPS and not c.culprit:  # a huge DP-only job: the bare cell, kept small
            parts.append(body)
            continue
        parts.append(f'<g class="{cls}" data-ranks="{",".join(map(str, c.ranks[:64]))}" data-state="{c.state}">'
                     f'<title>{escape(c.detail)}</title>{body}</g>')
        if c.culprit:
            culprit_rects.append(f'<rect class="culprit-outline" x="{x + 1.5:.1f}" y="{y + 1.5:.1f}" '
                                 f'width="{max(cw - 3, 1):.1f}" height="{max(ch - 3, 1):.1f}" fill="none" '
                                 f'stroke="#111111" stroke-width="3"/>')

    parts += _arrows(pic, plan, xy, cw, ch, n_pp, top, top + grid_h)
    parts += culprit_rects  # on top of the arrows: the culprit must stay visible
    # The legend: each state present, with how many ranks are in it.
    counts: dict[str, int] = {}
    for c in pic.cells:
        counts[c.state] = counts.get(c.state, 0) + len(c.ranks)
    lx, ly = left, top + grid_h + 22 + (ARC_ROOM if arcs_down else 0)
    for state in sorted(counts, key=lambda s: -STATES[s][3]):
        label = f"{_legend_label(state, pic, op)} · {counts[state]}"
        w = 22 + 6.3 * len(label)
        if lx + w > max(width, left + grid_w) and lx > left:
            lx, ly = left, ly + 20
        fill = STATES[state][0]
        parts.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{fill}" stroke="#888" '
                     f'stroke-width="0.5"/><text x="{lx + 17}" y="{ly}" font-size="11.5" fill="#222">'
                     f'{escape(label)}</text>')
        lx += w + 14
    if any(c.culprit for c in pic.cells):
        ly += 20
        parts.append(f'<rect x="{left + 1}" y="{ly - 10}" width="11" height="11" fill="none" stroke="#111" '
                     f'stroke-width="2.5"/><text x="{left + 17}" y="{ly}" font-size="11.5" fill="#222">'
                     'outlined: the culprit · arrows: who waits for whom</text>')
    w_total = max(width, int(left + grid_w + 8))
    h_total = int(ly + 10)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="hang-grid" width="{w_total}" height="{h_total}" '
            f'viewBox="0 0 {w_total} {h_total}" font-family="sans-serif" role="img" '
            f'aria-label="ranks by DP and PP, coloured by their state at the hang">{"".join(parts)}</svg>')


ARC_ROOM = 44
"""Pixels above and below the grid where the arcs of far arrows run, clear of the cells they would cross."""


def _arrow_plan(pic: Picture) -> list[tuple[list[Cell], Cell]]:
    """(waiting worker's cells, the cell it waits for) per arrow: one arrow per worker, not per rank (the TP
    ranks of a worker wait together), to the nearest rank it waits for; an even sample in a big job."""
    owner = {r: c for c in pic.cells for r in c.ranks}
    workers: dict[tuple[int, int], list[Cell]] = {}
    for c in pic.cells:
        if c.waits_for and c.state.startswith("waiting"):
            workers.setdefault((c.dp, c.pp), []).append(c)
    sources = [workers[k] for k in sorted(workers, key=lambda k: (k[1], k[0]))]
    if len(sources) > MAX_ARROWS:
        step = len(sources) / MAX_ARROWS
        sources = [sources[int(i * step)] for i in range(MAX_ARROWS)]
    plan = []
    for group in sources:
        targets = {id(owner[r]): owner[r] for c in group for r in c.waits_for if r in owner and owner[r] not in group}
        if targets:
            g = group[0]
            plan.append((group, min(targets.values(), key=lambda t: ((t.dp - g.dp) ** 2 + (t.pp - g.pp) ** 2,
                                                                      t.sub))))
    return plan


def _far(group: list[Cell], t: Cell) -> bool:
    """Whether a straight arrow would cross other workers: then it runs as an arc outside the grid."""
    g = group[0]
    return abs(t.dp - g.dp) > 1 or abs(t.pp - g.pp) > 1


def _arrows(pic: Picture, plan, xy, cw: float, ch: float, n_pp: int, grid_top: float, grid_bottom: float) -> list[str]:
    """Arrows from waiting workers to whom they wait for: short straight ones between neighbours, arcs above
    (upper stages) or below (lower stages) the grid for far ones, so that the rank numbers stay readable."""
    out = []
    for group, t in plan:
        xs = [xy(c)[0] for c in group]
        sx0, sx1, sy0 = min(xs), max(xs) + cw, xy(group[0])[1]
        tx0, ty0 = xy(t)
        if _far(group, t):
            up = group[0].pp < n_pp / 2
            x0, x1 = (sx0 + sx1) / 2, tx0 + cw / 2
            y0 = sy0 if up else sy0 + ch
            y1 = ty0 - 1 if up else ty0 + ch + 1
            rim = grid_top if up else grid_bottom
            lift = min(ARC_ROOM - 6, 12 + 0.1 * abs(x1 - x0))
            cy = rim - lift if up else rim + lift
            d = f"M{x0:.1f},{y0:.1f} C{x0:.1f},{cy:.1f} {x1:.1f},{cy:.1f} {x1:.1f},{y1:.1f}"
        else:
            x0, y0 = (sx0 + sx1) / 2, sy0 + ch / 2
            x1, y1 = tx0 + cw / 2, ty0 + ch / 2
            dx, dy = x1 - x0, y1 - y0
            dist = math.hypot(dx, dy)
            if dist < 1:
                continue
            # Start and stop near the cells' edges: the rank numbers in their middles stay readable.
            edge = 0.5 * min(cw, ch)
            start, stop = min(0.3 * dist, max(edge - 5, 0.0)), min(0.3 * dist, edge + 3)
            x0, y0 = x0 + dx / dist * start, y0 + dy / dist * start
            x1, y1 = x1 - dx / dist * stop, y1 - dy / dist * stop
            d = f"M{x0:.1f},{y0:.1f} L{x1:.1f},{y1:.1f}"
        # A pale halo under each arrow keeps it apart from the cells and labels it crosses.
        out.append(f'<path d="{d}" fill="none" stroke="#ffffff" stroke-opacity="0.6" stroke-width="3.4"/>'
                   f'<circle cx="{x0:.1f}" cy="{y0:.1f}" r="2.4" fill="#34495e"/>'
                   f'<path class="wait-arrow" data-from="{fold_ranks(r for c in group for r in c.ranks)}" '
                   f'data-to="{fold_ranks(t.ranks)}" d="{d}" fill="none" stroke="#34495e" stroke-opacity="0.8" '
                   'stroke-width="1.4" marker-end="url(#ss-arrow)"/>')
    return out


# -- the merged stacks as a flame graph -----------------------------------------------------------

_FRAME = re.compile(r"^(?P<name>.*?) \[ranks (?P<ranks>[^|\]]*)(?: \| not (?P<not>[^\]]*))?\]$")


MAX_THREADS = 4
"""Threads drawn as bands of the flame graph; the others are in the text view (a rank has dozens of idle ones)."""


def flame_svg(folded: str, width: int = 640, row_h: int = 18) -> str:
    """The merged stacks (``analyzers.stacks`` folded text) as an icicle per thread: callers on top, the width
    of a frame the share of the job's ranks in it.

    One band per thread name (the main thread first), each as wide as the ranks it
    was found in: a thread of every rank gets the whole width, so the frames where
    the ranks part (one rank in a recv, the others in an all-reduce) are wide
    enough to read. Red: not every rank that dumped its stacks is in the frame
    (where to look); grey: the ranks that dumped nothing (stopped or dead).
    Drawn here rather than shown as the stored SVG so that it fits its column.
    """
    threads: dict[str, dict] = {}
    all_ranks: set[int] = set()
    for line in (folded or "").splitlines():
        path = line.rpartition(" ")[0]
        node: dict | None = None
        for frame in path.split(";") if path else []:
            m = _FRAME.match(frame)
            if not m:
                continue
            ranks, absent = parse_ranks(m["ranks"]), parse_ranks(m["not"] or "")
            all_ranks.update(ranks, absent)
            siblings = threads if node is None else node["children"]
            node = siblings.setdefault(m["name"], {"children": {}, "ranks": ranks, "label": frame})
    if not threads:
        return ""
    dumped = set().union(*(t["ranks"] for t in threads.values()))
    silent = sorted(all_ranks - dumped)
    unit = width / max(1, len(all_ranks))

    def depth(n: dict) -> int:
        return 1 + max((depth(c) for c in n["children"].values()), default=0)

    order = sorted(threads.items(), key=lambda kv: (kv[0] != "MainThread", -len(kv[1]["ranks"]), -depth(kv[1]),
                                                    kv[0]))
    # The threads most ranks have: a helper named after its rank (one per rank) says nothing of the hang.
    shown = [kv for kv in order if kv[0] == "MainThread" or 2 * len(kv[1]["ranks"]) >= len(dumped)][:MAX_THREADS]
    hidden = [kv for kv in order if kv not in shown]
    rects: list[str] = []

    def frame(name: str, label: str, x: float, w: float, y: float, fill: str, cls: str = "frame") -> None:
        fits = max(0, int((w - 6) / 6.4))
        text = name if len(name) <= fits else name[: max(0, fits - 1)] + "…"
        rects.append(f'<g class="{cls}"><title>{escape(label)}</title><rect x="{x:.1f}" y="{y:.1f}" '
                     f'width="{max(w - 1, 0.5):.1f}" height="{row_h - 1}" fill="{fill}" rx="2"/>'
                     + (f'<text x="{x + 3:.1f}" y="{y + row_h - 5:.1f}" font-size="11" font-family="monospace" '
                        f'fill="#1b1b1b">{escape(text)}</text>' if fits >= 2 else "") + "</g>")

    def walk(name: str, node: dict, x: float, y: float) -> None:
        w = unit * len(node["ranks"])
        frame(name, node["label"], x, w, y, "#f2b134" if set(node["ranks"]) >= dumped else "#e4572e")
        # A rank has one path per thread, so the children's ranks are disjoint parts of the parent's.
        for cname, child in sorted(node["children"].items(), key=lambda kv: min(kv[1]["ranks"], default=0)):
            walk(cname, child, x, y + row_h)
            x += unit * len(child["ranks"])

    y = 0.0
    for name, node in shown:
        walk(name, node, 0.0, y)
        rest = sorted(all_ranks - set(node["ranks"]))
        if rest:  # the thread's missing ranks, named on its first row
            label = (f"no stack from rank{'s' if len(silent) > 1 else ''} {fold_ranks(silent)}"
                     if set(rest) == set(silent) else f"not in this thread: ranks {fold_ranks(rest)}")
            frame(label, label, unit * len(node["ranks"]), width - unit * len(node["ranks"]), y, "#d5d8dc",
                  "frame silent")
        y += depth(node) * row_h + 8
    if hidden:
        rects.append(f'<text x="0" y="{y + 10:.1f}" font-size="11" fill="#555">{len(hidden)} more '
                     f'thread{"s" if len(hidden) > 1 else ""} of fewer ranks: see the text view</text>')
        y += 16
    h = int(y)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="flame" width="{width}" height="{h}" '
            f'viewBox="0 0 {width} {h}" role="img" aria-label="merged stacks">{"".join(rects)}</svg>')


def recorder_rows(evidence: Mapping) -> list[dict]:
    """PyTorch's Flight Recorder of each rank that dumped it (``analyzers.hang``'s evidence), a row per rank
    and process group: the last collective the library enqueued, started and completed there, and what it
    had not completed. Its numbers are the library's own (they count from 1; ours from 0)."""
    out = []
    recorders = evidence.get("flight_recorder") if isinstance(evidence, Mapping) else None
    for rank, fr in sorted((recorders or {}).items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        if not isinstance(fr, Mapping):
            continue
        pending = [p for p in fr.get("pending") or [] if isinstance(p, Mapping)]
        for group, status in sorted((fr.get("groups") or {}).items()):
            if not isinstance(status, Mapping):
                continue
            mine = [p for p in pending if p.get("group") == group or len(fr.get("groups") or {}) == 1]
            out.append({"rank": str(rank), "group": str(group) or "default",
                        "enqueued": status.get("enqueued", -1), "started": status.get("started", -1),
                        "completed": status.get("completed", -1),
                        "not completed": ", ".join(f"{p.get('op', '')} #{p.get('seq', -1)} ({p.get('state', '')})"
                                                   for p in mine)})
    return out
