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

**Workers' liveness** (:class:`OwnerLocks`): every lease owner holds a session-level advisory
lock keyed by its owner id (``pg_try_advisory_lock(OWNER_LOCK_CLASS, hashtext(owner))``),
taken on the journal's connection before the first lease it sets there, and again after a
reconnect. While the owner's session lives the lock is held; once its process died or its
connection dropped, the server has released it. :meth:`OwnerLocks.gone` asks, for a few owners
at once, which locks are free (taking and at once releasing each), so a worker can take over
the leases of a worker that is gone without waiting for them to expire (fenced as any
takeover: the claim raises the lease token). Two owners whose ids hash alike share a lock: a
dead one may then pass for alive, and its runs wait for their leases to expire, as before.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs

from fsm_runner.exceptions import InvalidRunIdError, JournalError, RunNotFoundError
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._head import is_head_refusal
from fsm_runner.journal._postgres_connection import (
    UNRESOLVED,
    Connection,
    PostgresConnection,
    Unresolved,
)
from fsm_runner.journal._postgres_heads import PostgresHeads
from fsm_runner.records import RunRecord

__all__ = [
    "HEAD_DIGEST",
    "OWNER_LOCK_CLASS",
    "ClaimGroup",
    "OwnerLiveness",
    "OwnerLocks",
    "claim_group",
    "claim_next",
    "claim_next_query",
    "claim_unchanged_group",
    "lease_holders",
]

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
    refused: Collection[str] = (),
) -> tuple[str, list[Any]]:
    """The one statement that claims the oldest runnable run, and its parameters.

    ``now``: the server's time, a parameter rather than ``clock_timestamp()`` (volatile) so
    that the expired-lease and due ranges are index conditions; ``expires``: the new lease's
    expiry; ``refused``: the ids of runs not to take (their heads failed their digests).
    """
    spec = " AND spec_hash = %s" if spec_hash is not None else ""
    spec_params: list[Any] = [spec_hash] if spec_hash is not None else []
    if refused:  # runs this journal found failing their digests: passed by
        spec += " AND run_id <> ALL(%s)"
        spec_params.append(sorted(refused))
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
    heads: PostgresHeads,
    owner: str,
    *,
    ttl: float,
    machine: str,
    states: Collection[str],
    spec_hash: str | None,
    owners: OwnerLocks | None = None,
) -> RunRecord | None:
    """Claim the oldest runnable run (:func:`claim_next_query`), or ``None``; ``decode``: a row.

    Its lease's expiry is set by the server's clock; after a lost connection the claim that
    was cut off is found by the expiry it set. The run taken is verified in the claim's
    transaction (``heads``): one whose head fails its digest is not taken (the claim rolled
    back), logged once, and passed by from then on.
    """
    tried: list[dt.datetime] = []
    select = ", ".join(_rows.RUN_COLUMNS)

    passed_by: list[str] = []  # runs this call refused: it searches again without them

    def work(conn: Connection) -> RunRecord | None:
        if owners is not None:
            owners.hold(conn, owner)
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
            refused=heads.refused,
        )
        run_id = None
        try:
            with conn.transaction():
                row = conn.execute(statement, params).fetchone()
                if row is None:
                    return None
                run_id = row[0]
                heads.verify(conn, run_id)
        except (JournalError, InvalidRunIdError) as exc:
            if run_id is None or not heads.refuse(run_id, exc):
                raise
            passed_by.append(run_id)  # refused: rolled back, and passed by in the next search
            return None
        return decode(row)

    def resolve(conn: Connection) -> RunRecord | Unresolved | None:
        row = conn.execute(
            f"SELECT {select} FROM runs WHERE lease_owner = %s"
            " AND lease_expires_at = ANY(%s) AND machine = %s",
            (owner, tried, machine),
        ).fetchone()
        return UNRESOLVED if row is None else decode(row)

    while True:
        refused = len(passed_by)
        claimed = connection.call(work, resolve=resolve)
        if claimed is not None or len(passed_by) == refused:
            return claimed


