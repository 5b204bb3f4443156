"""Graphviz: a graph as DOT text (:func:`render_dot`), and DOT to an image (:func:`render_image`).

:func:`render_image` runs Graphviz ``dot`` in a subprocess: the diagrams' only I/O.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Literal

from fsm_runner.diagrams.graph import TRAVERSED, UNTRAVERSED, Edge, Graph, Node
from fsm_runner.exceptions import DiagramError

#: The image formats :func:`render_image` writes.
ImageFormat = Literal["svg", "png"]
#: The image formats, for command-line choices.
IMAGE_FORMATS: tuple[ImageFormat, ...] = ("svg", "png")

_NO_DOT = (
    "Graphviz `dot` is not installed; install it (apt-get install graphviz, brew install "
    "graphviz) or use --format mermaid|dot"
)
#: The point the initial state is pointed at from.
INITIAL = "$initial"
#: The outline of waiting states.
_WAITING = "#6a1b9a"


def dot_quote(text: str) -> str:
    """A quoted DOT identifier or string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**values: str) -> str:
    return "[" + ", ".join(f"{key}={dot_quote(value)}" for key, value in values.items()) + "]"


def _dot_node(node: Node) -> str:
    if node.kind == "wildcard":
        values = {"label": node.label, "shape": "plaintext", "fontsize": "20"}
    elif node.kind == "history":
        values = {"label": node.label, "shape": "circle", "width": "0.3", "fontsize": "10"}
    else:
        values = {"label": node.label, "shape": "doublecircle" if node.terminal else "box"}
    style = [] if node.terminal or node.kind != "state" else ["rounded"]
    if node.waiting:  # dashed, in purple unless the run's colours say more
        style.append("dashed")
        values.update(color=_WAITING, penwidth="1.5")
    if node.visited:
        style.append("filled")
        values["fillcolor"] = "#e3f2fd"
    if node.current:
        style += ["filled", "bold"]
        values.update(fillcolor="#fff59d", color="#f57f17", penwidth="2.5")
    if node.failed:
        style += ["filled", "bold"]
        values.update(fillcolor="#ffcdd2", color="#c62828", penwidth="2.5")
    if style:
        values["style"] = ",".join(dict.fromkeys(style))
    tooltip = node.tooltip
    if node.outcome is not None:
        tooltip = f"{tooltip} (run {node.outcome.value})" if tooltip else f"run {node.outcome}"
    if tooltip:
        values["tooltip"] = tooltip
    return f"{dot_quote(node.name)} {_attrs(**values)}"


def dot_edge_ends(graph: Graph, edge: Edge) -> tuple[str, str, dict[str, str]]:
    """The nodes an edge joins in DOT, and its ``ltail``/``lhead`` (``compound=true``).

    An edge from or to a composite ends at its cluster's border; it is laid out from the
    composite's last sub-phase and to its first, the way runs go through it.
    """
    tail, head = graph.exit_node(edge.source), graph.entry_node(edge.dest)
    values = {}
    if graph.composite(edge.source) and edge.source not in graph.enclosing(head):
        values["ltail"] = f"cluster_{edge.source}"
    if graph.composite(edge.dest) and edge.dest not in graph.enclosing(tail):
        values["lhead"] = f"cluster_{edge.dest}"
    return tail, head, values


def _dot_edge(graph: Graph, edge: Edge, *, plain: bool = False) -> str:
    tail, head, ends = dot_edge_ends(graph, edge)
    values = {"label": edge.counted_label, **ends}
    if edge.kind == "engine":
        values["style"] = "dotted"
    elif edge.wildcard or edge.history:
        values["style"] = "dashed"
    if edge.count:
        values.update(penwidth="2.5", color=TRAVERSED, fontcolor=TRAVERSED)
    elif graph.has_run and not plain:
        values.update(color=UNTRAVERSED, fontcolor=UNTRAVERSED)
    return f"{dot_quote(tail)} -> {dot_quote(head)} {_attrs(**values)}"


