"""SQLite's prune: ended runs deleted by index ranges, in short batches.

Schema version 9 keeps an ended run's last update in its row, indexed among the ended runs
(``idx_run_rows_ended``), so what a prune deletes is one range of that index: a dry run, or a
prune that finds nothing, costs the same in a journal of a thousand runs as of a million. The
delete goes in batches (of :data:`BATCH` runs first, then sized to hold the write lock about
15 ms), each its own short write transaction followed by a pause as long as it, so a writer
waits for one batch at most, never for the whole prune. The space freed is reused by the
journal's next writes; :func:`prune` gives it back to the file system only when asked
(``vacuum``), as ``VACUUM`` rewrites the whole file holding the write lock.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable, Sequence

from fsm_runner.journal._sqlite_connections import SqliteConnections
from fsm_runner.journal.base import PruneReport
from fsm_runner.records import format_utc

__all__ = ["BATCH", "prune"]

#: Runs deleted in the first write transaction; the next batches are sized so that each holds
#: the write lock about :data:`_HOLD` seconds (a big journal's deletes read colder pages), from
#: :data:`_SIZES` runs. A writer waits for one such batch at most.
BATCH = 200
_HOLD = 0.015
_SIZES = (10, 2000)
#: After each batch the prune waits as long as the batch held the write lock, within these
#: bounds (seconds): a writer that found the lock taken sleeps in SQLite's busy handler (1, 2,
#: 5, 10 ms... between tries), and without the pause the next batch would take the lock again
#: before it woke, batch after batch (a start waited 864 ms beside a prune of 100,000 runs).
_PAUSE = (0.002, 0.05)
#: The ended runs a prune deletes, oldest update first: one range of ``idx_run_rows_ended``.
#: A run whose child is still active stays (its children by ``idx_run_rows_parent``; "+"
#: keeps SQLite from reading every active run by status for each ended one).
_SELECT = (
    "SELECT run_id, run_key, spec_hash FROM run_rows AS r"
    " WHERE status != 'active' AND updated_at < ?"
    " AND NOT EXISTS (SELECT 1 FROM run_rows AS c WHERE c.parent_run_id = r.run_id"
    " AND +c.status = 'active') ORDER BY updated_at, run_key"
)
_OWNED_BY_ID = ("iterations", "artifacts", "effects")


def prune(
    connections: SqliteConnections,
    forget: Callable[[Sequence[str]], None],
    *,
    ended_before: dt.datetime,
    dry_run: bool = False,
    vacuum: bool = False,
) -> PruneReport:
    """Delete ended runs last updated before ``ended_before`` (see the module).

    ``forget`` is told the ids of each batch deleted, once it is
    (:meth:`~._sqlite_writes.SqliteWriter.forget`). ``vacuum``: then ``VACUUM`` (the file
    shrinks; every writer waits for it).
    """
    cutoff = format_utc(ended_before)
    before = connections.size()
    if dry_run:
        with connections.read() as conn:
            found = conn.execute(_SELECT, (cutoff,)).fetchall()
            (count,) = conn.execute(
                "SELECT count(*) FROM transitions"
                f" WHERE run_key IN (SELECT run_key FROM ({_SELECT}))",
                (cutoff,),
            ).fetchone()
        return PruneReport(
            tuple(str(row[0]) for row in found), int(count), dry_run=True, bytes_before=before
        )
    ids: list[str] = []
    count = 0
    hashes: set[str] = set()
    size = BATCH
    while True:
        began = time.monotonic()
        with connections.write() as conn:
            found = conn.execute(f"{_SELECT} LIMIT ?", (cutoff, size)).fetchall()
            keys = [(row[1],) for row in found]
            run_ids = [(row[0],) for row in found]
            cursor = conn.cursor()
            cursor.executemany("DELETE FROM transitions WHERE run_key = ?", keys)
            count += cursor.rowcount
            cursor.executemany("DELETE FROM signals WHERE run_key = ?", keys)
            for table in _OWNED_BY_ID:
                cursor.executemany(f"DELETE FROM {table} WHERE run_id = ?", run_ids)
            cursor.executemany("DELETE FROM run_rows WHERE run_key = ?", keys)
        batch = [str(row[0]) for row in found]
        forget(batch)
        ids += batch
        hashes.update(str(row[2]) for row in found)
        if len(found) < size:
            break
        held = time.monotonic() - began
        size = min(max(int(size * _HOLD / max(held, 1e-4)), _SIZES[0]), _SIZES[1], size * 2)
        time.sleep(min(max(held, _PAUSE[0]), _PAUSE[1]))
    _forget_specs(connections, hashes)
    if vacuum:
        with connections.read() as conn:
            # The thread's checkpoint would take the lock that TRUNCATE needs (SQLite does
            # not wait for it): stopped here, started again by the next write.
            connections.stop_checkpoints()
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return PruneReport(
        tuple(ids),
        count,
        dry_run=False,
        bytes_before=before,
        bytes_after=connections.size() if vacuum else None,
    )


def _forget_specs(connections: SqliteConnections, hashes: Iterable[str]) -> None:
    """Delete the specs of ``hashes`` that no run uses any more.

    Whether a run uses one is read outside the write lock (a read may take a while: no index
    on ``spec_hash``); under it, only what could have changed since: a run stored since (its
    key is above the highest read) or an active one (only those move to another spec).
    """
    unused = []
    with connections.read() as conn:
        (highest,) = conn.execute("SELECT coalesce(max(run_key), 0) FROM run_rows").fetchone()
        for spec_hash in sorted(hashes):
            used = conn.execute(
                "SELECT 1 FROM run_rows WHERE status = 'active' AND spec_hash = ?"
                " UNION ALL SELECT 1 FROM run_rows WHERE spec_hash = ? LIMIT 1",
                (spec_hash, spec_hash),
            ).fetchone()
            if used is None:
                unused.append(spec_hash)
    if not unused:
        return
    with connections.write() as conn:
        conn.executemany(
            "DELETE FROM specs WHERE spec_hash = ?"
            " AND NOT EXISTS (SELECT 1 FROM run_rows WHERE run_key > ? AND spec_hash = ?)"
            " AND NOT EXISTS (SELECT 1 FROM run_rows WHERE status = 'active' AND spec_hash = ?)",
            [(spec_hash, highest, spec_hash, spec_hash) for spec_hash in unused],
        )
