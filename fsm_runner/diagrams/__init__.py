"""Draw a machine, and a run's path through it, as Mermaid or Graphviz DOT (and as an image).

Two pure steps: :func:`extract` reads a :class:`~fsm_runner.spec.MachineSpec` (and a run's
journaled timeline) into a :class:`Graph` of plain records, and a renderer turns a graph into
text (:func:`render_mermaid`, :func:`render_dot`). Renderers know nothing about specs, so they
are tested on hand-built graphs; :func:`render` chains both steps. :func:`render_image` runs
Graphviz ``dot`` on DOT text; it is the module's only I/O.

The spec is the source of truth, drawn as it is declared:

* the initial state gets an arrow from a start point, terminal states one to an end point
  (Mermaid ``[*]``) or a double circle (DOT);
* a transition's label is its event and its guards: ``EVENT [guard] [unless guard]``;
* a wildcard transition (source ``*``) is drawn once, from a ``*`` node;
* a composite state is a box around its sub-phases (``state X { ... }``, a DOT cluster) with
  an arrow into its first sub-phase and its ``advance_on`` edges between consecutive ones;
* a :data:`~fsm_runner.spec.RETURN` transition goes to a deep-history node ``H*`` placed in the
  innermost composite that encloses every state the run can come from (at the top level when
  there is none): the run goes back to the very sub-phase it left.

With a run, every visited state is marked, the run's current state too, and for a failed run
(or one parked as ``dead_letter``) the state it failed in (the one the transition that ended it
left). Every traversed edge has its count in its label (``EVENT ×2``). Events the engine
journals without a spec transition -- ``RETRIED`` and ``INTERRUPTED`` (self transitions),
``USER_ABORTED`` from a state with no ``USER_ABORTED`` exit (the run stops in place),
``REWOUND`` (an operator moved the run back) and any other -- are drawn as dotted edges only
when the run took them, with their counts: a phase retried twice shows a ``RETRIED ×2``
self-loop. ``STARTED`` (seq 0) marks the initial state visited.
Transitions that name states the spec does not have (a run resumed under a changed spec) are
left out.

Mermaid's state diagrams cannot style transitions: ``linkStyle`` is flowchart syntax, and
Mermaid (11.x) reads a ``linkStyle`` line in a ``stateDiagram-v2`` as stray states. So a spec
alone is a ``stateDiagram-v2`` (:func:`render_mermaid`), and a run a ``flowchart``
(:func:`render_mermaid_flowchart`) whose states get ``classDef``/``class`` styles (``visited``,
``current``, ``failed``) and whose traversed links are drawn thick and blue by ``linkStyle``,
the others grey -- as DOT draws them. Mermaid also keeps only the last of several self-loops on
one state, so they are written as one link that lists them all.
"""  # noqa: RUF002 - the multiplication sign of traversal counts, as the diagrams show them

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import attrs

from fsm_runner.exceptions import DiagramError
from fsm_runner.records import RunRecord, TransitionRecord
from fsm_runner.spec import RETURN, WILDCARD, MachineSpec, RunOutcome, State, Transition

__all__ = [
    "HISTORY",
    "IMAGE_FORMATS",
    "TEXT_FORMATS",
    "Composite",
    "Edge",
    "EdgeKind",
    "Graph",
    "ImageFormat",
    "Node",
    "NodeKind",
    "TextFormat",
    "extract",
    "render",
    "render_dot",
    "render_image",
    "render_mermaid",
    "render_mermaid_flowchart",
]

#: Name of the top-level history node (a RETURN whose target lies in no single composite).
#: A composite's own is ``"$history:<composite>"``; ``$`` never starts a state name.
HISTORY = "$history"

#: What a node is: a leaf state, the wildcard ``*`` or a history node.
NodeKind = Literal["state", "wildcard", "history"]
#: Where an edge comes from: a spec transition, a composite's implicit move from one sub-phase
#: to the next, or an event the engine journaled without a spec transition.
EdgeKind = Literal["transition", "advance", "engine"]
#: The text formats :func:`render` writes.
TextFormat = Literal["mermaid", "dot"]
#: The image formats :func:`render_image` writes.
ImageFormat = Literal["svg", "png"]

