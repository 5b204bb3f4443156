"""A process forked from one that holds engines and journals (fsm_runner._fork).

``os.fork()`` — ``multiprocessing``'s default on Linux, pre-forking servers (gunicorn
``--preload``), Celery's workers — copies every object but only the thread that forked. Found by
forking on purpose while other threads were busy: a child whose parent had a thread inside a
journal call waited for ever at its first call (the journal's lock, copied held), and a child's
engine was its parent's worker (same ``worker_id``), so it claimed as "its own" the run its
parent was driving and ran the same phase beside it. What must hold, each with a real fork:

* a fork waits (briefly) for a transaction under way, and the child can write at once;
* a child's engine is another worker: it is refused a run its parent holds (``LeaseHeldError``),
  including one the parent started holding and has not driven yet, and the phase runs once;
* an engine's own ``worker_id`` is new in the child; one the app gave is kept;
* the memory journal and the checkpoint thread: a fork while they are busy leaves the child a
  working copy; forks at random moments of a busy writer lose nothing;
* a PostgreSQL journal: the child talks on a connection of its own, and its exit leaves the
  parent's session alive.

Each child reports by its exit code; an alarm kills a child that hangs (status -SIGALRM).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
from fsm_runner.exceptions import LeaseHeldError
from fsm_runner.journal import MemoryJournal
from fsm_runner.replay import check_journal

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SPEC = MachineSpec(
    "forked",
    [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
    [Transition("a", "NEXT", "b"), Transition("b", "NEXT", "done")],
)
HANG = 20  # seconds before a child that hangs is killed by its alarm


def _next(_ctx: object) -> str:
    return "NEXT"


def engine_on(journal: object, **options: object) -> Engine:
    return Engine(SPEC, handlers={"a": _next, "b": _next}, journal=journal, **options)  # type: ignore[arg-type]


def in_child(body: Callable[[], int | None]) -> int:
    """Fork; the child runs ``body`` (its return value is the exit code) under an alarm."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            signal.alarm(HANG)
            code = body() or 0
        except BaseException:  # reported through the exit code, the traceback to stderr
            traceback.print_exc()
            code = 71
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def inside_journal_call(journal: SqliteJournal | MemoryJournal, seconds: float) -> threading.Thread:
    """A thread that holds the journal's lock (in SQLite: a write transaction) for ``seconds``."""
    inside = threading.Event()

    def hold() -> None:
        if isinstance(journal, SqliteJournal):
            with journal._connections.write() as conn:
                conn.execute("UPDATE meta SET value = value WHERE key = 'schema_version'")
                inside.set()
                time.sleep(seconds)
        else:
            with journal._lock:
                inside.set()
                time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(10)
    return thread


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_a_fork_while_another_thread_is_inside_the_journal_leaves_the_child_working(
    tmp_path: Path, kind: str
) -> None:
    journal = SqliteJournal(tmp_path / "j.db") if kind == "sqlite" else MemoryJournal()
    engine = engine_on(journal)
    engine.run(engine.start())
    holder = inside_journal_call(journal, 0.3)

    def child() -> int:
        run = engine.run(engine.start())  # the inherited engine and journal
        return 0 if run.state == "done" else 3

    started = time.monotonic()
    code = in_child(child)
    holder.join()
    assert code == 0, f"child exit {code} (-{signal.SIGALRM}: it hung)"
    assert time.monotonic() - started >= 0.2  # the fork waited for the transaction to end
    assert engine.run(engine.start()).state == "done"  # the parent goes on
    if kind == "sqlite":
        assert len(journal.runs()) == 3  # the child's run is in the file
        assert check_journal(journal) == []
    engine.close()
    journal.close()


