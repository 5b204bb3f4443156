"""Which of the engine's rules a transition follows: its :data:`StepKind`, or what is wrong with it.

The engine knows the kind of each transition it builds (it retries, aborts, parks, rewinds);
a journaled transition has to be read back. The rules for both live here, once, as pure
functions of the spec, the run row before the transition and the transition: no journal, no
I/O. :mod:`fsm_runner.replay` reads every journaled transition with :func:`classify`; the
reducer asks :func:`abort_stops` where an abort ends; :func:`retries_left` is the rule by which
the engine retries a failed attempt (``rules.decisions.retry_wait``).

The rules: seq 0 is ``STARTED`` from no state into the spec's initial leaf; then, per
transition:

* ``RETRIED`` and ``INTERRUPTED`` self transitions are the engine's own (the next attempt of
  the visit: a ``retry``, an ``interruption``); a ``RETRIED`` needs a retry policy with
  attempts left (or a spec edge on ``RETRIED``);
* ``USER_ABORTED`` from a state without a ``USER_ABORTED`` exit is a ``stop`` where the run is;
* ``SPEC_CHANGED`` in place is a ``spec_change`` (the run goes on under another spec);
* ``DEAD_LETTERED`` is a ``park`` where the run is;
* ``REWOUND`` is a ``rewind`` to a non-terminal state the run was in before;
* anything else follows a spec edge of the state: a ``transition``, or a ``return`` where the
  edge's destination is RETURN and leads to the state the run came from. Guards are not
  evaluated (they need the host app), so any candidate counts; where a guarded edge and a
  RETURN lead to the same state, the transition's ``result["returned"]`` tells them apart.

A ``RETRIED`` or ``INTERRUPTED`` self transition is always read as the engine's own, even where
a spec declares such a self transition for a handler to take: the journal cannot tell the two
apart.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import attrs

from fsm_runner.events import (
    DEAD_LETTERED,
    INTERRUPTED,
    RETRIED,
    REWOUND,
    SPEC_CHANGED,
    STARTED,
    USER_ABORTED,
    WAITING,
    WOKEN,
)
from fsm_runner.records import RunRecord, TransitionRecord
from fsm_runner.spec import RETURN, MachineSpec, RunLifecycle, State

__all__ = [
    "Problem",
    "Reading",
    "StepKind",
    "abort_stops",
    "classify",
    "classify_start",
    "leaf",
    "output_text",
    "plain_reads",
    "retries_left",
]

#: How a transition is read: the ``start`` (seq 0); a spec ``transition``; a ``return`` (a
#: RETURN candidate); the engine's ``retry`` (``RETRIED``) or ``interruption``
#: (``INTERRUPTED``), both continuing the visit; a ``stop`` in place (``USER_ABORTED`` where the
#: state has no exit for it); a ``rewind`` (``REWOUND``); a ``park`` (``DEAD_LETTERED``:
#: recovery gave up on the run where it stood); a ``spec_change`` (``SPEC_CHANGED``: the run
#: goes on under another spec); a ``wait`` (``WAITING``: a phase parked the run where it is, to
#: wait for a signal or a time; ``WOKEN``: what woke it, before the phase runs again).
StepKind = Literal[
    "start",
    "transition",
    "return",
    "retry",
    "interruption",
    "stop",
    "rewind",
    "park",
    "spec_change",
    "wait",
]


@attrs.frozen
class Problem:
    """What the rules expected of a transition, and what it holds instead.

    Attributes:
        expected: what the rules expected (``state 'b'``).
        found: what the transition holds (``state 'c'``).
    """

    expected: str
    found: str


@attrs.frozen
class Reading:
    """How a transition is read, and every rule it breaks (none when it is as the engine writes).

    Attributes:
        kind: the rule it is read by (the nearest one, when it breaks them).
        problems: what is wrong with it, in the order the rules are checked.
    """

    kind: StepKind
    problems: tuple[Problem, ...] = ()


def leaf(spec: MachineSpec, name: str) -> State | None:
    """The leaf state called ``name``, or ``None`` (a journal may name what a spec lacks)."""
    if not spec.has_state(name):
        return None
    state = spec.state(name)
    return None if state.composite else state


#: The engine's own events: never read by the spec's edges alone (see :func:`_engine_kind`).
_ENGINE_EVENTS = frozenset(
    {RETRIED, INTERRUPTED, USER_ABORTED, SPEC_CHANGED, WAITING, WOKEN, DEAD_LETTERED, REWOUND}
)
#: How a plain read enters its destination: the run's status there, whether it starts an
#: iteration, whether it has a RETURN exit.
PlainEntry = tuple[RunLifecycle, bool, bool]
#: :func:`plain_reads` of the specs read lately, by identity (a spec's table, not its value).
_PLAIN_READS: dict[int, tuple[MachineSpec, dict[tuple[str, str, str], PlainEntry]]] = {}
_PLAIN_READS_KEPT = 64


def plain_reads(spec: MachineSpec) -> Mapping[tuple[str, str, str], PlainEntry]:
    """The transitions read as a spec ``transition`` by their state, event and destination alone.

    (state, event, destination) -> how the destination, a leaf, is entered: for a spec edge of
    an event that is not the engine's, whose candidates hold no RETURN (:func:`classify` reads
    any such transition to one of its candidates' destinations as a ``transition``, and finds
    no problem in it but a lease token going back). Built once a spec: a check reads every run
    through it (:mod:`fsm_runner.replay`).
    """
    kept = _PLAIN_READS.get(id(spec))
    if kept is not None and kept[0] is spec:
        return kept[1]
    table: dict[tuple[str, str, str], PlainEntry] = {}
    returning = spec.returning_states
    for (state, event), candidates in spec.edges.items():
        if event in _ENGINE_EVENTS or any(c.dest == RETURN for c in candidates):
            continue
        for candidate in candidates:
            entered = leaf(spec, candidate.dest)
            if entered is not None:
                table[state, event, candidate.dest] = (
                    entered.final_outcome,
                    entered.starts_iteration,
                    candidate.dest in returning,
                )
    if len(_PLAIN_READS) >= _PLAIN_READS_KEPT:
        _PLAIN_READS.clear()  # a race only costs a table built again
    _PLAIN_READS[id(spec)] = (spec, table)
    return table


def abort_stops(spec: MachineSpec, state: str) -> bool:
    """Whether ``USER_ABORTED`` stops a run in ``state`` where it is (no exit for it there)."""
    return (state, USER_ABORTED) not in spec.edges


def retries_left(state: State, attempt: int) -> bool:
    """Whether ``state``'s retry policy allows another attempt after attempt ``attempt``."""
    return state.retry is not None and attempt < state.retry.max_attempts