#: The text formats, for command-line choices.
TEXT_FORMATS: tuple[TextFormat, ...] = ("mermaid", "dot")
#: The image formats, for command-line choices.
IMAGE_FORMATS: tuple[ImageFormat, ...] = ("svg", "png")

_HISTORY_LABEL = "H*"
#: Colours of the edges a run took and of the others.
_TRAVERSED = "#1565c0"
_UNTRAVERSED = "#9e9e9e"
_TIMES = "\N{MULTIPLICATION SIGN}"
_NO_DOT = (
    "Graphviz `dot` is not installed; install it (apt-get install graphviz, brew install "
    "graphviz) or use --format mermaid|dot"
)


@attrs.frozen
class Node:
    """A node of the diagram: a leaf state, the wildcard ``*`` or a history node.

    Attributes:
        name: the state's name (pseudo nodes: ``*``, or :data:`HISTORY` and a suffix).
        label: what the node shows (the name for states, ``*`` or ``H*``).
        kind: ``state``, ``wildcard`` or ``history``.
        terminal: whether runs end here.
        outcome: how a run that ends here ended (``None`` for non-terminal nodes).
        parent: the composite directly enclosing the node, if any.
        description: the state's description.
        visited: the run has been in this state.
        current: the run is in this state.
        failed: the run failed in this state.
    """

    name: str
    label: str = attrs.field(default=attrs.Factory(lambda self: self.name, takes_self=True))
    kind: NodeKind = "state"
    terminal: bool = False
    outcome: RunOutcome | None = None
    parent: str | None = None
    description: str = ""
    visited: bool = False
    current: bool = False
    failed: bool = False


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _nodes(value: Iterable[Node]) -> tuple[Node, ...]:
    return tuple(value)


@attrs.frozen
class Composite:
    """A composite state, drawn as a box around its sub-phases.

    Attributes:
        name: the composite's name.
        parent: the composite enclosing it, if any.
        children: names of its direct sub-phases (leaves or composites), in order.
        description: the state's description.
    """

    name: str
    parent: str | None = None
    children: tuple[str, ...] = attrs.field(default=(), converter=_names)
    description: str = ""


@attrs.frozen
class Edge:
    """One drawn edge.

    Attributes:
        source: a node or composite name (``*`` for a wildcard transition).
        event: the event that takes it.
        dest: a node or composite name (a history node for a RETURN transition).
        label: the event and its guards, ``EVENT [guard] [unless guard]``.
        kind: ``transition`` (the spec's), ``advance`` (a composite's move to its next
            sub-phase) or ``engine`` (an engine event with no spec transition).
        wildcard: it leaves every non-terminal state.
        history: it returns the run to the state it came from.
        count: how often the run took it.
    """

    source: str
    event: str
    dest: str
    label: str = attrs.field(default=attrs.Factory(lambda self: self.event, takes_self=True))
    kind: EdgeKind = "transition"
    wildcard: bool = False
    history: bool = False
    count: int = 0

    @property
    def counted_label(self) -> str:
        """The label, with the traversal count when the run took the edge."""
        return f"{self.label} {_TIMES}{self.count}" if self.count else self.label


def _edges(value: Iterable[Edge]) -> tuple[Edge, ...]:
    return tuple(value)


def _composites(value: Iterable[Composite]) -> tuple[Composite, ...]:
    return tuple(value)