@attrs.frozen
class ClaimGroup:
    """What :func:`claim_group` needs of its journal: how it verifies, holds, reads and decodes."""

    heads: PostgresHeads
    locks: OwnerLocks
    #: Remember a claimed run's head (run id, seq, digest): its next commit chains to it.
    remember_head: Callable[[str, int, str], None]
    #: A run from its row (:data:`~._rows.RUN_COLUMNS`).
    decode: Callable[[Sequence[Any]], RunRecord]
    #: A run row's columns.
    select: str


def _granted(
    group: ClaimGroup,
    found: dict[str, RunRecord | Exception],
    heads: dict[str, str],
    grants: dict[str, int],
    *,
    owner: str,
    expires: dt.datetime,
) -> None:
    """Put the granted runs in ``found`` as the claim's UPDATE left them; remember their heads.

    From the rows read (locked: nobody else moved them), decoded once, not again from a
    ``RETURNING`` of every column.
    """
    for run_id, takeover in grants.items():
        run = found[run_id]
        assert isinstance(run, RunRecord)
        found[run_id] = _lease.claimed(run, owner, expires, takeover=bool(takeover))
        if run_id in heads:
            group.remember_head(run_id, run.seq, heads[run_id])


def claim_group(
    connection: PostgresConnection,
    group: ClaimGroup,
    run_ids: Sequence[str],
    owner: str,
    *,
    ttl: float,
    check: Callable[[RunRecord], object] | None = None,
) -> list[RunRecord | Exception]:
    """``PostgresJournal.claim_many``: several runs' leases in ONE transaction, each on its own.

    Four round trips for them all: BEGIN, one read of the runs (locked in id order, their head
    rows verified, the server's time), one UPDATE of the runs granted, COMMIT. A run refused
    (missing, ended, held by another, failing its digest, or by ``check``) gets its error at its
    index and nothing is written for it. After a lost connection, a try that did commit is found
    by the leases' expiry it set (each lease is taken once).
    """
    tried: list[dt.datetime] = []  # each try's expiry: the resolver looks for it
    refused: dict[str, Exception] = {}  # the last try's refusals

    def work(conn: Connection) -> list[RunRecord | Exception]:
        group.locks.hold(conn, owner)
        with conn.transaction():
            found, heads, now = group.heads.load_many(conn, run_ids, group.decode)
            grants: dict[str, int] = {}
            for run_id, run in found.items():
                if isinstance(run, Exception):
                    continue
                try:
                    if check is not None:
                        check(run)
                    assert now is not None  # read with the runs
                    grants[run_id] = int(_lease.grant(run, owner, now))
                except Exception as exc:  # noqa: BLE001 - refused alone, at its index
                    found[run_id] = exc
            refused.clear()
            refused.update((k, v) for k, v in found.items() if isinstance(v, Exception))
            if grants:
                assert now is not None
                expires = now + dt.timedelta(seconds=ttl)
                tried.append(expires)
                moved = conn.execute(
                    "UPDATE runs SET lease_owner = %s, lease_expires_at = %s,"
                    " lease_token = runs.lease_token + 1, recoveries = runs.recoveries"
                    " + granted.takeover FROM unnest(%s::text[], %s::int[])"
                    " AS granted(id, takeover) WHERE runs.run_id = granted.id",
                    (owner, expires, list(grants), list(grants.values())),
                ).rowcount
                if moved != len(grants):  # the rows are locked: each granted one moves
                    raise JournalError(
                        f"a claim of {len(grants)} runs moved {moved}", path=connection.location
                    )
                _granted(group, found, heads, grants, owner=owner, expires=expires)
        return [found[run_id] for run_id in run_ids]

    def resolve(conn: Connection) -> list[RunRecord | Exception] | Unresolved:
        rows = conn.execute(
            f"SELECT {group.select} FROM runs WHERE run_id = ANY(%s)", (list(run_ids),)
        ).fetchall()
        runs = {run.run_id: run for run in map(group.decode, rows)}
        taken = {
            run_id
            for run_id, run in runs.items()
            if run.lease_owner == owner and run.lease_expires_at in tried
        }
        if not taken:
            return UNRESOLVED  # nothing the cut-off try wrote: try again
        return [runs[r] if r in taken else refused.get(r, RunNotFoundError(r)) for r in run_ids]

    return connection.call(work, resolve=resolve)


