"""Checks of ``MachineSpec.validate()``, each one linear in the spec.

The reachability of every state and the dead ends (one pass over the edges to index each
state's destinations, then a breadth-first walk), the handlers and guards a spec names but the
engine has not registered, and a transition's fields of the wrong type. They live here, not
in :mod:`fsm_runner.spec`, which reads them through the small protocols below (this module
cannot import spec).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Protocol

from fsm_runner.waiting import text_problems

__all__ = [
    "graph_problems",
    "guard_problems",
    "handler_problem",
    "registration_problems",
    "transition_type_problems",
]

#: Names registered with the engine (a collection, or a mapping by name).
Registered = Collection[str] | Mapping[str, object]


class _State(Protocol):
    @property
    def name(self) -> object: ...
    @property
    def handler(self) -> str | None: ...
    @property
    def terminal(self) -> bool: ...


class _Candidate(Protocol):
    @property
    def dest(self) -> str: ...


class _Transition(Protocol):
    @property
    def source(self) -> tuple[str, ...]: ...
    @property
    def event(self) -> str: ...
    @property
    def dest(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def guards(self) -> tuple[str, ...]: ...
    @property
    def unless(self) -> tuple[str, ...]: ...


class _Spec(Protocol):
    @property
    def initial(self) -> str: ...
    @property
    def initial_leaf(self) -> str: ...
    @property
    def leaves(self) -> tuple[_State, ...]: ...
    @property
    def edges(self) -> Mapping[tuple[str, str], tuple[_Candidate, ...]]: ...
    def has_state(self, name: str) -> bool: ...


def graph_problems(spec: _Spec) -> Iterator[str]:
    """States no run can reach from the initial one, and non-terminal states without exits."""
    dests: dict[str, list[str]] = {}  # each leaf's destinations, from one pass over the edges
    for (source, _event), candidates in spec.edges.items():
        dests.setdefault(source, []).extend(candidate.dest for candidate in candidates)
    start = spec.initial_leaf
    reachable = {start}
    queue = deque([start])
    while queue:
        for dest in dests.get(queue.popleft(), ()):
            if dest not in reachable and spec.has_state(dest):
                reachable.add(dest)
                queue.append(dest)
    for state in spec.leaves:
        if not isinstance(state.name, str):
            continue  # validate() names it among the fields of the wrong type
        if state.name not in reachable:
            yield f"state {state.name!r} is unreachable from {spec.initial!r}"
        if not state.terminal and state.name not in dests:
            yield f"non-terminal state {state.name!r} is a dead end (no transition leaves it)"


def handler_problem(state: _State, handlers: Registered | None) -> str | None:
    """The problem of a handler ``state`` names but ``handlers`` does not hold, if any."""
    if (
        handlers is not None
        and isinstance(state.handler, str)
        and state.handler
        and state.handler not in handlers
    ):
        return f"state {state.name!r} names handler {state.handler!r}, not registered"
    return None


def guard_problems(label: str, transition: _Transition, guards: Registered | None) -> Iterator[str]:
    """The guards ``transition`` names but ``guards`` does not hold."""
    if guards is not None:
        for name in transition.guards + transition.unless:
            if isinstance(name, str) and name not in guards:
                yield f"{label}: guard {name!r} is not registered"


def registration_problems(
    states: Iterable[_State],
    transitions: Iterable[tuple[str, _Transition]],
    handlers: Registered | None,
    guards: Registered | None,
) -> Iterator[str]:
    """The unregistered handlers, then guards, of a spec that has no other problem.

    ``validate()`` lists them among the checks of each state and transition; when nothing else
    is wrong they come in this same order, so a valid spec's own checks are done once (cached)
    and an engine's registrations are checked on their own.
    """
    for state in states:
        problem = handler_problem(state, handlers)
        if problem is not None:
            yield problem
    for label, transition in transitions:
        yield from guard_problems(label, transition, guards)


def transition_type_problems(transition: _Transition) -> Iterator[str]:
    """A transition's fields that are not text, or text that UTF-8 cannot store."""
    texts = (*transition.source, *transition.guards, *transition.unless, transition.reason)
    if all(type(text) is str and text.isascii() for text in (*texts, transition.event)) and (
        type(transition.dest) is str and transition.dest.isascii()
    ):
        return  # the common case, at a glance: a spec may have tens of thousands of transitions
    for source in transition.source:
        yield from text_problems("source", source)
    yield from text_problems("event", transition.event, kind="a str or a str enum")
    yield from text_problems("destination", transition.dest)
    for guard in transition.guards + transition.unless:
        yield from text_problems("guard", guard)
    yield from text_problems("reason", transition.reason)