@attrs.frozen
class Graph:
    """A whole diagram: what :func:`extract` produces and the renderers draw.

    Attributes:
        title: the machine's name.
        nodes: leaf states in spec order, then pseudo nodes (wildcard, history).
        edges: spec transitions in spec order, then the moves between sub-phases, then the
            engine events the run took.
        composites: composite states, in spec order (outer before inner).
        initial: where runs start (a state or composite name).
        has_run: the graph carries a run (style its states, count its edges).
        order: every node and composite name in declaration order; a scope's members are
            drawn in this order. Nodes and composites missing from it come after it.
    """

    title: str
    nodes: tuple[Node, ...] = attrs.field(default=(), converter=_nodes)
    edges: tuple[Edge, ...] = attrs.field(default=(), converter=_edges)
    composites: tuple[Composite, ...] = attrs.field(default=(), converter=_composites)
    initial: str = ""
    has_run: bool = False
    order: tuple[str, ...] = attrs.field(default=(), converter=_names)

    def node(self, name: str) -> Node | None:
        """The node called ``name``, if there is one."""
        return next((n for n in self.nodes if n.name == name), None)

    def composite(self, name: str) -> Composite | None:
        """The composite called ``name``, if there is one."""
        return next((c for c in self.composites if c.name == name), None)

    def parent(self, name: str) -> str | None:
        """The composite directly enclosing node or composite ``name`` (``None``: top level)."""
        node = self.node(name)
        if node is not None:
            return node.parent
        composite = self.composite(name)
        return composite.parent if composite is not None else None

    def enclosing(self, name: str) -> tuple[str, ...]:
        """The composites enclosing node or composite ``name``, innermost first."""
        chain: list[str] = []
        parent = self.parent(name)
        while parent is not None and parent not in chain:
            chain.append(parent)
            parent = self.parent(parent)
        return tuple(chain)

    def members(self, scope: str | None) -> tuple[str, ...]:
        """The nodes and composites directly inside ``scope`` (``None``: the top level)."""
        names = [*self.order]
        names += [n.name for n in self.nodes if n.name not in self.order]
        names += [c.name for c in self.composites if c.name not in self.order]
        return tuple(name for name in names if self.parent(name) == scope)

    def entry_node(self, name: str) -> str:
        """A composite's first leaf (recursively); ``name`` itself for a node."""
        composite = self.composite(name)
        while composite is not None and composite.children:
            name = composite.children[0]
            composite = self.composite(name)
        return name

    def exit_node(self, name: str) -> str:
        """A composite's last leaf (recursively); ``name`` itself for a node."""
        composite = self.composite(name)
        while composite is not None and composite.children:
            name = composite.children[-1]
            composite = self.composite(name)
        return name

    def scope(self, edge: Edge) -> str | None:
        """The innermost composite that holds both ends of ``edge`` (``None``: the top level)."""
        around_dest = set(self.enclosing(edge.dest))
        return next((c for c in self.enclosing(edge.source) if c in around_dest), None)


# -- extract -----------------------------------------------------------------------------------


def _history_name(composite: str | None) -> str:
    return HISTORY if composite is None else f"{HISTORY}:{composite}"


def _return_target(spec: MachineSpec, transition: Transition) -> str | None:
    """The innermost composite enclosing every state a run can enter ``transition``'s source from.

    A RETURN goes back to where the run was before it entered the returning state; when every
    way in starts inside one composite, the return lands in that composite.
    """
    sources = set(spec.expand_source(transition))
    comers = [
        leaf
        for (leaf, _event), candidates in spec.edges.items()
        if leaf not in sources and any(c.dest in sources for c in candidates)
    ]
    if not comers:
        return None
    common = [p for p in spec.parents(comers[0]) if all(p in spec.parents(c) for c in comers)]
    return common[0] if common else None


def _label(transition: Transition) -> str:
    guards = [f"[{name}]" for name in transition.guards]
    guards += [f"[unless {name}]" for name in transition.unless]
    return " ".join([transition.event, *guards])


def _walk(states: Iterable[State], parent: str | None = None) -> Iterator[tuple[State, str | None]]:
    for state in states:
        yield state, parent
        yield from _walk(state.children, state.name)


def _resolve(spec: MachineSpec, transition: Transition) -> Transition:
    """The transition as :attr:`MachineSpec.edges` holds it (a composite dest: its first leaf)."""
    dest = transition.dest
    if dest != RETURN and spec.has_state(dest) and spec.state(dest).composite:
        return attrs.evolve(transition, dest=spec.entry_leaf(dest))
    return transition


