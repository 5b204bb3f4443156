"""What a drawing of a machine is made of, whichever layout placed it (:mod:`.dot_layout`).

Both layouts size every box and label from the same measures here: the width of a character
of the monospace fonts the page draws with, so a state's box always holds its label and an
edge's label box its text. A :class:`Drawing` is what :func:`fsm_runner.ui.svg.render_svg`
draws: boxes for states and composites, a path and a label box for each edge, and where the
start point sits, all in the SVG's coordinates (y down).
"""

from __future__ import annotations

import math

import attrs

from fsm_runner.diagrams import Edge, Node

#: Width of a character of the 12px monospace state labels (0.6em, and a little to spare).
CHAR = 7.4
#: Width of a character of the 10px monospace edge labels and badges.
SMALL_CHAR = 6.2
NODE_H = 32.0
#: A badge's height (a count of runs, inside the state's box, at its right end).
BADGE_H = 16.0
#: Above a composite's members: its title.
HEADER = 20.0
#: An edge label box's height.
LABEL_H = 14.0

Point = tuple[float, float]


@attrs.define
class Box:
    """A rectangle: its top-left corner and size."""

    x: float
    y: float
    w: float
    h: float

    @property
    def cx(self) -> float:
        """The centre's x."""
        return self.x + self.w / 2

    @property
    def cy(self) -> float:
        """The centre's y."""
        return self.y + self.h / 2

    def moved(self, dx: float, dy: float) -> Box:
        """The same box, ``dx`` right and ``dy`` down."""
        return Box(self.x + dx, self.y + dy, self.w, self.h)

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


@attrs.define
class Drawing:
    """Everything placed: what :func:`~fsm_runner.ui.svg.render_svg` draws.

    Attributes:
        width: the drawing's width (margins included).
        height: its height.
        boxes: each node's and composite's box, by name.
        edges: each edge drawn, with its SVG path and its label's box, in drawing order.
        start: the start point's centre and the path from it to the initial state.
        engine: what laid it out (``graphviz`` or ``builtin``), on the ``<svg>`` element.
    """

    width: float
    height: float
    boxes: dict[str, Box]
    edges: list[tuple[Edge, str, Box]]
    start: tuple[Point, str] | None
    engine: str


def badge_text(count: int) -> str:
    """A count as its badge shows it, digits grouped (``85,000``)."""
    return f"{count:,}"


def badge_width(count: int) -> float:
    """The width of a count's badge."""
    return len(badge_text(count)) * SMALL_CHAR + 10


def node_size(node: Node, count: int | None = None) -> tuple[float, float]:
    """A node's box: room for its label, and for its badge when it has a count."""
    if node.kind != "state":
        return NODE_H, NODE_H
    width = len(node.label) * CHAR + 28
    if count is not None:
        width += badge_width(count) + 6
    return max(64.0, width), NODE_H


def label_width(edge: Edge) -> float:
    """The width of an edge's label box (its text, with the run's count)."""
    return len(edge.counted_label) * SMALL_CHAR + 8


def title_width(name: str) -> float:
    """The width a composite's bold title takes."""
    return len(name) * (CHAR + 0.6)
