"""The lease rules, once: granting a claim, and telling why a fenced commit was refused.

Pure: the journal reads the run (locking it where its medium needs that), asks :func:`grant`
with the time its leases are judged by (the process's clock, or PostgreSQL's), and writes what
it answers; a commit its fence refused is explained by :func:`commit_refusal` from the run as
stored. So SQLite, PostgreSQL and the memory journal grant and refuse exactly alike.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import attrs

from fsm_runner.exceptions import (
    LeaseHeldError,
    LeaseLostError,
    RunConflictError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.records import RunRecord, format_utc

__all__ = ["admits", "claimed", "commit_refusal", "grant", "holds", "unheld"]


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


def holds(run: RunRecord, owner: str, token: int) -> bool:
    """Whether ``owner`` still holds ``run``'s lease with ``token`` (to renew or release it)."""
    return run.lease_owner == owner and run.lease_token == token


def unheld(run: RunRecord, now: dt.datetime) -> bool:
    """Whether nobody holds ``run``'s lease at ``now``: there is none, or it expired before.

    The runs ``claim_next`` may choose (the SQL journals state it in their ``WHERE``).
    """
    return run.lease_owner is None or run.lease_expires_at is None or run.lease_expires_at < now


def claimed(run: RunRecord, owner: str, expires: dt.datetime, *, takeover: bool) -> RunRecord:
    """``run`` as a granted claim leaves it: ``owner``'s until ``expires``, its token raised."""
    return attrs.evolve(
        run,
        lease_owner=owner,
        lease_expires_at=expires,
        lease_token=run.lease_token + 1,
        recoveries=run.recoveries + int(takeover),
    )


def admits(found: Sequence[Any] | None, expected_seq: int, token: int, *, aborting: bool) -> bool:
    """Whether the fence admits a commit of the run at ``expected_seq`` under lease ``token``.

    ``found`` is the run as stored, as for :func:`commit_refusal`. Admitted when the run is at
    ``expected_seq`` under ``token`` and no abort was requested under that token or a later
    one, unless the commit is the ``USER_ABORTED`` that carries the abort out. (The SQL
    journals state the same rule in their fence: SQLite's trigger, PostgreSQL's UPDATE.)
    """
    if found is None:
        return False
    seq, stored_token, _abort_reason, abort_token = found
    return (
        stored_token == token
        and seq == expected_seq
        and (abort_token is None or token > abort_token or aborting)
    )


def commit_refusal(
    found: Sequence[Any] | None, run_id: str, expected_seq: int, token: int, *, path: str
) -> Exception:
    """Why a commit of the run at ``expected_seq`` under lease ``token`` was (or is) refused.

    ``found`` is the run as stored: ``(seq, lease_token, abort_reason, abort_token)``, where
    ``abort_token`` is the lease token the run had when its abort was requested (``None``: no
    request), or ``None`` when there is no such run. A lease taken over is the more telling
    refusal; a commit at the right seq under a token the abort was requested under names the
    abort's reason (its writer must carry the abort out).
    """
    if found is None:
        return RunNotFoundError(run_id)
    seq, stored_token, abort_reason, abort_token = found
    if stored_token != token:  # taken over: the more telling refusal
        return LeaseLostError(run_id, token=token)
    fenced = seq == expected_seq and abort_token is not None and stored_token <= abort_token
    return RunConflictError(
        run_id=run_id,
        expected_seq=expected_seq,
        path=path,
        abort_reason=abort_reason if fenced else None,
    )
