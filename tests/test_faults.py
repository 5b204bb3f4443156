"""Bad input and faults, each with one clear error and nothing lost: the whole matrix in one table.

Every fault of the acceptance list is a row of :data:`FAULTS`, and every row is checked the same
three ways:

* through the library: the exact exception type, a one-line message naming the journal file
  (faults of the file) or the run (faults of a run);
* through the CLI (``fsm-runner runs`` / ``show`` / ``resume`` via click's ``CliRunner``): the
  commands the fault must stop exit non-zero with one line and no traceback, naming the same;
  the commands it must not stop (reads of a journal that cannot be written) still work;
* nothing lost: a file we refuse keeps its bytes (and gets no side files); a write that fails
  leaves the run row and its transitions as they were, and the journal usable once the fault
  is gone.

The read-only journal is made read-only by the operating system: ``chmod`` (a 0o444 file; a
0o555 directory), and, since root ignores file modes, with ``CAP_DAC_OVERRIDE`` and
``CAP_DAC_READ_SEARCH`` dropped from this thread's effective capabilities while the fault
lasts (so root is refused like anyone else; restored afterwards). A full disk is SQLite's
``PRAGMA max_page_count`` pinned, on every connection opened during the fault, to the pages
the file has.

One more property sits outside the table: once a read-only journal is made writable again, it
takes writes again (its stale ``-shm`` file, left read-only, once kept it read-only for good).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import hashlib
import os
import random
import sqlite3
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from fsm_runner import (
    Engine,
    JournalError,
    MachineSpec,
    MemoryJournal,
    PhaseResult,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.cli import EXIT_NOT_FOUND, cli
from fsm_runner.exceptions import (
    HandlerResultError,
    PayloadError,
    SchemaVersionError,
    SpecMismatchError,
)
from fsm_runner.replay import replay_run
from tests.helpers import NEXT, snapshot

RUN = "run-1"
DONE_RUN = "run-0"
BIG_OUTPUT = "x" * (64 * 1024)  # needs new pages: a full journal cannot take it
HUGE_BYTES = 50 * 1024 * 1024  # a 50 MB handler output
OVERSIZED_BYTES = 17 * 1024 * 1024  # just over the engine's default max_payload_bytes (16 MiB)


class Oversized:
    """Stands for an oversized string in the table; made only when a test uses it."""

    def __repr__(self) -> str:
        return "Oversized()"


OVERSIZED = Oversized()


def _made(value: Any) -> Any:
    """``value`` with every :class:`Oversized` replaced by a string of OVERSIZED_BYTES."""
    if isinstance(value, Oversized):
        return "x" * OVERSIZED_BYTES
    if isinstance(value, dict):
        return {key: _made(item) for key, item in value.items()}
    return value


# -- the app: drafting -> reviewing -> done --------------------------------------------------

SPEC = MachineSpec(
    "faults",
    [
        State("drafting", handler="draft"),
        State("reviewing", handler="review"),
        State("done", terminal=True),
    ],
    # No SYSTEM_ERROR exit: a refused handler result is raised, and nothing is written.
    [Transition("drafting", NEXT, "reviewing"), Transition("reviewing", NEXT, "done")],
)


def _draft(_ctx: Any) -> str:
    return NEXT


def _app(review: Callable[[Any], Any], spec: MachineSpec = SPEC, **options: Any) -> Engine:
    """The app's engine; the CLI (and the tests) move it to the journal at hand."""
    return Engine(
        spec, handlers={"draft": _draft, "review": review}, journal=MemoryJournal(), **options
    )


def make_app() -> Engine:
    """``--app`` for runs that go well: the review writes a big output."""
    return _app(lambda _ctx: PhaseResult(NEXT, output=BIG_OUTPUT))


def make_unjson_app() -> Engine:
    """``--app`` whose review returns an output JSON cannot hold (a datetime)."""
    return _app(
        lambda _ctx: PhaseResult(NEXT, output={"reviewed_at": dt.datetime.now(dt.timezone.utc)})
    )


def make_oversized_app() -> Engine:
    """``--app`` whose review returns a 50 MB output."""
    return _app(lambda _ctx: PhaseResult(NEXT, output="x" * HUGE_BYTES))


