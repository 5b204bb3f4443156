"""SQLite's ``claim_next``: a search of index ranges outside the write lock, then a claim.

The search is a read (WAL: it neither takes nor waits for the write lock), so a worker polling
a journal with nothing to claim never delays a writer, and (schema version 9) it reads only
index ranges, so it costs the same among a hundred runs as among a million: an unleased active
run's stored row is its head, so the runs a claim may take are one range of
``idx_run_rows_ready`` per state, the leases that expired one range of
``idx_run_rows_leased``, and (schema version 10) the unleased runs whose wake time has come one
range of ``idx_run_rows_due``, whatever their state. A run found is then claimed by one
conditional UPDATE in a short write transaction, which asks the search's question again of that
one run, as of then (:func:`_claim_found`): another worker may have claimed it, its head moved,
or its lease been renewed since. Such a run is skipped for the next one found; after
:data:`_CLAIM_SEARCHES` searches whose every run was taken meanwhile, ``None`` (the caller polls
again, as when nothing was runnable).
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from fsm_runner.journal import _lease
from fsm_runner.journal._sqlite_connections import SqliteConnections
from fsm_runner.records import RunRecord, format_utc, utc_now

__all__ = [
    "SqliteLiveness",
    "claim_in",
    "claim_next",
    "claim_unchanged",
    "claim_unchanged_many",
    "lease_holders",
]

#: A row of the ``runs`` view as a record: the cursor's description, the row.
RowReader = Callable[[Any, Sequence[Any]], RunRecord]
#: Whether the run of a key may be driven (its head verified: ``SqliteJournal``'s); a run
#: refused is not claimed, and is among the keys skipped from then on.
HeadCheck = Callable[[sqlite3.Connection, int], bool]

#: Runs one ``claim_next`` search returns, tried in order until one is still claimable.
_CLAIM_CANDIDATES = 8
#: Searches one ``claim_next`` makes when every run found was claimed by others meanwhile.
_CLAIM_SEARCHES = 3


def _claimable(states: int, spec_hash: str | None) -> str:
    """The ``runs`` view's condition of a run ``claim_next`` may take.

    In one of the states with no wake time, or due (schema version 10: its wake time has
    come, whatever its state; ``run_rows.wake_at`` is the claim's own row, as the view does
    not show it).
    Parameters: the machine, ``states`` states, "now" (its wake time), the spec hash (if
    ``spec_hash``), then "now" again (a lease that expired before it is free).
    """
    return (
        f"status = 'active' AND machine = ? AND ((state IN ({', '.join('?' * states)})"
        " AND run_rows.wake_at IS NULL) OR run_rows.wake_at <= ?)"
        + (" AND spec_hash = ?" if spec_hash is not None else "")
        + " AND (lease_owner IS NULL OR lease_expires_at < ?)"
    )


def _claim_statements(states: int, spec_hash: str | None) -> tuple[str, str]:
    """``claim_next``'s search (a read) and its conditional claim (one run, under the lock).

    The search reads index ranges only (schema version 9): for each state, the oldest unleased
    active runs stored in it (``idx_run_rows_ready``: an unleased run's row is its head; one
    whose row a hand edit left behind its last transition is skipped, and ``check`` names it),
    and
    the leased runs whose lease expired (``idx_run_rows_leased``, their head read through the
    view: a holder that died may have moved it; in one of the states, or due), and the
    unleased runs that are due, whatever their state (``idx_run_rows_due``: their wake time
    has come; the earliest first). Its parameters: per state the machine, the state (and the
    spec hash); then the machine, now, the states, now (and the spec hash); then the machine,
    now (and the spec hash); the number of runs wanted last, once per part and once in all
    (:func:`_search_params`).

    The claim asks the search's question again of that one run (:func:`_claimable`); its
    parameters: owner, expiry, the run key twice, then the search's.
    """
    spec = " AND spec_hash = ?" if spec_hash is not None else ""
    ready = (
        "SELECT run_key FROM (SELECT run_key FROM run_rows AS r WHERE machine = ? AND state = ?"
        f" AND status = 'active' AND lease_owner IS NULL AND wake_at IS NULL{spec}"
        " AND NOT EXISTS (SELECT 1 FROM transitions AS t"
        "                  WHERE t.run_key = r.run_key AND t.seq > r.seq)"
        " ORDER BY run_key LIMIT ?)"
    )
    expired = (
        "SELECT run_key FROM (SELECT run_key FROM runs WHERE machine = ? AND status = 'active'"
        f" AND lease_owner IS NOT NULL AND lease_expires_at < ?"
        f" AND (state IN ({', '.join('?' * states)})"
        "      OR (SELECT w.wake_at <= ? FROM run_rows AS w WHERE w.run_key = runs.run_key))"
        f"{spec} ORDER BY lease_expires_at LIMIT ?)"
    )
    due = (
        "SELECT run_key FROM (SELECT run_key FROM run_rows WHERE machine = ?"
        " AND status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL"
        f" AND wake_at <= ?{spec} ORDER BY wake_at LIMIT ?)"
    )
    search = " UNION ALL ".join([ready] * states + [expired, due]) + " ORDER BY run_key LIMIT ?"
    where = _claimable(states, spec_hash)
    claim = (
        "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
        " lease_token = lease_token + 1, recoveries = recoveries + (lease_owner IS NOT NULL)"
        f" WHERE run_key = ? AND EXISTS (SELECT 1 FROM runs WHERE run_key = ? AND {where})"
    )
    return search, claim


def _search_params(
    machine: str,
    states: Sequence[str],
    spec_hash: str | None,
    now: str,
    wanted: int = _CLAIM_CANDIDATES,
) -> list[Any]:
    """The parameters of :func:`_claim_statements`' search, for ``wanted`` runs."""
    spec = [] if spec_hash is None else [spec_hash]
    params: list[Any] = []
    for state in states:
        params += [machine, state, *spec, wanted]
    return [
        *params,
        *(machine, now, *states, now, *spec, wanted),
        *(machine, now, *spec, wanted),
        wanted,
    ]


