"""The SQLite journal: the embedded default, one file that sqlite-utils and Datasette can browse.

Schema and migrations go through ``sqlite-utils``; the hot path (one commit per transition) uses
prepared SQL on the raw connection, in WAL mode, inside ``BEGIN IMMEDIATE`` with a busy timeout
so concurrent writers queue instead of failing with "database is locked".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import itertools
import operator
import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from fsm_runner.events import RunEvent
from fsm_runner.exceptions import (
    JournalError,
    LeaseLostError,
    RunExistsError,
    RunNotFoundError,
    RunTerminalError,
    SchemaVersionError,
)
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._sql import SqlJournal
from fsm_runner.journal.base import Commit, Durability, PruneReport
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    format_utc,
    utc_now,
)

__all__ = ["APPLICATION_ID", "DEFAULT_PATH", "SCHEMA_VERSION", "TUNING", "SqliteJournal"]

#: ``PRAGMA application_id`` of every fsm_runner journal ("FSMR"): tells ours from foreign files.
APPLICATION_ID = 0x46534D52
#: The schema version this fsm_runner writes; a journal with a higher one is refused.
SCHEMA_VERSION = 8
#: Where the CLI looks when neither ``--journal`` nor ``FSM_RUNNER_JOURNAL`` is given.
DEFAULT_PATH = "fsm-runner.db"

#: What a ``sqlite3`` error says (lower-cased words in its message) -> what the user is told.
_SQLITE_ERRORS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("locked", "busy"),
        "is locked by another writer for longer than the busy timeout; nothing was written",
    ),
    (
        ("readonly", "read-only"),
        "is read-only (check the permissions of the file, its -wal and -shm files and "
        "its directory); nothing was written",
    ),
    (("full",), "the disk (or the journal's size limit) is full; nothing was written"),
    # SQLITE_NOTADB: the file's header is not SQLite's.
    (
        ("not a database",),
        "is not a SQLite database (a corrupt or foreign file); nothing was changed",
    ),
    (("malformed", "corrupt"), "is corrupt ({text}); nothing was changed"),
    (("unable to open",), "cannot be opened (check the path and its permissions)"),
)

#: How much of a ``sqlite3`` error's own text a message quotes, at most.
_DETAIL_CHARS = 160

T = TypeVar("T")

_USER_ABORTED = RunEvent.USER_ABORTED.value
_UTC = dt.timezone.utc
#: What the ``transitions_fence`` trigger raises when a transition does not follow the
#: run's last one (a stale seq), its writer's lease token is not the run's (fencing), or it is
#: not the USER_ABORTED that carries out the abort requested of the run.
_STALE_SEQ = "fsm_runner: the run is not at the seq before this transition"
#: What it raises for a transition written without its run's ``run_key`` (by hand, say).
_NO_RUN_KEY = (
    "fsm_runner: a transition needs the run_key of its run"
    " (SELECT run_key FROM run_rows WHERE run_id = ...)"
)


_EFFECT_COLUMNS = _rows.EFFECT_COLUMNS
_PUT_EFFECT = (
    f"INSERT OR REPLACE INTO effects ({', '.join(_EFFECT_COLUMNS)})"
    f" SELECT {', '.join('?' * len(_EFFECT_COLUMNS))}"
    " WHERE EXISTS (SELECT 1 FROM runs WHERE run_id = ? AND seq = ?"
    " AND (? IS NULL OR lease_token = ?))"
)
_ITERATION_COLUMNS = _rows.ITERATION_COLUMNS
_UPSERT_ITERATION = (
    f"INSERT OR REPLACE INTO iterations ({', '.join(_ITERATION_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(_ITERATION_COLUMNS))})"
)
_ARTIFACT_COLUMNS = _rows.ARTIFACT_COLUMNS
_UPSERT_ARTIFACT = (
    f"INSERT OR REPLACE INTO artifacts ({', '.join(_ARTIFACT_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(_ARTIFACT_COLUMNS))})"
)

#: How many runs' last written rows the journal remembers to write only changed columns.
_REMEMBERED_RUNS = 10_000
_INSERT_TRANSITION = (
    "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt, at,"
    " duration_ms, result, lease_token, run_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_TRANSITION_PARAMS = 12
_run_key_of = operator.itemgetter(_TRANSITION_PARAMS - 1)  # an INSERT's (run_key, seq) order
_BULK_ROWS = 256  # rows per multi-row INSERT, at most (12 parameters each)
#: How many run ids' keys (``run_rows.run_key``) the journal remembers; a miss costs one lookup.
_REMEMBERED_KEYS = 100_000
_LIMIT_VARIABLE_NUMBER = 9  # sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER (Python 3.11+)
_CACHE_KIB = 16 * 1024
#: Pragmas of every connection beyond WAL, synchronous and the page cache (benchmarks give their
#: raw baselines the same). A checkpoint (with its fsyncs) once the WAL holds 10,000 pages
#: (~40 MB) instead of SQLite's 1,000: a group commit of a thousand runs writes ~1,000 pages, and
#: a checkpoint after every one cost ~15 % of its time (bench_concurrent). The WAL file is cut
#: back to 64 MiB after a checkpoint; a crashed process's WAL is replayed on the next open
#: (tens of milliseconds at that size).
TUNING = {"wal_autocheckpoint": 10_000, "journal_size_limit": 64 * 1024 * 1024}


@functools.lru_cache(maxsize=64)
def _bulk_insert(rows: int) -> str:
    """The INSERT of ``rows`` transitions in one statement."""
    values = ", ".join(["(" + ", ".join("?" * _TRANSITION_PARAMS) + ")"] * rows)
    return _INSERT_TRANSITION.split(" VALUES ", maxsplit=1)[0] + " VALUES " + values


_RUN_COLUMNS = _rows.RUN_COLUMNS
_INSERT_RUN = (
    f"INSERT INTO run_rows ({', '.join(_RUN_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(_RUN_COLUMNS))})"
)


_dumps = _rows.dumps


def _inserted_key(cursor: sqlite3.Cursor) -> int:
    """The ``run_key`` SQLite gave the run row ``cursor`` just inserted."""
    key = cursor.lastrowid
    if key is None:  # pragma: no cover - SQLite sets it after every successful INSERT
        raise JournalError("gave no run_key to a new run row")
    return key


#: The schema objects whose SQL is fsm_runner's own text — the ``runs`` view and the triggers —
#: by (type, name): their table, and a digest of their SQL with whitespace normalised, as the
#: current schema version has them. Checked at every open; a test keeps it equal to a new
#: journal's (a change of them is a new migration and a new schema version).
_CODE: dict[tuple[str, str], tuple[str, str]] = {
    ("trigger", "transitions_fence"): ("transitions", "8fda0ea5177c86748a4c3748361f9e62"),
    ("view", "runs"): ("runs", "cc0c951c1f3d4f7ac3e42ba6c83e85fe"),
}
#: The journal's tables and its view: a trigger on one of them takes part in its writes.
_TABLES = frozenset(
    {"_sqlite_migrations", "artifacts", "effects", "iterations", "meta", "run_rows", "runs",
     "specs", "transitions"}
)  # fmt: skip
#: A column's type affinity (SQLite's rules, section 3.1 of its datatype page), by substring.
_AFFINITIES = (("INT", "INTEGER"), ("CHAR", "TEXT"), ("CLOB", "TEXT"), ("TEXT", "TEXT"),
               ("BLOB", "BLOB"), ("REAL", "REAL"), ("FLOA", "REAL"), ("DOUB", "REAL"))  # fmt: skip


def _code_digest(sql: bytes | None) -> str:
    """A digest of a schema object's SQL, whitespace aside (read as bytes: it may be damaged)."""
    return hashlib.sha256(b" ".join((sql or b"").split())).hexdigest()[:32]


