"""Lay a machine out with Graphviz ``dot`` for the run inspector, when ``dot`` is installed.

Graphviz places the states, routes the edges as splines around them and gives every edge label
a place of its own (a label is a node of its rank to ``dot``), so no label lies on another or
on a state. The inspector still draws the SVG itself (:func:`fsm_runner.ui.svg.render_svg`:
its classes, escaping and style): ``dot`` only answers *where*, as JSON (``dot -Tjson``), for
a graph whose every box and label has the exact size the page draws it at -- states fixed in
size (``fixedsize``), labels and composite titles empty HTML tables of the width their text
takes in the page's monospace font (:mod:`.geometry`). Text metrics of Graphviz's own fonts
never enter.

The same graph is laid out once: the answers are kept by their DOT text (a run's counts are in
it, so a run that moves is laid out again). Without ``dot``, for a graph too big to lay out
in a page's time, or when ``dot`` fails, :func:`lay_out` answers ``None`` and the inspector
uses its built-in layout.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from fsm_runner.diagrams import Edge, Graph
from fsm_runner.diagrams.dot import INITIAL, dot_edge_ends, dot_quote
from fsm_runner.ui.geometry import (
    HEADER,
    LABEL_H,
    Box,
    Drawing,
    Point,
    label_width,
    node_size,
    title_width,
)

__all__ = ["MAX_NODES", "browser_dot", "edge_places", "lay_out"]

#: Graphs with more nodes than this get the built-in layout (``dot`` takes seconds on them).
MAX_NODES = 300
#: Seconds ``dot`` may take for one layout.
TIMEOUT = 10.0
_MARGIN = 24.0
#: Points per inch: DOT's sizes are in inches, its coordinates in points (= SVG pixels here).
_PT = 72.0


def _empty_label(width: float, height: float) -> str:
    """An HTML-like label that takes exactly ``width`` x ``height`` points and shows nothing."""
    return (
        '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>'
        f'<TD FIXEDSIZE="TRUE" WIDTH="{math.ceil(width)}" HEIGHT="{math.ceil(height)}"></TD>'
        "</TR></TABLE>>"
    )


def layout_dot(graph: Graph, counts: Mapping[str, int]) -> str:
    """The DOT text ``dot`` lays out: sizes only, every node and edge named by its index."""
    lines = [
        "digraph layout {",
        '    graph [rankdir="TB", compound="true", nodesep="0.3", ranksep="0.4", margin="0"]',
        '    node [shape="box", fixedsize="true", label=""]',
        '    edge [arrowsize="0.7"]',
    ]

    def block(scope: str | None, indent: str) -> None:
        for name in graph.members(scope):
            node = graph.node(name)
            if graph.composite(name) is None:
                if node is not None:
                    width, height = node_size(node, counts.get(name))
                    lines.append(
                        f'{indent}{dot_quote(name)} [width="{width / _PT:.4f}",'
                        f' height="{height / _PT:.4f}"]'
                    )
                continue
            label = _empty_label(title_width(name), HEADER)
            lines.append(f"{indent}subgraph {dot_quote(f'cluster_{name}')} {{")
            lines.append(f'{indent}    graph [label={label}, labeljust="l", margin="14"]')
            block(name, indent + "    ")
            lines.append(f"{indent}}}")

    if graph.initial:
        lines.append(f'    {dot_quote(INITIAL)} [shape="point", width="0.14"]')
    block(None, "    ")
    if graph.initial:
        lines.append(_edge(graph, Edge(INITIAL, "", graph.initial, label=""), "initial", None))
    for index, (edge, together) in enumerate(zip(graph.edges, _stacks(graph), strict=True)):
        if index != together[0]:
            continue  # laid out with the first loop of its state
        width = max(label_width(graph.edges[i]) for i in together)
        label = _empty_label(width, LABEL_H * len(together))
        lines.append(_edge(graph, edge, f"e{index}", label))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _stacks(graph: Graph) -> list[list[int]]:
    """For each edge, the indexes of the edges laid out with it: its state's self-loops, or it.

    ``dot`` lays a state's self-loops out as one loop (as the first of them), their labels
    stacked: laid out one by one, the loops of a state nest, and each outer loop crosses the
    labels of the loops inside it; one loop with its labels one above the other crosses none.
    """
    loops: dict[str, list[int]] = {}
    for index, edge in enumerate(graph.edges):
        if edge.source == edge.dest:
            loops.setdefault(edge.source, []).append(index)
    return [
        loops[edge.source] if edge.source == edge.dest else [index]
        for index, edge in enumerate(graph.edges)
    ]


def _edge(graph: Graph, edge: Edge, name: str, label: str | None) -> str:
    tail, head, ends = dot_edge_ends(graph, edge)
    values = "".join(f", {key}={dot_quote(value)}" for key, value in ends.items())
    if label is not None:
        values += f", label={label}"
    return f'    {dot_quote(tail)} -> {dot_quote(head)} [id="{name}"{values}]'


@functools.lru_cache(maxsize=256)
def _run_dot(dot: str, text: str) -> dict[str, Any] | None:
    """``dot -Tjson``'s answer for ``text`` (``None`` if it failed or took too long)."""
    try:
        completed = subprocess.run(  # noqa: S603 - dot, found on PATH, on DOT text made here
            [dot, "-Tjson"], input=text.encode(), capture_output=True, timeout=TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if completed.returncode != 0:
        return None
    try:
        answer = json.loads(completed.stdout)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",")]