#: A claim of runs as this journal wrote them: each one's lease taken only while the run is
#: active at the seq and lease token written, no lease held and no abort requested.
_CLAIM_UNCHANGED = (
    "UPDATE runs SET lease_owner = %s,"
    " lease_expires_at = clock_timestamp() + %s * interval '1 second',"
    " lease_token = runs.lease_token + 1"
    " FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) AS u(id, seq, token)"
    " WHERE runs.run_id = u.id AND runs.seq = u.seq AND runs.lease_token = u.token"
    " AND runs.lease_owner IS NULL AND runs.abort_reason IS NULL AND runs.status = 'active'"
    " RETURNING runs.run_id, runs.lease_expires_at"
)


def claim_unchanged_group(
    connection: PostgresConnection,
    group: ClaimGroup,
    runs: Sequence[RunRecord],
    owner: str,
    *,
    ttl: float,
    refuse: bool = False,
) -> list[RunRecord | None]:
    """``PostgresJournal.claim_unchanged_many``: runs as written, claimed in ONE transaction.

    Four round trips for them all: BEGIN, one UPDATE of the runs still as written (no read
    before it), one read of the granted runs' heads, verified, COMMIT. ``None`` for a run not
    claimed (it changed: nothing was written for it). A head that fails its digest rolls the
    whole claim back, every entry ``None``: the caller claims them the usual way
    (``claim_many``), which refuses that run alone; with ``refuse`` (``claim_unchanged``'s)
    the head's ``JournalError`` is raised instead. After a lost connection, a try that did
    commit is found by the leases it set (each run's token one past the one written).
    """
    if not runs:
        return []
    run_ids = [run.run_id for run in runs]
    params = (owner, ttl, run_ids, [r.seq for r in runs], [r.lease_token for r in runs])

    def work(conn: Connection) -> tuple[dict[str, dt.datetime], dict[str, str]]:
        group.locks.hold(conn, owner)
        try:
            with conn.transaction():
                granted: dict[str, dt.datetime] = dict(
                    conn.execute(_CLAIM_UNCHANGED, params).fetchall()
                )
                heads = group.heads.verify_many(conn, list(granted)) if granted else {}
        except (JournalError, InvalidRunIdError) as exc:
            if refuse or not is_head_refusal(exc):
                raise
            return {}, {}  # rolled back: nothing claimed
        return granted, heads

    def resolve(conn: Connection) -> tuple[dict[str, dt.datetime], dict[str, str]] | Unresolved:
        rows = conn.execute(
            f"SELECT {group.select} FROM runs WHERE run_id = ANY(%s)", (run_ids,)
        ).fetchall()
        stored = {run.run_id: run for run in map(group.decode, rows)}
        taken = {
            run.run_id: found.lease_expires_at
            for run in runs
            if (found := stored.get(run.run_id)) is not None
            and found.lease_owner == owner
            and found.lease_token == run.lease_token + 1
            and found.lease_expires_at is not None
        }
        return (taken, {}) if taken else UNRESOLVED  # none taken: nothing written, again

    granted, heads = connection.call(work, resolve=resolve)
    claimed: list[RunRecord | None] = []
    for run in runs:
        expires = granted.get(run.run_id)
        if expires is None:
            claimed.append(None)
            continue
        claimed.append(_lease.claimed(run, owner, expires, takeover=False))
        if run.run_id in heads:
            group.remember_head(run.run_id, run.seq, heads[run.run_id])
    return claimed


#: The first key of the advisory locks lease owners hold (``"FSMR"``); the second is
#: ``hashtext(owner)``.
OWNER_LOCK_CLASS = 0x46534D52


