"""The diagram as plain records: :class:`Node`, :class:`Composite`, :class:`Edge`, :class:`Graph`.

What :func:`~fsm_runner.diagrams.extract` produces and every renderer draws; renderers are
tested on graphs built by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Literal

import attrs

from fsm_runner.spec import RunLifecycle

#: Name of the top-level history node (a RETURN whose target lies in no single composite).
#: A composite's own is ``"$history:<composite>"``; ``$`` never starts a state name.
HISTORY = "$history"

#: What a node is: a leaf state, the wildcard ``*`` or a history node.
NodeKind = Literal["state", "wildcard", "history"]
#: Where an edge comes from: a spec transition, a composite's implicit move from one sub-phase
#: to the next, or an event the engine journaled without a spec transition.
EdgeKind = Literal["transition", "advance", "engine"]

#: Colours of the edges a run took and of the others.
TRAVERSED = "#1565c0"
UNTRAVERSED = "#9e9e9e"
_TIMES = "\N{MULTIPLICATION SIGN}"


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
        waiting: a run here waits for a signal (a non-terminal state without a handler; see
            :class:`~fsm_runner.spec.Wait`): drawn dashed.
        timeout: how long a run waits here before the wait times out (seconds; ``None``:
            for ever, or not a waiting state).
        prompt: what the wait asks of whoever answers (shown as a tooltip).
    """

    name: str
    label: str = attrs.field(default=attrs.Factory(lambda self: self.name, takes_self=True))
    kind: NodeKind = "state"
    terminal: bool = False
    outcome: RunLifecycle | None = None
    parent: str | None = None
    description: str = ""
    visited: bool = False
    current: bool = False
    failed: bool = False
    waiting: bool = False
    timeout: float | None = None
    prompt: str = ""

    @property
    def tooltip(self) -> str:
        """The state's description, then how it waits and what it asks (one line each)."""
        lines = [self.description] if self.description else []
        if self.waiting:
            wait = "waits for a signal"
            if self.timeout is not None:
                wait += f", at most {wait_duration(self.timeout)}"
            lines.append(f"{wait}: {self.prompt}" if self.prompt else wait)
        return "\n".join(lines)


def wait_duration(seconds: float) -> str:
    """A wait's timeout, short and ASCII: ``90s``, ``5m``, ``24h``, ``30d``, ``1.5s``.

    The largest unit that divides it evenly (days from two on), so nothing is rounded away.
    """
    for unit, size, least in (("d", 86_400, 2 * 86_400), ("h", 3_600, 3_600), ("m", 60, 60)):
        if seconds >= least and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


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

    # The renderers ask these by name for every node and edge: indexed once, so that drawing
    # is linear in the graph (a scan per question made a 10,000-state spec take minutes).

    @functools.cached_property
    def _nodes(self) -> dict[str, Node]:
        found: dict[str, Node] = {}
        for node in self.nodes:
            found.setdefault(node.name, node)  # the first of a name, as a scan finds it
        return found

    @functools.cached_property
    def _composites(self) -> dict[str, Composite]:
        found: dict[str, Composite] = {}
        for composite in self.composites:
            found.setdefault(composite.name, composite)
        return found

    @functools.cached_property
    def _members(self) -> dict[str | None, tuple[str, ...]]:
        ordered = set(self.order)
        names = [*self.order]
        names += [n.name for n in self.nodes if n.name not in ordered]
        names += [c.name for c in self.composites if c.name not in ordered]
        members: dict[str | None, list[str]] = {}
        for name in names:
            members.setdefault(self.parent(name), []).append(name)
        return {scope: tuple(names) for scope, names in members.items()}

    def node(self, name: str) -> Node | None:
        """The node called ``name``, if there is one."""
        return self._nodes.get(name)

    def composite(self, name: str) -> Composite | None:
        """The composite called ``name``, if there is one."""
        return self._composites.get(name)

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
        return self._members.get(scope, ())

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