#: For counting: a transition as ``spec.edges`` holds it -> (edge index, leaves it leaves from).
_Keyed = dict[Transition, list[tuple[int, frozenset[str]]]]


def _spec_edges(spec: MachineSpec) -> tuple[list[Edge], _Keyed, dict[str | None, None]]:
    """The spec's transitions and composite moves as edges, and how to find them again."""
    edges: list[Edge] = []
    keyed: _Keyed = {}
    histories: dict[str | None, None] = {}  # an ordered set of history targets

    def add(edge: Edge, key: Transition, leaves_from: Iterable[str]) -> None:
        keyed.setdefault(key, []).append((len(edges), frozenset(leaves_from)))
        edges.append(edge)

    for transition in spec.transitions:
        key = _resolve(spec, transition)
        history = transition.dest == RETURN
        dest = transition.dest
        if history:
            target = _return_target(spec, transition)
            histories[target] = None
            dest = _history_name(target)
        label = _label(transition)
        if WILDCARD in transition.source:  # drawn once, not once per state
            edge = Edge(WILDCARD, transition.event, dest, label, wildcard=True, history=history)
            add(edge, key, spec.expand_source(transition))
            continue
        for source in transition.source:
            edge = Edge(source, transition.event, dest, label, history=history)
            add(edge, key, spec.leaves_under(source) if spec.has_state(source) else ())

    for state, _parent in _walk(spec.states):
        for current, following in itertools.pairwise(state.children):
            leaf = spec.exit_leaf(current.name)
            key = Transition(leaf, state.advance_on, spec.entry_leaf(following.name))
            add(Edge(current.name, state.advance_on, following.name, kind="advance"), key, [leaf])
    return edges, keyed, histories


def _taken(spec: MachineSpec, keyed: _Keyed, record: TransitionRecord) -> int | None:
    """Index of the edge a journaled transition took, or ``None`` if it took no spec edge."""
    source, dest = record.from_state, record.to_state
    assert source is not None
    candidates = [
        candidate
        for candidate in spec.edges.get((source, record.event), ())
        if candidate.dest == dest or (candidate.dest == RETURN and dest != source)
    ]
    # Guarded candidates may share a destination; the engine records the reason of the one
    # it took (``result["reason"]``), so try the candidates with that reason first.
    reason = (record.result or {}).get("reason") or ""
    candidates.sort(key=lambda candidate: candidate.reason != reason)
    for candidate in candidates:
        for index, leaves_from in keyed.get(candidate, ()):
            if source in leaves_from:
                return index
    return None


#: Run statuses drawn as a failure: failed, and parked by recovery (``dead_letter``, by value:
#: the status is newer than some journals).
_FAILED_STATUSES = frozenset({RunOutcome.FAILED.value, "dead_letter"})


def _failed_state(
    spec: MachineSpec,
    current: str | None,
    status: RunOutcome | None,
    timeline: Sequence[TransitionRecord],
) -> str | None:
    """Where a failed run failed: the state the transition into its current state left."""
    if status is None or status.value not in _FAILED_STATUSES or current is None:
        return None
    last = timeline[-1] if timeline else None
    if (
        last is not None
        and last.to_state == current
        and last.from_state is not None
        and spec.has_state(last.from_state)
    ):
        return last.from_state
    return current