def output_text(transition: TransitionRecord, name: str) -> str | None:
    """The string the transition's ``output`` holds under ``name`` (``to_spec``), if any."""
    output = transition.output
    value = output.get(name) if isinstance(output, Mapping) else None
    return value if isinstance(value, str) else None


def classify_start(spec: MachineSpec, transition: TransitionRecord) -> Reading:
    """Read a run's transition seq 0: ``STARTED`` from no state into the spec's initial leaf.

    Returns:
        The kind ``start``, and the problems found (another event or a source state, another
        destination).
    """
    problems: list[Problem] = []
    event, dest = transition.event, transition.to_state
    if transition.from_state is not None or event != STARTED:
        origin = f"state {transition.from_state!r}" if transition.from_state else "no state"
        problems.append(Problem(f"{STARTED} from no state", f"{event} from {origin}"))
    initial = spec.initial_leaf
    if dest != initial:
        problems.append(Problem(f"state {initial!r}", f"state {dest!r}"))
    return Reading("start", tuple(problems))


def classify(
    spec: MachineSpec, prev: RunRecord, transition: TransitionRecord, *, visited: Collection[str]
) -> Reading:
    """Read a journaled transition (not seq 0) the way the engine would have written it.

    Args:
        spec: the spec the run was under before the transition.
        prev: the run row before the transition.
        transition: the transition.
        visited: the states the run entered before it (a rewind goes back to one of them).

    Returns:
        Its kind, and the problems found (a lease token going back, an event the state does not
        allow, a destination no rule leads to, a retry beyond the policy's attempts, ...).
    """
    problems: list[Problem] = []
    if transition.lease_token < prev.lease_token:  # fencing: tokens never go back
        problems.append(
            Problem(
                f"lease token {prev.lease_token} or later", f"lease token {transition.lease_token}"
            )
        )
    kind = _engine_kind(spec, prev, transition, visited, problems)
    if kind is None:
        kind = _spec_kind(spec, prev, transition, problems)
    return Reading(kind, tuple(problems))


