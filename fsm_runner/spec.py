"""Declarative machine specs: states, transitions, retry policies, validation and a content hash.

A :class:`MachineSpec` is plain data (frozen attrs classes). It round-trips through a dict and
canonical JSON, and its :attr:`MachineSpec.spec_hash` identifies it: a run remembers the hash of
the spec it started with, and the journal keeps each spec's JSON so a run can be replayed and
drawn without importing the host app.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import attrs
import cattrs.gen

from fsm_runner import waiting
from fsm_runner._convert import by_value, converter
from fsm_runner._nesting import MAX_NESTING, data_too_deep, items, too_deep, walk
from fsm_runner._spec_checks import (
    graph_problems,
    guard_problems,
    handler_problem,
    registration_problems,
    transition_type_problems,
)
from fsm_runner.events import (
    INTERRUPTED,
    RESERVED_EVENTS,
    STATUS_EVENTS,
    PhaseStatus,
    RunEvent,
    event_name,
)
from fsm_runner.exceptions import SpecError
from fsm_runner.policies import RetryPolicy
from fsm_runner.waiting import Wait

__all__ = [
    "MAX_NESTING",
    "RETURN",
    "WILDCARD",
    "MachineSpec",
    "RetryPolicy",
    "RunLifecycle",
    "State",
    "Transition",
    "Wait",
]

#: A transition source that stands for every non-terminal state.
WILDCARD = "*"
#: A transition destination meaning "back to the state the run came from" (a history target):
#: a recovery state returns the run to the sub-phase that failed, never to one already done.
RETURN = "$return"
PHASE_COMPLETED = RunEvent.PHASE_COMPLETED.value


class RunLifecycle(str, enum.Enum):
    """Where a run is in its life: the status a ``RunRecord`` carries.

    ``active`` until it ends; then the outcome of its terminal state (``succeeded``, ``failed``,
    ``aborted``: what ``State(outcome=...)`` may say), or ``dead_letter`` when recovery parked
    it. (It was ``RunOutcome``, but ``active`` and ``dead_letter`` are no state's outcome.)
    """

    ACTIVE = "active"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ABORTED = "aborted"
    #: Not a state's outcome: a run parked by recovery after its worker was lost too often.
    DEAD_LETTER = "dead_letter"

    def __str__(self) -> str:
        return self.value


# The fields' converters never raise: a value of the wrong type is kept as it was given, and
# validate() names it with every other problem of the spec in one SpecError.


def _event_field(value: Any) -> str:
    try:
        return event_name(value)
    except TypeError:
        return cast(str, value)  # validate() names it


def _float_field(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return cast(float, value)  # validate() names it


def _items(value: Any) -> tuple[Any, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        return (value,)  # validate() names it


def _optional_kinds(value: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if value is None else _items(value)  # one kind given as a str is one kind


def _child_tuple(value: Iterable[State]) -> tuple[State, ...]:
    return _items(value)


def _optional_float(value: float | None) -> float | None:
    return None if value is None else _float_field(value)


def _optional_outcome(value: RunLifecycle | str | None) -> RunLifecycle | None:
    try:
        return None if value is None else RunLifecycle(value)
    except ValueError:
        return cast(RunLifecycle, value)  # validate() names it


@attrs.frozen
class State:
    """One state of a machine.

    Args:
        name: the state's name, a participle or adjective (``building``, ``succeeded``).
        handler: name of the phase handler run on entry; ``None`` for a state that waits for an
            external event (:meth:`fsm_runner.Engine.send`) and for terminal states.
        terminal: the run ends here; a terminal state has no exits and no handler.
        outcome: for a terminal state, how the run ended (``succeeded`` unless said otherwise).
        timeout: seconds the handler may take before the engine journals ``TIMEOUT``.
        retry: how often a raising handler is retried before ``SYSTEM_ERROR`` is followed.
        starts_iteration: entering this state starts a new iteration of the run.
        description: free text, shown in diagrams and ``fsm-runner show``.
        children: ordered sub-phases: this state is then a composite that a run is never in
            itself. Entering it enters its first child; each child's ``advance_on`` event
            leads to the next child, and the last child's to the composite's own exit for that
            event. A transition from the composite applies to every child (a child's own
            transitions come first). Child names are unique across the whole machine.
        advance_on: the event that moves a composite from one child to the next.
        allows: the kinds of operation (``read``, ``mutate``, ``topic_peek``,
            ``topic_publish`` or host-defined kinds) the phase may perform through
            ``ctx.effect``; ``None`` allows every kind.
        max_mutations: how many ``mutate`` effects one visit may perform; ``None`` for no limit.
        wait: for a state without a handler, how it waits (its deadline, what it asks); a
            non-terminal state without a handler waits for a signal even without one.
        signals: the signals the phase may wait for from inside (``ctx.wait_for(name)``):
            the run is parked where it is until one comes, then the phase runs again.
    """

    name: str
    handler: str | None = None
    terminal: bool = False
    outcome: RunLifecycle | None = attrs.field(default=None, converter=_optional_outcome)
    timeout: float | None = attrs.field(default=None, converter=_optional_float)
    retry: RetryPolicy | None = None
    starts_iteration: bool = False
    description: str = ""
    children: tuple[State, ...] = attrs.field(default=(), converter=_child_tuple)
    advance_on: str = attrs.field(default=PHASE_COMPLETED, converter=_event_field)
    allows: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_kinds)
    max_mutations: int | None = None
    wait: Wait | None = None
    signals: tuple[str, ...] = attrs.field(default=(), converter=_items)

    @property
    def composite(self) -> bool:
        """Whether this state has sub-phases."""
        return bool(self.children)

    @property
    def final_outcome(self) -> RunLifecycle:
        """How a run that enters this state stands afterwards."""
        if not self.terminal:
            return RunLifecycle.ACTIVE
        return self.outcome or RunLifecycle.SUCCEEDED


def _source_tuple(value: str | Iterable[str]) -> tuple[str, ...]:
    return _items(value)


@attrs.frozen
class Transition:
    """An edge: on ``event`` in any of ``source``, go to ``dest`` if the guards allow it.

    Args:
        source: a state name, several, or ``"*"`` for every non-terminal state.
        event: the event (a string or a str enum such as :class:`fsm_runner.RunEvent`).
        dest: the state the run moves to (a composite: its first sub-phase), or
            :data:`RETURN` for the state the run came from.
        guards: names of guards (registered with the engine) that must all return true.
        unless: names of guards that must all return false.
        reason: why a run takes this transition, recorded as the run's error when it does
            (for fallbacks such as ``"iteration limit spent"``).
    """

    source: tuple[str, ...] = attrs.field(converter=_source_tuple)
    event: str = attrs.field(converter=_event_field)
    dest: str
    guards: tuple[str, ...] = attrs.field(default=(), converter=_source_tuple)
    unless: tuple[str, ...] = attrs.field(default=(), converter=_source_tuple)
    reason: str = ""

    @property
    def guarded(self) -> bool:
        """Whether any guard decides if this transition is taken."""
        return bool(self.guards or self.unless)


def _str_mapping(value: Mapping[Any, Any] | None) -> Mapping[str, str]:
    return {
        (key.name if isinstance(key, PhaseStatus) else str(key)): _event_field(event)
        for key, event in (value or {}).items()
    }


def _state_tuple(value: Iterable[State]) -> tuple[State, ...]:
    return _items(value)


def _transition_tuple(value: Iterable[Transition]) -> tuple[Transition, ...]:
    return _items(value)


@attrs.frozen
class MachineSpec:
    """A whole machine: states, transitions and the initial state.

    Args:
        name: the machine's name (runs are listed by it).
        states: every state, in the order diagrams and listings show them.
        transitions: every edge; for one (state, event) pair, explicit sources are tried before
            wildcard ones, each in declaration order, and the first whose guards pass wins.
        initial: where runs start; the first state when not given (a composite: its first
            sub-phase).
        status_events: which event a handler's :class:`PhaseStatus` reports, by status name
            (``{"ERROR": "ANALYSIS_FAILED"}``); the standard mapping for the others.

    Building a spec never raises for a field of the wrong type: :meth:`validate` lists it with
    every other problem. A machine needs no terminal state: one without is a service loop whose
    runs are driven by a step budget or :meth:`fsm_runner.Engine.work` and end only by
    :meth:`fsm_runner.Engine.abort` (every run already can be aborted, and a spec that once
    passed must still compile for runs journaled under it). A non-terminal state that no
    transition leaves is still a problem (a dead end).
    """

    name: str
    states: tuple[State, ...] = attrs.field(converter=_state_tuple)
    transitions: tuple[Transition, ...] = attrs.field(converter=_transition_tuple)
    initial: str = attrs.field(default="")
    status_events: Mapping[str, str] = attrs.field(factory=dict, converter=_str_mapping)

    def __attrs_post_init__(self) -> None:
        if not self.initial and self.states and isinstance(self.states[0], State):
            object.__setattr__(self, "initial", self.states[0].name)

    @functools.cached_property
    def _by_name(self) -> dict[str, State]:
        found: dict[str, State] = {}
        for state in self._walk(self.states):
            if isinstance(state.name, str):  # any other name: validate() names it
                found.setdefault(state.name, state)
        return found

    @staticmethod
    def _walk(states: Iterable[State]) -> Iterator[State]:
        # anything but a State is skipped: validate() names it
        return (state for state, _chain in walk(states, State))

    @functools.cached_property
    def leaves(self) -> tuple[State, ...]:
        """The states a run can be in: every state that is not a composite, in order."""
        return tuple(state for state in self._walk(self.states) if not state.composite)

    @functools.cached_property
    def _parents(self) -> dict[str, tuple[str, ...]]:
        """Each state's enclosing composites, innermost first."""
        parents: dict[str, tuple[str, ...]] = {}
        for state, chain in walk(self.states, State):
            parents.setdefault(state.name, chain)
        return parents

    def parents(self, name: str) -> tuple[str, ...]:
        """The composites that enclose state ``name``, innermost first."""
        return self._parents.get(name, ())

    def entry_leaf(self, name: str) -> str:
        """The state a run enters for ``name``: a composite's first sub-phase (recursively)."""
        state = self._by_name[name]
        while state.composite:
            state = state.children[0]
        return state.name

    def exit_leaf(self, name: str) -> str:
        """A composite's last sub-phase (recursively); the state itself otherwise."""
        state = self._by_name[name]
        while state.composite:
            state = state.children[-1]
        return state.name

    def leaves_under(self, name: str) -> tuple[str, ...]:
        """The leaf states inside ``name`` (``name`` itself for a leaf)."""
        state = self._by_name[name]
        if not state.composite:
            return (name,)
        return tuple(s.name for s in self._walk(state.children) if not s.composite)

    @property
    def initial_leaf(self) -> str:
        """The state a new run starts in."""
        return self.entry_leaf(self.initial)

    def status_event(self, status: PhaseStatus) -> str:
        """The event a handler returning ``status`` reports."""
        return self.status_events.get(status.name) or STATUS_EVENTS[status].value

    @functools.cached_property
    def returning_states(self) -> frozenset[str]:
        """States with a :data:`RETURN` exit: entering one remembers where the run came from."""
        return frozenset(
            source
            for (source, _event), candidates in self.edges.items()
            if any(candidate.dest == RETURN for candidate in candidates)
        )

    def state(self, name: str) -> State:
        """Return the state called ``name``.

        Raises:
            KeyError: if there is no such state.
        """
        return self._by_name[name]

    def has_state(self, name: str) -> bool:
        """Whether the spec has a state called ``name``."""
        return isinstance(name, str) and name in self._by_name

    @property
    def terminal_states(self) -> tuple[str, ...]:
        """Names of the terminal states."""
        return tuple(state.name for state in self.leaves if state.terminal)

    def expand_source(self, transition: Transition) -> tuple[str, ...]:
        """The leaf states a transition leaves from.

        ``*`` is every non-terminal leaf, and a composite every leaf inside it.
        """
        if WILDCARD in transition.source:
            return tuple(state.name for state in self.leaves if not state.terminal)
        expanded: list[str] = []
        for source in transition.source:
            if source in self._by_name:
                expanded.extend(self.leaves_under(source))
            else:
                expanded.append(source)  # unknown: validate() names it
        return tuple(expanded)

    def _resolved(self, transition: Transition) -> Transition:
        dest = transition.dest
        if dest in self._by_name and self._by_name[dest].composite:
            return attrs.evolve(transition, dest=self.entry_leaf(dest))
        return transition

    @functools.cached_property
    def _edge_groups(self) -> dict[tuple[str, str], tuple[tuple[Transition, ...], ...]]:
        """Per (leaf, event), the candidate groups in the order they are tried.

        The leaf's own transitions; then, for each enclosing composite from the innermost
        out, its implicit move to its next child and then its own transitions; then
        wildcards. So a nested composite's own exit beats the outer one's implicit advance.
        """
        groups: dict[tuple[str, str], dict[int, list[Transition]]] = {}

        def add(key: tuple[str, str], rank: int, transition: Transition) -> None:
            groups.setdefault(key, {}).setdefault(rank, []).append(transition)

        for transition in self._well_typed_transitions:
            for leaf in self.expand_source(transition):
                if WILDCARD in transition.source:
                    rank = 1000
                elif leaf in transition.source:
                    rank = 0
                else:
                    chain = self.parents(leaf)
                    owner = next((p for p in chain if p in transition.source), None)
                    rank = 2 + 2 * (chain.index(owner) if owner is not None else 0)
                add((leaf, transition.event), rank, self._resolved(transition))
        for composite in self._walk(self.states):
            if not _is_text(composite.advance_on):
                continue  # validate() names it
            for current, following in itertools.pairwise(
                c for c in composite.children if isinstance(c, State)
            ):
                leaf = self.exit_leaf(current.name)
                # Just before the composite's own transitions, after those of everything inside
                # the child being left (which may itself be a composite with its own exit).
                add(
                    (leaf, composite.advance_on),
                    1 + 2 * self.parents(leaf).index(composite.name),
                    Transition(leaf, composite.advance_on, self.entry_leaf(following.name)),
                )
        return {
            key: tuple(tuple(ranked[rank]) for rank in sorted(ranked))
            for key, ranked in groups.items()
        }

    @functools.cached_property
    def _well_typed_transitions(self) -> tuple[Transition, ...]:
        """The transitions whose fields have the right types (validate() names the others)."""
        return tuple(
            transition
            for transition in self.transitions
            if isinstance(transition, Transition) and not list(transition_type_problems(transition))
        )

    @functools.cached_property
    def edges(self) -> dict[tuple[str, str], tuple[Transition, ...]]:
        """Candidate transitions per (leaf state, event), in the order they are tried.

        Composite destinations are resolved to their first sub-phase.
        """
        return {
            key: tuple(candidate for group in groups for candidate in group)
            for key, groups in self._edge_groups.items()
        }

    def events_from(self, state: str) -> tuple[str, ...]:
        """The events that have at least one transition out of ``state``."""
        return self._events_by_state.get(state, ())

    @functools.cached_property
    def _events_by_state(self) -> dict[str, tuple[str, ...]]:
        found: dict[str, list[str]] = {}
        for source, event in self.edges:
            found.setdefault(source, []).append(event)
        return {source: tuple(events) for source, events in found.items()}

    @functools.cached_property
    def waiting_states(self) -> frozenset[str]:
        """The states a run waits in: non-terminal states without a handler (see :class:`Wait`)."""
        return frozenset(waiting.waiting_leaves(self.leaves))

    @functools.cached_property
    def _accepted(self) -> dict[str, frozenset[str]]:
        return waiting.accepted_signals(self.waiting_states, self.edges, self._by_name)

    def accepts(self, state: str) -> frozenset[str]:
        """The signals a run waiting in ``state`` accepts (:func:`.waiting.accepted_signals`)."""
        return self._accepted.get(state, frozenset())

    @functools.cached_property
    def signal_names(self) -> frozenset[str]:
        """Every signal some waiting state, or some phase, accepts: another one is refused."""
        return waiting.signal_names(self._accepted, self.leaves)

    def wait_of(self, state: str) -> Wait | None:
        """How ``state`` waits: its :class:`Wait` (a bare one if it has none), or ``None``."""
        if state not in self.waiting_states:
            return None
        wait = self._by_name[state].wait
        return wait if isinstance(wait, Wait) else Wait()

    @property
    def handler_names(self) -> frozenset[str]:
        """Every handler name the states refer to."""
        return frozenset(
            state.handler
            for state in self.leaves
            if state.handler and isinstance(state.handler, str)
        )

    @property
    def guard_names(self) -> frozenset[str]:
        """Every guard name the transitions refer to."""
        return frozenset(
            name
            for transition in self._well_typed_transitions
            for name in transition.guards + transition.unless
        )

    def validate(
        self,
        *,
        handlers: Collection[str] | Mapping[str, object] | None = None,
        guards: Collection[str] | Mapping[str, object] | None = None,
    ) -> None:
        """Check the spec and raise one :class:`SpecError` listing every problem.

        Problems: sub-phases nested deeper than :data:`MAX_NESTING` (then the only one named),
        fields of the wrong type or holding text UTF-8 cannot store, unknown or
        unreachable states, non-terminal dead ends, terminal states with exits or handlers,
        ambiguous (state, event) pairs, timeouts and retry waits that are not finite numbers,
        handlers and guards named but not registered.

        Args:
            handlers: the handler names registered with the engine; when given, a handler that
                a state names but that is not registered is a problem.
            guards: likewise for guard names.

        Raises:
            SpecError: with ``problems`` holding one line per problem.
        """
        problems = list(self._problems(handlers, guards))
        if problems:
            raise SpecError(problems, machine=self.name)

    def _problems(
        self,
        handlers: Collection[str] | Mapping[str, object] | None,
        guards: Collection[str] | Mapping[str, object] | None,
    ) -> Iterator[str]:
        if self._own_problems:
            yield from (
                self._own_problems if handlers is guards is None else self._all(handlers, guards)
            )
            return
        given = enumerate(self.transitions) if guards is not None else ()
        labelled = ((_transition_label(i, t), t) for i, t in given)
        yield from registration_problems(self._walk(self.states), labelled, handlers, guards)

    @functools.cached_property
    def _own_problems(self) -> tuple[str, ...]:
        """The problems of the spec itself, found once: it is frozen."""
        return tuple(self._all(None, None))

    def _all(
        self,
        handlers: Collection[str] | Mapping[str, object] | None,
        guards: Collection[str] | Mapping[str, object] | None,
    ) -> Iterator[str]:
        deep = too_deep(self.states)
        if deep is not None:  # the other checks walk the tree: one problem, before them
            yield deep
            return
        yield from self._type_problems()
        yield from self._state_problems(handlers)
        yield from self._transition_problems(guards)
        if self.has_state(self.initial):
            yield from graph_problems(self)

    def _type_problems(self) -> Iterator[str]:
        """Fields of the wrong type, and text that UTF-8 (so no journal) can store."""
        yield from _text_problems("the machine's name", self.name)
        if not _is_text(self.initial):
            yield f"initial state {self.initial!r} is not a str"
        for key, event in self.status_events.items():
            yield from _text_problems(f"status_events[{key!r}]", event, kind="a str or a str enum")

        for state, index, parent in items(self.states, State):
            if not isinstance(state, State):
                where = "states" if parent is None else f"state {parent.name!r}: children"
                yield f"{where}[{index}] is not a State: {state!r:.80}"
            else:
                yield from _state_type_problems(state)
        given: tuple[Any, ...] = self.transitions
        for index, transition in enumerate(given):
            if not isinstance(transition, Transition):
                yield f"transitions[{index}] is not a Transition: {transition!r:.80}"
                continue
            for problem in transition_type_problems(transition):
                yield f"{_transition_label(index, transition)}: {problem}"

    def _state_problems(  # noqa: PLR0912 - one flat list of independent checks reads best
        self, handlers: Collection[str] | Mapping[str, object] | None
    ) -> Iterator[str]:
        if not self.name:
            yield "the machine has no name"
        if not self.states:
            yield "the machine has no states"
        seen: set[str] = set()
        for state in self._walk(self.states):
            named = isinstance(state.name, str)  # other names: _type_problems() names them
            if named and (not state.name or state.name == WILDCARD or state.name.startswith("$")):
                yield f"invalid state name {state.name!r}"
            if isinstance(state.max_mutations, int) and state.max_mutations < 0:
                yield f"state {state.name!r} has max_mutations < 0"
            if (state.composite or state.terminal) and (
                state.allows is not None or state.max_mutations is not None
            ):
                yield (
                    f"state {state.name!r} declares capabilities, but only phases with handlers"
                    " perform effects (declare them on each sub-phase)"
                )
            if state.composite and (state.handler or state.terminal or state.timeout):
                yield f"composite {state.name!r} cannot have a handler or timeout, or be terminal"
            if named and state.name in seen:
                yield f"state {state.name!r} is declared twice"
            if named:
                seen.add(state.name)
            if state.terminal and state.handler:
                yield f"terminal state {state.name!r} has a handler ({state.handler!r})"
            if not state.terminal and state.outcome is not None:
                yield f"non-terminal state {state.name!r} has an outcome"
            if state.terminal and state.outcome in (RunLifecycle.ACTIVE, RunLifecycle.DEAD_LETTER):
                yield f"terminal state {state.name!r} cannot have outcome {state.outcome.value!r}"
            if isinstance(state.timeout, float) and state.timeout <= 0:
                yield f"state {state.name!r} has a timeout <= 0"
            if isinstance(state.retry, RetryPolicy):
                yield from (f"state {state.name!r}: {p}" for p in state.retry.problems())
            yield from waiting.state_problems(self, state)
            unregistered = handler_problem(state, handlers)
            if unregistered is not None:
                yield unregistered
        if self.states and not self.has_state(self.initial):
            yield f"initial state {self.initial!r} is not a state"
        elif self.states and self.state(self.entry_leaf(self.initial)).terminal:
            yield f"initial state {self.initial!r} is terminal"
        for key in self.status_events:
            if key not in PhaseStatus.__members__:
                yield f"status_events names {key!r}, which is not a PhaseStatus"

    def _transition_problems(  # noqa: PLR0912 - one flat list of independent checks
        self, guards: Collection[str] | Mapping[str, object] | None
    ) -> Iterator[str]:
        given: tuple[Any, ...] = self.transitions
        for index, transition in enumerate(given):
            if not isinstance(transition, Transition):
                continue  # _type_problems() names it
            label = _transition_label(index, transition)
            if _is_text(transition.event) and not transition.event:
                yield f"{label} has no event"
            if not transition.source:
                yield f"{label} has no source"
            for source in transition.source:
                if source == WILDCARD or not isinstance(source, str):
                    continue
                if not self.has_state(source):
                    yield f"{label}: unknown source state {source!r}"
                elif self.state(source).terminal:
                    yield f"{label}: terminal state {source!r} has an exit"
            if (
                isinstance(transition.dest, str)
                and transition.dest != RETURN
                and not self.has_state(transition.dest)
            ):
                yield f"{label}: unknown destination state {transition.dest!r}"
            if not _is_text(transition.event):
                pass  # _type_problems() names it
            elif transition.event in RESERVED_EVENTS:
                yield f"{label}: {transition.event} is journaled by the engine alone"
            elif transition.event == INTERRUPTED and transition.dest in (
                *transition.source,
                WILDCARD,
            ):
                # the engine's own interruption is that self transition (the same visit, run
                # again); a spec's would read the same in the journal and replay differently
                yield f"{label}: an INTERRUPTED self transition is the engine's own"
            yield from guard_problems(label, transition, guards)
        for (state, event), groups in self._edge_groups.items():
            # A more specific source overrides a wider one on purpose (a leaf its composite, a
            # composite the wildcard); ambiguity is within each group.
            if any(not c.guarded for group in groups for c in group[:-1]):
                candidates = [c for group in groups for c in group]
                dests = ", ".join(candidate.dest for candidate in candidates)
                yield (
                    f"ambiguous: state {state!r} has {len(candidates)} transitions on {event!r} "
                    f"(to {dests}) and an unguarded one is not the last"
                )

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (fields equal to their default are left out).

        Raises:
            SpecError: if sub-phases nest deeper than :data:`MAX_NESTING`.
        """
        deep = too_deep(self.states)
        if deep is not None:  # cattrs writes the tree recursively
            raise SpecError([deep], machine=self.name)
        data: dict[str, Any] = converter.unstructure(self)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MachineSpec:
        """Build a spec from :meth:`to_dict` output (or hand-written data of the same shape).

        Raises:
            SpecError: if the data does not describe a spec.
        """
        deep = data_too_deep(data)
        if deep is not None:  # cattrs reads the tree recursively
            name = data.get("name")
            raise SpecError([deep], machine=name if isinstance(name, str) else None)
        try:
            return converter.structure(dict(data), cls)
        except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
            raise SpecError([f"cannot read spec data: {exc}"]) from None

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace; the input of :attr:`spec_hash`."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> MachineSpec:
        """Build a spec from :meth:`to_json` output.

        Raises:
            SpecError: if the text is not JSON describing a spec.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SpecError([f"spec JSON is not valid: {exc}"]) from None
        except RecursionError:  # the json module reads nested values recursively
            deep = f"sub-phases may nest at most {MAX_NESTING} levels"
            raise SpecError([f"spec JSON is nested too deep to read: {deep}"]) from None
        if not isinstance(data, dict):
            raise SpecError(["spec JSON must be an object"])
        return cls.from_dict(data)

    @functools.cached_property
    def spec_hash(self) -> str:
        """SHA-256 of the canonical JSON: the same spec always has the same hash."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _transition_label(index: int, transition: Transition) -> str:
    return f"transition #{index} ({'|'.join(map(str, transition.source))} -{transition.event}->)"


_text_problems = waiting.text_problems


def _state_type_problems(state: State) -> Iterator[str]:
    where = f"state {state.name!r:.80}"
    yield from _text_problems("state name", state.name)
    if state.handler is not None:
        yield from _text_problems(f"{where}: handler", state.handler)
    for flag in ("terminal", "starts_iteration"):
        if not isinstance(getattr(state, flag), bool):
            yield f"{where}: {flag} must be True or False, not {getattr(state, flag)!r:.80}"
    outcome: Any = state.outcome
    if outcome is not None and not isinstance(outcome, RunLifecycle):
        outcomes = ", ".join(
            o.value for o in (RunLifecycle.SUCCEEDED, RunLifecycle.FAILED, RunLifecycle.ABORTED)
        )
        yield f"{where}: outcome {outcome!r:.80} is not one of {outcomes}"
    if state.timeout is not None and not (
        isinstance(state.timeout, float) and math.isfinite(state.timeout)
    ):
        yield f"{where}: timeout must be a finite number of seconds, not {state.timeout!r:.80}"
    retry: Any = state.retry
    if retry is not None and not isinstance(retry, RetryPolicy):
        yield f"{where}: retry {retry!r:.80} is not a RetryPolicy"
    yield from _text_problems(f"{where}: description", state.description)
    yield from _text_problems(f"{where}: advance_on", state.advance_on, kind="a str or a str enum")
    for kind in state.allows or ():
        yield from _text_problems(f"{where}: allows", kind)
    if state.max_mutations is not None and (
        not isinstance(state.max_mutations, int) or isinstance(state.max_mutations, bool)
    ):
        yield f"{where}: max_mutations must be an integer, not {state.max_mutations!r:.80}"


def _structure_transition(data: Mapping[str, Any], _: type) -> Transition:
    fields = dict(data)
    for key in ("source", "guards", "unless"):
        if isinstance(fields.get(key), str):
            fields[key] = [fields[key]]
    return _transition_from_dict(fields)


by_value(RunLifecycle)
_transition_from_dict = cattrs.gen.make_dict_structure_fn(Transition, converter)
converter.register_structure_hook(Transition, _structure_transition)


if not TYPE_CHECKING:  # type checkers see only the new name

    def __getattr__(name: str) -> Any:
        if name in ("Outcome", "RunOutcome"):  # old names, deprecated: see fsm_runner._DEPRECATED
            from fsm_runner._deprecation import deprecated  # noqa: PLC0415

            return deprecated(__name__, name, "RunLifecycle", RunLifecycle)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
