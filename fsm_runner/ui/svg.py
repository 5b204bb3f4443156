"""Draw a :class:`~fsm_runner.diagrams.Graph` as SVG, in pure Python, for the run inspector.

The inspector must show a machine's diagram on a host without Graphviz and without internet,
so it cannot shell out to ``dot`` nor load a JavaScript renderer from a CDN. The graph that
:func:`fsm_runner.diagrams.extract` builds (the same one ``fsm-runner diagram`` renders, with
the run's path on it) is laid out here in layers:

* each scope (the top level, then each composite state) is laid out on its own; a composite
  is one box in its parent's layout, its sub-phases laid out inside it;
* a member's layer is its distance, along the scope's edges, from where runs enter the scope
  (the initial state, a composite's first sub-phase); the wildcard ``*`` and history ``H*``
  nodes sit in the first layer, members nothing reaches in the last;
* layers are rows, top to bottom; within a row, members keep their declaration order, then
  one pass orders them by the mean position of what leads to them (fewer crossings);
* edges are straight between adjacent rows and bowed otherwise, clipped at the boxes,
  labelled with their event (and how often the run took them).

Nodes carry the classes ``visited``, ``current`` and ``failed`` (and ``terminal``, and
``waiting`` for a state that waits for a signal: a dashed outline), edges
``traversed`` and ``engine``: the page's style and the tests read those. Every text is
escaped. The output is deterministic for a given graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from html import escape

from fsm_runner.diagrams import Edge, Graph, Node
from fsm_runner.ui import dot_layout
from fsm_runner.ui.geometry import (
    BADGE_H,
    HEADER,
    LABEL_H,
    NODE_H,
    Box,
    Drawing,
    Point,
    badge_text,
    badge_width,
    label_width,
    node_size,
    title_width,
)

__all__ = ["render_svg"]

_PAD = 14.0  # inside a composite box
_GAP_X = 56.0
_GAP_Y = 62.0
_MARGIN = 30.0

_STYLE = """
.fsm text{font:12px ui-monospace,Menlo,Consolas,monospace;fill:#1f2328}
.fsm .node rect,.fsm .node circle{fill:#fff;stroke:#6e7781;stroke-width:1.2}
.fsm .node.terminal rect.outer{stroke-width:1;fill:none}
.fsm .node.waiting rect{stroke:#6a1b9a;stroke-width:1.6;stroke-dasharray:5 3}
.fsm .node.visited rect,.fsm .node.visited circle{fill:#e3f2fd;stroke:#1565c0}
.fsm .node.current rect{fill:#fff59d;stroke:#f57f17;stroke-width:3}
.fsm .node.failed rect{fill:#ffcdd2;stroke:#c62828;stroke-width:3}
.fsm .composite>rect{fill:#f6f8fa;stroke:#8c959f;stroke-dasharray:4 3}
.fsm .composite.visited>rect{stroke:#1565c0}
.fsm .composite>text{font-weight:bold}
.fsm .edge path{fill:none;stroke:#9e9e9e;stroke-width:1.2}
.fsm .edge.traversed path{stroke:#1565c0;stroke-width:2.4}
.fsm .edge.engine path{stroke-dasharray:3 3}
.fsm .edge text{font-size:10px;fill:#57606a}
.fsm .edge.traversed text{fill:#0d47a1;font-weight:bold}
.fsm .edge rect{fill:#fff;opacity:.85}
.fsm .start{fill:#1f2328}
.fsm .badge rect{fill:#8250df}
.fsm .badge text{fill:#fff;font-size:10px;font-weight:bold}
"""


class _Layout:
    """Boxes for every node and composite of a graph, laid out scope by scope."""

    def __init__(self, graph: Graph, counts: Mapping[str, int]) -> None:
        self.graph = graph
        self.counts = counts
        self.boxes: dict[str, Box] = {}
        self._nodes = {node.name: node for node in graph.nodes}
        self._inner: dict[str, tuple[float, float]] = {}
        #: What each composite's layout placed (its members, theirs, ...), to move it along.
        self._placed: dict[str | None, list[str]] = {}
        self._scoped_links = self._all_links()
        self.width, self.height = self._scope(None)

    def _size(self, name: str) -> tuple[float, float]:
        node = self._nodes.get(name)
        if node is not None:
            return node_size(node, self.counts.get(name))
        width, height = self._scope(name)
        self._inner[name] = (width, height)
        title = title_width(name) + 2 * _PAD
        return max(width + 2 * _PAD, title), height + 2 * _PAD + HEADER

    def _member(self, name: str, scope: str | None) -> str | None:
        """The member of ``scope`` that is or holds ``name`` (``None``: not inside ``scope``)."""
        for candidate in (name, *self.graph.enclosing(name)):
            if self.graph.parent(candidate) == scope:
                return candidate
        return None

    def _scope(self, scope: str | None) -> tuple[float, float]:
        """Lay out ``scope``'s members relative to its origin; return its size."""
        members = list(self.graph.members(scope))
        if not members:
            return 0.0, 0.0
        sizes = {name: self._size(name) for name in members}
        placed = self._placed.setdefault(scope, [])
        for name in members:
            placed += [name, *self._placed.get(name, ())]
        links = self._scoped_links.get(scope, [])
        rows = self._rows(scope, members, links)
        y = 0.0
        width = max(sum(sizes[n][0] for n in row) + _GAP_X * (len(row) - 1) for row in rows)
        for row in rows:
            row_w = sum(sizes[n][0] for n in row) + _GAP_X * (len(row) - 1)
            row_h = max(sizes[n][1] for n in row)
            x = (width - row_w) / 2
            for name in row:
                w, h = sizes[name]
                self._place(name, Box(x, y + (row_h - h) / 2, w, h))
                x += w + _GAP_X
            y += row_h + _GAP_Y
        return width, y - _GAP_Y

    def _place(self, name: str, box: Box) -> None:
        """Put ``name`` at ``box`` (relative to its scope), moving what is inside it along."""
        self.boxes[name] = box
        inner = self._inner.get(name)
        if inner is None:
            return
        dx = box.x + (box.w - inner[0]) / 2
        dy = box.y + _PAD + HEADER
        for other in self._placed.get(name, ()):
            self.boxes[other] = self.boxes[other].moved(dx, dy)

    def _all_links(self) -> dict[str | None, list[tuple[str, str]]]:
        """Per scope, the edges between two of its members (or what holds their ends).

        One pass over the edges, each end's enclosing chain walked once: asking every scope
        about every edge made the layout quadratic.
        """
        graph = self.graph
        scopes = (None, *(composite.name for composite in graph.composites))
        members = {scope: set(graph.members(scope)) for scope in scopes}
        links: dict[str | None, list[tuple[str, str]]] = {}
        for edge in graph.edges:
            sources = {graph.parent(c): c for c in (edge.source, *graph.enclosing(edge.source))}
            for dest in (edge.dest, *graph.enclosing(edge.dest)):
                scope = graph.parent(dest)
                source = sources.get(scope)
                inside = members.get(scope, set())
                if source is not None and source != dest and source in inside and dest in inside:
                    links.setdefault(scope, []).append((source, dest))
        return links

    def _rows(
        self, scope: str | None, members: list[str], links: list[tuple[str, str]]
    ) -> list[list[str]]:
        layer = self._layers(scope, members, links)
        rows: list[list[str]] = [[] for _ in range(max(layer.values()) + 1)]
        for name in members:
            rows[layer[name]].append(name)
        rows = [row for row in rows if row]
        position = {name: i for row in rows for i, name in enumerate(row)}
        into: dict[str, list[str]] = {}
        for source, dest in links:
            into.setdefault(dest, []).append(source)
        for row in rows[1:]:
            mean = {}
            for name in row:
                sources = [position[s] for s in into.get(name, ()) if s in position]
                mean[name] = sum(sources) / len(sources) if sources else position[name]
            row.sort(key=lambda n: (mean[n], position[n]))
            position.update({name: i for i, name in enumerate(row)})
        return rows

    def _layers(
        self, scope: str | None, members: list[str], links: list[tuple[str, str]]
    ) -> dict[str, int]:
        """Each member's row: its distance from where runs enter the scope (see the module)."""
        composite = self.graph.composite(scope) if scope is not None else None
        start = composite.children[0] if composite and composite.children else None
        if scope is None:
            start = self._member(self.graph.initial, None)
        layer: dict[str, int] = {}
        frontier = [start] if start in members else members[:1]
        for name in frontier:
            layer[name] = 0
        out: dict[str, list[str]] = {}
        for source, dest in links:
            out.setdefault(source, []).append(dest)
        while frontier:  # breadth first: a member's layer is its distance, whatever the order
            following = []
            for source in frontier:
                for dest in out.get(source, ()):
                    if dest not in layer:
                        layer[dest] = layer[source] + 1
                        following.append(dest)
            frontier = following
        # Terminal states in the bottom row, the wildcard just above it (its edges go down to
        # the terminal states), states nothing reaches below the others.
        ends = {n for n in members if n in self._nodes and self._nodes[n].terminal}
        last = max((layer[n] for n in layer if n not in ends), default=0) + 1
        for name in members:
            kind = self._nodes[name].kind if name in self._nodes else "composite"
            if kind == "wildcard":
                layer[name] = max(last - 1, 0)
            elif kind == "history" and name not in layer:
                layer[name] = 0
            elif name not in layer:
                ends.add(name)
        for name in ends:
            layer[name] = last
        return layer


def _classes(*names: str | None) -> str:
    return " ".join(name for name in names if name)


def _node_svg(node: Node, box: Box, count: int | None) -> str:
    """A state (its box, or a circle for ``*`` and ``H*``), its label, and its badge if counted.

    A terminal state's box holds a second, inner one; a badge sits inside the box at its
    right end, the label centred in what is left: nothing drawn leaves the box.
    """
    classes = _classes(
        "node",
        node.kind,
        "terminal" if node.terminal else None,
        "visited" if node.visited else None,
        "current" if node.current else None,
        "failed" if node.failed else None,
        "waiting" if node.waiting else None,
    )
    title = f"<title>{escape(node.tooltip or node.name)}</title>"
    head = f'<g class="{classes}" data-state="{escape(node.name)}">{title}'
    if node.kind != "state":
        shape = f'<circle cx="{box.cx:.1f}" cy="{box.cy:.1f}" r="{box.h / 2 - 2:.1f}"/>'
    else:
        inner = Box(box.x + 3, box.y + 3, box.w - 6, box.h - 6) if node.terminal else box
        shape = (
            f'<rect x="{inner.x:.1f}" y="{inner.y:.1f}" width="{inner.w:.1f}"'
            f' height="{inner.h:.1f}" rx="8"/>'
        )
        if node.terminal:
            shape += (
                f'<rect class="outer" x="{box.x:.1f}" y="{box.y:.1f}"'
                f' width="{box.w:.1f}" height="{box.h:.1f}" rx="10"/>'
            )
    middle = box.cx
    badge = ""
    if count is not None and node.kind == "state":
        width = badge_width(count)
        left = box.x + box.w - width - 6
        middle = box.x + (box.w - width - 6) / 2
        badge = (
            f'<g class="badge" data-state="{escape(node.name)}">'
            f'<rect x="{left:.1f}" y="{box.cy - BADGE_H / 2:.1f}" width="{width:.1f}"'
            f' height="{BADGE_H:.1f}" rx="8"/><text x="{left + width / 2:.1f}"'
            f' y="{box.cy + 3.5:.1f}" text-anchor="middle">{badge_text(count)}</text></g>'
        )
    label = (
        f'<text x="{middle:.1f}" y="{box.cy + 4:.1f}" text-anchor="middle">'
        f"{escape(node.label)}</text>"
    )
    return f"{head}{shape}{label}</g>{badge}"


#: Where along an edge its label may sit, in order of preference (0: source, 1: destination).
_LABEL_AT = (0.5, 0.38, 0.62, 0.27, 0.73, 0.18, 0.82)


def _edge_path(
    source: Box, dest: Box, bend: float, *, loop: bool, label_w: float
) -> tuple[str, list[Point]]:
    """The path of an edge and the places its label's centre may go (best first).

    A loop's label sits beside the loop, at its height or a line above or below; another
    edge's label on the curve or beside it, nearer the middle first.
    """
    if loop:
        x, y = source.x + source.w, source.cy
        r = 14 + bend
        path = f"M{x:.1f},{y - 6:.1f} C{x + 2 * r:.1f},{y - 2 * r:.1f} {x + 2 * r:.1f},"
        path += f"{y + 2 * r:.1f} {x:.1f},{y + 6:.1f}"
        beside = x + 1.5 * r + 4 + label_w / 2  # the loop reaches 1.5 r to the right
        return path, [(beside, y + k * LABEL_H) for k in (0, -1, 1, -2, 2, -3, 3)]
    mx, my = (source.cx + dest.cx) / 2, (source.cy + dest.cy) / 2
    dx, dy = dest.cx - source.cx, dest.cy - source.cy
    length = math.hypot(dx, dy) or 1.0
    cx, cy = mx - dy / length * bend, my + dx / length * bend
    x1, y1 = source.clip(cx, cy)
    x2, y2 = dest.clip(cx, cy)
    path = f"M{x1:.1f},{y1:.1f} Q{cx:.1f},{cy:.1f} {x2:.1f},{y2:.1f}"
    on_curve = [
        (
            (1 - t) ** 2 * x1 + 2 * (1 - t) * t * cx + t**2 * x2,
            (1 - t) ** 2 * y1 + 2 * (1 - t) * t * cy + t**2 * y2,
        )
        for t in _LABEL_AT
    ]
    # Beside the curve: off it sideways (as far as the label is wide, for an upright edge).
    nx, ny = -dy / length, dx / length
    reach = (label_w / 2 + 4) * abs(nx) + (LABEL_H / 2 + 4) * abs(ny)
    places = list(on_curve)
    for side in (1, -1, 2, -2):
        places += [(px + side * nx * reach, py + side * ny * reach) for px, py in on_curve]
    return path, places


def _label_box(edge: Edge, at: Point) -> Box:
    width = label_width(edge)
    return Box(at[0] - width / 2, at[1] - LABEL_H / 2, width, LABEL_H)


def _overlap(box: Box, others: Iterable[Box]) -> float:
    """How much of ``box`` the ``others`` cover (areas added up)."""
    return sum(
        max(0.0, min(box.x + box.w, o.x + o.w) - max(box.x, o.x))
        * max(0.0, min(box.y + box.h, o.y + o.h) - max(box.y, o.y))
        for o in others
    )


class _Taken:
    """The boxes already drawn, in a grid of cells: a label is checked against its neighbours.

    Checking every label against every box drawn before it was quadratic. A box that shares
    no cell with the label does not overlap it (it adds 0.0), and the neighbours are summed
    in the order they were taken, so the sums -- and the places chosen -- are the same.
    """

    _CELL = 128.0

    def __init__(self, boxes: Iterable[Box]) -> None:
        self._boxes: list[Box] = []
        self._cells: dict[tuple[int, int], list[int]] = {}
        for box in boxes:
            self.add(box)

    def _keys(self, box: Box) -> Iterable[tuple[int, int]]:
        x0, x1 = math.floor(box.x / self._CELL), math.floor((box.x + box.w) / self._CELL)
        y0, y1 = math.floor(box.y / self._CELL), math.floor((box.y + box.h) / self._CELL)
        return ((x, y) for x in range(x0, x1 + 1) for y in range(y0, y1 + 1))

    def add(self, box: Box) -> None:
        """Take ``box``."""
        for key in self._keys(box):
            self._cells.setdefault(key, []).append(len(self._boxes))
        self._boxes.append(box)

    def overlap(self, box: Box) -> float:
        """How much of ``box`` the boxes taken cover (:func:`_overlap`)."""
        near = sorted({i for key in self._keys(box) for i in self._cells.get(key, ())})
        return _overlap(box, (self._boxes[i] for i in near))


def _first_free(taken: _Taken, boxes: Iterable[Box]) -> Box:
    """The first of ``boxes`` that nothing taken covers, else the least covered (the first)."""
    best: Box | None = None
    least = math.inf
    for box in boxes:
        covered = taken.overlap(box)
        if best is None or covered < least:
            best, least = box, covered
            if not covered:  # nothing can beat it: the places after it need not be made
                break
    assert best is not None  # an edge has places for its label
    return best


def _edge_svg(edge: Edge, path: str, label: Box, place: tuple[str, int, int] | None) -> str:
    classes = _classes(
        "edge",
        edge.kind,
        "traversed" if edge.count else None,
        "wildcard" if edge.wildcard else None,
    )
    # For the page's own layout (no ``dot`` here): which DOT edge it is, its label's place.
    layout = f' data-layout-id="{place[0]}" data-stack="{place[1]} {place[2]}"' if place else ""
    return (
        f'<g class="{classes}" data-event="{escape(edge.event)}"'
        f' data-source="{escape(edge.source)}" data-dest="{escape(edge.dest)}"{layout}>'
        f'<path d="{path}" marker-end="url(#arrow{"-on" if edge.count else ""})"/>'
        f'<rect x="{label.x:.1f}" y="{label.y:.1f}" width="{label.w:.1f}"'
        f' height="{label.h:.1f}"/>'
        f'<text x="{label.cx:.1f}" y="{label.cy + 3.5:.1f}" text-anchor="middle">'
        f"{escape(edge.counted_label)}</text></g>"
    )


def _builtin_edges(layout: _Layout) -> list[tuple[Edge, str, Box]]:
    """Each edge, its label where it overlaps no state, title or label placed before it."""
    seen: dict[tuple[str, str], int] = {}
    taken = _Taken(
        box if layout.graph.node(name) is not None
        else Box(box.x + _PAD, box.y, title_width(name), HEADER)  # a composite: its title
        for name, box in layout.boxes.items()
    )  # fmt: skip
    placed = []
    # The run's edges first: their labels get the best places.
    for edge in sorted(layout.graph.edges, key=lambda e: not e.count):
        source = layout.boxes.get(edge.source)
        dest = layout.boxes.get(edge.dest)
        if source is None or dest is None:
            continue
        key = (min(edge.source, edge.dest), max(edge.source, edge.dest))
        index = seen.get(key, 0)
        seen[key] = index + 1
        loop = edge.source == edge.dest
        # Straight between adjacent rows; otherwise bowed, more the longer the edge: edges
        # going down bow to the left, edges going back up to the right, so a loop's way back
        # does not lie on its way there.
        rows_apart = abs(dest.cy - source.cy) > NODE_H + _GAP_Y + 1 or dest.cy == source.cy
        length = math.hypot(dest.cx - source.cx, dest.cy - source.cy)
        bend = max(28.0, 0.16 * length) if rows_apart else 0.0
        bend += 24.0 * index
        path, places = _edge_path(
            source, dest, 12.0 * index if loop else bend, loop=loop, label_w=label_width(edge)
        )
        label = _first_free(taken, (_label_box(edge, at) for at in places))
        taken.add(label)
        placed.append((edge, path, label))
    return placed


def _builtin(graph: Graph, counts: Mapping[str, int]) -> Drawing:
    """The layout in rows of :class:`_Layout`, for when Graphviz is not there (see the module)."""
    layout = _Layout(graph, counts)
    for name, box in list(layout.boxes.items()):
        layout.boxes[name] = box.moved(_MARGIN, _MARGIN)
    start = layout.boxes.get(graph.entry_node(graph.initial)) if graph.initial else None
    initial = None
    if start is not None:
        path = f"M{start.x - 17:.1f},{start.cy:.1f} L{start.x - 1:.1f},{start.cy:.1f}"
        initial = ((start.x - 22, start.cy), path)
    return Drawing(
        width=layout.width + 2 * _MARGIN + 60,  # room for self-loops and start points
        height=layout.height + 2 * _MARGIN,
        boxes=layout.boxes,
        edges=_builtin_edges(layout),
        start=initial,
        engine="builtin",
    )


def render_svg(graph: Graph, *, counts: Mapping[str, int] | None = None) -> str:
    """Draw ``graph`` (with its run's path, if it has one) as a standalone SVG document.

    Laid out by Graphviz ``dot`` when it is installed and the graph is not too big
    (:mod:`fsm_runner.ui.dot_layout`), else by the built-in layout (see the module).

    Args:
        graph: what :func:`fsm_runner.diagrams.extract` returns.
        counts: a number to show in a state's badge (how many runs are there now).

    Returns:
        The SVG text: ``<svg class="fsm" data-layout="graphviz|builtin" ...>`` with one
        ``g.node`` per state (``data-state``), one ``g.composite`` per composite, one
        ``g.edge`` per edge and one ``g.badge`` per count.
    """
    counts = counts or {}
    drawing = dot_layout.lay_out(graph, counts)
    dot = None  # the DOT the page lays out itself, when Graphviz did not here
    if drawing is None:
        drawing = _builtin(graph, counts)
        dot = dot_layout.browser_dot(graph, counts)
    width, height = drawing.width, drawing.height
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="fsm" role="img"'
        f' data-layout="{drawing.engine}"'
        + (f' data-dot="{escape(dot)}"' if dot is not None else "")
        + f' width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}"'
        f' aria-label="{escape(graph.title)}"><title>{escape(graph.title)}</title>'
        f"<style>{_STYLE}</style><defs>"
        '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7"'
        ' markerHeight="7" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z"'
        ' fill="#9e9e9e"/></marker>'
        '<marker id="arrow-on" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6"'
        ' markerHeight="6" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z"'
        ' fill="#1565c0"/></marker></defs>'
    ]
    visited = {node.parent for node in graph.nodes if node.visited}
    for composite in graph.composites:  # outer before inner: inner boxes drawn on top
        box = drawing.boxes.get(composite.name)
        if box is None:
            continue
        classes = _classes("composite", "visited" if composite.name in visited else None)
        parts.append(
            f'<g class="{classes}" data-state="{escape(composite.name)}">'
            f"<title>{escape(composite.description or composite.name)}</title>"
            f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}"'
            ' rx="10"/>'
            f'<text x="{box.x + _PAD:.1f}" y="{box.y + 16:.1f}">{escape(composite.name)}</text>'
            "</g>"
        )
    if drawing.start is not None:
        (x, y), path = drawing.start
        parts.append(
            f'<g class="initial"><circle class="start" cx="{x:.1f}" cy="{y:.1f}" r="5"/>'
            f'<path d="{path}" stroke="#1f2328" fill="none" marker-end="url(#arrow)"/></g>'
        )
    places = dict(zip(map(id, graph.edges), dot_layout.edge_places(graph), strict=True))
    parts += [
        _edge_svg(edge, path, label, places[id(edge)] if dot is not None else None)
        for edge, path, label in drawing.edges
    ]
    parts += [
        _node_svg(node, drawing.boxes[node.name], counts.get(node.name))
        for node in graph.nodes
        if node.name in drawing.boxes
    ]
    parts.append("</svg>")
    return "".join(parts)