def make_changed_app() -> Engine:
    """``--app`` whose spec was changed since the run started (a description, say)."""
    states = [
        attrs.evolve(s, description="reviewed twice") if s.name == "reviewing" else s
        for s in SPEC.states
    ]
    return _app(lambda _ctx: NEXT, attrs.evolve(SPEC, states=states))


def make_state_gone_app() -> Engine:
    """``--app`` opted in to spec changes, whose new spec has no state the run is in."""
    spec = MachineSpec(
        "faults",
        [
            State("drafting", handler="draft"),
            State("revising", handler="review"),
            State("done", terminal=True),
        ],
        [Transition("drafting", NEXT, "revising"), Transition("revising", NEXT, "done")],
    )
    return _app(lambda _ctx: NEXT, spec, allow_spec_change=True)


def app_path(factory: Callable[[], Engine]) -> str:
    return f"{__name__}:{factory.__name__}"


@contextlib.contextmanager
def engine_on(path: Path, factory: Callable[[], Engine] = make_app) -> Iterator[Engine]:
    """The app's engine on the journal file at ``path``; both closed afterwards."""
    journal = SqliteJournal(path)
    engine = factory().with_journal(journal)
    try:
        yield engine
    finally:
        engine.close()
        journal.close()


# -- scenes: the journal file before the fault -----------------------------------------------


@attrs.frozen
class Scene:
    """Where the fault happens: the journal file, and the run in progress in it."""

    path: Path
    run_id: str = RUN


def journal_with_runs(tmp_path: Path) -> Scene:
    """A real journal: one finished run, and ``run-1`` in progress (``reviewing``)."""
    directory = tmp_path / "journals"
    directory.mkdir()
    path = directory / "journal.db"
    with engine_on(path) as engine:
        engine.run(engine.start(run_id=DONE_RUN, input={"doc": "a"}))
        engine.step(engine.start(run_id=RUN, input={"doc": "b"}))
    assert not Path(f"{path}-wal").exists()  # checkpointed on close: the file is the journal
    return Scene(path)


