"""Opening a SQLite journal file, and telling its schema objects from damaged ones: functions.

They check the file before and as it is opened (never with ``open()``: see the comment above
:func:`check_path`), migrate it (:func:`open_schema`), and compare its schema objects with a new
journal's: tables by their columns, keys and unique constraints; indexes by their columns; the
view and the triggers (fsm_runner's own SQL text) by a digest of their SQL. Each takes the
connection it reads; :class:`~fsm_runner.journal._sqlite_connections.SqliteConnections` calls
them as it opens the file, and the journal for ``check``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

from fsm_runner.exceptions import JournalError, SchemaVersionError
from fsm_runner.journal._sqlite_chain import chain_problems
from fsm_runner.journal.search import SearchKey, search_index_sql

__all__ = [
    "APPLICATION_ID",
    "CODE",
    "SCHEMA_VERSION",
    "TABLES",
    "check_path",
    "code_objects",
    "difference",
    "expected_shapes",
    "heal_side_files",
    "integrity_problems",
    "object_name",
    "open_schema",
    "schema_problems",
    "schema_shapes",
    "verify_code",
]

#: ``PRAGMA application_id`` of every fsm_runner journal ("FSMR"): tells ours from foreign files.
APPLICATION_ID = 0x46534D52
#: The schema version this fsm_runner writes; a journal with a higher one is refused.
SCHEMA_VERSION = 12
#: The schema objects whose SQL is fsm_runner's own text — the ``runs`` view and the triggers —
#: by (type, name): their table, and a digest of their SQL with whitespace normalised, as the
#: current schema version has them. Checked at every open; a test keeps it equal to a new
#: journal's (a change of them is a new migration and a new schema version).
CODE: dict[tuple[str, str], tuple[str, str]] = {
    ("trigger", "run_rows_released"): ("run_rows", "5eca3f6602dc9e51441241142bad196d"),
    ("trigger", "transitions_fence"): ("transitions", "8fda0ea5177c86748a4c3748361f9e62"),
    ("view", "runs"): ("runs", "cc0c951c1f3d4f7ac3e42ba6c83e85fe"),
}
#: The journal's tables and its view: a trigger on one of them takes part in its writes.
TABLES = frozenset(
    {"_sqlite_migrations", "artifacts", "effects", "iterations", "meta", "run_rows", "runs",
     "signals", "specs", "transitions"}
)  # fmt: skip
#: A column's type affinity (SQLite's rules, section 3.1 of its datatype page), by substring.
_AFFINITIES = (("INT", "INTEGER"), ("CHAR", "TEXT"), ("CLOB", "TEXT"), ("TEXT", "TEXT"),
               ("BLOB", "BLOB"), ("REAL", "REAL"), ("FLOA", "REAL"), ("DOUB", "REAL"))  # fmt: skip


def _code_digest(sql: bytes | None) -> str:
    """A digest of a schema object's SQL, whitespace aside (read as bytes: it may be damaged)."""
    return hashlib.sha256(b" ".join((sql or b"").split())).hexdigest()[:32]


def code_objects(conn: sqlite3.Connection) -> dict[tuple[str, str], tuple[str, str]]:
    """The views and triggers of the main schema: (type, name) -> (table, SQL digest)."""
    rows = conn.execute(
        "SELECT CAST(type AS BLOB), CAST(name AS BLOB), CAST(tbl_name AS BLOB),"
        " CAST(sql AS BLOB) FROM main.sqlite_master WHERE type IN ('view', 'trigger')"
    ).fetchall()
    return {
        (object_name(kind), object_name(name)): (object_name(table), _code_digest(sql))
        for kind, name, table, sql in rows
    }


def object_name(raw: bytes | None) -> str:
    """A schema object's name as text (a damaged one shown with its bad bytes escaped)."""
    return (raw or b"").decode("utf-8", "backslashreplace")


def _affinity(declared: str) -> str:
    upper = declared.upper()
    for needle, affinity in _AFFINITIES:
        if needle in upper:
            return affinity
    return "BLOB" if not upper else "NUMERIC"


