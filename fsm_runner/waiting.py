"""Waiting in a spec: :class:`Wait`, which states wait, what signals they accept, and checks.

A **waiting state** is a non-terminal leaf state without a handler: a run there holds no lease
and no process until a signal it accepts comes (one of its exits' events, but the engine's own
and the wait's ``on_timeout``) or, with :attr:`Wait.timeout`, its deadline. A phase may also
wait from inside for the signals its state declares (``State(signals=...)``). What the engine
does with them is :mod:`fsm_runner.engine.waits`; this module is the spec's side only, which
:mod:`fsm_runner.spec` uses (no import of it at run time).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, cast

import attrs

from fsm_runner.events import OFF_SPEC_EVENTS, RunEvent, event_name

__all__ = [
    "NOT_SIGNALS",
    "Wait",
    "accepted_signals",
    "signal_names",
    "state_problems",
    "text_problems",
    "waiting_leaves",
]


class State(Protocol):
    """What of a :class:`fsm_runner.spec.State` this module reads (it cannot import spec)."""

    @property
    def name(self) -> str: ...
    @property
    def handler(self) -> str | None: ...
    @property
    def terminal(self) -> bool: ...
    @property
    def composite(self) -> bool: ...
    @property
    def wait(self) -> Wait | None: ...
    @property
    def signals(self) -> tuple[str, ...]: ...


class MachineSpec(Protocol):
    """What of a :class:`fsm_runner.spec.MachineSpec` this module reads."""

    @property
    def edges(self) -> Mapping[tuple[str, str], tuple[object, ...]]: ...
    def accepts(self, state: str) -> frozenset[str]: ...


#: Events the engine journals itself: an exit on one of them is not a signal.
NOT_SIGNALS: frozenset[str] = OFF_SPEC_EVENTS | {RunEvent.SYSTEM_ERROR.value}


def _optional_float(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return cast(float, value)  # validate() names it


def _event(value: Any) -> str:
    try:
        return event_name(value)
    except TypeError:
        return cast(str, value)  # validate() names it


@attrs.frozen
class Wait:
    """How a state without a handler waits: for a signal, at most until a deadline.

    A run in a waiting state holds no lease and no process. It continues when a signal that
    the state accepts arrives (one of its exits' events; :meth:`fsm_runner.Engine.signal`),
    or, with ``timeout``, when the deadline comes: the engine then journals ``on_timeout``.

    Args:
        timeout: seconds from entering the state to its deadline; ``None`` waits for ever.
        on_timeout: the event journaled at the deadline (the state needs an exit for it).
        prompt: what the wait asks of whoever answers (shown by ``fsm-runner runs --waiting``
            and the inspector).
        schema: what an answer's payload should look like (a JSON schema, shown with the
            prompt).
    """

    timeout: float | None = attrs.field(default=None, converter=_optional_float)
    on_timeout: str = attrs.field(default=RunEvent.TIMEOUT.value, converter=_event)
    prompt: str = ""
    schema: Mapping[str, Any] | None = None


def waiting_leaves(leaves: Iterable[State]) -> Iterator[str]:
    """The names of the leaves a run waits in: non-terminal, without a handler."""
    for state in leaves:
        if not state.terminal and not state.handler and isinstance(state.name, str):
            yield state.name


def accepted_signals(
    waiting: Iterable[str],
    edges: Mapping[tuple[str, str], object],
    states: Mapping[str, State],
) -> dict[str, frozenset[str]]:
    """Per waiting state, the signals it accepts.

    Its exits' events, but the engine's own (:data:`NOT_SIGNALS`) and its wait's
    ``on_timeout``.
    """
    accepted: dict[str, set[str]] = {name: set() for name in waiting}
    for source, event in edges:
        if source in accepted and event not in NOT_SIGNALS:
            accepted[source].add(event)
    for name, events in accepted.items():
        wait = states[name].wait
        if isinstance(wait, Wait):
            events.discard(wait.on_timeout)
    return {name: frozenset(events) for name, events in accepted.items()}


def signal_names(accepted: Mapping[str, frozenset[str]], leaves: Iterable[State]) -> frozenset[str]:
    """Every signal a waiting state or a phase (``State.signals``) accepts."""
    names = {name for events in accepted.values() for name in events}
    for state in leaves:
        if state.handler and isinstance(state.signals, tuple):
            names.update(name for name in state.signals if isinstance(name, str))
    return frozenset(names)


def state_problems(spec: MachineSpec, state: State) -> Iterator[str]:
    """What is wrong with ``state``'s wait or the signals its phase declares."""
    if state.wait is not None:
        yield from _wait_problems(spec, state)
    if state.signals:
        yield from _phase_signal_problems(state)


def text_problems(name: str, value: object, *, kind: str = "a str") -> Iterator[str]:
    """A value that should be text but is not, or that no journal can store (UTF-8)."""
    if not isinstance(value, str):
        yield f"{name} {value!r:.80} is not {kind}"
    elif not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            yield f"{name} {value!r:.80} holds a lone surrogate, which UTF-8 cannot store"


def _wait_problems(spec: MachineSpec, state: State) -> Iterator[str]:
    wait = state.wait
    where = f"state {state.name!r}"
    if not isinstance(wait, Wait):
        yield f"{where}: wait must be a Wait, not {type(wait).__name__}"
        return
    if state.handler or state.terminal or state.composite:
        yield f"{where} waits, so it cannot have a handler or children, or be terminal"
        return
    timeout: Any = wait.timeout  # as given: the converter keeps what it cannot read
    if timeout is not None and not (isinstance(timeout, float) and math.isfinite(timeout)):
        yield f"{where}: wait timeout must be a finite number, not {timeout!r}"
    elif timeout is not None and timeout <= 0:
        yield f"{where} has a wait timeout <= 0"
    elif timeout is not None and (state.name, wait.on_timeout) not in spec.edges:
        yield (
            f"{where} waits at most {timeout:g} s but has no exit for its"
            f" on_timeout event {wait.on_timeout!r}"
        )
    on_timeout: Any = wait.on_timeout
    if not isinstance(on_timeout, str) or not on_timeout:
        yield f"{where}: wait on_timeout must be an event name, not {on_timeout!r}"
    yield from text_problems(f"{where}: wait prompt", wait.prompt)
    schema: Any = wait.schema
    if schema is not None and not isinstance(schema, Mapping):
        yield f"{where}: wait schema must be a JSON object, not {type(schema).__name__}"
    elif schema is not None:
        try:
            json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as exc:
            yield f"{where}: wait schema must be JSON ({exc})"
    if not spec.accepts(state.name) and wait.timeout is None:
        yield (
            f"{where} waits for ever, but no signal can move it (no exit but the engine's"
            " own events)"
        )


def _phase_signal_problems(state: State) -> Iterator[str]:
    where = f"state {state.name!r}"
    if not state.handler:
        yield f"{where} declares signals, but only a phase waits for signals from inside"
    for name in state.signals:
        yield from text_problems(f"{where}: signal", name)
        if isinstance(name, str) and (not name or name in NOT_SIGNALS):
            yield f"{where}: {name!r} cannot be a signal (the engine journals it itself)"