class OwnerLocks:
    """The advisory locks of the lease owners this journal's session holds (see the module).

    Bound to one connection: a new connection (after a lost one, or in a forked child) holds
    none, and each owner's lock is taken again at its next :meth:`hold`.
    """

    def __init__(self) -> None:
        self._conn: Connection | None = None
        self._held: set[str] = set()
        #: the connection it was read on, and when the server started (this process's clock)
        self._up_since: tuple[Connection, float] | None = None

    def hold(self, conn: Connection, owner: str) -> None:
        """Hold ``owner``'s lock on ``conn`` (one statement the first time on a connection)."""
        if conn is not self._conn:
            self._conn, self._held = conn, set()
        if owner in self._held:
            return
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (OWNER_LOCK_CLASS, owner)
        ).fetchone()
        if row is not None and row[0]:
            self._held.add(owner)  # else another session holds it a moment: next time

    def gone(self, conn: Connection, owners: Collection[str], *, settled: float) -> set[str]:
        """Which of ``owners`` hold no lock: their sessions are gone (one statement).

        Owners whose lock this session holds are alive (this process): never asked, as a
        session may take its own lock again. None is gone within ``settled`` seconds of the
        server's start: a restart ended every session, and a live worker takes its lock again
        only at its next claim or renewal (within its heartbeat).
        """
        if conn is not self._conn:
            self._conn, self._held = conn, set()
        if self._up_since is None or self._up_since[0] is not conn:
            row = conn.execute(
                "SELECT extract(epoch FROM clock_timestamp() - pg_postmaster_start_time())"
            ).fetchone()
            assert row is not None
            self._up_since = (conn, time.monotonic() - float(row[0]))
        asked = sorted(set(owners) - self._held)
        if not asked or time.monotonic() - self._up_since[1] < settled:
            return set()
        rows = conn.execute(
            "WITH free AS MATERIALIZED (SELECT o FROM unnest(%s::text[]) AS o"
            " WHERE pg_try_advisory_lock(%s, hashtext(o)))"
            " SELECT o FROM free WHERE pg_advisory_unlock(%s, hashtext(o))",
            (asked, OWNER_LOCK_CLASS, OWNER_LOCK_CLASS),
        ).fetchall()
        return {owner for (owner,) in rows}


def lease_holders(connection: PostgresConnection, machine: str) -> list[tuple[str, str]]:
    """``(run_id, owner)`` of ``machine``'s active runs someone holds (``runs_leased``)."""
    _, rows = connection.select(
        "SELECT run_id, lease_owner FROM runs WHERE machine = %s AND status = 'active'"
        " AND lease_owner IS NOT NULL",
        [machine],
    )
    return [(run_id, owner) for run_id, owner in rows]


class OwnerLiveness:
    """The PostgreSQL journal's ``liveness``: who holds its leases, and which owners are gone.

    Args:
        connection: the journal's connection (whose session holds its owners' locks).
    """

    def __init__(self, connection: PostgresConnection) -> None:
        self._connection = connection
        self.locks = OwnerLocks()

    def hold_owner(self, owner: str) -> None:
        """Hold ``owner``'s advisory lock on the journal's session: alive while it lives.

        Every claim and renewal takes it too; call it before storing a run holding ``owner``'s
        lease.
        """
        self._connection.call(lambda conn: self.locks.hold(conn, owner))

    def owners_gone(self, owners: Collection[str], *, settled: float) -> set[str]:
        """Which lease ``owners`` hold no session on the server any more (died, disconnected).

        ``settled``: none within that many seconds of the server's start (:meth:`OwnerLocks.gone`).
        """
        return self._connection.call(lambda conn: self.locks.gone(conn, owners, settled=settled))

    def lease_holders(self, *, machine: str) -> list[tuple[str, str]]:
        """``(run_id, owner)`` of ``machine``'s active runs someone holds (one index range)."""
        return lease_holders(self._connection, machine)
