"""Durable waits: a run's mailbox of signals, a waiting state's deadline, and parking.

A run waits in a state without a handler (:attr:`fsm_runner.spec.MachineSpec.waiting_states`)
holding no lease and no process. Three things can move it on, each exactly once because each is
a fenced commit under the run's lease:

* a **signal** the state accepts (one of its exits' events): :func:`signal_run` journals it in
  the run's mailbox whenever it comes — before the run reaches the state too — and whoever holds
  the run while it waits where the signal is accepted consumes it (:meth:`Waits.next_move`),
  oldest first, in one transaction with the transition it causes;
* the state's **deadline** (``Wait.timeout`` after the run entered it): the wait's
  ``on_timeout`` event is journaled;
* an operator's ``send`` or ``abort``, as before.

A run held in a waiting state with nothing to consume is **parked**: its lease given up and its
wake time set in one transaction (:meth:`~fsm_runner.journal.base.Journal.park`): its deadline,
or now when a signal it accepts came while it was held. ``claim_next`` offers a run whose wake
time has come to any worker, so a signal sent while nobody runs, or a deadline days away,
survives every restart; between deadlines a worker reads only the next wake time (one index
read).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Mapping
from typing import Any

from fsm_runner._convert import format_utc, parse_utc
from fsm_runner.events import WAITING, WOKEN, event_name
from fsm_runner.exceptions import (
    InvalidTransitionError,
    JournalError,
    LeaseHeldError,
    PayloadError,
    RunConflictError,
    RunTerminalError,
)
from fsm_runner.journal import Journal
from fsm_runner.journal._head import is_head_refusal
from fsm_runner.machine import CompiledMachine, Guard, compile_spec
from fsm_runner.records import RunRecord, SignalRecord, SignalStatus, TransitionRecord, utc_now
from fsm_runner.rules.reducer import take
from fsm_runner.spec import MachineSpec

__all__ = ["NEVER", "Move", "deadline", "next_move", "parked_phase", "signal_run", "waits_now"]

#: The wake time of a phase parked for a signal with no deadline: a run with a wake time is
#: claimed only once it has come (``claim_next``), and this one never comes by itself.
NEVER = dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc)

#: A waiting run's next move: its transition and row after it, and the signal it consumes
#: (``None``: the deadline's ``on_timeout``).
Move = tuple[TransitionRecord, RunRecord, int | None]

#: Seconds the short lease of a signal's consumption from outside any engine lasts.
_SIGNAL_LEASE_TTL = 30.0
_MAX_TRIES = 20


def deadline(journal: Journal, spec: MachineSpec, run: RunRecord) -> dt.datetime | None:
    """When the wait of the run's state times out: its visit's start plus ``Wait.timeout``.

    ``None`` for a state that does not wait, or waits for ever.
    """
    wait = spec.wait_of(run.state)
    if wait is None or wait.timeout is None:
        return None
    entered = journal.transitions(run.run_id, from_seq=run.visit_seq, to_seq=run.visit_seq)
    start = entered[0].at if entered else run.updated_at
    return start + dt.timedelta(seconds=wait.timeout)


def parked_phase(run: RunRecord) -> tuple[str | None, dt.datetime | None] | None:
    """What a run whose phase parked it waits for: (signal or ``None``, until or ``None``).

    ``None`` when its phase did not park it (its last transition is no ``WAITING``: the run
    row's error says so, as the ``WAITING`` transition's result set it).
    """
    error = run.error
    if error is None or error.get("type") != WAITING:
        return None
    signal = error.get("for")
    until = error.get("until")
    return (
        signal if isinstance(signal, str) else None,
        parse_utc(until) if isinstance(until, str) else None,
    )


def waits_now(spec: MachineSpec, run: RunRecord) -> bool:
    """Whether the run waits: in a waiting state, or parked by its phase."""
    return spec.wait_of(run.state) is not None or parked_phase(run) is not None


def _resolvable(spec: MachineSpec, state: str, event: str, guards: Mapping[str, Guard]) -> bool:
    """Whether every guard the (state, event) edges name can be asked here."""
    return all(
        name in guards
        for transition in spec.edges.get((state, event), ())
        for name in (*transition.guards, *transition.unless)
    )


def next_move(
    journal: Journal,
    spec: MachineSpec,
    run: RunRecord,
    guards: Mapping[str, Guard],
    *,
    now: dt.datetime | None = None,
) -> Move | None:
    """What a run held in a waiting state does next, or ``None`` (it waits on: park it).

    The oldest pending signal its state accepts, if its exit's guards let it through (a signal
    whose guards cannot be asked here, or reject it now, stays pending); else, once the
    deadline has passed, the wait's ``on_timeout``.
    """
    accepts = spec.accepts(run.state)
    machine = compile_spec(spec)
    if accepts:
        for signal in journal.signals(run.run_id, pending=True):
            if signal.name not in accepts or not _resolvable(spec, run.state, signal.name, guards):
                continue
            try:
                dest = machine.resolve(run.state, signal.name, run, guards, run_id=run.run_id)
            except InvalidTransitionError:
                continue  # its guards reject it now: it stays pending
            result: dict[str, Any] = {"signal": signal.number}
            if signal.payload is not None:
                result["output"] = signal.payload
            transition, after = take(
                spec, run, signal.name, dest, result=result, duration_ms=0.0, at=utc_now()
            )
            return transition, after, signal.number
    due = deadline(journal, spec, run)
    wait = spec.wait_of(run.state)
    if due is None or wait is None or due > (now or utc_now()):
        return None
    event = wait.on_timeout
    if not _resolvable(spec, run.state, event, guards):
        return None
    dest = machine.resolve(run.state, event, run, guards, run_id=run.run_id)
    result = {"output": {"deadline": format_utc(due)}}
    transition, after = take(spec, run, event, dest, result=result, duration_ms=0.0, at=utc_now())
    return transition, after, None


def phase_move(
    journal: Journal, spec: MachineSpec, run: RunRecord, *, now: dt.datetime | None = None
) -> Move | None:
    """What wakes a run its phase parked: the signal it waits for, or its time (``WOKEN``).

    ``None`` while it waits on. The ``WOKEN`` self transition records what woke it (the
    signal's payload as its output, or that the wait timed out) for the phase, which runs
    again after it and finds the answer (``ctx.wait_for``, ``ctx.sleep_until``).
    """
    parked = parked_phase(run)
    if parked is None:
        return None
    signal, until = parked
    number: int | None = None
    result: dict[str, Any] | None = None
    if signal is not None:
        found = next(
            (s for s in journal.signals(run.run_id, pending=True) if s.name == signal), None
        )
        if found is not None:
            number = found.number
            result = {"for": signal, "signal": number}
            if found.payload is not None:
                result["output"] = found.payload
    if result is None and until is not None and until <= (now or utc_now()):
        result = {"for": signal, "timed_out": signal is not None}
    if result is None:
        return None
    transition, after = take(
        spec, run, WOKEN, run.state, result=result, duration_ms=0.0, at=utc_now(), kind="wait"
    )
    return transition, after, number


def write_move(journal: Journal, move: Move) -> None:
    """Commit a waiting run's move: with the signal it consumes, in one transaction."""
    transition, after, number = move
    if number is None:
        journal.commit(after, transition)
    else:
        journal.consume_signal(after, transition, number)


def park(
    journal: Journal,
    spec: MachineSpec,
    run: RunRecord,
    lease: tuple[str, int],
    guards: Mapping[str, Guard],
) -> bool:
    """Give up the lease of a run that waits, with its wake time set (see the module).

    A pending signal that the state accepts but its exit's guards reject now does not wake the
    run at once again (no worker would loop on it): it waits for the deadline, or for another
    signal. One whose guards cannot be asked here wakes it, for a worker of the app to ask.
    """
    parked = parked_phase(run)
    if parked is not None:
        name, until = parked
        owner, token = lease
        return journal.park(
            run.run_id,
            owner,
            token,
            wake_at=until or (NEVER if name is not None else None),
            accepts=() if name is None else (name,),
        )
    accepts = set(spec.accepts(run.state))
    if accepts:
        machine = compile_spec(spec)
        for signal in journal.signals(run.run_id, pending=True):
            if signal.name not in accepts:
                continue
            if not _passes(machine, spec, run, signal.name, guards):
                accepts.discard(signal.name)
    owner, token = lease
    return journal.park(
        run.run_id, owner, token, wake_at=deadline(journal, spec, run), accepts=accepts
    )


def _passes(
    machine: CompiledMachine,
    spec: MachineSpec,
    run: RunRecord,
    event: str,
    guards: Mapping[str, Guard],
) -> bool:
    """Whether the run's state has an exit for ``event`` that its guards do not reject now.

    True when the guards cannot be asked here (an operator's signal): a worker of the app may.
    """
    if not _resolvable(spec, run.state, event, guards):
        return True
    try:
        machine.resolve(run.state, event, run, guards, run_id=run.run_id)
    except InvalidTransitionError:
        return False
    return True


def check_signal(spec: MachineSpec, run: RunRecord, name: str) -> None:
    """Refuse a signal no waiting state of the run's spec accepts (nothing is written)."""
    if name not in spec.signal_names:
        accepted = ", ".join(sorted(spec.signal_names)) or "none"
        raise InvalidTransitionError(
            run_id=run.run_id,
            state=run.state,
            event=name,
            reason=(
                f"not a signal any waiting state (or phase) of machine {spec.name!r} accepts"
                f" (it accepts: {accepted});"
            ),
        )


def signal_name(run_id: str, state: str, name: Any) -> str:
    """The signal's name as journaled (a str enum's value), or InvalidTransitionError."""
    try:
        text = event_name(name)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise InvalidTransitionError(
            run_id=run_id,
            state=state,
            event=repr(name),
            reason=f"not a signal name (a non-empty str or a str enum, not {type(name).__name__})",
        )
    return text


def signal_run(
    journal: Journal,
    run_id: str,
    name: Any,
    payload: Any = None,
    *,
    signal_id: str | None = None,
    spec: MachineSpec | None = None,
    guards: Mapping[str, Guard] | None = None,
    owner: str | None = None,
) -> SignalRecord:
    """Send a signal to a run: journal it in the run's mailbox; consume it now if it waits.

    Without an engine of the app (operators, the CLI) or from one (``Engine.signal``, which
    passes its spec and guards). The signal is journaled even when the run is not (yet)
    waiting for it; the run consumes it when it waits in a state that accepts it, in arrival
    order, exactly once. If the run waits in such a state now and nobody holds it, it is
    consumed here at once under a short lease of ``owner``'s (unless the exit's guards cannot
    be asked here: then a worker of the app consumes it). A repeated ``signal_id`` writes
    nothing and returns the first signal sent with it, as it stands.

    Returns:
        The signal as it stands: ``consumed`` (``consumed_seq``) or ``pending``.

    Raises:
        RunNotFoundError: no such run.
        RunTerminalError: the run has ended (and no signal with ``signal_id`` was sent).
        InvalidTransitionError: no waiting state of the run's spec accepts a signal of that
            name; nothing was written.
        PayloadError: the payload is not JSON the journal stores; nothing was written.
    """
    run = journal.load(run_id)
    name = signal_name(run_id, run.state, name)
    if signal_id is not None and not isinstance(signal_id, str):
        raise InvalidTransitionError(
            run_id=run_id, state=run.state, event=name, reason="has a signal_id that is not a str;"
        )
    if signal_id is not None:
        for stored in journal.signals(run_id):
            if stored.signal_id == signal_id:
                return stored
    if run.ended:
        raise RunTerminalError(run_id=run.run_id, state=run.state, status=run.status.value)
    run_spec = spec if spec is not None and spec.spec_hash == run.spec_hash else None
    if run_spec is None:
        run_spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
    check_signal(run_spec, run, name)
    journal.signals(run_id, pending=True)  # a damaged mailbox is refused before any write
    try:
        stored = journal.put_signal(
            SignalRecord(run_id=run_id, number=0, name=name, payload=payload, signal_id=signal_id)
        )
    except ValueError as exc:  # pragma: no cover - journals raise JournalError
        raise PayloadError(run_id=run_id, what="signal payload", detail=str(exc)) from None
    if stored.status is not SignalStatus.PENDING:
        return stored
    return _consume_now(journal, run_spec, stored, guards or {}, owner)


def let_go(
    journal: Journal,
    spec: MachineSpec,
    run: RunRecord,
    lease: tuple[str, int],
    guards: Mapping[str, Guard],
) -> None:
    """Give up the lease of a run held: parked if it waits, released otherwise (not if ended)."""
    if run.ended:
        return  # the commit that ended it cleared its lease
    if waits_now(spec, run):
        try:
            park(journal, spec, run, lease, guards)
        except JournalError as exc:
            # A pending signal of it fails its digest (reading the pending signals refuses):
            # never delivered, the run is let go of as one that does not wait, and each claim
            # that would deliver it is refused the same way.
            if not is_head_refusal(exc):
                raise
        else:
            return
    journal.release(run.run_id, *lease)


def _consume_now(
    journal: Journal,
    spec: MachineSpec,
    signal: SignalRecord,
    guards: Mapping[str, Guard],
    owner: str | None,
) -> SignalRecord:
    """Consume a pending signal at once if its run waits unheld where it is accepted."""
    owner = owner or f"signal:{socket.gethostname()}:{os.getpid()}"
    run_id = signal.run_id
    for _ in range(_MAX_TRIES):
        run = journal.load(run_id)
        if run.ended or signal.name not in spec.accepts(run.state) or run.lease_owner:
            break  # not waiting for it now, or held: its holder (or a worker) consumes it
        try:
            claimed = journal.claim(run_id, owner, ttl=_SIGNAL_LEASE_TTL)
        except (LeaseHeldError, RunTerminalError):
            break
        now = claimed
        try:
            if claimed.spec_hash != spec.spec_hash:
                break  # it moved to another spec meanwhile: a worker of the app consumes it
            move = next_move(journal, spec, claimed, guards)
            if move is None:
                break
            try:
                write_move(journal, move)
            except RunConflictError:
                continue  # another writer moved it meanwhile; look again
            now = move[1]
        finally:
            let_go(journal, spec, now, (owner, claimed.lease_token), guards)
        break
    for stored in journal.signals(run_id):
        if stored.number == signal.number:
            return stored
    return signal  # pragma: no cover - a signal is never removed but with its run
