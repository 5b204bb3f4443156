"""What operators do to runs without an engine of the app: abort a run, fork one."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping

import attrs

from fsm_runner._json import storable_text
from fsm_runner.engine.core import Listener
from fsm_runner.engine.leases import unleased
from fsm_runner.exceptions import LeaseHeldError, RunConflictError, RunTerminalError
from fsm_runner.journal import Journal
from fsm_runner.machine import Guard
from fsm_runner.records import RunRecord, utc_now
from fsm_runner.rules.reducer import abort_records
from fsm_runner.run_ids import check_run_id, shown
from fsm_runner.spec import MachineSpec

__all__ = ["abort_run", "fork_run"]

_MAX_ABORT_TRIES = 20
#: Seconds the short lease of an abort from outside any engine lasts.
_ABORT_LEASE_TTL = 30.0


def abort_run(
    journal: Journal,
    run_id: str,
    reason: str,
    *,
    spec: MachineSpec | None = None,
    guards: Mapping[str, Guard] | None = None,
    owner: str | None = None,
    _notify: Listener | None = None,
) -> RunRecord:
    """Abort a run that no engine in this process is advancing (operators, the CLI).

    When no worker holds the run, it is moved at once under a short lease of ``owner``'s: it
    follows its spec's ``USER_ABORTED`` transition or, where its state has none, stops where it
    is with status ``aborted``. When a worker holds a live lease on it, the request is
    journaled (``abort_reason`` shows it meanwhile) and that worker carries it out at its next
    step: from then on the journal refuses every other transition of the run, so the phase in
    progress is told through ``ctx.cancelled`` (by the holder's heartbeat) and whatever it
    returns, the run ends aborted in the state that phase ran in. The spec is read from the
    journal unless ``spec`` is the one the run started with. Nothing journaled is removed.

    Returns:
        The run after the abort, or with the abort requested (and a holder, ``lease_owner``).

    Raises:
        RunNotFoundError: no such run.
        RunTerminalError: the run has already ended.
        RunConflictError: other writers kept advancing the run; try again.
    """
    owner = owner or f"abort:{socket.gethostname()}:{os.getpid()}"
    reason = storable_text(reason)  # a lone surrogate (an argv byte that is not UTF-8)
    for _ in range(_MAX_ABORT_TRIES):
        run = journal.load(run_id)
        if run.ended:
            raise RunTerminalError(run_id=run.run_id, state=run.state, status=run.status.value)
        try:
            run = journal.claim(run_id, owner, ttl=_ABORT_LEASE_TTL)
        except LeaseHeldError:
            requested = journal.request_abort(run_id, reason)  # its holder carries it out
            if requested.lease_owner is not None:
                return requested
            continue  # its holder let go meanwhile: nobody would carry it out, so move it here
        ended = False
        try:
            run_spec = spec
            if run_spec is None or run_spec.spec_hash != run.spec_hash:
                run_spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
            transition, after = abort_records(run_spec, run, reason, guards, at=utc_now())
            try:
                journal.commit(after, transition)
            except RunConflictError:
                continue  # another writer moved it meanwhile; look again
            ended = after.ended
        finally:
            if not ended:  # the commit that ends a run ends its lease: nothing to release
                journal.release(run_id, owner, run.lease_token)
        if _notify is not None:
            _notify(transition, after)
        return unleased(after)
    raise RunConflictError(run_id=run_id, expected_seq=-1, path=journal.location)


def fork_run(
    journal: Journal, run_id: str, *, at_seq: int | None = None, new_run_id: str | None = None
) -> RunRecord:
    """Start a new run whose history is ``run_id``'s up to ``at_seq``; the original is untouched.

    The fork's row is the original's as it stood at ``at_seq`` (replayed from the journal, so
    no host app is needed), with ``forked_from`` set to ``"RUN@SEQ"``; its transitions
    0..``at_seq``, the iteration records up to its iteration, the artifacts committed by then
    and the effects of visits that had ended are copied. The phase of the state it stands in
    runs on its next step (resume it with the app's engine). A run that ended can be forked
    at any seq before its end.

    Args:
        journal: the journal holding the run.
        run_id: the run to fork.
        at_seq: the last seq to keep; the run's last seq when not given (an active run only).
        new_run_id: the fork's id, which must follow the rule of run ids; a new random one
            when not given.

    Returns:
        The fork's run row.

    Raises:
        RunNotFoundError: no such run.
        RunExistsError: a run with ``new_run_id`` exists.
        InvalidRunIdError: ``new_run_id`` breaks the rule of run ids (:mod:`fsm_runner.run_ids`);
            nothing was read or written.
        ValueError: there is no ``at_seq`` in the run, or the run had ended by then.
        ReplayMismatchError: the run's journal does not replay through its spec.
    """
    from fsm_runner.replay import journal_specs, state_at  # noqa: PLC0415

    if new_run_id is not None:  # before anything is read: a bad id is the caller's mistake
        check_run_id(new_run_id)
    source = journal.load(run_id)
    seq = source.seq if at_seq is None else at_seq
    if not 0 <= seq <= source.seq:
        raise ValueError(f"run {shown(run_id)} has seqs 0..{source.seq}; there is no seq {seq}")
    specs = journal_specs(journal)
    # The whole timeline: a spec change after ``at_seq`` tells which spec the run was under.
    timeline = journal.transitions(run_id)
    then = state_at(specs(source.spec_hash), source, timeline, seq, specs=specs)
    if then.ended:
        raise ValueError(
            f"run {shown(run_id)} had ended at seq {seq} (state {then.state!r}); fork it at an "
            "earlier seq"
        )
    fork = attrs.evolve(
        then,
        run_id=uuid.uuid4().hex if new_run_id is None else new_run_id,
        forked_from=f"{run_id}@{seq}",
        parent_run_id=None,
        abort_reason=None,
        lease_owner=None,
        lease_expires_at=None,
        lease_token=0,
        recoveries=0,
        created_at=utc_now(),
    )
    journal.fork_run(fork, source_run_id=run_id, at_seq=seq)
    return journal.load(fork.run_id)