def truncated(tmp_path: Path) -> Scene:
    scene = journal_with_runs(tmp_path)
    size = scene.path.stat().st_size
    with scene.path.open("r+b") as handle:
        handle.truncate(size // 2)
    return scene


def random_bytes(tmp_path: Path) -> Scene:
    scene = Scene(tmp_path / "journals" / "journal.db")
    scene.path.parent.mkdir()
    scene.path.write_bytes(random.Random(7).randbytes(16 * 1024))
    return scene


def foreign_database(tmp_path: Path) -> Scene:
    scene = Scene(tmp_path / "journals" / "journal.db")
    scene.path.parent.mkdir()
    conn = sqlite3.connect(scene.path)
    try:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("INSERT INTO invoices (total) VALUES (9.5)")
        conn.commit()
    finally:
        conn.close()
    return scene


def newer_schema(tmp_path: Path) -> Scene:
    scene = journal_with_runs(tmp_path)
    conn = sqlite3.connect(scene.path, isolation_level=None)
    try:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    finally:
        conn.close()
    return scene


@contextlib.contextmanager
def _schema_edit(path: Path) -> Iterator[sqlite3.Connection]:
    """A raw connection that may rewrite ``sqlite_master`` (what a flipped byte does too)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA writable_schema = ON")
        yield conn
    finally:
        conn.close()


def _object_sql(conn: sqlite3.Connection, name: str) -> bytes:
    (sql,) = conn.execute(
        "SELECT CAST(sql AS BLOB) FROM sqlite_master WHERE name = ?", (name,)
    ).fetchone()
    return bytes(sql)


def _set_object_sql(conn: sqlite3.Connection, name: str, sql: bytes) -> None:
    conn.execute("UPDATE sqlite_master SET sql = CAST(? AS TEXT) WHERE name = ?", (sql, name))


def view_not_utf8(tmp_path: Path) -> Scene:
    """One flipped bit in the ``runs`` view's SQL: a column alias that is not UTF-8 any more."""
    scene = journal_with_runs(tmp_path)
    with _schema_edit(scene.path) as conn:
        sql = _object_sql(conn, "runs")
        at = sql.index(b"END AS state") + len(b"END AS st")
        _set_object_sql(conn, "runs", sql[:at] + bytes([sql[at] ^ 0x80]) + sql[at + 1 :])
    return scene


def view_unparseable(tmp_path: Path) -> Scene:
    """One flipped byte in the ``runs`` view's SQL opens a quote SQLite never sees closed."""
    scene = journal_with_runs(tmp_path)
    with _schema_edit(scene.path) as conn:
        sql = _object_sql(conn, "runs")
        at = sql.index(b"r.run_id, r.machine")
        _set_object_sql(conn, "runs", sql[:at] + b"'" + sql[at + 1 :])
    return scene


def text_not_utf8(tmp_path: Path) -> Scene:
    """A run row whose machine name is bytes that are not UTF-8."""
    scene = journal_with_runs(tmp_path)
    conn = sqlite3.connect(scene.path, isolation_level=None)
    try:
        conn.execute(
            "UPDATE run_rows SET machine = CAST(x'666175ff6c7473' AS TEXT) WHERE run_id = ?",
            (RUN,),
        )
    finally:
        conn.close()
    return scene


def fence_damaged(tmp_path: Path) -> Scene:
    """The fence trigger names a column that is not there: ``run_key`` became ``pun_key``."""
    scene = journal_with_runs(tmp_path)
    with _schema_edit(scene.path) as conn:
        sql = _object_sql(conn, "transitions_fence")
        assert b"WHERE run_key = NEW.run_key" in sql
        damaged = sql.replace(b"WHERE run_key = NEW.run_key", b"WHERE pun_key = NEW.run_key")
        _set_object_sql(conn, "transitions_fence", damaged)
    return scene


def _edit_spec(path: Path, edit: Callable[[str], str], *, rehash: bool) -> None:
    """Edit the stored spec's JSON; ``rehash``: and its hash everywhere, as a careful hand would."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        ((old, text),) = conn.execute("SELECT spec_hash, json FROM specs").fetchall()
        new_text = edit(text)
        assert new_text != text
        conn.execute("UPDATE specs SET json = ?", (new_text,))
        if rehash:
            new = hashlib.sha256(new_text.encode()).hexdigest()
            conn.execute("UPDATE specs SET spec_hash = ?", (new,))
            conn.execute("UPDATE run_rows SET spec_hash = ? WHERE spec_hash = ?", (new, old))
    finally:
        conn.close()


def _rename_initial_state(text: str) -> str:
    return text.replace('"name":"drafting"', '"name":"drafted"')


def spec_edited(tmp_path: Path) -> Scene:
    """The stored spec's initial state renamed in its JSON: the JSON no longer has its hash."""
    scene = journal_with_runs(tmp_path)
    _edit_spec(scene.path, _rename_initial_state, rehash=False)
    return scene


def spec_edited_and_rehashed(tmp_path: Path) -> Scene:
    """The same rename, with the spec's hash rewritten to match: a spec that is not valid."""
    scene = journal_with_runs(tmp_path)
    _edit_spec(scene.path, _rename_initial_state, rehash=True)
    return scene


def empty_file(tmp_path: Path) -> Scene:
    scene = Scene(tmp_path / "journals" / "journal.db")
    scene.path.parent.mkdir()
    scene.path.touch()
    return scene


def tableless_database(tmp_path: Path) -> Scene:
    """A SQLite database with a header (a user_version) but no tables."""
    scene = Scene(tmp_path / "journals" / "journal.db")
    scene.path.parent.mkdir()
    conn = sqlite3.connect(scene.path)
    try:
        conn.execute("PRAGMA user_version = 3")
        conn.commit()
    finally:
        conn.close()
    assert scene.path.stat().st_size > 0
    return scene


# -- conditions: the fault, while it lasts ---------------------------------------------------

_CAP_DAC_OVERRIDE = 1
_CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


@contextlib.contextmanager
def file_modes_enforced() -> Iterator[None]:
    """Within the block, file modes bind this thread even as root (as they bind everyone else).

    Root ignores file modes through ``CAP_DAC_OVERRIDE`` (and ``CAP_DAC_READ_SEARCH``); they
    are dropped from this thread's *effective* set only, and raised again afterwards (they stay
    permitted). Everything SQLite does for the test happens in this thread.
    """
    if os.geteuid() != 0:
        yield
        return
    if not sys.platform.startswith("linux"):
        pytest.skip("root ignores file modes here, and only Linux capabilities can stop that")
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)  # pid 0: this thread
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip(f"capget failed (errno {ctypes.get_errno()})")
    saved = data[0].effective
    data[0].effective &= ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH))
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip(f"capset failed (errno {ctypes.get_errno()})")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0, "could not restore capabilities"