def extract(
    spec: MachineSpec,
    *,
    run: RunRecord | None = None,
    timeline: Sequence[TransitionRecord] = (),
) -> Graph:
    """Read a spec, and optionally a run and its timeline, into a :class:`Graph`.

    Args:
        spec: the machine to draw.
        run: the run to mark: its state is ``current``; if it failed, the state it failed in
            is ``failed``.
        timeline: the run's transitions in seq order (``journal.transitions(run_id)``): the
            states they leave and enter are ``visited``, and each edge counts how often the
            run took it. Without ``run``, the last transition says where the run is.

    Returns:
        The graph, ready for :func:`render_mermaid` or :func:`render_dot`.
    """
    edges, keyed, histories = _spec_edges(spec)
    counts = [0] * len(edges)
    engine: dict[tuple[str, str, str], int] = {}  # engine events taken, in order, with counts
    visited: set[str] = set()
    for record in timeline:
        if not spec.has_state(record.to_state):
            continue
        if record.from_state is None:  # STARTED, seq 0
            visited.add(record.to_state)
            continue
        if not spec.has_state(record.from_state):
            continue
        visited.update((record.from_state, record.to_state))
        index = _taken(spec, keyed, record)
        if index is not None:
            counts[index] += 1
        else:
            key = (record.from_state, record.event, record.to_state)
            engine[key] = engine.get(key, 0) + 1
    edges = [attrs.evolve(edge, count=count) for edge, count in zip(edges, counts, strict=True)]
    edges += [
        Edge(source, event, dest, kind="engine", count=count)
        for (source, event, dest), count in engine.items()
    ]

    current = run.state if run is not None else (timeline[-1].to_state if timeline else None)
    if current is not None and not spec.has_state(current):
        current = None
    status = run.status if run is not None else None
    if run is None and current is not None:
        status = spec.state(current).final_outcome
    failed = _failed_state(spec, current, status, timeline)
    if current is not None:
        visited.add(current)

    composites: list[Composite] = []
    nodes: list[Node] = []
    order: list[str] = []
    for state, parent in _walk(spec.states):
        order.append(state.name)
        if state.composite:
            children = [child.name for child in state.children]
            composites.append(Composite(state.name, parent, children, state.description))
            continue
        nodes.append(
            Node(
                state.name,
                terminal=state.terminal,
                outcome=state.final_outcome if state.terminal else None,
                parent=parent,
                description=state.description,
                visited=state.name in visited,
                current=state.name == current,
                failed=state.name == failed,
            )
        )
    if any(edge.wildcard for edge in edges):
        nodes.append(Node(WILDCARD, kind="wildcard", description="any non-terminal state"))
    nodes.extend(
        Node(
            _history_name(target),
            label=_HISTORY_LABEL,
            kind="history",
            parent=target,
            description="back to the state the run came from",
        )
        for target in histories
    )
    return Graph(
        title=spec.name,
        nodes=nodes,
        edges=edges,
        composites=composites,
        initial=spec.initial,
        has_run=run is not None or bool(timeline),
        order=order,
    )


# -- Mermaid -----------------------------------------------------------------------------------

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


def _mermaid_links(edges: Iterable[Edge]) -> list[tuple[str, str, str]]:
    """(source, dest, label) of each link, a state's self-loops merged into one link.

    Mermaid (11.x) keeps only the last of several self-loops on one state, so they are drawn
    as one, at the place of the first, labelled with each one's label.
    """
    links: list[tuple[str, str, list[str]]] = []
    loops: dict[str, list[str]] = {}
    for edge in edges:
        label = _mermaid_text(edge.counted_label)
        if edge.source == edge.dest and edge.source in loops:
            loops[edge.source].append(label)
            continue
        links.append((edge.source, edge.dest, [label]))
        if edge.source == edge.dest:
            loops[edge.source] = links[-1][2]
    return [(source, dest, ", ".join(labels)) for source, dest, labels in links]


def render_mermaid(graph: Graph) -> str:
    """Render a graph as a Mermaid ``stateDiagram-v2``, with the machine's name as its title.

    Composites become ``state ID { ... }`` blocks; a name Mermaid cannot read as an id (it
    starts with a digit, is a keyword such as ``end``, ...) is declared as
    ``state "name" as s_name``. With a run, states get the classes ``visited``, ``current``
    and ``failed`` (``classDef`` + ``class``) and traversed edges their counts in the label.
    Several self-loops on one state are drawn as one link that lists them all (Mermaid would
    keep only the last).

    Args:
        graph: what to draw (from :func:`extract`, or built by hand).

    Returns:
        The diagram's text, ending with a newline.
    """
    ids = _MermaidIds(graph)
    lines = ["---", f"title: {_mermaid_title(graph.title)}", "---", "stateDiagram-v2"]
    scoped: dict[str | None, list[Edge]] = {}
    for edge in graph.edges:
        scoped.setdefault(graph.scope(edge), []).append(edge)

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
        for source, dest, label in _mermaid_links(scoped.get(scope, ())):
            lines.append(f"{indent}{ids(source)} --> {ids(dest)} : {label}")

    block(None, "    ")
    lines.extend(f"    {ids(n.name)} --> [*]" for n in graph.nodes if n.terminal)
    if graph.has_run:
        lines.extend(f"    classDef {name} {style}" for name, style in _MERMAID_CLASSES)
        for name, _style in _MERMAID_CLASSES:
            members = [ids(n.name) for n in graph.nodes if getattr(n, name)]
            if members:
                lines.append(f"    class {','.join(members)} {name}")
    return "\n".join(lines) + "\n"


