"""The SQLite journal's migration to schema version 11: a digest on every row.

Kept apart from :mod:`~fsm_runner.journal._schema` (which registers it) so that module stays
within its size; frozen once released, as every migration is.
"""

from __future__ import annotations

import sqlite_utils

from fsm_runner.journal._sqlite_chain import MIGRATED, MIGRATED_KEYS, fill_digests
from fsm_runner.records import format_utc, utc_now

__all__ = ["m0011_digests"]

#: The tables that gain a ``digest`` column.
_DIGESTED = ("transitions", "run_rows", "iterations", "effects", "artifacts")


def m0011_digests(db: sqlite_utils.Database) -> None:
    """Version 11: each run's transitions form a hash chain; every other row has a digest.

    * ``transitions.digest``: BLAKE2b-128 of the transition's values as stored, chained to
      the digest of the run's previous transition (see :mod:`fsm_runner.journal._digest`):
      ``check`` names the first seq whose content no longer matches. A run's head digest is
      its last transition's. Written with the transition (in the same INSERT).
    * ``run_rows.digest``, ``iterations.digest``, ``effects.digest``, ``artifacts.digest``:
      a digest of the row's own values (a run row's: who the run is, its input, context and
      error), rewritten by every write of those values.

    No trigger or view changes: the writers compute the digests. The rows a journal holds
    when it is migrated get theirs computed here, from what they hold then, and ``meta``
    says so (:data:`~._sqlite_chain.MIGRATED`: when; :data:`~._sqlite_chain.MIGRATED_KEYS`:
    up to which run key): ``check`` then says that such a run's digests vouch only for what
    the migration read.
    """
    for table in _DIGESTED:
        db.execute(f"ALTER TABLE {table} ADD COLUMN digest TEXT")
    last_key = db.execute("SELECT max(run_key) FROM run_rows").fetchone()[0]
    fill_digests(db.conn)
    if last_key is not None:
        when = format_utc(utc_now())[:10]
        db.conn.executemany(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            [
                (MIGRATED, f"computed at migration to version 11 on {when}"),
                (MIGRATED_KEYS, str(last_key)),
            ],
        )
    db.execute("UPDATE meta SET value = '11' WHERE key = 'schema_version'")