@contextlib.contextmanager
def no_fault(_scene: Scene) -> Iterator[None]:
    yield


@contextlib.contextmanager
def read_only_file(scene: Scene) -> Iterator[None]:
    """The journal file is 0o444 (its directory stays writable)."""
    scene.path.chmod(0o444)
    try:
        with file_modes_enforced():
            with pytest.raises(PermissionError):  # the OS refuses, whoever we are
                scene.path.open("r+b")
            yield
    finally:
        scene.path.chmod(0o644)


@contextlib.contextmanager
def read_only_directory(scene: Scene) -> Iterator[None]:
    """The journal's directory is 0o555 (SQLite cannot create its -wal and -shm files)."""
    directory = scene.path.parent
    directory.chmod(0o555)
    try:
        with file_modes_enforced():
            with pytest.raises(PermissionError):
                (directory / "probe").touch()
            yield
    finally:
        directory.chmod(0o755)


@contextlib.contextmanager
def disk_full(_scene: Scene) -> Iterator[None]:
    """Every SQLite connection opened meanwhile may not grow its file by a single page."""
    connect = sqlite3.connect

    def full_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn: sqlite3.Connection = connect(*args, **kwargs)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sqlite3, "connect", full_connect)
        yield


# -- library calls that meet the fault -------------------------------------------------------


def open_and_read(scene: Scene) -> None:
    with SqliteJournal(scene.path) as journal:
        journal.load(scene.run_id)
        journal.transitions(scene.run_id)


def open_to_read(scene: Scene) -> None:
    """What the CLI's read commands do: open an existing journal (never make one), read."""
    with SqliteJournal(scene.path, create=False) as journal:
        journal.load(scene.run_id)


def replay_from_journal(scene: Scene) -> None:
    with SqliteJournal(scene.path) as journal:
        replay_run(journal, scene.run_id)


def step_with(factory: Callable[[], Engine]) -> Callable[[Scene], Any]:
    def step(scene: Scene) -> Any:
        with engine_on(scene.path, factory) as engine:
            return engine.step(scene.run_id)

    return step


def resume_with(factory: Callable[[], Engine]) -> Callable[[Scene], Any]:
    def resume(scene: Scene) -> Any:
        with engine_on(scene.path, factory) as engine:
            return engine.resume(scene.run_id)

    return resume


def start_with(**payload: Any) -> Callable[[Scene], Any]:
    def start(scene: Scene) -> Any:
        with engine_on(scene.path) as engine:
            return engine.start(run_id="run-2", **_made(payload))

    return start


def send_with(output: Any) -> Callable[[Scene], Any]:
    def send(scene: Scene) -> Any:
        with engine_on(scene.path) as engine:
            return engine.send(scene.run_id, NEXT, output=_made(output))

    return send


# -- the table -----------------------------------------------------------------------------

RUNS = ("runs",)
SHOW = ("show", RUN)


def resume(factory: Callable[[], Engine] = make_app) -> tuple[str, ...]:
    return ("resume", RUN, "--app", app_path(factory))


@attrs.frozen
class Fault:
    """One row of the matrix.

    Attributes:
        id: the test id.
        covers: the item of the acceptance list this row checks.
        prepare: builds the journal file as it is before the fault.
        condition: the fault itself, while it lasts (a context manager factory).
        library: the library call that meets the fault.
        error: the exact exception it must raise.
        names: what the message must name: ``file`` (and ``.path``) or ``run``.
        failing: CLI commands the fault must stop (exit 1, one line, no traceback).
        working: CLI commands that must still work (exit 0).
        kept: what "nothing lost" means: ``file`` (the same bytes, no side files),
            ``bytes`` (the same bytes) and/or ``run`` (the run row and transitions as before).
        code: the exit code of the ``failing`` commands.
    """

    id: str
    covers: str
    prepare: Callable[[Path], Scene]
    library: Callable[[Scene], Any]
    error: type[Exception]
    names: str
    condition: Callable[[Scene], contextlib.AbstractContextManager[None]] = no_fault
    failing: tuple[tuple[str, ...], ...] = ()
    working: tuple[tuple[str, ...], ...] = ()
    kept: frozenset[str] = frozenset({"file"})
    code: int = 1