def schema_shapes(conn: sqlite3.Connection) -> dict[tuple[str, str], Any]:
    """Every schema object by (type, name), as much of it as tells a damaged one.

    Tables by their columns (name, type affinity, NOT NULL, default, key), foreign keys and
    unique constraints: the text sqlite-utils writes for them differs between its versions and
    after ``ALTER TABLE``, so their SQL is not compared. Indexes by table, uniqueness and
    columns; views and triggers by table and SQL (:func:`code_objects`). SQLite's own objects
    (``sqlite_*``) are not the journal's; sqlite-utils' ``_sqlite_migrations`` by name only.
    """
    shapes: dict[tuple[str, str], Any] = dict(code_objects(conn))
    rows = conn.execute(
        "SELECT type, name, tbl_name FROM main.sqlite_master"
        " WHERE type IN ('table', 'index') AND name NOT LIKE 'sqlite^_%' ESCAPE '^'"
    ).fetchall()
    for kind, name, table in rows:
        if kind == "index":
            shapes[kind, name] = (
                table,
                conn.execute(
                    'SELECT "unique", partial FROM pragma_index_list(?) WHERE name = ?',
                    (table, name),
                ).fetchone(),
                tuple(
                    row[0] for row in conn.execute("SELECT name FROM pragma_index_info(?)", (name,))
                ),
            )
        elif name == "_sqlite_migrations":
            shapes[kind, name] = ()
        else:
            shapes[kind, name] = _table_shape(conn, name)
    return shapes


def _table_shape(conn: sqlite3.Connection, table: str) -> tuple[Any, ...]:
    columns = tuple(
        (name, _affinity(declared), bool(notnull), default, pk)
        for name, declared, notnull, default, pk in conn.execute(
            'SELECT name, type, "notnull", dflt_value, pk FROM pragma_table_xinfo(?)', (table,)
        )
    )
    keys = tuple(
        sorted(
            conn.execute(
                'SELECT "table", "from", "to" FROM pragma_foreign_key_list(?)', (table,)
            ).fetchall()
        )
    )
    unique = tuple(
        sorted(
            tuple(row[0] for row in conn.execute("SELECT name FROM pragma_index_info(?)", (index,)))
            for (index,) in conn.execute(
                "SELECT name FROM pragma_index_list(?) WHERE origin = 'u'", (table,)
            )
        )
    )
    return columns, keys, unique


def difference(kind: str, found: Any, expected: Any) -> str:
    """Which columns of a table differ (for a table); nothing for other objects."""
    if kind != "table" or not found or not expected:
        return ""
    names = sorted({column[0] for column in set(found[0]) ^ set(expected[0])})
    return f" (columns {', '.join(names)})" if names else ""