def claim_next(
    connections: SqliteConnections,
    read_row: RowReader,
    owner: str,
    *,
    ttl: float,
    machine: str,
    states: Collection[str],
    spec_hash: str | None,
    head_check: HeadCheck,
    skipped: Collection[int] = (),
) -> RunRecord | None:
    """Claim the oldest runnable run of ``machine`` (in ``states``, or due) for ``owner``.

    Each run found is verified (``head_check``) before it is claimed: one refused is not
    claimed, nor are the runs of the keys ``skipped`` (refused before), which the search
    looks past.
    """
    ordered = sorted(set(states))
    search, claim = _claim_statements(len(ordered), spec_hash)
    wanted = _CLAIM_CANDIDATES + len(skipped)
    for _ in range(_CLAIM_SEARCHES):
        with connections.read() as conn:
            params = _search_params(machine, ordered, spec_hash, format_utc(utc_now()), wanted)
            found = conn.execute(search, params).fetchall()
        keys = [key for (key,) in found if key not in skipped]
        if not keys:
            return None
        claimed = _claim_found(
            connections,
            read_row,
            keys,
            owner=owner,
            ttl=ttl,
            claim=(claim, head_check),
            wanted=(machine, ordered, spec_hash),
        )
        if claimed is not None:
            return claimed
    return None


def _claim_found(
    connections: SqliteConnections,
    read_row: RowReader,
    keys: Sequence[int],
    *,
    owner: str,
    ttl: float,
    claim: tuple[str, HeadCheck],
    wanted: tuple[str, Sequence[str], str | None],
) -> RunRecord | None:
    """Claim the first of the runs ``keys`` that is still claimable, in ONE transaction.

    ``claim`` (:func:`_claim_statements`) writes only while the run still answers the search,
    as of now: a run claimed, moved or renewed since changes no row and the next one is tried.
    Under the write lock no other writer comes between its check and its write, so the lease
    token rises once per claim, and the run's head verified first (``claim``'s check: one read
    of its head rows) is the head claimed; ``recoveries`` counts a takeover by the lease found
    at that moment.
    """
    machine, states, spec_hash = wanted
    update, head_check = claim
    spec = [] if spec_hash is None else [spec_hash]
    with connections.write() as conn:
        # "now" once the lock is held: a lease that expired (a wake time that came) while
        # this waited counts.
        now = utc_now()
        expires = format_utc(now + dt.timedelta(seconds=ttl))
        stamp = format_utc(now)
        params = [machine, *states, stamp, *spec, stamp]
        for key in keys:
            if not head_check(conn, key):  # its head fails its digest: never claimed
                continue
            changed = conn.execute(update, [owner, expires, key, key, *params])
            if changed.rowcount:
                cursor = conn.execute("SELECT * FROM runs WHERE run_key = ?", (key,))
                return read_row(cursor.description, cursor.fetchone())
    return None