def _code_objects(conn: sqlite3.Connection) -> dict[tuple[str, str], tuple[str, str]]:
    """The views and triggers of the main schema: (type, name) -> (table, SQL digest)."""
    rows = conn.execute(
        "SELECT CAST(type AS BLOB), CAST(name AS BLOB), CAST(tbl_name AS BLOB),"
        " CAST(sql AS BLOB) FROM main.sqlite_master WHERE type IN ('view', 'trigger')"
    ).fetchall()
    return {
        (_name(kind), _name(name)): (_name(table), _code_digest(sql))
        for kind, name, table, sql in rows
    }


def _name(raw: bytes | None) -> str:
    """A schema object's name as text (a damaged one shown with its bad bytes escaped)."""
    return (raw or b"").decode("utf-8", "backslashreplace")


def _affinity(declared: str) -> str:
    upper = declared.upper()
    for needle, affinity in _AFFINITIES:
        if needle in upper:
            return affinity
    return "BLOB" if not upper else "NUMERIC"


def _schema_shapes(conn: sqlite3.Connection) -> dict[tuple[str, str], Any]:
    """Every schema object by (type, name), as much of it as tells a damaged one.

    Tables by their columns (name, type affinity, NOT NULL, default, key), foreign keys and
    unique constraints: the text sqlite-utils writes for them differs between its versions and
    after ``ALTER TABLE``, so their SQL is not compared. Indexes by table, uniqueness and
    columns; views and triggers by table and SQL (:func:`_code_objects`). SQLite's own objects
    (``sqlite_*``) are not the journal's; sqlite-utils' ``_sqlite_migrations`` by name only.
    """
    shapes: dict[tuple[str, str], Any] = dict(_code_objects(conn))
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


def _difference(kind: str, found: Any, expected: Any) -> str:
    """Which columns of a table differ (for a table); nothing for other objects."""
    if kind != "table" or not found or not expected:
        return ""
    names = sorted({column[0] for column in set(found[0]) ^ set(expected[0])})
    return f" (columns {', '.join(names)})" if names else ""


@functools.cache
def _expected_shapes() -> dict[tuple[str, str], Any]:
    """The schema objects of a new journal, as :func:`_schema_shapes` sees them."""
    with SqliteJournal(":memory:") as journal:
        return _schema_shapes(journal._conn)