# -- Mermaid flowchart (a run's path) ------------------------------------------------------------

#: Id of the flowchart's start point; no alias can take it (aliases start with ``s_`` or
#: ``any_state``).
_FLOW_START = "start_"
_FLOW_START_CLASS = ("initial", "fill:#212121,stroke:#212121")
_FLOW_TRAVERSED = f"stroke:{_TRAVERSED},stroke-width:3px"
_FLOW_UNTRAVERSED = f"stroke:{_UNTRAVERSED}"


@attrs.frozen
class _FlowLink:
    source: str
    dest: str
    label: str
    traversed: bool
    engine: bool


def _flow_links(edges: Iterable[Edge]) -> list[_FlowLink]:
    """The links of a scope, a state's self-loops merged into one (as :func:`_mermaid_links`).

    A merged loop is traversed when any of its edges is, and dotted when all are engine events.
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
        _FlowLink(
            first.source,
            first.dest,
            ", ".join(_mermaid_text(edge.counted_label) for edge in merged),
            traversed=any(edge.count for edge in merged),
            engine=all(edge.kind == "engine" for edge in merged),
        )
        for first, merged in links
    ]


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
    States get the classes ``visited``, ``current`` and ``failed``; every traversed link is
    thick and blue (``linkStyle`` by the link's index, counted in the order links are written,
    the start point's one included), every other one but the start point's grey.

    Args:
        graph: what to draw (from :func:`extract`, or built by hand).

    Returns:
        The diagram's text, ending with a newline.
    """
    ids = _MermaidIds(graph, alias_all=True)
    lines = ["---", f"title: {_mermaid_title(graph.title)}", "---", "flowchart TD"]
    scoped: dict[str | None, list[Edge]] = {}
    for edge in graph.edges:
        scoped.setdefault(graph.scope(edge), []).append(edge)
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
        for flow in _flow_links(scoped.get(scope, ())):
            (traversed if flow.traversed else untraversed).append(links)
            link(indent, flow.source, flow.dest, flow.label, dotted=flow.engine)

    if graph.initial:
        lines.append(f'    {_FLOW_START}((" "))')
    block(None, "    ")
    for name, style in (_FLOW_START_CLASS, *_MERMAID_CLASSES):
        lines.append(f"    classDef {name} {style}")
    if graph.initial:
        lines.append(f"    class {_FLOW_START} {_FLOW_START_CLASS[0]}")
    for name, _style in _MERMAID_CLASSES:
        members = [ids(n.name) for n in graph.nodes if getattr(n, name)]
        if members:
            lines.append(f"    class {','.join(members)} {name}")
    for indexes, style in ((traversed, _FLOW_TRAVERSED), (untraversed, _FLOW_UNTRAVERSED)):
        if indexes:
            lines.append(f"    linkStyle {','.join(map(str, indexes))} {style}")
    return "\n".join(lines) + "\n"


# -- Graphviz DOT ------------------------------------------------------------------------------

_INITIAL = "$initial"