FILE_COMMANDS = (RUNS, SHOW, resume())
CHECK = ("check",)
REPLAY = ("replay", RUN)
READ_COMMANDS = (RUNS, SHOW, CHECK, REPLAY, ("export", RUN, "exported"))
FAULTS = [
    Fault(
        "truncated",
        "a truncated journal file",
        truncated,
        open_and_read,
        JournalError,
        "file",
        failing=FILE_COMMANDS,
    ),
    Fault(
        "random-bytes",
        "a random-bytes journal file",
        random_bytes,
        open_and_read,
        JournalError,
        "file",
        failing=FILE_COMMANDS,
    ),
    Fault(
        "foreign-sqlite",
        "a SQLite file that is not a journal",
        foreign_database,
        open_and_read,
        JournalError,
        "file",
        failing=FILE_COMMANDS,
    ),
    Fault(
        "newer-schema",
        "a journal with a newer schema",
        newer_schema,
        open_and_read,
        SchemaVersionError,
        "file",
        failing=FILE_COMMANDS,
    ),
    Fault(
        "read-only-file",
        "a read-only journal",
        journal_with_runs,
        step_with(make_app),
        JournalError,
        "file",
        condition=read_only_file,
        failing=(resume(),),
        working=(RUNS, SHOW),
        kept=frozenset({"bytes", "run"}),  # SQLite may leave an empty -wal and a -shm
    ),
    Fault(
        "read-only-directory",
        "a read-only journal",
        journal_with_runs,
        open_and_read,
        JournalError,
        "file",
        condition=read_only_directory,
        failing=FILE_COMMANDS,
        kept=frozenset({"file", "run"}),
    ),
    Fault(
        "disk-full",
        "a full disk",
        journal_with_runs,
        step_with(make_app),
        JournalError,
        "file",
        condition=disk_full,
        failing=(resume(),),
        working=(RUNS, SHOW),
        kept=frozenset({"run"}),
    ),
    Fault(
        "disk-full-new-run",
        "a full disk",
        journal_with_runs,
        start_with(input={"doc": BIG_OUTPUT}),
        JournalError,
        "file",
        condition=disk_full,
        kept=frozenset({"run"}),
    ),
    Fault(
        "unserialisable-output",
        "a handler output that is not JSON-serialisable",
        journal_with_runs,
        step_with(make_unjson_app),
        HandlerResultError,
        "run",
        failing=(resume(make_unjson_app),),
        kept=frozenset({"run"}),
    ),
    Fault(
        "unserialisable-input",
        "a handler output that is not JSON-serialisable",
        journal_with_runs,
        start_with(input={"due": dt.date(2030, 1, 1)}),
        PayloadError,
        "run",
        kept=frozenset({"run"}),
    ),
    Fault(
        "unserialisable-event-output",
        "a handler output that is not JSON-serialisable",
        journal_with_runs,
        send_with({"reviewer": object()}),
        PayloadError,
        "run",
        kept=frozenset({"run"}),
    ),
    Fault(
        "oversized-output",
        "an oversized payload",
        journal_with_runs,
        step_with(make_oversized_app),
        HandlerResultError,
        "run",
        failing=(resume(make_oversized_app),),
        kept=frozenset({"run"}),
    ),
    Fault(
        "oversized-input",
        "an oversized payload",
        journal_with_runs,
        start_with(input=OVERSIZED),
        PayloadError,
        "run",
        kept=frozenset({"run"}),
    ),
    Fault(
        "oversized-context",
        "an oversized payload",
        journal_with_runs,
        start_with(context={"notes": OVERSIZED}),
        PayloadError,
        "run",
        kept=frozenset({"run"}),
    ),
    Fault(
        "oversized-event-output",
        "an oversized payload",
        journal_with_runs,
        send_with(OVERSIZED),
        PayloadError,
        "run",
        kept=frozenset({"run"}),
    ),
    Fault(
        "spec-changed",
        "a spec changed under a running run",
        journal_with_runs,
        resume_with(make_changed_app),
        SpecMismatchError,
        "run",
        failing=(resume(make_changed_app),),
        kept=frozenset({"file", "run"}),
    ),
    Fault(
        "spec-changed-state-gone",
        "a spec changed under a running run",
        journal_with_runs,
        resume_with(make_state_gone_app),
        SpecMismatchError,
        "run",
        failing=(resume(make_state_gone_app),),
        kept=frozenset({"file", "run"}),
    ),
    Fault(
        "view-not-utf8",
        "a damaged schema object",
        view_not_utf8,
        open_and_read,
        JournalError,
        "file",
        failing=(*FILE_COMMANDS, REPLAY),
    ),
    Fault(
        "view-unparseable",
        "a damaged schema object",
        view_unparseable,
        open_and_read,
        JournalError,
        "file",
        failing=(*FILE_COMMANDS, CHECK, REPLAY),
    ),
    Fault(
        "fence-damaged",
        "a damaged schema object",
        fence_damaged,
        step_with(make_app),
        JournalError,
        "file",
        failing=(resume(),),
        working=(RUNS, SHOW),
    ),
    Fault(
        "text-not-utf8",
        "text that is not UTF-8",
        text_not_utf8,
        open_and_read,
        JournalError,
        "file",
        failing=(RUNS, SHOW, REPLAY),
        # the statement that met the bytes stays open while its traceback lives (pytest's):
        # the connection closes after it, and its -wal and -shm may be left for a while
        kept=frozenset({"bytes"}),
    ),
    Fault(
        "spec-json-not-its-hash",
        "a damaged stored spec",
        spec_edited,
        replay_from_journal,
        JournalError,
        "file",
        failing=(REPLAY, SHOW),
        working=(RUNS,),
    ),
    Fault(
        "spec-not-valid",
        "a damaged stored spec",
        spec_edited_and_rehashed,
        replay_from_journal,
        JournalError,
        "file",
        failing=(REPLAY,),
        working=(RUNS, SHOW),
    ),
    Fault(
        "empty-file",
        "an empty or table-less file opened to read",
        empty_file,
        open_to_read,
        JournalError,
        "file",
        failing=READ_COMMANDS,
        code=EXIT_NOT_FOUND,
    ),
    Fault(
        "tableless-file",
        "an empty or table-less file opened to read",
        tableless_database,
        open_to_read,
        JournalError,
        "file",
        failing=READ_COMMANDS,
    ),
]