def test_a_forked_engine_is_refused_the_run_its_parent_is_driving(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    calls = tmp_path / "calls"
    in_phase = threading.Event()

    def slow_a(ctx: object) -> str:
        with calls.open("a") as out:
            out.write(f"{os.getpid()}\n")
        in_phase.set()
        time.sleep(0.8)
        return "NEXT"

    journal = SqliteJournal(path)
    engine = Engine(SPEC, handlers={"a": slow_a, "b": _next}, journal=journal)
    run_id = engine.start()
    driving = threading.Thread(target=engine.run, args=(run_id,))
    driving.start()
    assert in_phase.wait(10)

    def child() -> int:
        try:
            engine.run(run_id)  # the inherited engine: same object, same app
        except LeaseHeldError as exc:
            return 0 if exc.owner != engine.worker_id else 4
        return 3  # it drove the run its parent holds

    code = in_child(child)
    driving.join()
    assert code == 0, f"child exit {code}"
    assert calls.read_text().split() == [str(os.getpid())]  # phase a ran once, here
    assert journal.load(run_id).state == "done"
    assert [t.lease_token for t in journal.transitions(run_id)][1:] == [1, 1]
    engine.close()
    journal.close()


def test_a_forked_engine_does_not_take_a_run_its_parent_started_holding(tmp_path: Path) -> None:
    journal = SqliteJournal(tmp_path / "j.db")
    engine = engine_on(journal)
    (run_id,) = engine.start_many([None], claim=True)  # held here, not yet driven

    def child() -> int:
        try:
            engine.run(run_id)
        except LeaseHeldError:
            return 0
        return 3

    assert in_child(child) == 0
    assert engine.run(run_id).state == "done"  # the parent drives it, without a second claim
    assert [t.lease_token for t in journal.transitions(run_id)][1:] == [1, 1]  # one claim
    engine.close()
    journal.close()


def test_the_worker_id_made_for_an_engine_is_new_in_a_child_and_one_given_is_kept(
    tmp_path: Path,
) -> None:
    made = engine_on(MemoryJournal())
    given = engine_on(MemoryJournal(), worker_id="worker-7")
    parent_id = made.worker_id
    read, write = os.pipe()

    def child() -> int:
        os.write(write, f"{made.worker_id} {given.worker_id}".encode())
        return 0

    assert in_child(child) == 0
    os.close(write)
    child_made, child_given = os.read(read, 1000).decode().split()
    os.close(read)
    assert child_made != parent_id
    assert child_made.split(":")[1] != str(os.getpid())  # host:pid:random, the child's pid
    assert child_given == "worker-7"
    assert made.worker_id == parent_id  # the parent's unchanged


def test_forks_at_random_moments_of_a_busy_writer_lose_nothing(tmp_path: Path) -> None:
    """A writer thread and the checkpoint thread busy while the main thread forks 12 times."""
    path = tmp_path / "j.db"
    journal = SqliteJournal(path)
    engine = engine_on(journal)
    stop, written = threading.Event(), []

    def write() -> None:
        while not stop.is_set():
            written.append(engine.run(engine.start()).run_id)

    writer = threading.Thread(target=write)
    writer.start()
    rng = random.Random(7)
    codes = []
    for _ in range(12):
        time.sleep(rng.uniform(0.0, 0.05))

        def child() -> int:
            runs = [engine.run(engine.start()) for _ in range(3)]
            return 0 if all(run.state == "done" for run in runs) else 3

        codes.append(in_child(child))
    stop.set()
    writer.join()
    assert codes == [0] * 12
    engine.close()
    journal.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conn.close()
    with SqliteJournal(path) as again:
        runs = again.runs()
        assert len(runs) == len(written) + 12 * 3
        assert {run.state for run in runs} == {"done"}
        assert check_journal(again) == []


def test_a_forked_child_talks_to_postgresql_on_a_connection_of_its_own(postgres_journal) -> None:
    journal = postgres_journal
    engine = engine_on(journal)
    engine.run(engine.start())
    backend = journal.backend_pid

    def child() -> int:
        run = engine.run(engine.start())
        ok = run.state == "done" and journal.backend_pid not in (None, backend)
        return 0 if ok else 3

    assert in_child(child) == 0
    # The child's exit closed nothing of the parent's: the same session still answers.
    assert journal.backend_pid == backend
    assert len(journal.runs()) == 2
    assert engine.run(engine.start()).state == "done"
    assert journal.backend_pid == backend
    engine.close()


def test_a_paused_checkpoint_thread_copies_nothing_until_let_go(tmp_path: Path) -> None:
    """What a fork holds still: no checkpoint starts (none is under way in the copied child)."""
    path = tmp_path / "j.db"
    journal = SqliteJournal(path)
    engine = engine_on(journal)
    engine.run(engine.start())  # the first write starts the thread
    checkpointer = journal._connections.checkpointer
    assert checkpointer is not None
    deadline = time.monotonic() + 10
    while path.stat().st_size < 4096 * 8 and time.monotonic() < deadline:
        time.sleep(0.02)  # the thread's first copy made the file
    release = checkpointer.pause()  # type: ignore[attr-defined]
    assert release is not None
    size = path.stat().st_size
    for _ in range(200):
        engine.run(engine.start())
    time.sleep(0.3)  # ~15 of the thread's looks
    assert path.stat().st_size == size  # nothing copied back while held
    release()
    deadline = time.monotonic() + 10
    while path.stat().st_size == size and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.stat().st_size > size  # copied once let go
    engine.close()
    journal.close()


def test_two_threads_forking_at_once_each_let_go_of_what_they_held(tmp_path: Path) -> None:
    journal = SqliteJournal(tmp_path / "j.db")
    engine = engine_on(journal)
    engine.run(engine.start())
    codes: list[int] = []

    def child() -> int:
        return 0 if engine.run(engine.start()).state == "done" else 3

    def fork_some() -> None:
        codes.extend(in_child(child) for _ in range(5))

    forkers = [threading.Thread(target=fork_some) for _ in range(2)]
    for forker in forkers:
        forker.start()
    for forker in forkers:
        forker.join()
    assert codes == [0] * 10
    # Every lock the forks held is let go: another thread can use the journal at once.
    other = threading.Thread(target=lambda: engine.run(engine.start()))
    other.start()
    other.join(10)
    assert not other.is_alive()
    assert len(journal.runs()) == 12
    engine.close()
    journal.close()