@functools.cache
def expected_shapes() -> dict[tuple[str, str], Any]:
    """The schema objects of a new journal, as :func:`schema_shapes` sees them."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        open_schema(conn, ":memory:", create=True)
        return schema_shapes(conn)
    finally:
        conn.close()


# -- opening -------------------------------------------------------------------------------

# Nothing here may open the journal or its side files with ``open()``: POSIX advisory locks
# belong to a process, not to a descriptor, so closing *any* descriptor of the file drops
# every lock this process's other connections hold on it. Another process closing its
# connection then believes it is the last one, checkpoints and deletes the ``-wal`` and
# ``-shm`` under our live connections: commits land in a deleted WAL and are lost, and
# readers of the truncated ``-shm`` die of SIGBUS. Only SQLite itself (which shares one lock
# set between the connections of a process) reads these files; the checks below use
# ``stat``/``access``, which open nothing.


def check_path(path: str) -> None:
    """Refuse a path whose directory is missing, or that is a directory itself."""
    if path == ":memory:":
        return
    try:
        found = os.stat(path)
    except FileNotFoundError:
        if not Path(path).parent.is_dir():
            raise JournalError("its directory does not exist", path=path) from None
        return
    except OSError as exc:
        raise JournalError(f"cannot be read: {exc.strerror}", path=path) from None
    if stat.S_ISDIR(found.st_mode):
        raise JournalError("is a directory, not a journal file", path=path)
    if found.st_nlink > 1:  # sqlite.org/howtocorrupt.html, 2.4 (a symlink is fine)
        raise JournalError(
            f"has {found.st_nlink} hard links: SQLite keeps a -wal and -shm file beside each"
            " name, so writers under two names would not exclude each other and corrupt it;"
            " keep one name (a symlink is fine); nothing was changed",
            path=path,
        )
    if not os.access(path, os.R_OK, effective_ids=True):
        raise JournalError("cannot be read: Permission denied", path=path)


def heal_side_files(path: str) -> None:
    """Make stale ``-wal``/``-shm`` files writable again when the journal itself is.

    A connection to a read-only journal leaves its ``-shm`` file behind with the journal's
    mode then; once the journal is made writable again, SQLite would still open it
    read-only because of that file. Only files this process owns are changed.
    """
    if path == ":memory:" or not os.access(path, os.W_OK, effective_ids=True):
        return  # missing, or not writable: nothing to heal
    real = os.path.realpath(path)  # SQLite keeps them beside a symlink's target
    for suffix in ("-wal", "-shm"):
        side = real + suffix
        if os.path.exists(side) and not os.access(side, os.W_OK, effective_ids=True):
            with contextlib.suppress(OSError):
                if os.stat(side).st_uid == os.getuid():
                    os.chmod(side, os.stat(path).st_mode & 0o777)


def open_schema(conn: sqlite3.Connection, path: str, *, create: bool) -> None:
    """Read the journal's schema on ``conn``; make it (a new journal's) or migrate it.

    Raises:
        JournalError: the file is another application's, not a journal, or (``create`` false)
            an empty file or a database without tables.
        SchemaVersionError: a newer fsm_runner wrote it.
    """
    app_id, tables = _id_and_tables(conn)
    current = app_id == APPLICATION_ID and _stored_version(conn, path) == SCHEMA_VERSION
    if app_id not in (0, APPLICATION_ID):
        raise JournalError(
            f"is a SQLite database of another application (application_id {app_id:#x}), "
            "not an fsm_runner journal",
            path=path,
        )
    if current:
        _enable_wal(conn, path)
        return  # the common case: an up-to-date journal, opened without taking a write lock
    if app_id == 0 and not tables and not create:
        empty = path != ":memory:" and os.stat(path).st_size == 0
        raise JournalError(
            "is not an fsm_runner journal ("
            + ("an empty file" if empty else "a SQLite database without tables")
            + "); nothing was changed",
            path=path,
        )
    if app_id == 0 and tables - {"_sqlite_migrations"}:
        raise JournalError(
            "is a SQLite database but not an fsm_runner journal (it has tables "
            f"{', '.join(sorted(tables)[:5])})",
            path=path,
        )
    _enable_wal(conn, path)
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not tables and not _has_tables(conn):  # new (and nobody made it meanwhile)
            from fsm_runner.journal import _schema_new  # noqa: PLC0415 - only a new journal's

            _schema_new.create(conn)
        else:
            _migrate(conn, path)
        conn.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
            (str(SCHEMA_VERSION),),
        )
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _id_and_tables(conn: sqlite3.Connection) -> tuple[int, set[str]]:
    """The file's ``application_id`` and its tables, as one writer left them.

    Read apart, a journal another opener made between the two reads looked like tables
    without our id (a foreign database); so the id is read again after the tables, and the
    reads repeated if it changed meanwhile (it changes once, when the journal is made, in the
    same transaction as its tables). No read transaction is held across them: a rollback-
    journal file's reader then held off the opener switching it to WAL past the busy timeout.
    """
    while True:
        app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
        tables = {
            str(row[0])
            for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if int(conn.execute("PRAGMA application_id").fetchone()[0]) == app_id:
            return app_id, tables


def verify_code(conn: sqlite3.Connection) -> tuple[str | None, str | None]:
    """Compare the journal's view and triggers with its schema version's.

    Returns why writes, and why reads, are to be refused (``None``: they are not).

    Their SQL is fsm_runner's own text, stored as written, so a digest of it (whitespace
    aside) tells a damaged or hand-edited one: ``transitions_fence`` altered or dropped
    loses the fencing of every write (invariants 2 and 4), an extra trigger runs inside
    every commit, and an altered ``runs`` view misreads every run's head. Writes are then
    refused, and reads too when the view is not the expected one; ``check`` lists what
    differs (:func:`schema_problems`). Costs one read of ``sqlite_master`` (~25 µs).
    """
    found = {  # triggers on tables of the user's own (in the same file) are theirs
        key: value for key, value in code_objects(conn).items() if key in CODE or value[0] in TABLES
    }
    damaged = sorted(
        f"{kind} {name}"
        for kind, name in found.keys() ^ CODE.keys()
        | {key for key in found.keys() & CODE.keys() if found[key] != CODE[key]}
    )
    if not damaged:
        return None, None
    what = (
        f"its schema is damaged ({', '.join(damaged)}: not as schema version"
        f" {SCHEMA_VERSION} has {'it' if len(damaged) == 1 else 'them'};"
        " fsm-runner check lists what differs)"
    )
    unreadable = None
    if found.get(("view", "runs")) != CODE["view", "runs"]:
        unreadable = f"{what}; nothing was read"
    return f"{what}; nothing was written", unreadable


def schema_problems(conn: sqlite3.Connection) -> list[str]:
    """How the journal's schema objects differ from those of its schema version.

    Every table, index, view and trigger is compared with a new journal's (tables by their
    columns, keys and unique constraints; indexes by their columns; views and triggers by
    their SQL, whitespace aside): one line per object missing, altered, or added to one of
    the journal's tables (an index or a trigger: it takes part in every write). Tables,
    views and the like of the user's own in the same file are not the journal's business.
    Empty for a journal as fsm_runner made (or migrated) it.
    """
    expected = expected_shapes()
    found = schema_shapes(conn)
    owners = {
        (object_name(kind), object_name(name)): object_name(table)
        for kind, name, table in conn.execute(
            "SELECT CAST(type AS BLOB), CAST(name AS BLOB), CAST(tbl_name AS BLOB)"
            " FROM main.sqlite_master"
        )
    }
    ours = {name for kind, name in expected if kind in ("table", "view")}
    problems = []
    # (a damaged name may be read as bytes: ordered by its text, never compared with a str)
    for key in sorted(expected.keys() | found.keys(), key=lambda key: tuple(map(str, key))):
        kind, name = key
        if key not in found:
            problems.append(f"schema: {kind} {name} is missing")
        elif key not in expected:
            if kind not in ("index", "trigger") or owners.get(key) not in ours:
                continue  # the user's own, beside the journal
            if kind == "index" and is_search_index(conn, name):
                continue  # an operator's (journal.search_indexes)
            problems.append(f"schema: {kind} {name} is not part of schema version {SCHEMA_VERSION}")
        elif found[key] != expected[key]:
            problems.append(
                f"schema: {kind} {name} differs from schema version {SCHEMA_VERSION}"
                f"{difference(kind, found[key], expected[key])} (damaged or edited by hand)"
            )
    return problems


def is_search_index(conn: sqlite3.Connection, name: str) -> bool:
    """Whether index ``name`` is a search index as ``search_indexes.add`` makes it.

    Named ``search:KEY``, with the SQL ``add`` writes for the key: an index of that name over
    anything else is reported as any index added to the journal's tables is.
    """
    if not name.startswith("search:"):
        return False
    try:
        key = SearchKey.parse(name.removeprefix("search:"))
    except ValueError:
        return False
    row = conn.execute(
        "SELECT sql FROM main.sqlite_master WHERE type = 'index' AND name = ?", (name,)
    ).fetchone()
    return row is not None and row[0] == search_index_sql(key)


def integrity_problems(conn: sqlite3.Connection, *, chains: bool = True) -> list[str]:
    """SQLite's ``integrity_check`` and ``foreign_key_check``, one line per problem.

    Then the schema objects that differ from the schema version's (:func:`schema_problems`).
    Then every run's hash chain and every row's digest (schema 11: see
    :func:`~fsm_runner.journal._sqlite_chain.chain_problems`). Also transitions whose
    ``run_key`` is not the key of the run their ``run_id`` names (only
    a hand edit makes one: the fence trigger refuses such an insert): reads go by ``run_key``,
    so such a row would show in another run's history; and signals likewise (another run's
    mailbox). A signal of no run is a dangling row, as ``foreign_key_check`` reports it.
    ``chains=False``: all but the runs' hash chains (verified as a check reads each run).
    """
    schema = schema_problems(conn)
    problems = [
        f"SQLite integrity check: {row[0]}"
        for row in conn.execute("PRAGMA integrity_check(20)")
        if row[0] != "ok"
    ]
    dangling, miskeyed = _transitions_keys(conn)
    problems += schema
    problems += [
        f"{count} row(s) of table {table} refer to missing rows"
        + (f" (first rowid {first})" if first is not None else "")  # transitions: no rowid
        for table, count, first in dangling
    ]
    if miskeyed:
        run_id, seq = miskeyed[0]
        problems.append(
            f"{len(miskeyed)} row(s) of table transitions have a run_key that is not their"
            f" run's (first: run {run_id}, seq {seq})"
        )
    # Signals too are read by run_key (schema 10): one filed under another run's key would
    # show in that run's mailbox. (A journal without the table has that problem listed.)
    count, first = 0, None
    with contextlib.suppress(sqlite3.OperationalError):
        count, first = conn.execute(
            "SELECT count(*), min(s.number) FROM signals AS s"
            " JOIN run_rows AS r ON r.run_key = s.run_key WHERE s.run_id IS NOT r.run_id"
        ).fetchone()
    if count:
        problems.append(
            f"{count} row(s) of table signals have a run_key that is not their run's"
            f" (first: number {first})"
        )
    # An unleased active run's row is its head (schema 9): claims read the stored state.
    # Read from the tables alone (the view may be the damaged object).
    behind = conn.execute(
        "SELECT r.run_id, r.state, t.to_state FROM run_rows AS r JOIN transitions AS t"
        " ON t.run_key = r.run_key AND t.seq > r.seq"
        " AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = r.run_key)"
        " WHERE r.status = 'active' AND r.lease_owner IS NULL ORDER BY r.run_key"
    ).fetchall()
    if behind:
        run_id, stored, head = behind[0]
        problems.append(
            f"{len(behind)} unleased active run(s) whose row is not their last transition's,"
            f" so claims misjudge them (first: run {run_id}, row in {stored!r}, head in"
            f" {head!r})"
        )
    # Schema 11: every run's hash chain and every row's own digest (a journal migrated only
    # as far as it is read by a newer fsm_runner has no digests to verify).
    if _has_digests(conn):
        problems += chain_problems(conn, transitions=chains)
    return problems


def _transitions_keys(
    conn: sqlite3.Connection,
) -> tuple[list[tuple[str, int, int | None]], list[tuple[str, int]]]:
    """The rows that refer to missing rows, by table; the transitions filed under another run.

    ``foreign_key_check`` table by table but for ``transitions``, whose rows are looked up once
    in one pass for both: its foreign key (a run id naming no run, as the pragma reports it:
    a count and the first rowid) and its run keys (a transition whose ``run_key`` is not the
    key of the run its ``run_id`` names). The two passes over every transition cost ~12 s of
    CPU a million runs; this one ~6.
    """
    tables = [
        name
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'transitions'"
            " ORDER BY name"
        )
    ]
    dangling: list[tuple[str, int, int | None]] = []
    for table in tables:
        dangling += conn.execute(
            'SELECT "table", count(*), min(rowid) FROM pragma_foreign_key_check(?)'
            ' GROUP BY "table"',
            (table,),
        ).fetchall()
    found = conn.execute(
        "SELECT t.rowid, t.run_id, t.seq, r.run_key IS NULL FROM transitions AS t"
        " LEFT JOIN run_rows AS r ON r.run_id = t.run_id"
        " WHERE t.run_id IS NOT NULL AND (r.run_key IS NULL OR t.run_key IS NOT r.run_key)"
        " ORDER BY t.run_key, t.seq"
    ).fetchall()
    missing = [rowid for rowid, _, _, no_run in found if no_run]
    if missing:
        dangling.append(("transitions", len(missing), min(missing)))
    dangling.sort(key=lambda row: row[0])
    return dangling, [(run_id, seq) for _, run_id, seq, no_run in found if not no_run]


def _has_tables(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table'").fetchone() is not None


def _migrate(conn: sqlite3.Connection, path: str) -> None:
    # sqlite-utils (schema and migrations) is imported only here: opening an up-to-date
    # journal, as every command and worker does, does not pay its ~0.1 s import.
    from fsm_runner.journal import _schema  # noqa: PLC0415 - lazy on purpose (see above)

    db = _schema.database(conn)
    _refuse_newer_schema(conn, path, _schema.unknown_migrations(db))
    _schema.migrate(db)


def _has_digests(conn: sqlite3.Connection) -> bool:
    return any(row[1] == "digest" for row in conn.execute("PRAGMA table_info(transitions)"))


def _refuse_newer_schema(conn: sqlite3.Connection, path: str, unknown: set[str]) -> None:
    found = _stored_version(conn, path)
    if (found is not None and found > SCHEMA_VERSION) or unknown:
        raise SchemaVersionError(found=found or 0, supported=SCHEMA_VERSION, path=path)


def _enable_wal(conn: sqlite3.Connection, path: str) -> None:
    """Switch the file to WAL (a new journal's, or one a rollback-journal tool left).

    The switch takes the file's exclusive lock without SQLite's busy handler: openers of one new
    file at once (another switching it, or reading it in rollback mode meanwhile) got "database
    is locked" at once, whatever the busy timeout. So it is tried again, with short sleeps, for
    as long as the connection's busy timeout; the mode is read again first (another opener has
    most often switched it meanwhile).
    """
    if path == ":memory:":
        return
    patience = int(conn.execute("PRAGMA busy_timeout").fetchone()[0]) / 1000
    deadline = time.monotonic() + patience
    pause = 0.001
    while str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        try:
            conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:  # noqa: PERF203 - a retry, once a race
            if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        else:
            return  # switched, or a mode SQLite keeps (its answer, as before: not an error)


def _stored_version(conn: sqlite3.Connection, path: str) -> int | None:
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.OperationalError:
        return None  # no meta table yet
    if row is None:
        return None
    try:
        return int(row[0])
    except ValueError:
        raise JournalError(f"has an unreadable schema version {row[0]!r}", path=path) from None