ACCEPTANCE = (
    "a truncated journal file",
    "a random-bytes journal file",
    "a SQLite file that is not a journal",
    "a journal with a newer schema",
    "a read-only journal",
    "a full disk",
    "a handler output that is not JSON-serialisable",
    "an oversized payload",
    "a spec changed under a running run",
    # issue 17, points 4 and 5
    "a damaged schema object",
    "text that is not UTF-8",
    "a damaged stored spec",
    "an empty or table-less file opened to read",
)


def test_the_table_covers_the_acceptance_list():
    assert {fault.covers for fault in FAULTS} == set(ACCEPTANCE)
    assert len({fault.id for fault in FAULTS}) == len(FAULTS)


# -- checking ------------------------------------------------------------------------------


@attrs.frozen
class Before:
    """What must not be lost."""

    files: dict[str, bytes]
    runs: tuple[Any, ...] | None


def _run_state(path: Path) -> tuple[Any, ...]:
    """Every run row and its transitions, lease bookkeeping aside (``helpers.snapshot``)."""
    with SqliteJournal(path) as journal:
        return tuple(snapshot(journal, run.run_id) for run in journal.runs())


def record(scene: Scene, fault: Fault) -> Before:
    directory = scene.path.parent
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    return Before(files, _run_state(scene.path) if "run" in fault.kept else None)


