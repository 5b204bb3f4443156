"""The PostgreSQL journal's ``claim_next``: its search, index-served at any number of runs.

A run is runnable when it is active, either nobody holds it or its lease expired, and it is in
one of the states a handler runs or its wake time has come. Each part is one index range (see
:mod:`fsm_runner.journal._postgres_schema`), so an idle claim costs the same over a thousand
runs or a million:

* **unleased runs**: ``runs_ready`` holds only active runs nobody holds, keyed by
  ``(machine, ready_state, created_at, rowid)``; each state's oldest is the first entry of its
  own range (one ``LATERAL`` probe a state, so a backlog is never sorted);
* **expired leases**: ``runs_leased`` holds only active leased runs, keyed by
  ``(machine, lease_expires_at)``; the expired ones are the range below now. They are read
  whole (a materialized CTE: usually none, a few after a worker died) and sorted, so that no
  plan can instead walk every run in ``created_at`` order looking for an expired one (what a
  generic plan chose for ``ORDER BY created_at LIMIT 1`` with the expiry as a mere filter).
  An expired lease is taken over in a handled state, or in any state once its wake time came;
* **due runs** (durable waits, migration 8): ``runs_due`` holds only active runs nobody holds
  that have a wake time, keyed by ``(machine, wake_at)``; the runs due are the range up to
  now, whatever their state, and the earliest due is its first entry (one seek).

Each probe takes its run with ``FOR UPDATE SKIP LOCKED``, so concurrent workers step past each
other's picks instead of waiting; the oldest of the (at most one a state, plus two) candidates
is claimed, and the other candidates' row locks end with the statement. (Among due runs the
earliest due is the candidate, not the oldest: a range read in the index's order, never sorted.)
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Sequence
from typing import Any

from fsm_runner.journal import _rows
from fsm_runner.journal._postgres_connection import (
    UNRESOLVED,
    Connection,
    PostgresConnection,
    Unresolved,
)
from fsm_runner.records import RunRecord

__all__ = ["HEAD_DIGEST", "claim_next", "claim_next_query"]

#: The claimed run's head digest (its last transition's, schema 9), returned with its row: one
#: lookup in the transitions' primary key, in the claim's own statement.
HEAD_DIGEST = (
    "(SELECT t.digest FROM transitions AS t WHERE t.run_id = runs.run_id AND t.seq = runs.seq)"
)

_CANDIDATE = "SELECT run_id, lease_owner, created_at, rowid FROM runs WHERE machine = %s"
_LOCK = " ORDER BY created_at, rowid LIMIT 1 FOR UPDATE SKIP LOCKED"


def claim_next_query(
    *,
    machine: str,
    states: Collection[str],
    spec_hash: str | None,
    now: Any,
    owner: str,
    expires: Any,
) -> tuple[str, list[Any]]:
    """The one statement that claims the oldest runnable run, and its parameters.

    ``now``: the server's time, a parameter rather than ``clock_timestamp()`` (volatile) so
    that the expired-lease and due ranges are index conditions; ``expires``: the new lease's
    expiry.
    """
    spec = " AND spec_hash = %s" if spec_hash is not None else ""
    spec_params = [spec_hash] if spec_hash is not None else []
    statement = (
        "WITH expired AS MATERIALIZED ("
        " SELECT run_id, created_at, rowid FROM runs WHERE machine = %s AND status = 'active'"
        " AND lease_owner IS NOT NULL AND lease_expires_at < %s"
        f" AND (state = ANY(%s) OR wake_at <= %s){spec}),"
        " candidates AS ("
        " SELECT c.* FROM unnest(%s::text[]) AS s(state) CROSS JOIN LATERAL"
        f" ({_CANDIDATE} AND ready_state = s.state{spec}{_LOCK}) AS c"
        " UNION ALL SELECT * FROM"
        " (SELECT r.run_id, r.lease_owner, r.created_at, r.rowid FROM expired AS x"
        " JOIN runs AS r ON r.run_id = x.run_id WHERE r.status = 'active'"
        " AND r.lease_owner IS NOT NULL AND r.lease_expires_at < %s"
        " ORDER BY x.created_at, x.rowid LIMIT 1 FOR UPDATE OF r SKIP LOCKED) AS e"
        f" UNION ALL SELECT * FROM ({_CANDIDATE} AND status = 'active' AND lease_owner IS NULL"
        f" AND wake_at <= %s{spec} ORDER BY wake_at LIMIT 1 FOR UPDATE SKIP LOCKED) AS d),"
        " chosen AS (SELECT run_id, lease_owner FROM candidates"
        " ORDER BY created_at, rowid LIMIT 1)"
        " UPDATE runs SET lease_owner = %s, lease_expires_at = %s,"
        " lease_token = runs.lease_token + 1,"
        " recoveries = runs.recoveries + (chosen.lease_owner IS NOT NULL)::int"
        " FROM chosen WHERE runs.run_id = chosen.run_id RETURNING "
        + ", ".join(f"runs.{column}" for column in _rows.RUN_COLUMNS)
        + f", {HEAD_DIGEST}"
    )
    wanted = sorted(set(states))
    params: list[Any] = [machine, now, wanted, now, *spec_params, wanted, machine, *spec_params]
    params += [now, machine, now, *spec_params]
    return statement, [*params, owner, expires]


def claim_next(
    connection: PostgresConnection,
    decode: Callable[[Sequence[Any]], RunRecord],
    owner: str,
    *,
    ttl: float,
    machine: str,
    states: Collection[str],
    spec_hash: str | None,
) -> RunRecord | None:
    """Claim the oldest runnable run (:func:`claim_next_query`), or ``None``; ``decode``: a row.

    Its lease's expiry is set by the server's clock; after a lost connection the claim that
    was cut off is found by the expiry it set.
    """
    tried: list[dt.datetime] = []
    select = ", ".join(_rows.RUN_COLUMNS)

    def work(conn: Connection) -> RunRecord | None:
        found = conn.execute("SELECT clock_timestamp()").fetchone()
        assert found is not None
        now: dt.datetime = found[0]
        expires = now + dt.timedelta(seconds=ttl)
        tried.append(expires)
        statement, params = claim_next_query(
            machine=machine,
            states=states,
            spec_hash=spec_hash,
            now=now,
            owner=owner,
            expires=expires,
        )
        row = conn.execute(statement, params).fetchone()
        return None if row is None else decode(row)

    def resolve(conn: Connection) -> RunRecord | Unresolved | None:
        row = conn.execute(
            f"SELECT {select} FROM runs WHERE lease_owner = %s"
            " AND lease_expires_at = ANY(%s) AND machine = %s",
            (owner, tried, machine),
        ).fetchone()
        return UNRESOLVED if row is None else decode(row)

    return connection.call(work, resolve=resolve)
