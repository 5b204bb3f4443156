"""From a spec, and a run's journaled timeline, to a :class:`~fsm_runner.diagrams.graph.Graph`.

The spec's transitions become edges (a wildcard transition once, a RETURN one to a history
node), a composite's moves between its sub-phases too; the timeline counts how often the run
took each edge, adds the engine events it took without a spec transition, and marks the
states it visited, is in and failed in. Waiting states (``spec.waiting_states``) are marked
``waiting``, with their wait's timeout in the label (``approving (waits 24h)``) and its prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import attrs

from fsm_runner._nesting import too_deep, walk
from fsm_runner.diagrams.graph import HISTORY, Composite, Edge, Graph, Node, wait_duration
from fsm_runner.exceptions import SpecError
from fsm_runner.records import RunRecord, TransitionRecord
from fsm_runner.spec import RETURN, WILDCARD, MachineSpec, RunLifecycle, State, Transition

_HISTORY_LABEL = "H*"


def _history_name(composite: str | None) -> str:
    return HISTORY if composite is None else f"{HISTORY}:{composite}"


#: Per leaf, the leaves with an edge into it, each with the position of its first such edge
#: in ``spec.edges``: built once, so that each RETURN does not scan every edge.
_Incoming = dict[str, dict[str, int]]


def _incoming(spec: MachineSpec) -> _Incoming:
    incoming: _Incoming = {}
    for position, ((leaf, _event), candidates) in enumerate(spec.edges.items()):
        for candidate in candidates:
            incoming.setdefault(candidate.dest, {}).setdefault(leaf, position)
    return incoming


def _return_target(spec: MachineSpec, transition: Transition, incoming: _Incoming) -> str | None:
    """The innermost composite enclosing every state a run can enter ``transition``'s source from.

    A RETURN goes back to where the run was before it entered the returning state; when every
    way in starts inside one composite, the return lands in that composite.
    """
    sources = set(spec.expand_source(transition))
    comers: dict[str, int] = {}
    for source in sources:
        for leaf, position in incoming.get(source, {}).items():
            if leaf not in sources and position < comers.get(leaf, position + 1):
                comers[leaf] = position
    if not comers:
        return None
    first = min(comers, key=comers.__getitem__)  # the first in the edges' order
    around = [set(spec.parents(leaf)) for leaf in comers]
    common = [p for p in spec.parents(first) if all(p in chain for chain in around)]
    return common[0] if common else None


def _label(transition: Transition) -> str:
    guards = [f"[{name}]" for name in transition.guards]
    guards += [f"[unless {name}]" for name in transition.unless]
    return " ".join([transition.event, *guards])


def _walk(states: Iterable[State]) -> Iterator[tuple[State, str | None]]:
    for state, chain in walk(states, State):
        yield state, chain[0] if chain else None


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
    incoming = _incoming(spec) if any(t.dest == RETURN for t in spec.transitions) else {}

    def add(edge: Edge, key: Transition, leaves_from: Iterable[str]) -> None:
        keyed.setdefault(key, []).append((len(edges), frozenset(leaves_from)))
        edges.append(edge)

    for transition in spec.transitions:
        key = _resolve(spec, transition)
        history = transition.dest == RETURN
        dest = transition.dest
        if history:
            target = _return_target(spec, transition, incoming)
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
_FAILED_STATUSES = frozenset({RunLifecycle.FAILED.value, "dead_letter"})


def _failed_state(
    spec: MachineSpec,
    current: str | None,
    status: RunLifecycle | None,
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

    Raises:
        SpecError: if sub-phases nest deeper than ``fsm_runner.spec.MAX_NESTING``.
    """
    deep = too_deep(spec.states)
    if deep is not None:  # the renderers draw composites as nested blocks, recursively
        raise SpecError([deep], machine=spec.name)
    edges, keyed, histories = _spec_edges(spec)
    edges, visited = _count_taken(spec, edges, keyed, timeline)
    current = run.state if run is not None else (timeline[-1].to_state if timeline else None)
    if current is not None and not spec.has_state(current):
        current = None
    status = run.status if run is not None else None
    if run is None and current is not None:
        status = spec.state(current).final_outcome
    failed = _failed_state(spec, current, status, timeline)
    if current is not None:
        visited.add(current)
    composites, nodes, order = _states(spec, visited, current, failed)
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


def taken_edges(spec: MachineSpec, timeline: Sequence[TransitionRecord]) -> list[int | None]:
    """For each transition, the index in ``extract(spec).edges`` of the spec edge it took.

    ``None`` for one that took none (an engine event, seq 0, a state the spec does not have).
    What ``extract(spec, timeline=[record])`` counts, for many records at the cost of one.
    """
    _edges, keyed, _histories = _spec_edges(spec)
    return [
        _taken(spec, keyed, record)
        if record.from_state is not None
        and spec.has_state(record.from_state)
        and spec.has_state(record.to_state)
        else None
        for record in timeline
    ]


def _count_taken(
    spec: MachineSpec,
    edges: list[Edge],
    keyed: _Keyed,
    timeline: Sequence[TransitionRecord],
) -> tuple[list[Edge], set[str]]:
    """The edges counted (how often the run took each), then the engine events; visited states.

    The engine events are those the run took without a spec transition, with their counts.
    Transitions that name a state the spec does not have are left out.
    """
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
    counted = [attrs.evolve(edge, count=count) for edge, count in zip(edges, counts, strict=True)]
    counted += [
        Edge(source, event, dest, kind="engine", count=count)
        for (source, event, dest), count in engine.items()
    ]
    return counted, visited


def _states(
    spec: MachineSpec, visited: set[str], current: str | None, failed: str | None
) -> tuple[list[Composite], list[Node], list[str]]:
    """The spec's composites, its leaves as nodes marked for the run, every name in order."""
    composites: list[Composite] = []
    nodes: list[Node] = []
    order: list[str] = []
    for state, parent in _walk(spec.states):
        order.append(state.name)
        if state.composite:
            children = [child.name for child in state.children]
            composites.append(Composite(state.name, parent, children, state.description))
            continue
        wait = spec.wait_of(state.name)
        label = state.name
        if wait is not None and wait.timeout is not None:
            label = f"{state.name} (waits {wait_duration(wait.timeout)})"
        nodes.append(
            Node(
                state.name,
                label=label,
                terminal=state.terminal,
                outcome=state.final_outcome if state.terminal else None,
                parent=parent,
                description=state.description,
                visited=state.name in visited,
                current=state.name == current,
                failed=state.name == failed,
                waiting=wait is not None,
                timeout=wait.timeout if wait is not None else None,
                prompt=wait.prompt if wait is not None else "",
            )
        )
    return composites, nodes, order
