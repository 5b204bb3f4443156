"""The WAL's checkpoints, on a thread of the journal's own (fsm_runner.journal._checkpoint).

A sync engine no longer waits inside a commit while SQLite copies the WAL back: a thread copies
it as it grows, with its own connection, and the writer's own checkpoint has only the rest to
copy. What must hold: the checkpoints do happen (the WAL does not grow without end), a journal that only reads starts no thread, closing or dropping a journal stops
its thread, a failing checkpoint loses nothing, and a process killed while its checkpointer
copies pages leaves every committed run as it was committed.
"""

from __future__ import annotations

import gc
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
from fsm_runner.journal import sqlite as sqlite_module
from fsm_runner.journal._checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]
SPEC = MachineSpec(
    "checkpoints",
    [State("a", handler="next"), State("b", handler="next"), State("done", terminal=True)],
    [Transition("a", "NEXT", "b"), Transition("b", "NEXT", "done")],
)


def _next(ctx: object) -> str:
    return "NEXT"


def _checkpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fsm_runner checkpoints")]


def _wait_for(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def small_wal(monkeypatch: pytest.MonkeyPatch) -> int:
    """The writer's own checkpoint at 40 pages."""
    monkeypatch.setitem(sqlite_module.TUNING, "wal_autocheckpoint", 40)
    return 40


def _settled_size(path: Path) -> int:
    """The database file's size once the thread has copied what it can (stable for 0.2 s)."""
    size, since = path.stat().st_size, time.monotonic()
    while time.monotonic() - since < 0.2:
        time.sleep(0.02)
        if path.stat().st_size != size:
            size, since = path.stat().st_size, time.monotonic()
    return size


def _only_the_thread_copies(journal: SqliteJournal) -> tuple[Engine, int]:
    """An engine on ``journal`` after one run, the writer's own checkpoints off: the file's size."""
    engine = Engine(SPEC, handlers={"next": _next}, journal=journal)
    engine.run(engine.start())
    journal._connections.conn.execute("PRAGMA wal_autocheckpoint = 0")
    return engine, _settled_size(Path(journal.path))


def _write_blobs(engine: Engine) -> None:
    """20 runs with 8 KB of input each: new pages, the file must grow ~160 KB for them."""
    for _ in range(20):
        engine.run(engine.start({"blob": "x" * 8192}, claim=True))


def test_the_thread_copies_the_wal_back_without_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SqliteJournal(path) as journal:
        engine, size = _only_the_thread_copies(journal)
        _write_blobs(engine)
        assert _wait_for(lambda: path.stat().st_size >= size + 80_000), "nothing copied back"
        engine.close()


def test_the_wal_stays_bounded_over_many_runs(tmp_path: Path, small_wal: int) -> None:
    path = tmp_path / "j.db"
    wal = tmp_path / "j.db-wal"
    largest = 0
    with SqliteJournal(path) as journal:
        engine = Engine(SPEC, handlers={"next": _next}, journal=journal)
        for _ in range(1000):
            engine.run(engine.start(claim=True))
            largest = max(largest, wal.stat().st_size)
        run_ids = [run.run_id for run in journal.runs()]
        engine.close()
    # ~10 pages a run, 10,000 pages written: the WAL was started over again and again
    assert largest < 4000 * 4120
    with SqliteJournal(path) as journal:
        assert len(run_ids) == 1000
        assert all(journal.load(run_id).state == "done" for run_id in run_ids)
        assert journal.integrity_problems() == []


def test_two_journals_on_one_file_checkpoint_beside_each_other(
    tmp_path: Path, small_wal: int
) -> None:
    # Each has its own thread: their checkpoints collide (one is refused as busy) and the
    # writers' own ones too; whatever the order, every run is as committed.
    path = tmp_path / "j.db"
    wal = tmp_path / "j.db-wal"
    first, second = SqliteJournal(path), SqliteJournal(path, durability="power")
    engines = [Engine(SPEC, handlers={"next": _next}, journal=j) for j in (first, second)]
    run_ids, largest = [], 0
    for index in range(600):
        engine = engines[index % 2]
        run_ids.append(engine.run(engine.start(claim=True)).run_id)
        largest = max(largest, wal.stat().st_size)
    assert first._connections.checkpointer is not None
    assert second._connections.checkpointer is not None
    for engine in engines:
        engine.close()
    first.close()
    second.close()
    assert largest < 4000 * 4120  # ~6,000 pages written: started over again and again
    with SqliteJournal(path) as journal:
        assert journal.integrity_problems() == []
        assert all(journal.load(run_id).state == "done" for run_id in run_ids)


def test_a_journal_that_only_reads_starts_no_thread(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SqliteJournal(path) as journal:
        Engine(SPEC, handlers={"next": _next}, journal=journal).start()
    before = len(_checkpoint_threads())
    with SqliteJournal(path, create=False) as journal:
        journal.runs()
        assert journal._connections.checkpointer is None
        assert len(_checkpoint_threads()) == before


def test_checkpoint_thread_false_leaves_checkpoints_to_the_commits(
    tmp_path: Path, small_wal: int
) -> None:
    path = tmp_path / "j.db"
    before = len(_checkpoint_threads())
    with SqliteJournal(path, checkpoint_thread=False) as journal:
        engine = Engine(SPEC, handlers={"next": _next}, journal=journal)
        for _ in range(40):  # ~400 pages: the writer's own checkpoint at 40 pages copies them
            engine.run(engine.start(claim=True))
        assert journal._connections.checkpointer is None
        assert len(_checkpoint_threads()) == before
        assert path.stat().st_size > 20 * 4096  # copied back by the commits' own checkpoints
        assert journal.integrity_problems() == []
        engine.close()


def test_memory_journal_file_has_no_thread() -> None:
    with SqliteJournal(":memory:") as journal:
        Engine(SPEC, handlers={"next": _next}, journal=journal).start()
        assert journal._connections.checkpointer is None


def test_close_stops_the_thread(tmp_path: Path) -> None:
    journal = SqliteJournal(tmp_path / "j.db")
    Engine(SPEC, handlers={"next": _next}, journal=journal).start()
    checkpointer = journal._connections.checkpointer
    assert isinstance(checkpointer, Checkpointer)
    assert checkpointer.alive
    journal.close()
    assert not checkpointer.alive
    assert not (tmp_path / "j.db-wal").exists()  # the last connection closed removed the WAL


def test_a_journal_dropped_unclosed_stops_its_thread(tmp_path: Path) -> None:
    journal = SqliteJournal(tmp_path / "j.db")
    Engine(SPEC, handlers={"next": _next}, journal=journal).start()
    checkpointer = journal._connections.checkpointer
    assert isinstance(checkpointer, Checkpointer)
    # Dropped unclosed on purpose: it warns (its last reference gone), and closes what it held
    with pytest.warns(ResourceWarning, match=r"SqliteJournal\(.*j\.db.* was not closed"):
        del journal
    gc.collect()
    assert _wait_for(lambda: not checkpointer.alive)


def test_a_checkpoint_that_fails_loses_nothing_and_the_thread_goes_on(tmp_path: Path) -> None:
    # the file it was told to checkpoint is not there: every attempt fails
    owner = type("Owner", (), {})()
    checkpointer = Checkpointer(owner, str(tmp_path / "missing.db"), size_limit=0)
    (tmp_path / "missing.db-wal").write_bytes(b"x" * 100)
    time.sleep(0.1)
    assert checkpointer.alive
    assert not (tmp_path / "missing.db").exists()  # never created
    checkpointer.stop()
    assert not checkpointer.alive


def test_a_checkpoint_a_reader_holds_back_is_made_later(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with SqliteJournal(path) as journal:
        engine, size = _only_the_thread_copies(journal)
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM run_rows").fetchone()  # holds its snapshot
        _write_blobs(engine)
        assert _settled_size(path) == size  # nothing past the reader's snapshot was copied
        reader.execute("COMMIT")
        reader.close()
        assert _wait_for(lambda: path.stat().st_size >= size + 80_000)
        engine.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_checkpoints_with_a_thread_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journal = SqliteJournal(path)
    Engine(SPEC, handlers={"next": _next}, journal=journal).start()
    journal.close()
    journal = SqliteJournal(path)
    journal.runs()
    pid = os.fork()
    if pid == 0:  # the child: its own journal object, after the fork
        code = 1
        try:
            with SqliteJournal(path) as child:
                engine = Engine(SPEC, handlers={"next": _next}, journal=child)
                engine.run(engine.start())
                checkpointer = child._connections.checkpointer
                code = 0 if isinstance(checkpointer, Checkpointer) and checkpointer.alive else 2
                engine.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(journal.runs()) == 2
    journal.close()


CHILD = textwrap.dedent(
    """
    import sys
    from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
    from fsm_runner.journal import sqlite as sqlite_module
    sqlite_module.TUNING["wal_autocheckpoint"] = 8  # a checkpoint every run or so
    spec = MachineSpec(
        "checkpoints",
        [State("a", handler="next"), State("b", handler="next"), State("done", terminal=True)],
        [Transition("a", "NEXT", "b"), Transition("b", "NEXT", "done")],
    )
    journal = SqliteJournal(sys.argv[1])
    engine = Engine(spec, handlers={"next": lambda ctx: "NEXT"}, journal=journal)
    print("ready", flush=True)
    while True:
        run_id = engine.start(claim=True)
        engine.run(run_id)
        print(run_id, flush=True)
    """
)


@pytest.mark.xdist_group("processes")
def test_sigkill_while_checkpoints_run_keeps_every_committed_run(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done: list[str] = []
    for kill_after in (0.05, 0.13, 0.21, 0.34, 0.55):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(kill_after)
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        done += out.split()  # each printed only after its run ended, committed
        with SqliteJournal(path) as journal:
            assert journal.integrity_problems() == []
            for run_id in done:
                run = journal.load(run_id)
                assert (run.state, run.seq) == ("done", 2), run_id
    assert len(done) > 5