class _Flip:
    """Graphviz's points (y up, from the bottom) to the SVG's (y down, with a margin)."""

    def __init__(self, height: float) -> None:
        self.height = height

    def point(self, text: str) -> Point:
        x, y = _floats(text)[:2]
        return x + _MARGIN, self.height - y + _MARGIN

    def box(self, centre: Point, width: float, height: float) -> Box:
        return Box(centre[0] - width / 2, centre[1] - height / 2, width, height)

    def path(self, spline: str) -> str:
        """An SVG path for a DOT spline (``e,x,y p0 p1 p2 p3 ...``), ending at its arrow's tip."""
        end: Point | None = None
        points: list[Point] = []
        for token in spline.split(";", maxsplit=1)[0].split():
            if token.startswith("e,"):
                end = self.point(token[2:])
            elif not token.startswith("s,"):
                points.append(self.point(token))
        parts = [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
        for i in range(1, len(points) - 2, 3):
            (x1, y1), (x2, y2), (x3, y3) = points[i : i + 3]
            parts.append(f"C{x1:.1f},{y1:.1f} {x2:.1f},{y2:.1f} {x3:.1f},{y3:.1f}")
        if end is not None:
            parts.append(f"L{end[0]:.1f},{end[1]:.1f}")
        return " ".join(parts)


def browser_dot(graph: Graph, counts: Mapping[str, int]) -> str | None:
    """The DOT the page lays out itself when ``dot`` did not (``None``: too big for a page).

    The inspector serves Viz.js (Graphviz compiled to WebAssembly) with its pages; the
    browser lays this text out with it and moves what the built-in layout drew to where
    Graphviz puts it (``relayoutDiagrams`` in ``static/inspector.js``), as :func:`lay_out`
    would have placed it here.
    """
    if len(graph.nodes) + len(graph.composites) > MAX_NODES:
        return None
    return layout_dot(graph, counts)


def edge_places(graph: Graph) -> list[tuple[str, int, int]]:
    """Each edge's DOT id in :func:`layout_dot`, and its label's place in the stack there.

    ``(id, k, n)``: the edge is laid out as ``id``, its label the ``k``-th of ``n`` stacked
    in the place kept for them (a state's loops share one; every other edge is ``k=0, n=1``).
    """
    return [
        (f"e{together[0]}", together.index(index), len(together))
        for index, together in enumerate(_stacks(graph))
    ]


def lay_out(graph: Graph, counts: Mapping[str, int]) -> Drawing | None:
    """Where ``dot`` puts every box, edge and label of ``graph`` (``None``: use the built-in).

    Args:
        graph: the machine (and a run's path) to draw.
        counts: the badges' counts, by state (a state with one is wider).
    """
    dot = shutil.which("dot")
    if dot is None or len(graph.nodes) + len(graph.composites) > MAX_NODES:
        return None
    answer = _run_dot(dot, layout_dot(graph, counts))
    if answer is None:
        return None
    try:
        return _drawing(graph, counts, answer)
    except (KeyError, ValueError, IndexError, TypeError):  # an answer not as documented
        return None


def _drawing(graph: Graph, counts: Mapping[str, int], answer: dict[str, Any]) -> Drawing:
    _, _, width, height = _floats(answer["bb"])
    flip = _Flip(height)
    boxes: dict[str, Box] = {}
    start: Point | None = None
    for item in answer.get("objects", ()):
        name = item["name"]
        if "bb" in item and name.startswith("cluster_"):
            x0, y0, x1, y1 = _floats(item["bb"])
            boxes[name.removeprefix("cluster_")] = Box(
                x0 + _MARGIN, height - y1 + _MARGIN, x1 - x0, y1 - y0
            )
        elif name == INITIAL:
            start = flip.point(item["pos"])
        elif "pos" in item:
            node = graph.node(name)
            if node is not None:
                w, h = node_size(node, counts.get(name))
                boxes[name] = flip.box(flip.point(item["pos"]), w, h)
    splines = {item["id"]: item for item in answer.get("edges", ())}
    edges = []
    for index, (edge, together) in enumerate(zip(graph.edges, _stacks(graph), strict=True)):
        item = splines[f"e{together[0]}"]
        x, y = flip.point(item["lp"])
        # Stacked labels (a state's loops) aligned on the left of the place kept for them.
        left = x - max(label_width(graph.edges[i]) for i in together) / 2
        top = y - LABEL_H * len(together) / 2 + LABEL_H * together.index(index)
        edges.append((edge, flip.path(item["pos"]), Box(left, top, label_width(edge), LABEL_H)))
    initial = None
    if start is not None and "initial" in splines:
        initial = (start, flip.path(splines["initial"]["pos"]))
    return Drawing(
        width=width + 2 * _MARGIN,
        height=height + 2 * _MARGIN,
        boxes=boxes,
        edges=edges,
        start=initial,
        engine="graphviz",
    )