class RunLoad(Protocol):
    """A journal's read of a run inside its transaction (with ``verify``, its head verified)."""

    def __call__(self, conn: sqlite3.Connection, run_id: str, *, verify: bool) -> RunRecord: ...


def claim_in(  # noqa: PLR0917 - one call shape for claim and claim_many
    conn: sqlite3.Connection,
    load: RunLoad,
    run_id: str,
    owner: str,
    now: dt.datetime,
    ttl: float,
    take_over: str | None,
    check: Callable[[RunRecord], object] | None,
) -> RunRecord:
    """One claim inside the caller's write transaction; returns the row it wrote.

    The run is loaded with its head verified, checked by ``check``, then granted
    (:func:`~._lease.grant`) or refused by what that raises.
    """
    run = load(conn, run_id, verify=True)
    if check is not None:
        check(run)
    takeover = _lease.grant(run, owner, now, take_over=take_over)
    expires = now + dt.timedelta(seconds=ttl)
    conn.execute(
        "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
        " lease_token = lease_token + 1, recoveries = recoveries + ? WHERE run_id = ?",
        (owner, format_utc(expires), int(takeover), run_id),
    )
    # The row as just written (read inside the same write transaction): no second read.
    return _lease.claimed(run, owner, expires, takeover=takeover)


#: Take a run's lease only while it is as written: active, no abort requested, no lease held,
#: at its lease token and with no transition after its seq.
_CLAIM_UNCHANGED = (
    "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
    " lease_token = lease_token + 1 WHERE run_id = ? AND lease_token = ?"
    " AND lease_owner IS NULL AND abort_reason IS NULL AND status = 'active'"
    " AND NOT EXISTS (SELECT 1 FROM transitions AS t"
    " WHERE t.run_key = run_rows.run_key AND t.seq > ?)"
)


def claim_unchanged(
    connections: SqliteConnections, run: RunRecord, owner: str, *, ttl: float
) -> RunRecord | None:
    """``SqliteJournal.claim_unchanged``: one conditional UPDATE, no read; ``None``: not claimed."""
    expires = utc_now() + dt.timedelta(seconds=ttl)
    with connections.write() as conn:
        changed = conn.execute(
            _CLAIM_UNCHANGED, (owner, format_utc(expires), run.run_id, run.lease_token, run.seq)
        ).rowcount
    return _lease.claimed(run, owner, expires, takeover=False) if changed else None


def claim_unchanged_many(
    connections: SqliteConnections, runs: Sequence[RunRecord], owner: str, *, ttl: float
) -> list[RunRecord | None]:
    """``SqliteJournal.claim_unchanged_many``: :func:`claim_unchanged` of each, in ONE transaction.

    A conditional UPDATE each, no read; ``None`` for a run not claimed.
    """
    expires = utc_now() + dt.timedelta(seconds=ttl)
    stamp = format_utc(expires)
    with connections.write() as conn:
        changed = [
            conn.execute(
                _CLAIM_UNCHANGED, (owner, stamp, run.run_id, run.lease_token, run.seq)
            ).rowcount
            for run in runs
        ]
    return [
        _lease.claimed(run, owner, expires, takeover=False) if moved else None
        for run, moved in zip(runs, changed, strict=True)
    ]


def lease_holders(connections: SqliteConnections, machine: str) -> list[tuple[str, str]]:
    """``(run_id, owner)`` of ``machine``'s active runs someone holds: a read of one index range.

    (``idx_run_rows_leased``: the leased active runs, by machine.)
    """
    with connections.read() as conn:
        rows = conn.execute(
            "SELECT run_id, lease_owner FROM run_rows WHERE machine = ? AND status = 'active'"
            " AND lease_owner IS NOT NULL",
            (machine,),
        ).fetchall()
    return [(run_id, owner) for run_id, owner in rows]


class SqliteLiveness:
    """The SQLite journal's ``liveness``: who holds its leases (a dead owner is told by its pid).

    Args:
        connections: the journal's connections.
    """

    def __init__(self, connections: SqliteConnections) -> None:
        self._connections = connections

    def lease_holders(self, *, machine: str) -> list[tuple[str, str]]:
        """``(run_id, owner)`` of ``machine``'s active runs someone holds (one index range)."""
        return lease_holders(self._connections, machine)