def _q(text: str) -> str:
    """A quoted DOT identifier or string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**values: str) -> str:
    return "[" + ", ".join(f"{key}={_q(value)}" for key, value in values.items()) + "]"


def _dot_node(node: Node) -> str:
    if node.kind == "wildcard":
        values = {"label": node.label, "shape": "plaintext", "fontsize": "20"}
    elif node.kind == "history":
        values = {"label": node.label, "shape": "circle", "width": "0.3", "fontsize": "10"}
    else:
        values = {"label": node.label, "shape": "doublecircle" if node.terminal else "box"}
    style = [] if node.terminal or node.kind != "state" else ["rounded"]
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
    tooltip = node.description
    if node.outcome is not None:
        tooltip = f"{tooltip} (run {node.outcome.value})" if tooltip else f"run {node.outcome}"
    if tooltip:
        values["tooltip"] = tooltip
    return f"{_q(node.name)} {_attrs(**values)}"


def _dot_edge(graph: Graph, edge: Edge, *, plain: bool = False) -> str:
    # An edge from or to a composite ends at its cluster's border (compound=true); it is laid
    # out from the composite's last sub-phase and to its first, the way runs go through it.
    tail, head = graph.exit_node(edge.source), graph.entry_node(edge.dest)
    values = {"label": edge.counted_label}
    if graph.composite(edge.source) and edge.source not in graph.enclosing(head):
        values["ltail"] = f"cluster_{edge.source}"
    if graph.composite(edge.dest) and edge.dest not in graph.enclosing(tail):
        values["lhead"] = f"cluster_{edge.dest}"
    if edge.kind == "engine":
        values["style"] = "dotted"
    elif edge.wildcard or edge.history:
        values["style"] = "dashed"
    if edge.count:
        values.update(penwidth="2.5", color=_TRAVERSED, fontcolor=_TRAVERSED)
    elif graph.has_run and not plain:
        values.update(color=_UNTRAVERSED, fontcolor=_UNTRAVERSED)
    return f"{_q(tail)} -> {_q(head)} {_attrs(**values)}"


def render_dot(graph: Graph) -> str:
    """Render a graph as a Graphviz DOT ``digraph`` (for ``dot``, see :func:`render_image`).

    Composites become ``cluster_<name>`` subgraphs, terminal states double circles, and the
    initial state is pointed at from a point node. With a run, visited states are filled, the
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
        f"digraph {_q(graph.title)} {{",
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
            lines.append(f"{indent}subgraph {_q(f'cluster_{name}')} {{")
            lines.append(f"{indent}    graph {_attrs(**values)}")
            block(name, indent + "    ")
            lines.append(f"{indent}}}")

    if graph.initial:
        lines.append(f"    {_q(_INITIAL)} {_attrs(label='', shape='point', width='0.15')}")
    block(None, "    ")
    if graph.initial:
        initial = Edge(_INITIAL, "", graph.initial, label="")
        lines.append(f"    {_dot_edge(graph, initial, plain=True)}")
    lines.extend(f"    {_dot_edge(graph, edge)}" for edge in graph.edges)
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- entry points ------------------------------------------------------------------------------


def render(
    spec: MachineSpec,
    *,
    format: TextFormat = "mermaid",  # noqa: A002 - the CLI's --format, under the same name
    run: RunRecord | None = None,
    timeline: Sequence[TransitionRecord] = (),
) -> str:
    """Draw a spec, and a run's path through it: :func:`extract`, then render as text.

    Mermaid is a ``stateDiagram-v2`` for a spec alone and a ``flowchart`` (whose links can be
    styled) when a run or a timeline is given.

    Args:
        spec: the machine.
        format: ``mermaid`` or ``dot``.
        run: the run to mark, if any.
        timeline: the run's transitions, in seq order.

    Returns:
        The diagram's text.

    Raises:
        DiagramError: for an unknown format.
    """
    if format not in TEXT_FORMATS:
        raise DiagramError(
            f"unknown diagram format {format!r}: use mermaid or dot (svg and png through "
            "render_image)"
        )
    graph = extract(spec, run=run, timeline=timeline)
    if format == "dot":
        return render_dot(graph)
    return render_mermaid_flowchart(graph) if graph.has_run else render_mermaid(graph)


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