def assert_nothing_lost(scene: Scene, fault: Fault, before: Before) -> None:
    directory = scene.path.parent
    if "file" in fault.kept:
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before.files
    if "bytes" in fault.kept:
        assert scene.path.read_bytes() == before.files[scene.path.name]
    if "run" in fault.kept:  # read back once the fault is gone; the journal still works too
        assert _run_state(scene.path) == before.runs
        with engine_on(scene.path) as engine:
            assert engine.run(scene.run_id).state == "done"


def assert_names(fault: Fault, scene: Scene, text: str) -> None:
    if fault.names == "file":
        assert str(scene.path) in text
    else:
        assert scene.run_id in text or "run-2" in text


def check(fault: Fault, tmp_path: Path, meet: Callable[[Scene], None]) -> None:
    scene = fault.prepare(tmp_path)
    before = record(scene, fault)
    with fault.condition(scene):
        meet(scene)
    assert_nothing_lost(scene, fault, before)


def by_id(faults: list[Fault]) -> list[Any]:
    return [pytest.param(fault, id=fault.id) for fault in faults]


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", by_id(FAULTS))
def test_library_raises_one_clear_error(fault, tmp_path):
    def meet(scene: Scene) -> None:
        with pytest.raises(fault.error) as info:
            fault.library(scene)
        error = info.value
        assert type(error) is fault.error
        message = str(error)
        assert "\n" not in message
        assert len(message) < 400
        assert_names(fault, scene, message)
        if fault.names == "file":
            assert error.path == str(scene.path)

    check(fault, tmp_path, meet)


def _commands(kind: str) -> list[Any]:
    return [
        pytest.param(fault, command, id=f"{fault.id}-{command[0]}")
        for fault in FAULTS
        for command in getattr(fault, kind)
    ]


def invoke(scene: Scene, command: tuple[str, ...]) -> Any:
    return CliRunner().invoke(cli, ["--journal", str(scene.path), *command], catch_exceptions=False)


@pytest.mark.parametrize(("fault", "command"), _commands("failing"))
def test_cli_fails_with_one_line(fault, command, tmp_path):
    def meet(scene: Scene) -> None:
        result = invoke(scene, command)
        assert result.exit_code == fault.code, result.output
        assert "Traceback" not in result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1, result.output
        assert lines[0].startswith("Error: ")
        assert_names(fault, scene, lines[0])

    check(fault, tmp_path, meet)


@pytest.mark.parametrize(("fault", "command"), _commands("working"))
def test_cli_reads_what_it_can(fault, command, tmp_path):
    def meet(scene: Scene) -> None:
        result = invoke(scene, command)
        assert result.exit_code == 0, result.output
        assert RUN[:12] in result.output

    check(fault, tmp_path, meet)


def test_writable_again_once_the_file_is(tmp_path):
    """Once found: a read-only episode left journal.db-shm read-only, and the journal with it."""
    scene = journal_with_runs(tmp_path)
    with read_only_file(scene):  # an operator lists the runs meanwhile
        assert invoke(scene, RUNS).exit_code == 0
    assert os.access(scene.path, os.W_OK)
    with file_modes_enforced(), engine_on(scene.path) as engine:
        assert engine.run(RUN).state == "done"


# -- check names what is damaged (issue 17, point 5) ----------------------------------------


def fence_dropped(tmp_path: Path) -> Scene:
    scene = journal_with_runs(tmp_path)
    with _schema_edit(scene.path) as conn:
        conn.execute("DROP TRIGGER transitions_fence")
    return scene


def extra_trigger(tmp_path: Path) -> Scene:
    """A trigger fsm_runner did not write: it would run inside every commit."""
    scene = journal_with_runs(tmp_path)
    with _schema_edit(scene.path) as conn:
        conn.execute(
            "CREATE TRIGGER forget AFTER INSERT ON transitions"
            " BEGIN DELETE FROM transitions WHERE seq = 0; END"
        )
    return scene


def index_dropped(tmp_path: Path) -> Scene:
    scene = journal_with_runs(tmp_path)
    with _schema_edit(scene.path) as conn:
        conn.execute("DROP INDEX idx_run_rows_ready")
    return scene


