"""Mermaid: a spec as a ``stateDiagram-v2``, a run's path as a ``flowchart`` (its links styled).

Mermaid's state diagrams cannot style transitions, so a run is drawn as a flowchart whose
traversed links ``linkStyle`` draws thick and blue. Both write several self-loops on one state
as one link that lists them all (Mermaid keeps only the last).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import attrs

from fsm_runner.diagrams.graph import TRAVERSED, UNTRAVERSED, Edge, Graph, Node
from fsm_runner.spec import WILDCARD

_MERMAID_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words Mermaid's state-diagram lexer reads as keywords (case-insensitively), and ``root``,
# the id of the diagram itself; a state called one of them gets an alias.
_MERMAID_RESERVED = frozenset(
    {
        "accdescr",
        "acctitle",
        "as",
        "class",
        "classdef",
        "click",
        "default",
        "direction",
        "end",
        "hide",
        "href",
        "note",
        "root",
        "scale",
        "state",
        "statediagram",
        "style",
    }
)
#: The class of waiting states (drawn dashed), with or without a run; defined before the run's
#: classes so that theirs override its colour, not its dashes.
_WAITING_CLASS = ("waiting", "stroke:#6a1b9a,stroke-dasharray:5")
_MERMAID_CLASSES = (
    ("visited", "fill:#e3f2fd,stroke:#1565c0"),
    ("current", "fill:#fff59d,stroke:#f57f17,stroke-width:3px"),
    ("failed", "fill:#ffcdd2,stroke:#c62828,stroke-width:3px"),
)


class _MermaidIds:
    """Mermaid ids for every name: the name itself where Mermaid reads it as one, else an alias.

    With ``alias_all`` (flowcharts) every name gets an alias: a flowchart reads more words as
    keywords (``end``, ``subgraph``, ...) and an id starting with ``o`` or ``x`` right after a
    link as the link's arrowhead, and ``s_`` ids are safe from both.

    Mermaid names a composite's start and end points ``<id>_start`` and ``<id>_end`` (the
    diagram's own ``root_start`` and ``root_end``): a state with such a name would merge into
    one, so it gets an alias too.
    """

    def __init__(self, graph: Graph, *, alias_all: bool = False) -> None:
        self._ids: dict[str, str] = {}
        self._taken: set[str] = set()
        self._reserved: set[str] = {_FLOW_START} if alias_all else set()
        self._alias_all = alias_all
        composites = [c.name for c in graph.composites]
        for name in composites:
            if self._plain(name):
                self._assign(name, name)
        for name in composites:
            if name not in self._ids:
                self._assign(name, self._alias(name))
        self._reserved.update(("root_start", "root_end"))
        for name in composites:
            self._reserved |= {f"{self._ids[name]}_start", f"{self._ids[name]}_end"}
        others = [n.name for n in graph.nodes]
        for name in others:
            if self._plain(name) and name not in self._reserved and name not in self._taken:
                self._assign(name, name)
        for name in others:
            if name not in self._ids:
                self._assign(name, self._alias(name))

    def _plain(self, name: str) -> bool:
        if self._alias_all:
            return False
        return bool(_MERMAID_ID.fullmatch(name)) and name.lower() not in _MERMAID_RESERVED

    def _assign(self, name: str, ident: str) -> None:
        self._ids[name] = ident
        self._taken.add(ident)

    def _alias(self, name: str) -> str:
        if name == WILDCARD:
            base = "any_state"
        else:
            base = "s_" + (re.sub(r"\W", "_", name.lstrip("$"), flags=re.ASCII) or "state")
        candidate, number = base, 1
        while candidate in self._taken or candidate in self._reserved:
            number += 1
            candidate = f"{base}_{number}"
        return candidate

    def __call__(self, name: str) -> str:
        return self._ids.get(name) or name

    def aliased(self, name: str) -> bool:
        return self(name) != name


def _mermaid_text(text: str) -> str:
    """Text Mermaid reads back whole: one line, no ``:``/``;`` (they end a label), no ``"``."""
    text = text.replace(":", "\N{RATIO}").replace(";", ",").replace('"', "'")
    return " ".join(text.split())


def _mermaid_title(title: str) -> str:
    if re.fullmatch(r"\w[\w .-]*", title):
        return title
    return json.dumps(title, ensure_ascii=False)  # a YAML double-quoted string