class SqliteJournal(SqlJournal):
    """A journal in one SQLite file (WAL mode).

    Args:
        path: the database file; created with the schema if it does not exist.
        create: make a journal of a missing file, or of an empty one (0 bytes, or a SQLite
            database without tables); when ``False`` such a file is refused, left as it was.
            Commands that only read a journal open it so.
        durability: ``process`` (default, synchronous=NORMAL: survives a killed process) or
            ``power`` (synchronous=FULL: survives power loss).
        busy_timeout: seconds a writer waits for another one before giving up.

    Raises:
        JournalError: the file is not a SQLite database, not an fsm_runner journal, corrupt,
            read-only where a write is needed, or cannot be opened; or (``create=False``) it
            is missing or empty. A journal whose schema objects (the ``runs`` view, the
            triggers) differ from its schema version's opens, but refuses what they would
            make it misread or miswrite (see :meth:`schema_problems`).
        SchemaVersionError: the journal was written by a newer fsm_runner.
    """

    _MARK = "?"
    _RUN_TABLE = "run_rows"
    _RUN_SELECT = "*"  # the runs view, with run_key (remembered for commits)
    _ROW_ORDER = "run_key"
    _PUT_EFFECT = _PUT_EFFECT
    _stamp = staticmethod(format_utc)

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_PATH,
        *,
        durability: Durability = "process",
        busy_timeout: float = 30.0,
        create: bool = True,
    ) -> None:
        if durability not in ("process", "power"):
            raise ValueError(f"durability must be 'process' or 'power', not {durability!r}")
        self.path = str(Path(path).absolute()) if str(path) != ":memory:" else ":memory:"
        self.durability: Durability = durability
        self._lock = threading.RLock()
        self._closed = False
        self._written: dict[str, RunRecord] = {}  # run rows as last written or read here
        self._keys: dict[str, int] = {}  # run id -> run_rows.run_key, as read or written here
        self._update_sql: dict[tuple[str, ...], str] = {}
        self._create = create
        #: Why reads, and why writes, are refused: a schema object they depend on is damaged.
        self._unreadable: str | None = None
        self._unwritable: str | None = None
        self._check_header()
        if not create and self.path != ":memory:" and not os.path.exists(self.path):
            raise JournalError("does not exist; nothing was created", path=self.path)
        self._heal_side_files()
        with self._errors():
            self._conn = sqlite3.connect(
                self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
        try:
            with self._errors():
                # recursive_triggers stays off (SQLite's default; sqlite-utils would turn it on):
                # our one trigger never recurses, and on costs ~1 µs a step.
                self._cursor = self._conn.cursor()
                self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
                # 16 MiB of page cache (SQLite's default is 2 MiB): a group commit of a thousand
                # runs dirties up to a thousand index pages (one a run, once each run's keys
                # fill a page), and spilling them mid-transaction cost ~3 µs a row
                # (bench_concurrent). Allocated only as pages are used.
                self._conn.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
                for pragma, value in TUNING.items():
                    self._conn.execute(f"PRAGMA {pragma} = {value}")
                getlimit = getattr(self._conn, "getlimit", None)  # Python 3.11+
                variables = getlimit(_LIMIT_VARIABLE_NUMBER) if getlimit else 999
                self._bulk_rows = max(1, min(_BULK_ROWS, variables // _TRANSITION_PARAMS))
                self._open_schema()
                self._verify_code()
                self._conn.execute(
                    "PRAGMA synchronous = " + ("FULL" if durability == "power" else "NORMAL")
                )
                # Foreign keys are declared (Datasette shows the links) but not enforced: the
                # journal's own transactions keep them, and enforcing costs every commit.
        except BaseException:
            self._conn.close()
            raise

    @property
    def location(self) -> str:
        """The journal file's absolute path."""
        return self.path

    def close(self) -> None:
        """Close the connection; further use raises ``JournalError``."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    # -- opening -------------------------------------------------------------------------------

    # Nothing here may open the journal or its side files with ``open()``: POSIX advisory locks
    # belong to a process, not to a descriptor, so closing *any* descriptor of the file drops
    # every lock this process's other connections hold on it. Another process closing its
    # connection then believes it is the last one, checkpoints and deletes the ``-wal`` and
    # ``-shm`` under our live connections: commits land in a deleted WAL and are lost, and
    # readers of the truncated ``-shm`` die of SIGBUS. Only SQLite itself (which shares one lock
    # set between the connections of a process) reads these files; the checks below use
    # ``stat``/``access``, which open nothing.

    def _check_header(self) -> None:
        """Refuse a path whose directory is missing, or that is a directory itself."""
        if self.path == ":memory:":
            return
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            if not Path(self.path).parent.is_dir():
                raise JournalError("its directory does not exist", path=self.path) from None
            return
        except OSError as exc:
            raise JournalError(f"cannot be read: {exc.strerror}", path=self.path) from None
        if stat.S_ISDIR(mode):
            raise JournalError("is a directory, not a journal file", path=self.path)
        if not os.access(self.path, os.R_OK, effective_ids=True):
            raise JournalError("cannot be read: Permission denied", path=self.path)

    def _heal_side_files(self) -> None:
        """Make stale ``-wal``/``-shm`` files writable again when the journal itself is.

        A connection to a read-only journal leaves its ``-shm`` file behind with the journal's
        mode then; once the journal is made writable again, SQLite would still open it
        read-only because of that file. Only files this process owns are changed.
        """
        if self.path == ":memory:" or not os.access(self.path, os.W_OK, effective_ids=True):
            return  # missing, or not writable: nothing to heal
        for suffix in ("-wal", "-shm"):
            side = self.path + suffix
            if os.path.exists(side) and not os.access(side, os.W_OK, effective_ids=True):
                with contextlib.suppress(OSError):
                    if os.stat(side).st_uid == os.getuid():
                        os.chmod(side, os.stat(self.path).st_mode & 0o777)

    def _open_schema(self) -> None:
        conn = self._conn
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        if app_id not in (0, APPLICATION_ID):
            raise JournalError(
                f"is a SQLite database of another application (application_id {app_id:#x}), "
                "not an fsm_runner journal",
                path=self.path,
            )
        if app_id == APPLICATION_ID and self._stored_version() == SCHEMA_VERSION:
            self._enable_wal()
            return  # the common case: an up-to-date journal, opened without taking a write lock
        tables = {
            str(row[0])
            for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if app_id == 0 and not tables and not self._create:
            empty = self.path != ":memory:" and os.stat(self.path).st_size == 0
            raise JournalError(
                "is not an fsm_runner journal ("
                + ("an empty file" if empty else "a SQLite database without tables")
                + "); nothing was changed",
                path=self.path,
            )
        if app_id == 0 and tables - {"_sqlite_migrations"}:
            raise JournalError(
                "is a SQLite database but not an fsm_runner journal (it has tables "
                f"{', '.join(sorted(tables)[:5])})",
                path=self.path,
            )
        self._enable_wal()
        # sqlite-utils (schema and migrations) is imported only here: opening an up-to-date
        # journal, as every command and worker does, does not pay its ~0.1 s import.
        from fsm_runner.journal import _schema  # noqa: PLC0415 - lazy on purpose (see above)

        db = _schema.database(conn)
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._refuse_newer_schema(_schema.unknown_migrations(db))
            _schema.migrate(db)
            self._conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _verify_code(self) -> None:
        """Compare the journal's view and triggers with its schema version's; note what differs.

        Their SQL is fsm_runner's own text, stored as written, so a digest of it (whitespace
        aside) tells a damaged or hand-edited one: ``transitions_fence`` altered or dropped
        loses the fencing of every write (invariants 2 and 4), an extra trigger runs inside
        every commit, and an altered ``runs`` view misreads every run's head. Writes are then
        refused, and reads too when the view is not the expected one; ``check`` lists what
        differs (:meth:`schema_problems`). Costs one read of ``sqlite_master`` (~25 µs).
        """
        found = {  # triggers on tables of the user's own (in the same file) are theirs
            key: value
            for key, value in _code_objects(self._conn).items()
            if key in _CODE or value[0] in _TABLES
        }
        damaged = sorted(
            f"{kind} {name}"
            for kind, name in found.keys() ^ _CODE.keys()
            | {key for key in found.keys() & _CODE.keys() if found[key] != _CODE[key]}
        )
        if not damaged:
            return
        what = (
            f"its schema is damaged ({', '.join(damaged)}: not as schema version"
            f" {SCHEMA_VERSION} has {'it' if len(damaged) == 1 else 'them'};"
            " fsm-runner check lists what differs)"
        )
        self._unwritable = f"{what}; nothing was written"
        if found.get(("view", "runs")) != _CODE["view", "runs"]:
            self._unreadable = f"{what}; nothing was read"

    def schema_problems(self) -> list[str]:
        """How the journal's schema objects differ from those of its schema version.

        Every table, index, view and trigger is compared with a new journal's (tables by their
        columns, keys and unique constraints; indexes by their columns; views and triggers by
        their SQL, whitespace aside): one line per object missing, altered, or added to one of
        the journal's tables (an index or a trigger: it takes part in every write). Tables,
        views and the like of the user's own in the same file are not the journal's business.
        Empty for a journal as fsm_runner made (or migrated) it.
        """
        expected = _expected_shapes()
        with self._read(damaged=True) as conn:
            found = _schema_shapes(conn)
            owners = {
                (_name(kind), _name(name)): _name(table)
                for kind, name, table in conn.execute(
                    "SELECT CAST(type AS BLOB), CAST(name AS BLOB), CAST(tbl_name AS BLOB)"
                    " FROM main.sqlite_master"
                )
            }
        ours = {name for kind, name in expected if kind in ("table", "view")}
        problems = []
        for key in sorted(expected.keys() | found.keys()):
            kind, name = key
            if key not in found:
                problems.append(f"schema: {kind} {name} is missing")
            elif key not in expected:
                if kind not in ("index", "trigger") or owners.get(key) not in ours:
                    continue  # the user's own, beside the journal
                problems.append(
                    f"schema: {kind} {name} is not part of schema version {SCHEMA_VERSION}"
                )
            elif found[key] != expected[key]:
                problems.append(
                    f"schema: {kind} {name} differs from schema version {SCHEMA_VERSION}"
                    f"{_difference(kind, found[key], expected[key])} (damaged or edited by hand)"
                )
        return problems

    def _refuse_newer_schema(self, unknown: set[str]) -> None:
        found = self._stored_version()
        if (found is not None and found > SCHEMA_VERSION) or unknown:
            raise SchemaVersionError(found=found or 0, supported=SCHEMA_VERSION, path=self.path)

    def _enable_wal(self) -> None:
        if self.path == ":memory:":
            return
        mode = self._conn.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            self._conn.execute("PRAGMA journal_mode = WAL")

    def _stored_version(self) -> int | None:
        try:
            row = self._conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'"
            ).fetchone()
        except sqlite3.OperationalError:
            return None  # no meta table yet
        if row is None:
            return None
        try:
            return int(row[0])
        except ValueError:
            raise JournalError(
                f"has an unreadable schema version {row[0]!r}", path=self.path
            ) from None

    # -- error mapping -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Map ``sqlite3`` errors to :class:`JournalError`; they never leave this module.

        So does a ``UnicodeDecodeError``: SQLite hands back text (a value, a column name, a
        schema object's SQL) as the bytes the file holds, and bytes that are not UTF-8 are a
        damaged file, not a bug of the caller's.
        """
        try:
            yield
        except sqlite3.Error as exc:
            raise JournalError(self._describe(exc), path=self.path) from exc
        except UnicodeDecodeError as exc:
            raise JournalError(
                f"is corrupt (it holds text that is not UTF-8: {exc}); nothing was changed",
                path=self.path,
            ) from exc

    @staticmethod
    def _describe(exc: sqlite3.Error) -> str:
        # One line, cut: a schema that SQLite cannot parse comes back with the rest of the
        # object's SQL in the message (a corrupt view: 20 lines and more).
        text = " ".join(str(exc).split())
        if len(text) > _DETAIL_CHARS:
            text = text[: _DETAIL_CHARS - 1] + "…"
        lowered = text.lower()
        for needles, message in _SQLITE_ERRORS:
            if any(needle in lowered for needle in needles):
                return message.format(text=text)
        return f"SQLite error: {text}"

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One short ``BEGIN IMMEDIATE`` transaction; rolled back on any error."""
        with self._lock, self._errors():
            if self._closed:
                raise JournalError("is closed", path=self.path)
            if self._unwritable is not None:
                raise JournalError(self._unwritable, path=self.path)
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise JournalError("is closed", path=self.path)

    def _check_writable(self) -> None:
        if self._unwritable is not None:  # a damaged fence (or more): see _verify_code
            raise JournalError(self._unwritable, path=self.path)

    @contextlib.contextmanager
    def _read(self, *, damaged: bool = False) -> Iterator[sqlite3.Connection]:
        """The connection, for reads.

        ``damaged``: even when the ``runs`` view is not the expected one (for reads of tables
        alone, and of the schema itself).
        """
        with self._lock, self._errors():
            if self._closed:
                raise JournalError("is closed", path=self.path)
            if self._unreadable is not None and not damaged:
                raise JournalError(self._unreadable, path=self.path)
            yield self._conn

    # -- writes --------------------------------------------------------------------------------

    def create_run(
        self,
        run: RunRecord,
        first: TransitionRecord,
        *,
        spec_json: str,
        iterations: Sequence[IterationRecord] = (),
    ) -> None:
        """Store a new run with its transition seq 0, spec and iterations, in one transaction."""
        run_row = self._run_params(run)
        transition_row = self._transition_params(first)
        try:
            with self._write() as conn:
                conn.execute(
                    "INSERT OR IGNORE INTO specs (spec_hash, machine, json, created_at)"
                    " VALUES (?, ?, ?, ?)",
                    (run.spec_hash, run.machine, spec_json, format_utc(utc_now())),
                )
                key = _inserted_key(conn.execute(_INSERT_RUN, run_row))
                conn.execute(_INSERT_TRANSITION, (*transition_row, key))
                for record in iterations:
                    conn.execute(_UPSERT_ITERATION, self._iteration_params(record))
            self._remember(run)
            self._remember_key(run.run_id, key)
        except JournalError as exc:
            if isinstance(exc.__cause__, sqlite3.IntegrityError) and "run_rows.run_id" in str(
                exc.__cause__
            ):
                raise RunExistsError(run.run_id) from None
            raise

    def commit(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        *,
        iterations: Sequence[IterationRecord] = (),
        artifacts: Sequence[ArtifactRecord] = (),
        spec_json: str | None = None,
    ) -> None:
        """Store ``transition`` and the run row it leads to, in one transaction.

        The run's head (state, seq, iteration, updated_at) is its last transition, and the
        ``transitions_fence`` trigger refuses a stale seq or lease token, so in the common
        step — nothing else about the run changed — the whole commit is one autocommit INSERT.
        Other changed columns are written by an UPDATE of ``run_rows`` in the same
        ``BEGIN IMMEDIATE`` transaction.
        """
        insert, rows = self._statements(run, transition, iterations, artifacts, spec_json)
        run_id = run.run_id
        written = self._written
        with self._lock:
            if self._closed:
                raise JournalError("is closed", path=self.path)
            if self._unwritable is not None:
                raise JournalError(self._unwritable, path=self.path)
            cursor = self._cursor  # one reused cursor: a new one per statement costs ~0.5 µs
            try:
                if rows is None:
                    cursor.execute(_INSERT_TRANSITION, insert)
                else:
                    self._commit_with_rows(cursor, insert, rows)
            except sqlite3.IntegrityError as exc:
                written.pop(run_id, None)
                raise self._refusal(
                    exc, run_id, transition.seq - 1, transition.lease_token
                ) from None
            except sqlite3.Error as exc:
                written.pop(run_id, None)
                raise JournalError(self._describe(exc), path=self.path) from exc
            if len(written) >= _REMEMBERED_RUNS:
                written.clear()
            written[run_id] = run

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in one ``BEGIN IMMEDIATE`` transaction (see ``Journal``).

        A one-statement commit that is refused is undone by SQLite itself (the trigger's
        ``RAISE(ABORT)`` ends that statement only); one with more statements runs inside a
        SAVEPOINT, rolled back when it is refused.
        """
        results: list[Exception | None] = [None] * len(commits)
        planned = []
        for index, item in enumerate(commits):
            try:
                insert, rows = self._statements(
                    item.run, item.transition, item.iterations, item.artifacts, item.spec_json
                )
            except Exception as exc:  # noqa: BLE001, PERF203 - refused alone, returned at its index
                results[index] = exc
            else:
                planned.append((index, insert, rows))
        if not planned:
            return results
        stored: list[int] = []
        with self._lock:
            try:
                self._check_open()
                self._check_writable()
                with self._errors():
                    self._write_group(commits, planned, results, stored)
            except JournalError as failure:
                for index in stored:
                    self._written.pop(commits[index].run.run_id, None)
                return [failure if result is None else result for result in results]
            if len(self._written) >= _REMEMBERED_RUNS:
                self._written.clear()
        return results

    def _write_group(
        self,
        commits: Sequence[Commit],
        planned: Sequence[tuple[int, tuple[Any, ...], list[tuple[str, tuple[Any, ...]]] | None]],
        results: list[Exception | None],
        stored: list[int],
    ) -> None:
        written = self._written
        cursor = self._cursor
        cursor.execute("BEGIN IMMEDIATE")
        try:
            one_each = [item for item in planned if item[2] is not None]
            bulk = [item for item in planned if item[2] is None]
            if len(bulk) > 1 and len({commits[i].run.run_id for i, _, _ in planned}) == len(
                planned
            ):
                try:
                    self._insert_many([insert for _, insert, _ in bulk])
                except sqlite3.IntegrityError:  # one of them is refused: each on its own, below
                    cursor.execute("ROLLBACK")
                    cursor.execute("BEGIN IMMEDIATE")
                    one_each = list(planned)
                else:
                    for index, _, _ in bulk:
                        written[commits[index].run.run_id] = commits[index].run
                        stored.append(index)
            else:
                one_each = list(planned)
            for index, insert, rows in one_each:
                run = commits[index].run
                try:
                    if rows is None:
                        cursor.execute(_INSERT_TRANSITION, insert)
                    else:
                        self._savepoint(cursor, insert, rows)
                except sqlite3.IntegrityError as exc:
                    written.pop(run.run_id, None)
                    results[index] = self._refusal(
                        exc, run.run_id, run.seq - 1, commits[index].transition.lease_token
                    )
                else:
                    written[run.run_id] = run  # known at this seq for a later commit here
                    stored.append(index)
            cursor.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                cursor.execute("ROLLBACK")
            raise

    def _insert_many(self, inserts: Sequence[tuple[Any, ...]]) -> None:
        """INSERT many transitions (of distinct runs) in as few statements as the parameters allow.

        One multi-row VALUES statement binds the whole group and steps once: one call, instead
        of one per row, and SQLite releases the GIL for the whole of it. The rows go in the
        order of the ``(run_key, seq)`` index, so each insert lands next to the one before
        instead of in a random leaf: half the cost of a row at 1,000 runs (bench_concurrent).
        """
        inserts = sorted(inserts, key=_run_key_of)
        per_statement = self._bulk_rows
        for start in range(0, len(inserts), per_statement):
            chunk = inserts[start : start + per_statement]
            self._cursor.execute(
                _bulk_insert(len(chunk)), list(itertools.chain.from_iterable(chunk))
            )

    def _statements(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        iterations: Sequence[IterationRecord],
        artifacts: Sequence[ArtifactRecord],
        spec_json: str | None,
    ) -> tuple[tuple[Any, ...], list[tuple[str, tuple[Any, ...]]] | None]:
        """The INSERT of ``transition`` and, off the hot path, the other statements with it."""
        seq = transition.seq
        if run.seq != seq or run.state != transition.to_state or seq < 1:
            self._refuse_malformed(run, transition)
        insert = (
            transition.run_id,
            seq,
            transition.from_state,
            transition.event,
            transition.to_state,
            transition.iteration,
            transition.attempt,
            format_utc(transition.at),
            transition.duration_ms,
            None if transition.result is None else _dumps(transition.result),
            transition.lease_token,
            self._keys.get(transition.run_id) or self._run_key(transition.run_id),
        )
        known = self._written.get(run.run_id)
        if (
            known is not None  # the hot path: the transition is all that changed
            and known.seq == seq - 1
            and run.visit_seq == seq
            and run.status is known.status
            and run.attempt == known.attempt
            and run.context is known.context
            and run.error is known.error
            and run.return_to == known.return_to
            and transition.event != _USER_ABORTED
        ):
            extra = None
        else:
            extra = self._extra_update(run, transition)
        if extra is None and not iterations and not artifacts and spec_json is None:
            return insert, None
        rows = [extra] if extra is not None else []
        if spec_json is not None:
            rows += [
                (
                    "INSERT OR IGNORE INTO specs (spec_hash, machine, json, created_at)"
                    " VALUES (?, ?, ?, ?)",
                    (run.spec_hash, run.machine, spec_json, format_utc(utc_now())),
                ),
                ("UPDATE run_rows SET spec_hash = ? WHERE run_id = ?", (run.spec_hash, run.run_id)),
            ]
        rows += [(_UPSERT_ITERATION, self._iteration_params(i)) for i in iterations]
        rows += [(_UPSERT_ARTIFACT, self._artifact_params(a)) for a in artifacts]
        return insert, rows

    def _savepoint(
        self,
        cursor: sqlite3.Cursor,
        insert: tuple[Any, ...],
        rows: Sequence[tuple[str, tuple[Any, ...]]],
    ) -> None:
        """One commit of several statements inside a group: all of them or none."""
        cursor.execute("SAVEPOINT one_commit")
        try:
            self._insert_with(cursor, insert, rows)
        except BaseException:
            cursor.execute("ROLLBACK TO one_commit")
            raise
        finally:
            cursor.execute("RELEASE one_commit")

    @staticmethod
    def _insert_with(
        cursor: sqlite3.Cursor,
        insert: tuple[Any, ...],
        rows: Sequence[tuple[str, tuple[Any, ...]]],
    ) -> None:
        """The transition's INSERT, then the statements that go with it (inside a transaction)."""
        cursor.execute(_INSERT_TRANSITION, insert)
        for sql, params in rows:
            cursor.execute(sql, params)

    def _commit_with_rows(
        self,
        cursor: sqlite3.Cursor,
        insert: tuple[Any, ...],
        rows: Sequence[tuple[str, tuple[Any, ...]]],
    ) -> None:
        cursor.execute("BEGIN IMMEDIATE")
        try:
            self._insert_with(cursor, insert, rows)
            cursor.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                cursor.execute("ROLLBACK")
            raise

    def _extra_update(
        self, run: RunRecord, transition: TransitionRecord
    ) -> tuple[str, tuple[Any, ...]] | None:
        """The UPDATE of the stored run row, when more than the run's head changed.

        The head (state, seq, iteration, updated_at and a new visit) is the last transition, read
        through the ``runs`` view, so a plain step writes no run row at all. Any other change
        writes the head into the row too (the view then reads the row's own updated_at and
        visit_seq). Every column assigned costs (the status index alone ~8 µs a step), so when
        this journal knows the row as stored at ``seq - 1`` it leaves unchanged columns alone.
        That knowledge is safe: the fence trigger refuses the commit unless the run is at
        ``seq - 1``.
        """
        known = self._written.get(run.run_id)
        if known is None or known.seq != transition.seq - 1:
            known = None
        elif (
            run.visit_seq == transition.seq
            and run.status is known.status
            and run.attempt == known.attempt
            and run.context is known.context
            and run.error is known.error
            and run.return_to == known.return_to
            and transition.event != _USER_ABORTED
        ):
            return None  # the hot path: the transition is all that changed
        columns = ["state", "seq", "iteration", "updated_at", "visit_seq"]
        params: list[Any] = [
            run.state,
            run.seq,
            run.iteration,
            format_utc(run.updated_at),
            run.visit_seq,
        ]
        if known is None or run.status is not known.status:
            columns.append("status")
            params.append(run.status.value)
        if known is None or run.attempt != known.attempt:
            columns.append("attempt")
            params.append(run.attempt)
        if known is None or run.context is not known.context:
            columns.append("context")
            params.append(_dumps(run.context))
        if known is None or run.error is not known.error:
            columns.append("error")
            params.append(_dumps(run.error))
        if known is None or (run.return_to, run.return_attempt) != (
            known.return_to,
            known.return_attempt,
        ):
            columns += ["return_to", "return_attempt", "return_visit"]
            params += [run.return_to, run.return_attempt, run.return_visit]
        if transition.event == _USER_ABORTED:
            columns += ["abort_reason", "abort_token"]  # the abort carried out clears the request
            params += [None, None]
        key = tuple(columns)
        sql = self._update_sql.get(key)
        if sql is None:
            assignments = ", ".join(f"{column} = ?" for column in columns)
            sql = self._update_sql[key] = f"UPDATE run_rows SET {assignments} WHERE run_id = ?"
        params.append(run.run_id)
        return sql, tuple(params)

    def _remember(self, run: RunRecord) -> None:
        if len(self._written) >= _REMEMBERED_RUNS:
            self._written.clear()
        self._written[run.run_id] = run

    def _remember_key(self, run_id: str, key: int) -> None:
        if len(self._keys) >= _REMEMBERED_KEYS:
            self._keys.clear()
        self._keys[run_id] = key

    def _run_key(self, run_id: str) -> int:
        """The run's ``run_key`` (when this journal has not read or written the run yet)."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT run_key FROM run_rows WHERE run_id = ?", (run_id,)
            ).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        key = int(row[0])
        self._remember_key(run_id, key)
        return key

    def _refusal(
        self, exc: sqlite3.IntegrityError, run_id: str, expected_seq: int, token: int
    ) -> Exception:
        """Why the fence trigger (or a constraint) refused a commit."""
        if _STALE_SEQ not in str(exc) and "transitions.run_key" not in str(exc):
            return JournalError(self._describe(exc), path=self.path)
        self._keys.pop(run_id, None)  # read again next time, in case it was not the run's
        found = self._conn.execute(
            "SELECT v.seq, v.lease_token, v.abort_reason, r.abort_token FROM runs AS v"
            " JOIN run_rows AS r ON r.run_key = v.run_key WHERE v.run_id = ?",
            (run_id,),
        ).fetchone()
        return self._commit_refusal(found, run_id, expected_seq, token)

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its lease's writes are fenced but for the abort."""
        with self._write() as conn:
            run = self._load(conn, run_id)
            if run.ended:
                raise RunTerminalError(run_id=run_id, state=run.state, status=run.status.value)
            conn.execute(
                "UPDATE run_rows SET abort_reason = ?, abort_token = lease_token WHERE run_id = ?",
                (reason, run_id),
            )
        return self.load(run_id)

    # -- reads ---------------------------------------------------------------------------------

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row (one primary-key lookup; history is not read)."""
        with self._read() as conn:
            return self._load(conn, run_id)

    def _load(self, conn: sqlite3.Connection, run_id: str) -> RunRecord:
        cursor = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        row = cursor.fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        run = self._run_from_row(cursor.description, row)
        self._remember(run)
        return run

    def _run_from_row(self, description: Any, row: Sequence[Any]) -> RunRecord:
        return self._decode_run(
            {column[0]: value for column, value in zip(description, row, strict=True)}
        )

    def _decode_run(self, data: dict[str, Any]) -> RunRecord:
        key = data.pop("run_key", None)  # the view's: remembered for this journal's commits
        if key is not None:
            self._remember_key(data["run_id"], key)
        return super()._decode_run(data)

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> list[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order."""
        with self._read() as conn:
            found = conn.execute(
                "SELECT run_key FROM run_rows WHERE run_id = ?", (run_id,)
            ).fetchone()
            if found is None:
                raise RunNotFoundError(run_id)
            cursor = conn.execute(
                "SELECT * FROM transitions WHERE run_key = ? AND seq >= ? AND seq <= ?"
                " ORDER BY seq",
                (found[0], from_seq, to_seq if to_seq is not None else 2**62),
            )
            names = [column[0] for column in cursor.description]
            rows = cursor.fetchall()
        return self._transition_records(names, rows)

    def _select(
        self, query: str, params: Sequence[Any], *, damaged: bool = False
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        with self._read(damaged=damaged) as conn:
            cursor = conn.execute(query, params)
            return [column[0] for column in cursor.description], cursor.fetchall()

    def _writing(self, work: Callable[[sqlite3.Connection], T]) -> T:
        with self._write() as conn:
            return work(conn)

    def _stale_bound(self) -> tuple[str, list[Any]]:
        return "?", [format_utc(utc_now())]

    # -- leases --------------------------------------------------------------------------------

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` seconds; its token increases by one.

        Granted when nobody holds the lease, when it has expired (a takeover: the run's
        ``recoveries`` count increases), or when ``owner`` holds it already.
        """
        now = utc_now()
        with self._write() as conn:
            claimed = self._claim_in(conn, run_id, owner, now, ttl, take_over, None)
        self._remember(claimed)
        return claimed

    def claim_many(
        self,
        run_ids: Sequence[str],
        owner: str,
        *,
        ttl: float,
        check: Callable[[RunRecord], object] | None = None,
    ) -> list[RunRecord | Exception]:
        """Claim several runs' leases in ONE transaction, each granted or refused on its own.

        For an engine starting many runs at once (``Engine.arun`` with group commit): one
        commit instead of one each. Each run is claimed as by :meth:`claim`; ``check`` is
        called with the run as loaded, first, and what it raises refuses that run. A refused
        run's error is returned at its index and nothing is written for it. When the
        transaction itself fails, nothing was written and every entry is that ``JournalError``.
        """
        now = utc_now()
        results: list[RunRecord | Exception] = []
        try:
            with self._write() as conn:
                for run_id in run_ids:
                    try:
                        results.append(self._claim_in(conn, run_id, owner, now, ttl, None, check))
                    except sqlite3.Error:  # noqa: PERF203 - the transaction failed: every claim
                        raise
                    except Exception as exc:  # noqa: BLE001 - refused alone, returned at its index
                        results.append(exc)
        except JournalError as failure:
            return [failure] * len(run_ids)
        for result in results:
            if isinstance(result, RunRecord):
                self._remember(result)
        return results

    def _claim_in(  # noqa: PLR0917 - one private call shape for claim and claim_many
        self,
        conn: sqlite3.Connection,
        run_id: str,
        owner: str,
        now: dt.datetime,
        ttl: float,
        take_over: str | None,
        check: Callable[[RunRecord], object] | None,
    ) -> RunRecord:
        """One claim inside the caller's write transaction; returns the row it wrote."""
        run = self._load(conn, run_id)
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

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        machine: str,
        states: Collection[str],
        spec_hash: str | None = None,
    ) -> RunRecord | None:
        """Claim the oldest runnable run (one transaction), or ``None``."""
        if not states:
            return None
        now = utc_now()
        marks = ", ".join("?" * len(states))
        sql = (
            "SELECT run_id, lease_owner FROM runs WHERE status = 'active' AND machine = ?"
            f" AND state IN ({marks}) AND (lease_owner IS NULL OR lease_expires_at < ?)"
        )
        params: list[Any] = [machine, *states, format_utc(now)]
        if spec_hash is not None:
            sql += " AND spec_hash = ?"
            params.append(spec_hash)
        sql += " ORDER BY created_at, run_key LIMIT 1"
        with self._write() as conn:
            found = conn.execute(sql, params).fetchone()
            if found is None:
                return None
            expires = now + dt.timedelta(seconds=ttl)
            conn.execute(
                "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
                " lease_token = lease_token + 1, recoveries = recoveries + ? WHERE run_id = ?",
                (owner, format_utc(expires), int(found[1] is not None), found[0]),
            )
            return self._load(conn, found[0])

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` by ``ttl`` seconds from now."""
        expires = utc_now() + dt.timedelta(seconds=ttl)
        with self._write() as conn:
            changed = conn.execute(
                "UPDATE run_rows SET lease_expires_at = ? WHERE run_id = ? AND lease_owner = ?"
                " AND lease_token = ?",
                (format_utc(expires), run_id, owner, token),
            ).rowcount
            if not changed:
                self._require_run(conn, run_id)
                raise LeaseLostError(run_id, token=token)
        return expires

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it."""
        with self._write() as conn:
            released = conn.execute(
                "UPDATE run_rows SET lease_owner = NULL, lease_expires_at = NULL"
                " WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
                (run_id, owner, token),
            ).rowcount
        return bool(released)

    # -- operations ----------------------------------------------------------------------------

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        if run.seq != at_seq:
            raise ValueError(f"the forked run must be at seq {at_seq}, not {run.seq}")
        first = self._run_params(attrs.evolve(run, seq=0))
        try:
            with self._write() as conn:
                found = conn.execute(
                    "SELECT seq, run_key FROM runs WHERE run_id = ?", (source_run_id,)
                ).fetchone()
                if found is None:
                    raise RunNotFoundError(source_run_id)
                if not 0 <= at_seq <= found[0]:
                    raise ValueError(
                        f"run {source_run_id} has seqs 0..{found[0]}; there is no seq {at_seq}"
                    )
                key = _inserted_key(conn.execute(_INSERT_RUN, first))
                # In seq order: the fence trigger admits each on top of the one before.
                conn.execute(
                    "INSERT INTO transitions (run_id, run_key, seq, from_state, event, to_state,"
                    " iteration, attempt, at, duration_ms, result) SELECT ?, ?, seq, from_state,"
                    " event, to_state, iteration, attempt, at, duration_ms, result"
                    " FROM transitions WHERE run_key = ? AND seq <= ? ORDER BY seq",
                    (run.run_id, key, found[1], at_seq),
                )
                assignments = ", ".join(f"{column} = ?" for column in _RUN_COLUMNS[1:])
                conn.execute(
                    f"UPDATE run_rows SET {assignments} WHERE run_id = ?",
                    (*self._run_params(run)[1:], run.run_id),
                )
                copies = (
                    ("iterations", _ITERATION_COLUMNS, "iteration <= ?", run.iteration),
                    ("artifacts", _ARTIFACT_COLUMNS, "seq <= ?", at_seq),
                    ("effects", _EFFECT_COLUMNS, "visit_seq < ?", run.visit_seq),
                )
                for table, columns, condition, bound in copies:
                    rest = [column for column in columns if column != "run_id"]
                    conn.execute(
                        f"INSERT INTO {table} (run_id, {', '.join(rest)})"
                        f" SELECT ?, {', '.join(rest)} FROM {table}"
                        f" WHERE run_id = ? AND {condition}",
                        (run.run_id, source_run_id, bound),
                    )
            self._remember(run)
            self._remember_key(run.run_id, key)
        except JournalError as exc:
            if isinstance(exc.__cause__, sqlite3.IntegrityError) and "run_rows.run_id" in str(
                exc.__cause__
            ):
                raise RunExistsError(run.run_id) from None
            raise

    def _size(self) -> int | None:
        if self.path == ":memory:":
            return None
        return sum(
            Path(self.path + suffix).stat().st_size
            for suffix in ("", "-wal")
            if Path(self.path + suffix).exists()
        )

    def prune(self, *, ended_before: dt.datetime, dry_run: bool = False) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, then ``VACUUM``."""
        select = (
            "SELECT run_id, run_key FROM runs AS r WHERE status != 'active' AND updated_at < ?"
            " AND NOT EXISTS (SELECT 1 FROM run_rows AS c WHERE c.parent_run_id = r.run_id"
            " AND c.status = 'active') ORDER BY updated_at, run_key"
        )
        cutoff = (format_utc(ended_before),)
        before = self._size()
        if dry_run:
            with self._read() as conn:
                ids = tuple(str(row[0]) for row in conn.execute(select, cutoff))
                count = conn.execute(
                    "SELECT count(*) FROM transitions"
                    f" WHERE run_key IN (SELECT run_key FROM ({select}))",
                    cutoff,
                ).fetchone()[0]
            return PruneReport(ids, int(count), dry_run=True, bytes_before=before)
        with self._write() as conn:
            conn.execute("DROP TABLE IF EXISTS temp.pruned")
            conn.execute(f"CREATE TEMP TABLE pruned AS {select}", cutoff)
            ids = tuple(str(row[0]) for row in conn.execute("SELECT run_id FROM temp.pruned"))
            count = conn.execute(
                "DELETE FROM transitions WHERE run_key IN (SELECT run_key FROM temp.pruned)"
            ).rowcount
            for table in ("iterations", "artifacts", "effects", "run_rows"):
                conn.execute(
                    f"DELETE FROM {table} WHERE run_id IN (SELECT run_id FROM temp.pruned)"
                )
            conn.execute(
                "DELETE FROM specs WHERE spec_hash NOT IN (SELECT DISTINCT spec_hash FROM run_rows)"
            )
            conn.execute("DROP TABLE temp.pruned")
        for run_id in ids:
            self._written.pop(run_id, None)
            self._keys.pop(run_id, None)
        if ids:
            with self._read() as conn:
                conn.execute("VACUUM")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return PruneReport(ids, count, dry_run=False, bytes_before=before, bytes_after=self._size())

    def integrity_problems(self) -> list[str]:
        """SQLite's ``integrity_check`` and ``foreign_key_check``, one line per problem.

        Then the schema objects that differ from the schema version's
        (:meth:`schema_problems`). Also transitions whose ``run_key`` is not the key of the run
        their ``run_id`` names (only a hand edit makes one: the fence trigger refuses such an
        insert): reads go by ``run_key``, so such a row would show in another run's history.
        """
        schema = self.schema_problems()
        with self._read(damaged=True) as conn:
            problems = [
                f"SQLite integrity check: {row[0]}"
                for row in conn.execute("PRAGMA integrity_check(20)")
                if row[0] != "ok"
            ]
            dangling = conn.execute(
                'SELECT "table", count(*), min(rowid) FROM pragma_foreign_key_check'
                ' GROUP BY "table"'
            ).fetchall()
            miskeyed, first_miskeyed = conn.execute(
                "SELECT count(*), min(t.rowid) FROM transitions AS t"
                " JOIN run_rows AS r ON r.run_id = t.run_id WHERE t.run_key IS NOT r.run_key"
            ).fetchone()
        problems += schema
        problems += [
            f"{count} row(s) of table {table} refer to missing rows (first rowid {first})"
            for table, count, first in dangling
        ]
        if miskeyed:
            problems.append(
                f"{miskeyed} row(s) of table transitions have a run_key that is not their run's"
                f" (first rowid {first_miskeyed})"
            )
        return problems

    def meta(self) -> Mapping[str, str]:
        """The journal's ``meta`` table (schema version, format)."""
        with self._read(damaged=True) as conn:
            return dict(conn.execute("SELECT key, value FROM meta").fetchall())