@pytest.mark.parametrize(
    ("prepare", "expected", "writable"),
    [
        (
            fence_damaged,
            ["schema: trigger transitions_fence differs from schema version 12"],
            False,
        ),
        (fence_dropped, ["schema: trigger transitions_fence is missing"], False),
        (extra_trigger, ["schema: trigger forget is not part of schema version 12"], False),
        (index_dropped, ["schema: index idx_run_rows_ready is missing"], True),
        (
            view_not_utf8,
            [
                "schema: view runs differs from schema version 12",
                f"runs {DONE_RUN}, {RUN}: cannot be read: journal ",
            ],
            False,
        ),
        (spec_edited, [f"runs {DONE_RUN}, {RUN}: its spec "], True),
        (spec_edited_and_rehashed, [f"runs {DONE_RUN}, {RUN}: its spec "], True),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_check_names_what_is_damaged(tmp_path, prepare, expected, writable):
    """Each damage is a line of `check` (exit 1), and a write is refused before it happens."""
    scene = prepare(tmp_path)
    before = scene.path.read_bytes()
    result = invoke(scene, CHECK)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert lines[0] == f"journal {scene.path}: {len(expected)} problems in 2 runs"
    assert len(lines) == 1 + len(expected)
    for line, start in zip(lines[1:], expected, strict=True):
        assert line.startswith(f"  {start}"), result.output
    assert scene.path.read_bytes() == before
    if not writable:  # the fence (or more) is not what it should be: nothing is written
        with pytest.raises(JournalError, match="its schema is damaged") as info:
            step_with(make_app)(scene)
        assert "nothing was" in str(info.value)  # read (the view) or written (the triggers)
        assert scene.path.read_bytes() == before


def test_a_damaged_spec_is_named_with_its_problems(tmp_path):
    """A renamed state, hashes rewritten: replay and check name the spec's problems, no KeyError."""
    scene = spec_edited_and_rehashed(tmp_path)
    with SqliteJournal(scene.path) as journal, pytest.raises(JournalError) as info:
        replay_run(journal, RUN)
    assert "which is not a valid machine spec (initial state 'drafting' is not a state" in str(
        info.value
    )
    result = invoke(scene, CHECK)
    assert "initial state 'drafting' is not a state" in result.output
    result = invoke(scene, REPLAY)
    assert "initial state 'drafting' is not a state" in result.output


def test_a_read_command_leaves_an_empty_file_as_it_was(tmp_path):
    """Not a journal made of it, not even WAL mode: the same 0 bytes, no side files."""
    for prepare in (empty_file, tableless_database):
        (tmp_path / prepare.__name__).mkdir()
        scene = prepare(tmp_path / prepare.__name__)
        before = {p.name: p.read_bytes() for p in scene.path.parent.iterdir()}
        for command in READ_COMMANDS:
            assert invoke(scene, command).exit_code != 0
        with pytest.raises(JournalError, match="not an fsm_runner journal"):
            SqliteJournal(scene.path, create=False)
        assert {p.name: p.read_bytes() for p in scene.path.parent.iterdir()} == before
        with SqliteJournal(scene.path) as journal:  # a write (the library's default) may
            assert journal.run_ids("") == []


# -- one line, however long the message (issue 17, point 6) ---------------------------------

TWENTY_THREE_LINES = "\n".join(f"line {n}: {'detail ' * 8}" for n in range(1, 24))


def make_exploding_app() -> Engine:
    """``--app`` whose factory fails with a 23-line message."""
    raise RuntimeError(TWENTY_THREE_LINES)


def test_a_23_line_message_is_one_cut_line(tmp_path):
    scene = journal_with_runs(tmp_path)
    result = invoke(scene, resume(make_exploding_app))
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: tests.test_faults:make_exploding_app failed: RuntimeError:")
    assert "line 1: detail" in lines[0]  # the first part is kept
    assert "line 23" not in lines[0]
    assert lines[0].endswith("…")
    assert len(lines[0]) <= len("Error: ") + 300


def test_a_corrupt_schema_message_is_one_line_in_the_library_too(tmp_path):
    """SQLite quotes the rest of the view's SQL (16 lines): the JournalError keeps one, cut."""
    scene = view_unparseable(tmp_path)
    with pytest.raises(JournalError, match="malformed database schema") as info:
        open_and_read(scene)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith(
        "…); nothing was changed ('fsm-runner check' says what is damaged)"
    )
