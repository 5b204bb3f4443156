"""Hypothesis strategies for fsm_runner: random valid machine specs, and scripts to run them.

Attrs-style: each strategy is a function returning a strategy. Specs are valid *by
construction* (never filtered), so every example counts and shrinking walks towards smaller
machines: fewer units, leaves instead of composites, no retry policies, no extra edges.

A spec is built around a *spine* that makes it valid: top-level units (a leaf with a handler,
or a composite of sub-phases, nested at most twice) chained by ``NEXT`` (a composite by its
``advance_on`` event) and ending in the first terminal state. Every non-terminal leaf is then
reachable and has an exit. On top of the spine come the risky parts, each optional:

* a ``recovering`` state that ``SERVER_UNREACHABLE`` leads to and that ``RECOVERED`` leaves
  through a :data:`fsm_runner.RETURN` history target;
* more terminal states (``succeeded`` / ``failed`` / ``aborted`` outcomes), each reached by an
  edge from a unit or from the wildcard ``*``;
* a wildcard ``SYSTEM_ERROR`` exit, retry policies, timeouts, ``starts_iteration`` states,
  states without a handler (they wait for an external event);
* extra edges from any non-terminal state (a leaf, a composite or ``*``) on any event of a small
  vocabulary to any state or to RETURN, optionally guarded by :data:`GUARDS` (deterministic
  functions of the run row) or carrying a ``reason``.

For one (source, event) the unguarded candidate always comes last, which is what
``MachineSpec.validate()`` asks; the strategy still calls it, so a bug here fails loudly.

A *script* (:func:`moves`) is what the world does to one run, one :class:`Move` per step: the
event a phase handler returns (chosen by index among those its state allows, so shrinking keeps
it meaningful; with a context update, an output, an iteration update), a status, a phase that
overruns its timeout, a handler exception, a Ctrl-C, a disallowed event, a result that is not a
result, an unserialisable output, or an operator's action (an external event, an abort, a
rewind).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from hypothesis import strategies as st

from fsm_runner import (
    RETURN,
    WILDCARD,
    MachineSpec,
    PhaseStatus,
    RetryPolicy,
    RunEvent,
    SpecError,
    State,
    Transition,
)

NEXT = "NEXT"
RECOVERED = "RECOVERED"
SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
SERVER_UNREACHABLE = RunEvent.SERVER_UNREACHABLE.value
USER_ABORTED = RunEvent.USER_ABORTED.value
TIMEOUT = RunEvent.TIMEOUT.value
#: What composites advance on.
ADVANCE_EVENTS = (RunEvent.PHASE_COMPLETED.value, "STEP_DONE")
#: Events of the extra edges (never one the engine alone journals).
EVENTS = (
    NEXT,
    "BACK",
    "SKIP",
    RunEvent.PHASE_FAILED.value,
    SERVER_UNREACHABLE,
    SYSTEM_ERROR,
    TIMEOUT,
    USER_ABORTED,
    RECOVERED,
    *ADVANCE_EVENTS,
)
#: An event no spec of :func:`machine_specs` has: always refused.
BAD_EVENT = "NEVER_DECLARED"

#: Guards by name: deterministic functions of the run row, so a resumed run decides as an
#: uninterrupted one would.
GUARDS: Mapping[str, Callable[[Any], bool]] = {
    "seq_even": lambda run: run.seq % 2 == 0,
    "flagged": lambda run: bool(run.context.get("flag")),
}

OUTCOMES = ("succeeded", "failed", "aborted")
TERMINAL_NAMES = {"succeeded": "done", "failed": "failed", "aborted": "canceled"}

# -- specs ---------------------------------------------------------------------------------


def retry_policies() -> st.SearchStrategy[RetryPolicy]:
    """Retry policies of 1-3 attempts (waits go through the tests' fake clock)."""
    return st.builds(
        RetryPolicy,
        max_attempts=st.integers(1, 3),
        wait_initial=st.sampled_from([0.0, 0.5]),
        wait_max=st.just(2.0),
    )


@attrs.define
class _Names:
    """Hands out unique state names: leaves ``p0, p1 …``, composites ``c0, c1 …``."""

    leaves: itertools.count[int] = attrs.field(factory=itertools.count)
    composites: itertools.count[int] = attrs.field(factory=itertools.count)

    def leaf(self) -> str:
        return f"p{next(self.leaves)}"

    def composite(self) -> str:
        return f"c{next(self.composites)}"


_COMPOSITE_ODDS = st.integers(0, 3)  # 3: a composite
_CHILD_COUNTS = st.integers(2, 3)
_ADVANCE_ON = st.sampled_from(ADVANCE_EVENTS)
_RETRIES = st.none() | retry_policies()
_TIMEOUTS = st.none() | st.just(5.0)
_BOOLEANS = st.booleans()
_WAITING_ODDS = st.integers(0, 7)  # 7: a state without handler, waiting for an external event


def _unit(draw: st.DrawFn, names: _Names, depth: int) -> State:
    """A leaf with a handler (mostly), or a composite of 2-3 units (up to two levels deep)."""
    if depth < 2 and draw(_COMPOSITE_ODDS) == 3:
        name = names.composite()
        children = [_unit(draw, names, depth + 1) for _ in range(draw(_CHILD_COUNTS))]
        return State(name, children=children, advance_on=draw(_ADVANCE_ON))
    name = names.leaf()
    if draw(_WAITING_ODDS) == 7:
        return State(name, starts_iteration=draw(_BOOLEANS))
    return State(
        name,
        handler=name,
        retry=draw(_RETRIES),
        timeout=draw(_TIMEOUTS),
        starts_iteration=draw(_BOOLEANS),
    )


def _walk(states: list[State] | tuple[State, ...]) -> list[State]:
    found: list[State] = []
    for state in states:
        found.append(state)
        found.extend(_walk(state.children))
    return found


@attrs.define
class _Edges:
    """Transitions per (source, event), kept valid: guarded candidates first, one unguarded last."""

    by_key: dict[tuple[str, str], list[Transition]] = attrs.field(factory=dict)

    def add(self, transition: Transition, *, keep: bool = False) -> None:
        """Add ``transition``; a second unguarded one is dropped, or guarded when ``keep``."""
        candidates = self.by_key.setdefault((transition.source[0], transition.event), [])
        if not transition.guarded and any(not c.guarded for c in candidates):
            if not keep:
                return
            transition = attrs.evolve(transition, guards=("seq_even",))
        candidates.append(transition)

    def all(self) -> list[Transition]:
        ordered: list[Transition] = []
        for candidates in self.by_key.values():
            ordered += [c for c in candidates if c.guarded]
            ordered += [c for c in candidates if not c.guarded]
        return ordered


_GUARD_KINDS = st.sampled_from(["none", "guards", "unless"])
_GUARD_NAMES = st.sampled_from(sorted(GUARDS))
_EVENTS = st.sampled_from(EVENTS)
_OUTCOMES = st.sampled_from(OUTCOMES)
_MORE_OUTCOMES = st.lists(_OUTCOMES, max_size=2, unique=True)
_REASONS = st.sampled_from(["", "limit spent"])


def _guards(draw: st.DrawFn) -> dict[str, tuple[str, ...]]:
    kind = draw(_GUARD_KINDS)
    if kind == "none":
        return {}
    return {kind: (draw(_GUARD_NAMES),)}


@st.composite
def machine_specs(draw: st.DrawFn, *, max_units: int = 4, max_extra_edges: int = 6) -> MachineSpec:
    """Random valid :class:`MachineSpec`s (see the module docstring for their shape).

    Handlers are named after their states; guards are those of :data:`GUARDS`.
    """
    names = _Names()
    units = [_unit(draw, names, 0) for _ in range(draw(st.integers(1, max_units)))]
    outcomes = [draw(_OUTCOMES), *draw(_MORE_OUTCOMES)]
    outcomes = list(dict.fromkeys(outcomes))
    terminals = [
        State(TERMINAL_NAMES[o], terminal=True, outcome=None if o == "succeeded" else o)
        for o in outcomes
    ]
    recovery = draw(_BOOLEANS)
    states = [*units]
    if recovery:
        states.append(State("recovering", handler="recovering"))
    states += terminals

    edges = _Edges()
    # The spine: every unit leads to the next, the last one to the first terminal state.
    for unit, following in zip(units, [*units[1:], terminals[0]], strict=True):
        event = unit.advance_on if unit.composite else NEXT
        edges.add(Transition(unit.name, event, following.name))

    active = [s.name for s in _walk(units)]  # every non-terminal state but recovering
    sources = [*active, WILDCARD]
    if recovery:
        edges.add(Transition("recovering", RECOVERED, RETURN))
        origin = draw(st.sampled_from(sources))
        edges.add(Transition(origin, SERVER_UNREACHABLE, "recovering"), keep=True)
    for terminal in terminals[1:]:
        origin = draw(st.sampled_from(sources))
        edges.add(Transition(origin, draw(_EVENTS), terminal.name), keep=True)
    if draw(_BOOLEANS):
        failed = next((t for t in terminals if t.outcome is not None), terminals[-1])
        edges.add(Transition(WILDCARD, SYSTEM_ERROR, failed.name))

    all_sources = [*sources, *(["recovering"] if recovery else [])]
    all_dests = [s.name for s in _walk(states)] + [RETURN]
    for _ in range(draw(st.integers(0, max_extra_edges))):
        edges.add(
            Transition(
                draw(st.sampled_from(all_sources)),
                draw(_EVENTS),
                draw(st.sampled_from(all_dests)),
                reason=draw(_REASONS),
                **_guards(draw),
            )
        )
    spec = MachineSpec("prop", states, edges.all())
    spec.validate(handlers=spec.handler_names, guards=GUARDS)  # valid by construction
    return spec


# -- scripts -------------------------------------------------------------------------------

#: Moves made by a phase handler (one handler call each; in a state without handler, one step
#: that does nothing).
HANDLER_MOVES = ("event", "status", "slow", "raise", "interrupt", "bad", "junk", "unjson")
#: Moves made by an operator between phases (no handler call).
OPERATOR_MOVES = ("send", "send_bad", "abort", "rewind")


@attrs.frozen
class Move:
    """One step of a script.

    Attributes:
        kind: ``event`` (the handler returns an allowed event), ``status`` (it returns a
            :class:`PhaseStatus`), ``slow`` (it returns an allowed event, past its state's
            timeout if it has one), ``raise`` (it raises), ``interrupt`` (Ctrl-C in it),
            ``bad`` (it returns an event the state does not allow), ``junk`` (it returns
            something that is not a result), ``unjson`` (its output is not JSON-serialisable),
            ``send`` / ``send_bad`` (an external event, allowed or not), ``abort``, ``rewind``.
        index: which allowed event (``event``, ``slow``, ``send``), status (``status``) or
            visited state (``rewind``), modulo how many there are.
        event: the event by name instead of by index (hand-written examples).
        context: what the handler merges into the run's context.
        output: the handler's (or the external event's) JSON output.
        tokens: an update of the iteration record (``tokens_total``), if any.
    """

    kind: str = "event"
    index: int = 0
    event: str | None = None
    context: Mapping[str, Any] | None = None
    output: Any = None
    tokens: int | None = None

    @property
    def by_handler(self) -> bool:
        """Whether a phase handler makes this move (otherwise an operator does)."""
        return self.kind in HANDLER_MOVES

    def pick(self, spec: MachineSpec, state: str) -> str:
        """The allowed event this move stands for in ``state``."""
        if self.event is not None:
            return self.event
        events = spec.events_from(state)
        return events[self.index % len(events)]

    @property
    def status(self) -> PhaseStatus:
        """The status a ``status`` move returns."""
        statuses = list(PhaseStatus)
        return statuses[self.index % len(statuses)]


def move() -> st.SearchStrategy[Move]:
    """One move; mostly allowed events, which shrink towards the first allowed one."""
    return _MOVE


_MOVE = st.builds(
    Move,
    kind=st.sampled_from(
        ["event"] * 8
        + ["raise"] * 2
        + ["status", "slow", "interrupt", "bad", "junk", "unjson"]
        + ["send", "send_bad", "abort", "rewind"]
    ),
    index=st.integers(0, 7),
    context=st.none() | st.fixed_dictionaries({"flag": st.booleans()}),
    output=st.none() | st.integers(0, 9) | st.just({"note": "é ✓"}),
    tokens=st.none() | st.integers(0, 999),
)


def moves(*, max_size: int = 20) -> st.SearchStrategy[tuple[Move, ...]]:
    """A script: the moves made on one run, in order."""
    return st.lists(move(), max_size=max_size).map(tuple)


@attrs.frozen
class Case:
    """A spec and a script to run on it."""

    spec: MachineSpec
    moves: tuple[Move, ...]


@attrs.frozen
class CrashCase:
    """A spec, a script, and where the process dies.

    Attributes:
        crash_at: the process dies in the phase handler call of this number (0-based, modulo
            how many calls the uninterrupted run makes, so every example crashes if its run
            calls any handler) or, ``in_effect``, in the first one after it that performs its
            side effect.
        crash_where: where in that phase: ``before_effect``, ``in_effect`` (inside the phase's
            recorded side effect) or ``after_effect``.
        resume_with: how both processes drive the run: ``run`` (``Engine.resume``, several
            phases a call) or ``step`` (``Engine.step``, one phase at a time).
    """

    spec: MachineSpec
    moves: tuple[Move, ...]
    crash_at: int
    crash_where: str = "before_effect"
    resume_with: str = "run"


def cases(**spec_options: Any) -> st.SearchStrategy[Case]:
    """A random valid spec with a random script."""
    return st.builds(Case, spec=machine_specs(**spec_options), moves=moves())


def crash_cases(**spec_options: Any) -> st.SearchStrategy[CrashCase]:
    """A random valid spec, a script, and a crash point in it."""
    return st.builds(
        CrashCase,
        spec=machine_specs(**spec_options),
        moves=st.lists(move(), min_size=1, max_size=20).map(tuple),
        crash_at=st.integers(0, 20),
        crash_where=st.sampled_from(["before_effect", "in_effect", "after_effect"]),
        resume_with=st.sampled_from(["run", "step"]),
    )


# -- spec changes ----------------------------------------------------------------------------

#: The event of the edge a changed spec adds: from every state to the first terminal one.
PATCHED = "PATCHED"


def _redescribe(states: tuple[State, ...], name: str) -> tuple[State, ...]:
    return tuple(
        attrs.evolve(
            state,
            description="changed" if state.name == name else state.description,
            children=_redescribe(state.children, name),
        )
        for state in states
    )


@st.composite
def changed_specs(draw: st.DrawFn, spec: MachineSpec) -> MachineSpec:
    """``spec`` as a host app changed it later: the same states (one described anew), an edge
    or two dropped where the spec stays valid without them, maybe a new wildcard edge.
    """
    states = _redescribe(spec.states, draw(st.sampled_from([s.name for s in spec.leaves])))
    dropped = draw(st.sets(st.integers(0, len(spec.transitions) - 1), max_size=2))
    added = [Transition(WILDCARD, PATCHED, spec.terminal_states[0])] if draw(_BOOLEANS) else []
    kept = [t for i, t in enumerate(spec.transitions) if i not in dropped]
    changed = MachineSpec(spec.name, states, [*kept, *added])
    try:
        changed.validate(handlers=spec.handler_names, guards=GUARDS)
    except SpecError:  # a dropped edge was needed: keep them all
        changed = MachineSpec(spec.name, states, [*spec.transitions, *added])
        changed.validate(handlers=spec.handler_names, guards=GUARDS)
    assert changed.spec_hash != spec.spec_hash
    return changed


@attrs.frozen
class SpecChangeCase:
    """A run that goes on under a changed spec: ``before`` under ``spec``, ``after`` under
    ``changed`` (resumed with ``allow_spec_change=True``).
    """

    spec: MachineSpec
    changed: MachineSpec
    before: tuple[Move, ...]
    after: tuple[Move, ...]


@st.composite
def spec_change_cases(draw: st.DrawFn, **spec_options: Any) -> SpecChangeCase:
    """A random valid spec, a changed version of it, and the moves made under each."""
    spec = draw(machine_specs(**spec_options))
    return SpecChangeCase(
        spec, draw(changed_specs(spec)), draw(moves(max_size=12)), draw(moves(max_size=12))
    )
