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

import attrs

from fsm_runner.diagrams import Edge, Graph, Node

__all__ = ["render_svg"]

_CHAR = 7.2  # width of a character of the 12px monospace labels
_NODE_H = 32.0
_PAD = 14.0  # inside a composite box
_HEADER = 20.0  # a composite's title
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
.fsm .badge circle{fill:#8250df}
.fsm .badge text{fill:#fff;font-size:10px;font-weight:bold}
"""


_Point = tuple[float, float]


@attrs.define
class _Box:
    """Where a member (node or composite) of the drawing sits: its top-left corner and size."""

    x: float
    y: float
    w: float
    h: float

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def cy(self) -> float:
        return self.y + self.h / 2

    def moved(self, dx: float, dy: float) -> _Box:
        return _Box(self.x + dx, self.y + dy, self.w, self.h)

    def clip(self, tx: float, ty: float) -> tuple[float, float]:
        """Where the segment from the centre towards (tx, ty) leaves the box."""
        dx, dy = tx - self.cx, ty - self.cy
        if dx == 0 and dy == 0:
            return self.cx, self.cy
        scale = min(
            (self.w / 2) / abs(dx) if dx else math.inf,
            (self.h / 2) / abs(dy) if dy else math.inf,
        )
        return self.cx + dx * scale, self.cy + dy * scale


class _Layout:
    """Boxes for every node and composite of a graph, laid out scope by scope."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.boxes: dict[str, _Box] = {}
        self._nodes = {node.name: node for node in graph.nodes}
        self._inner: dict[str, tuple[float, float]] = {}
        #: What each composite's layout placed (its members, theirs, ...), to move it along.
        self._placed: dict[str | None, list[str]] = {}
        self._scoped_links = self._all_links()
        self.width, self.height = self._scope(None)

    def _size(self, name: str) -> tuple[float, float]:
        node = self._nodes.get(name)
        if node is not None:
            if node.kind != "state":
                return _NODE_H, _NODE_H
            return max(64.0, len(node.label) * _CHAR + 28), _NODE_H
        width, height = self._scope(name)
        self._inner[name] = (width, height)
        title = len(name) * _CHAR + 2 * _PAD
        return max(width + 2 * _PAD, title), height + 2 * _PAD + _HEADER

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
                self._place(name, _Box(x, y + (row_h - h) / 2, w, h))
                x += w + _GAP_X
            y += row_h + _GAP_Y
        return width, y - _GAP_Y

    def _place(self, name: str, box: _Box) -> None:
        """Put ``name`` at ``box`` (relative to its scope), moving what is inside it along."""
        self.boxes[name] = box
        inner = self._inner.get(name)
        if inner is None:
            return
        dx = box.x + (box.w - inner[0]) / 2
        dy = box.y + _PAD + _HEADER
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


def _node_svg(node: Node, box: _Box) -> str:
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
        shape = (
            f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}"'
            ' rx="8"/>'
        )
        if node.terminal:
            shape += (
                f'<rect class="outer" x="{box.x - 3:.1f}" y="{box.y - 3:.1f}"'
                f' width="{box.w + 6:.1f}" height="{box.h + 6:.1f}" rx="10"/>'
            )
    label = (
        f'<text x="{box.cx:.1f}" y="{box.cy + 4:.1f}" text-anchor="middle">'
        f"{escape(node.label)}</text>"
    )
    return f"{head}{shape}{label}</g>"


#: Where along an edge its label may sit, in order of preference (0: source, 1: destination).
_LABEL_AT = (0.5, 0.38, 0.62, 0.27, 0.73, 0.18, 0.82)


def _edge_path(source: _Box, dest: _Box, bend: float, *, loop: bool) -> tuple[str, list[_Point]]:
    """The path of an edge and the places its label may go (best first)."""
    if loop:
        x, y = source.x + source.w, source.cy
        r = 14 + bend
        path = f"M{x:.1f},{y - 6:.1f} C{x + 2 * r:.1f},{y - 2 * r:.1f} {x + 2 * r:.1f},"
        path += f"{y + 2 * r:.1f} {x:.1f},{y + 6:.1f}"
        return path, [(x + 2 * r, y)]
    mx, my = (source.cx + dest.cx) / 2, (source.cy + dest.cy) / 2
    dx, dy = dest.cx - source.cx, dest.cy - source.cy
    length = math.hypot(dx, dy) or 1.0
    cx, cy = mx - dy / length * bend, my + dx / length * bend
    x1, y1 = source.clip(cx, cy)
    x2, y2 = dest.clip(cx, cy)
    path = f"M{x1:.1f},{y1:.1f} Q{cx:.1f},{cy:.1f} {x2:.1f},{y2:.1f}"
    places = [
        (
            (1 - t) ** 2 * x1 + 2 * (1 - t) * t * cx + t**2 * x2,
            (1 - t) ** 2 * y1 + 2 * (1 - t) * t * cy + t**2 * y2,
        )
        for t in _LABEL_AT
    ]
    return path, places


def _label_box(edge: Edge, at: _Point) -> _Box:
    width = len(edge.counted_label) * 6.0 + 4
    return _Box(at[0] - width / 2, at[1] - 8, width, 12)


def _overlap(box: _Box, others: Iterable[_Box]) -> float:
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

    def __init__(self, boxes: Iterable[_Box]) -> None:
        self._boxes: list[_Box] = []
        self._cells: dict[tuple[int, int], list[int]] = {}
        for box in boxes:
            self.add(box)

    def _keys(self, box: _Box) -> Iterable[tuple[int, int]]:
        x0, x1 = math.floor(box.x / self._CELL), math.floor((box.x + box.w) / self._CELL)
        y0, y1 = math.floor(box.y / self._CELL), math.floor((box.y + box.h) / self._CELL)
        return ((x, y) for x in range(x0, x1 + 1) for y in range(y0, y1 + 1))

    def add(self, box: _Box) -> None:
        """Take ``box``."""
        for key in self._keys(box):
            self._cells.setdefault(key, []).append(len(self._boxes))
        self._boxes.append(box)

    def overlap(self, box: _Box) -> float:
        """How much of ``box`` the boxes taken cover (:func:`_overlap`)."""
        near = sorted({i for key in self._keys(box) for i in self._cells.get(key, ())})
        return _overlap(box, (self._boxes[i] for i in near))


def _first_free(taken: _Taken, boxes: Iterable[_Box]) -> _Box:
    """The first of ``boxes`` that nothing taken covers, else the least covered (the first)."""
    best: _Box | None = None
    least = math.inf
    for box in boxes:
        covered = taken.overlap(box)
        if best is None or covered < least:
            best, least = box, covered
            if not covered:  # nothing can beat it: the places after it need not be made
                break
    assert best is not None  # an edge has places for its label
    return best


def _edge_svg(edge: Edge, path: str, label: _Box) -> str:
    classes = _classes(
        "edge",
        edge.kind,
        "traversed" if edge.count else None,
        "wildcard" if edge.wildcard else None,
    )
    return (
        f'<g class="{classes}" data-event="{escape(edge.event)}"'
        f' data-source="{escape(edge.source)}" data-dest="{escape(edge.dest)}">'
        f'<path d="{path}" marker-end="url(#arrow{"-on" if edge.count else ""})"/>'
        f'<rect x="{label.x:.1f}" y="{label.y:.1f}" width="{label.w:.1f}" height="12"/>'
        f'<text x="{label.cx:.1f}" y="{label.y + 9:.1f}" text-anchor="middle">'
        f"{escape(edge.counted_label)}</text></g>"
    )


def _edges_svg(layout: _Layout, edges: Iterable[Edge]) -> list[str]:
    """Each edge, its label where it overlaps no state and no label placed before it."""
    seen: dict[tuple[str, str], int] = {}
    taken = _Taken(box for name, box in layout.boxes.items() if layout.graph.node(name) is not None)
    parts = []
    # The run's edges first: their labels get the best places.
    for edge in sorted(edges, key=lambda e: not e.count):
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
        rows_apart = abs(dest.cy - source.cy) > _NODE_H + _GAP_Y + 1 or dest.cy == source.cy
        length = math.hypot(dest.cx - source.cx, dest.cy - source.cy)
        bend = max(28.0, 0.16 * length) if rows_apart else 0.0
        bend += 24.0 * index
        path, places = _edge_path(source, dest, 12.0 * index if loop else bend, loop=loop)
        label = _first_free(taken, (_label_box(edge, at) for at in places))
        taken.add(label)
        parts.append(_edge_svg(edge, path, label))
    return parts


def render_svg(graph: Graph, *, counts: Mapping[str, int] | None = None) -> str:
    """Draw ``graph`` (with its run's path, if it has one) as a standalone SVG document.

    Args:
        graph: what :func:`fsm_runner.diagrams.extract` returns.
        counts: a number to show on a state's corner (how many runs are there now).

    Returns:
        The SVG text: ``<svg class="fsm" ...>`` with one ``g.node`` per state
        (``data-state``), one ``g.composite`` per composite and one ``g.edge`` per edge.
    """
    layout = _Layout(graph)
    width = layout.width + 2 * _MARGIN + 60  # room for self-loops and start points
    height = layout.height + 2 * _MARGIN
    top = _MARGIN
    for name, box in list(layout.boxes.items()):
        layout.boxes[name] = box.moved(_MARGIN, top)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="fsm" role="img"'
        f' width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}"'
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
        box = layout.boxes[composite.name]
        classes = _classes("composite", "visited" if composite.name in visited else None)
        parts.append(
            f'<g class="{classes}" data-state="{escape(composite.name)}">'
            f"<title>{escape(composite.description or composite.name)}</title>"
            f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}"'
            ' rx="10"/>'
            f'<text x="{box.x + _PAD:.1f}" y="{box.y + 16:.1f}">{escape(composite.name)}</text>'
            "</g>"
        )
    start = layout.boxes.get(graph.entry_node(graph.initial)) if graph.initial else None
    if start is not None:
        parts.append(
            f'<g class="initial"><circle class="start" cx="{start.x - 22:.1f}"'
            f' cy="{start.cy:.1f}" r="5"/><path d="M{start.x - 17:.1f},{start.cy:.1f}'
            f' L{start.x - 1:.1f},{start.cy:.1f}" stroke="#1f2328" marker-end="url(#arrow)"/>'
            "</g>"
        )
    parts += _edges_svg(layout, graph.edges)
    parts += [_node_svg(node, layout.boxes[node.name]) for node in graph.nodes]
    for name, count in (counts or {}).items():
        at = layout.boxes.get(name)
        if at is not None and graph.node(name) is not None:
            parts.append(
                f'<g class="badge" data-state="{escape(name)}"><circle cx="{at.x + at.w:.1f}"'
                f' cy="{at.y:.1f}" r="11"/><text x="{at.x + at.w:.1f}" y="{at.y + 4:.1f}"'
                f' text-anchor="middle">{count}</text></g>'
            )
    parts.append("</svg>")
    return "".join(parts)