def render_dot(graph: Graph) -> str:
    """Render a graph as a Graphviz DOT ``digraph`` (for ``dot``, see :func:`render_image`).

    Composites become ``cluster_<name>`` subgraphs, terminal states double circles, waiting
    states dashed purple boxes (their prompt in the tooltip), and the initial state is
    pointed at from a point node. With a run, visited states are filled, the
    current one yellow and the one a failed run failed in red; traversed edges are thick and
    blue with their counts, the others grey.

    Args:
        graph: what to draw (from :func:`extract`, or built by hand).

    Returns:
        The DOT text, ending with a newline (every identifier quoted).
    """
    header = _attrs(
        label=graph.title, labelloc="t", fontname="Helvetica", compound="true", rankdir="LR"
    )
    lines = [
        f"digraph {dot_quote(graph.title)} {{",
        f"    graph {header}",
        f"    node {_attrs(fontname='Helvetica', fontsize='12')}",
        f"    edge {_attrs(fontname='Helvetica', fontsize='10')}",
    ]

    def block(scope: str | None, indent: str) -> None:
        for name in graph.members(scope):
            composite = graph.composite(name)
            node = graph.node(name)
            if composite is None:
                if node is not None:
                    lines.append(f"{indent}{_dot_node(node)}")
                continue
            values = {"label": name, "style": "rounded"}
            if composite.description:
                values["tooltip"] = composite.description
            lines.append(f"{indent}subgraph {dot_quote(f'cluster_{name}')} {{")
            lines.append(f"{indent}    graph {_attrs(**values)}")
            block(name, indent + "    ")
            lines.append(f"{indent}}}")

    if graph.initial:
        lines.append(f"    {dot_quote(INITIAL)} {_attrs(label='', shape='point', width='0.15')}")
    block(None, "    ")
    if graph.initial:
        initial = Edge(INITIAL, "", graph.initial, label="")
        lines.append(f"    {_dot_edge(graph, initial, plain=True)}")
    lines.extend(f"    {_dot_edge(graph, edge)}" for edge in graph.edges)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _first_line(stderr: bytes) -> str:
    """The line of dot's stderr that says what went wrong (its first error, else its first)."""
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if line.lower().startswith("error")]
    return (errors or lines or ["no message"])[0]


def render_image(
    dot_text: str,
    *,
    format: ImageFormat,  # noqa: A002 - the CLI's --format, under the same name
    timeout: float = 60.0,
) -> bytes:
    """Render DOT text to an image with Graphviz ``dot -T<format>`` (a subprocess).

    Args:
        dot_text: the DOT text, e.g. from ``render(spec, format="dot")``.
        format: ``svg`` or ``png``.
        timeout: seconds ``dot`` may take.

    Returns:
        The image's bytes, exactly as ``dot`` wrote them.

    Raises:
        DiagramError: for an unknown format; when ``dot`` is not on ``PATH`` (the message says
            how to install it); when it fails (with the first line of its error output) or
            takes longer than ``timeout``.
    """
    if format not in IMAGE_FORMATS:
        raise DiagramError(f"unknown image format {format!r}: use svg or png")
    dot = shutil.which("dot")
    if dot is None:
        raise DiagramError(_NO_DOT)
    try:
        completed = subprocess.run(  # noqa: S603 - runs dot, found on PATH, on our own DOT text
            [dot, f"-T{format}"],
            input=dot_text.encode(),
            capture_output=True,
            check=False,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise DiagramError(f"Graphviz `dot` took longer than {timeout:g}s") from None
    except OSError as exc:
        raise DiagramError(f"Graphviz `dot` could not be run: {exc}") from None
    if completed.returncode != 0:
        raise DiagramError(f"Graphviz `dot` failed: {_first_line(completed.stderr)}")
    return completed.stdout