@attrs.frozen
class _Link:
    source: str
    dest: str
    label: str
    traversed: bool
    engine: bool


def _links(edges: Iterable[Edge]) -> list[_Link]:
    """The links of a scope, a state's self-loops merged into one link.

    Mermaid (11.x) keeps only the last of several self-loops on one state, so they are drawn
    as one, at the place of the first, labelled with each one's label. A merged loop is
    traversed when any of its edges is, and dotted (in a flowchart) when all are engine events.
    """
    links: list[tuple[Edge, list[Edge]]] = []
    loops: dict[str, list[Edge]] = {}
    for edge in edges:
        if edge.source == edge.dest and edge.source in loops:
            loops[edge.source].append(edge)
            continue
        links.append((edge, [edge]))
        if edge.source == edge.dest:
            loops[edge.source] = links[-1][1]
    return [
        _Link(
            first.source,
            first.dest,
            ", ".join(_mermaid_text(edge.counted_label) for edge in merged),
            traversed=any(edge.count for edge in merged),
            engine=all(edge.kind == "engine" for edge in merged),
        )
        for first, merged in links
    ]


def _header(graph: Graph, diagram: str) -> list[str]:
    """The front matter with the machine's name as the title, then the diagram's type."""
    return ["---", f"title: {_mermaid_title(graph.title)}", "---", diagram]


def _scoped(graph: Graph) -> dict[str | None, list[Edge]]:
    """The edges by the innermost composite holding both their ends (``None``: top level)."""
    scoped: dict[str | None, list[Edge]] = {}
    for edge in graph.edges:
        scoped.setdefault(graph.scope(edge), []).append(edge)
    return scoped


def _waiting(graph: Graph) -> tuple[tuple[str, str], ...]:
    """The ``waiting`` class, for a graph with waiting states."""
    return (_WAITING_CLASS,) if any(node.waiting for node in graph.nodes) else ()


def _class_lines(graph: Graph, ids: _MermaidIds) -> list[str]:
    """``class`` lines giving states their classes (``waiting``, and the run's: ``visited``...)."""
    lines = []
    for name, _style in (*_waiting(graph), *_MERMAID_CLASSES):
        members = [ids(n.name) for n in graph.nodes if getattr(n, name)]
        if members:
            lines.append(f"    class {','.join(members)} {name}")
    return lines


def render_mermaid(graph: Graph) -> str:
    """Render a graph as a Mermaid ``stateDiagram-v2``, with the machine's name as its title.

    Composites become ``state ID { ... }`` blocks; a name Mermaid cannot read as an id (it
    starts with a digit, is a keyword such as ``end``, ...) is declared as
    ``state "name" as s_name``. Waiting states get the class ``waiting`` (a dashed outline);
    with a run, states get the classes ``visited``, ``current`` and ``failed`` (``classDef`` +
    ``class``) and traversed edges their counts in the label.
    Several self-loops on one state are drawn as one link that lists them all (Mermaid would
    keep only the last).

    Args:
        graph: what to draw (from :func:`extract`, or built by hand).

    Returns:
        The diagram's text, ending with a newline.
    """
    ids = _MermaidIds(graph)
    lines = _header(graph, "stateDiagram-v2")
    scoped = _scoped(graph)

    def block(scope: str | None, indent: str) -> None:
        # Declare every member first: a state belongs to the block it is first named in.
        for name in graph.members(scope):
            node = graph.node(name)
            label = node.label if node is not None else name
            if ids.aliased(name) or label != name:
                lines.append(f'{indent}state "{_mermaid_text(label)}" as {ids(name)}')
            elif graph.composite(name) is None:
                lines.append(f"{indent}{ids(name)}")
            if graph.composite(name) is not None:
                lines.append(f"{indent}state {ids(name)} {{")
                block(name, indent + "    ")
                lines.append(f"{indent}}}")
        composite = graph.composite(scope) if scope is not None else None
        if composite is not None and composite.children:
            lines.append(f"{indent}[*] --> {ids(composite.children[0])}")
        elif scope is None and graph.initial:
            lines.append(f"{indent}[*] --> {ids(graph.initial)}")
        for link in _links(scoped.get(scope, ())):
            lines.append(f"{indent}{ids(link.source)} --> {ids(link.dest)} : {link.label}")

    block(None, "    ")
    lines.extend(f"    {ids(n.name)} --> [*]" for n in graph.nodes if n.terminal)
    classes = (*_waiting(graph), *(_MERMAID_CLASSES if graph.has_run else ()))
    lines.extend(f"    classDef {name} {style}" for name, style in classes)
    if classes:
        lines.extend(_class_lines(graph, ids))
    return "\n".join(lines) + "\n"