def _engine_kind(  # noqa: PLR0911 - one return per engine event reads best
    spec: MachineSpec,
    prev: RunRecord,
    transition: TransitionRecord,
    visited: Collection[str],
    problems: list[Problem],
) -> StepKind | None:
    """The engine's own use of an engine event, if the transition is one."""
    state, event, dest = prev.state, transition.event, transition.to_state
    if event in (RETRIED, INTERRUPTED) and dest == state:
        if event == RETRIED:
            problems.extend(_retry_problems(spec, prev))
            return "retry"
        return "interruption"
    if event == USER_ABORTED and abort_stops(spec, state):
        if dest != state:
            problems.append(
                Problem(f"state {state!r} (it has no {USER_ABORTED} exit)", f"state {dest!r}")
            )
        return "stop"
    if event == SPEC_CHANGED and dest == state:
        return "spec_change"
    if event in (WAITING, WOKEN):
        if dest != state:
            problems.append(
                Problem(f"state {state!r} (a phase waits where it is)", f"state {dest!r}")
            )
        return "wait"
    if event == DEAD_LETTERED:
        if dest != state:
            problems.append(
                Problem(f"state {state!r} (a run is parked where it is)", f"state {dest!r}")
            )
        return "park"
    if event == REWOUND:
        target = leaf(spec, dest)
        if target is None or target.terminal or dest not in visited:
            problems.append(
                Problem("a rewind to a non-terminal state the run was in", f"state {dest!r}")
            )
        return "rewind"
    return None


def _retry_problems(spec: MachineSpec, prev: RunRecord) -> list[Problem]:
    """What is wrong with a ``RETRIED`` from ``prev``: no policy, or no attempts left."""
    state = leaf(spec, prev.state)
    if state is None or state.retry is None:
        if (prev.state, RETRIED) in spec.edges:
            return []
        return [Problem(f"no {RETRIED} (state {prev.state!r} has no retry policy)", RETRIED)]
    if retries_left(state, prev.attempt):
        return []
    return [
        Problem(
            f"at most {state.retry.max_attempts} attempts of state {prev.state!r}",
            f"{RETRIED} after attempt {prev.attempt}",
        )
    ]


def _spec_kind(
    spec: MachineSpec, prev: RunRecord, transition: TransitionRecord, problems: list[Problem]
) -> StepKind:
    """The spec edge the transition follows: a ``transition`` or a ``return``."""
    state, event, dest = prev.state, transition.event, transition.to_state
    candidates = spec.edges.get((state, event))
    if not candidates:
        problems.append(Problem(f"an event that state {state!r} allows", f"event {event!r}"))
        return "transition"
    targets = [prev.return_to if c.dest == RETURN else c.dest for c in candidates]
    kinds: set[StepKind] = {
        "return" if candidate.dest == RETURN else "transition"
        for candidate, target in zip(candidates, targets, strict=True)
        if target == dest
    }
    if len(kinds) > 1:  # a guarded edge and a RETURN to the same state: the journal says
        returned = isinstance(transition.result, Mapping) and transition.result.get("returned")
        return "return" if returned else "transition"
    if kinds:
        return kinds.pop()
    problems.append(Problem(_states(targets), f"state {dest!r}"))
    return "transition"


def _states(names: Sequence[str | None]) -> str:
    shown = dict.fromkeys(
        repr(name) if name is not None else "(a RETURN, with nowhere to return to)"
        for name in names
    )
    return "state " + " or ".join(shown)
