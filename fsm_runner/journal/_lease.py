"""The lease-grant rule, once: every journal's ``claim`` asks it before it writes a lease.

Pure: the journal reads the run (locking it where its medium needs that), asks :func:`grant`
with the time its leases are judged by (the process's clock, or PostgreSQL's), and writes what
it answers. So SQLite, PostgreSQL and the memory journal grant and refuse exactly alike.
"""

from __future__ import annotations

import datetime as dt

import attrs

from fsm_runner.exceptions import LeaseHeldError, RunTerminalError
from fsm_runner.records import RunRecord, format_utc

__all__ = ["claimed", "grant"]


def grant(run: RunRecord, owner: str, now: dt.datetime, *, take_over: str | None = None) -> bool:
    """Whether ``owner`` may take ``run``'s lease at ``now``, and whether that is a takeover.

    Granted when nobody holds the lease, when it has expired, when ``owner`` holds it already,
    or when ``take_over`` names its live holder (one known to be dead).

    Returns:
        ``True`` when the claim takes a lease over (it had expired, or another owner held
        it): the run's ``recoveries`` count increases by one.

    Raises:
        RunTerminalError: the run has ended.
        LeaseHeldError: another owner holds a live lease (its owner and expiry named).
    """
    if run.ended:
        raise RunTerminalError(run_id=run.run_id, state=run.state, status=run.status.value)
    expires = run.lease_expires_at
    held = run.lease_owner is not None and expires is not None
    live = held and expires is not None and expires > now
    if live and run.lease_owner not in (owner, take_over):
        raise LeaseHeldError(
            run.run_id, owner=str(run.lease_owner), expires_at=format_utc(expires or now)
        )
    return held and (not live or run.lease_owner != owner)  # a lost lease, found


def claimed(run: RunRecord, owner: str, expires: dt.datetime, *, takeover: bool) -> RunRecord:
    """``run`` as a granted claim leaves it: ``owner``'s until ``expires``, its token raised."""
    return attrs.evolve(
        run,
        lease_owner=owner,
        lease_expires_at=expires,
        lease_token=run.lease_token + 1,
        recoveries=run.recoveries + int(takeover),
    )