# -- the flowchart (a run's path) -----------------------------------------------------------

#: Id of the flowchart's start point; no alias can take it (aliases start with ``s_`` or
#: ``any_state``).
_FLOW_START = "start_"
_FLOW_START_CLASS = ("initial", "fill:#212121,stroke:#212121")
_FLOW_TRAVERSED = f"stroke:{TRAVERSED},stroke-width:3px"
_FLOW_UNTRAVERSED = f"stroke:{UNTRAVERSED}"


def _flow_node(ident: str, node: Node) -> str:
    label = _mermaid_text(node.label)
    if node.kind == "wildcard":
        return f'{ident}["{label}"]'
    if node.kind == "history":
        return f'{ident}(("{label}"))'
    if node.terminal:
        return f'{ident}((("{label}")))'
    return f'{ident}("{label}")'


def render_mermaid_flowchart(graph: Graph) -> str:
    """Render a graph as a Mermaid ``flowchart TD``, with the run's path styled on its links.

    A state diagram cannot style transitions; a flowchart can (``linkStyle``), so a run is
    drawn as one. States are rounded boxes, terminal states double circles, the initial state
    is pointed at from a small filled circle, composites are ``subgraph`` blocks (nested) and
    every name is aliased (``s_<name>``: the ``*`` node is ``any_state``). Edges carry the
    labels of :func:`render_mermaid` (counts included); engine events are dotted links.
    States get the classes ``waiting`` (dashed), ``visited``, ``current`` and ``failed``; every
    traversed link is thick and blue (``linkStyle`` by the link's index, counted in the order
    links are written, the start point's one included), every other one but the start point's
    grey.

    Args:
        graph: what to draw (from :func:`extract`, or built by hand).

    Returns:
        The diagram's text, ending with a newline.
    """
    ids = _MermaidIds(graph, alias_all=True)
    lines = _header(graph, "flowchart TD")
    scoped = _scoped(graph)
    traversed: list[int] = []
    untraversed: list[int] = []
    links = 0

    def link(indent: str, source: str, dest: str, label: str = "", *, dotted: bool = False) -> None:
        nonlocal links
        arrow = "-.->" if dotted else "-->"
        text = f'|"{label}"| ' if label else " "
        lines.append(f"{indent}{ids(source)} {arrow}{text}{ids(dest)}")
        links += 1

    def block(scope: str | None, indent: str) -> None:
        for name in graph.members(scope):
            node = graph.node(name)
            if node is not None:
                lines.append(f"{indent}{_flow_node(ids(name), node)}")
            elif graph.composite(name) is not None:
                lines.append(f'{indent}subgraph {ids(name)} ["{_mermaid_text(name)}"]')
                block(name, indent + "    ")
                lines.append(f"{indent}end")
        if scope is None and graph.initial:
            link(indent, _FLOW_START, graph.initial)
        for flow in _links(scoped.get(scope, ())):
            (traversed if flow.traversed else untraversed).append(links)
            link(indent, flow.source, flow.dest, flow.label, dotted=flow.engine)

    if graph.initial:
        lines.append(f'    {_FLOW_START}((" "))')
    block(None, "    ")
    for name, style in (_FLOW_START_CLASS, *_waiting(graph), *_MERMAID_CLASSES):
        lines.append(f"    classDef {name} {style}")
    if graph.initial:
        lines.append(f"    class {_FLOW_START} {_FLOW_START_CLASS[0]}")
    lines.extend(_class_lines(graph, ids))
    for indexes, style in ((traversed, _FLOW_TRAVERSED), (untraversed, _FLOW_UNTRAVERSED)):
        if indexes:
            lines.append(f"    linkStyle {','.join(map(str, indexes))} {style}")
    return "\n".join(lines) + "\n"
