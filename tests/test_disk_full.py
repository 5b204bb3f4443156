"""A real full disk: a small tmpfs filled until ``write()`` fails with ENOSPC, then freed.

``test_faults.py`` simulates a full disk with ``PRAGMA max_page_count``; that never fills the
WAL, the ``-shm`` file or a checkpoint's copy into the database file. Here each test mounts a
tmpfs of its own under ``tmp_path`` (:func:`small_disk`; skipped where mounting is refused),
puts a journal on it, and fills what is left with a filler file until the kernel says ENOSPC
(:meth:`Disk.fill`). Then it attacks: a sync run's steps, a batch of claimed starts, many async
runs committed in groups, the checkpoint thread, ``Engine.close`` letting go of claimed runs,
the CLI, and a journal created on the full disk. Each attack checks:

* one clear error (a one-line :class:`JournalError` saying the disk is full; through the CLI,
  one ``Error:`` line and a non-zero exit), no traceback, no hang;
* nothing lost: what was committed before the fault is exactly there afterwards (read by a
  new connection), nothing half-written (``check_journal`` clean, SQLite's integrity check
  among it);
* recovery: once the filler is deleted, the same journal takes writes again, the runs finish,
  and no phase whose transition was committed runs a second time (handler calls counted).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
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
    PhaseResult,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.cli import cli
from fsm_runner.exceptions import LeaseHeldError
from fsm_runner.replay import check_journal
from tests.helpers import NEXT

PHASES = tuple(f"p{n}" for n in range(12))
SPEC = MachineSpec(
    "disk",
    [*(State(phase, handler="phase") for phase in PHASES), State("done", terminal=True)],
    [
        Transition(phase, NEXT, after)
        for phase, after in zip(PHASES, [*PHASES[1:], "done"], strict=True)
    ],
)
FULL = "the disk (or the journal's size limit) is full"


# -- the disk --------------------------------------------------------------------------------


@attrs.define
class Disk:
    """A tmpfs of its own; :meth:`fill` writes a filler file until ENOSPC, :meth:`free` drops it."""

    root: Path

    @property
    def filler(self) -> Path:
        return self.root / "filler"

    def fill(self, leave: int = 0) -> None:
        """Write the filler until the disk is full, then give back ``leave`` bytes of it."""
        chunk = b"\xff" * 4096
        with self.filler.open("ab", buffering=0) as filler, pytest.raises(OSError) as info:
            _write_forever(filler, chunk)
        assert info.value.errno == errno.ENOSPC, info.value
        if leave:
            os.truncate(self.filler, max(0, self.filler.stat().st_size - leave))

    def free(self) -> None:
        self.filler.unlink()

    @property
    def available(self) -> int:
        stat = os.statvfs(self.root)
        return stat.f_bavail * stat.f_frsize


def _write_forever(file: Any, chunk: bytes) -> None:
    """Write ``chunk`` after ``chunk`` until the kernel refuses."""
    while True:
        file.write(chunk)


def _unmount(root: Path) -> None:
    if subprocess.run(["umount", root], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "-l", root], capture_output=True, check=False)  # busy: lazily


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Disk]]:
    """``small_disk("2m")``: a tmpfs of that size mounted under ``tmp_path``, unmounted after."""
    mounted: list[Path] = []

    def mount(size: str) -> Disk:
        if not sys.platform.startswith("linux") or shutil.which("mount") is None:
            pytest.skip("a real full disk needs Linux's mount (a tmpfs)")
        root = tmp_path / f"disk{len(mounted)}"
        root.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", root],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            reason = (done.stderr.strip().splitlines() or ["refused"])[0]
            pytest.skip(f"cannot mount a tmpfs (root or CAP_SYS_ADMIN needed): {reason}")
        mounted.append(root)
        return Disk(root)

    yield mount
    for root in mounted:
        _unmount(root)


# -- the app ---------------------------------------------------------------------------------


@attrs.define
class App:
    """An engine on ``path`` whose phases write ``output_bytes`` each; what it did, recorded."""

    journal: SqliteJournal
    engine: Engine
    calls: collections.Counter[tuple[str, str]]
    committed: dict[str, list[Any]]  # run id -> its transitions, as the listener was told
    rows: dict[str, Any]  # run id -> its row after its last committed transition


def make_app(
    path: Path,
    *,
    output_bytes: int = 2000,
    checkpoint_thread: bool = True,
    journal: SqliteJournal | None = None,
    **options: Any,
) -> App:
    if journal is None:
        journal = SqliteJournal(path, checkpoint_thread=checkpoint_thread)
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    committed: dict[str, list[Any]] = collections.defaultdict(list)
    rows: dict[str, Any] = {}

    def phase(ctx: Any) -> PhaseResult:
        calls[ctx.run_id, ctx.state] += 1
        return PhaseResult(NEXT, output="x" * output_bytes)

    def listen(transition: Any, run: Any) -> None:
        committed[run.run_id].append(transition)
        rows[run.run_id] = run

    engine = Engine(SPEC, handlers={"phase": phase}, journal=journal, listeners=[listen], **options)
    return App(journal, engine, calls, committed, rows)


def make_cli_app(journal: SqliteJournal) -> Engine:
    """``--app`` for the CLI (given its journal): the same machine, its phases writing 2 KB each."""
    return make_app(Path(journal.location), journal=journal).engine


def all_ids(journal: SqliteJournal) -> list[str]:
    return sorted(journal.run_ids("", limit=sys.maxsize))


def _unleased(run: Any) -> Any:
    """The run row without its lease bookkeeping (a failed release may leave a lease)."""
    return attrs.evolve(run, lease_owner=None, lease_expires_at=None, lease_token=0)


def assert_as_committed(path: Path, app: App, run_ids: list[str]) -> None:
    """A new connection reads each run exactly as its last committed transition left it."""
    with SqliteJournal(path, create=False) as journal:
        for run_id in run_ids:
            assert journal.transitions(run_id) == app.committed[run_id]
            assert _unleased(journal.load(run_id)) == _unleased(app.rows[run_id])
        assert check_journal(journal) == []


def assert_no_phase_ran_twice(app: App, run_ids: list[str], interrupted: dict[str, str]) -> None:
    """Each run's phases ran once, but the one whose commit the full disk refused (twice)."""
    for run_id in run_ids:
        path = [t.from_state for t in app.committed[run_id] if t.from_state is not None]
        assert path == list(PHASES)
        for phase in PHASES:
            expected = 2 if interrupted.get(run_id) == phase else 1
            assert app.calls[run_id, phase] == expected, (run_id, phase, app.calls)


def assert_full_error(error: BaseException, path: Path) -> None:
    assert type(error) is JournalError
    assert error.path == str(path)
    assert str(error) == f"journal {path}: {FULL}; nothing was written"


# -- 1. a sync run ---------------------------------------------------------------------------


def test_a_sync_run_stops_at_its_last_commit_and_finishes_once_space_is_back(small_disk):
    disk = small_disk("2m")
    path = disk.root / "journal.db"
    app = make_app(path, output_bytes=16_000)
    run_id = app.engine.start(run_id="run-1")
    disk.fill(leave=96 * 1024)  # room for a few steps, not for twelve of 16 KB

    with pytest.raises(JournalError) as info:
        app.engine.run(run_id)
    assert_full_error(info.value, path)
    stopped_in = app.rows[run_id].state
    assert stopped_in != "done"
    assert len(app.committed[run_id]) > 1  # a step or more fitted before the disk was full
    assert_as_committed(path, app, [run_id])

    disk.free()
    assert app.engine.run(run_id).state == "done"
    assert_no_phase_ran_twice(app, [run_id], {run_id: stopped_in})
    assert_as_committed(path, app, [run_id])
    app.engine.close()
    app.journal.close()


# -- 2. a batch of claimed starts ------------------------------------------------------------


def test_a_batch_of_claimed_starts_is_all_or_nothing(small_disk):
    disk = small_disk("2m")
    path = disk.root / "journal.db"
    app = make_app(path, output_bytes=100)
    earlier = app.engine.start_many([{"n": n} for n in range(3)], claim=True)
    for run_id in earlier:
        app.engine.run(run_id, max_steps=2)
    disk.fill(leave=32 * 1024)

    with pytest.raises(JournalError) as info:
        app.engine.start_many([{"n": n, "pad": "y" * 400} for n in range(2000)], claim=True)
    assert_full_error(info.value, path)
    assert all_ids(app.journal) == sorted(earlier)  # none of the 2000
    assert_as_committed(path, app, earlier)

    disk.free()
    later = app.engine.start_many([{"n": n} for n in range(5)], claim=True)
    app.engine.close()  # lets go of the five: nothing held of the refused batch
    with SqliteJournal(path, create=False) as journal:
        assert all_ids(journal) == sorted(earlier + later)
        assert all(journal.load(run_id).lease_owner is None for run_id in later)
        assert check_journal(journal) == []
    app.journal.close()


# -- 3. many async runs, committed in groups -------------------------------------------------


def test_async_runs_in_group_commits_keep_every_commit_and_run_no_phase_twice(small_disk):
    disk = small_disk("16m")
    path = disk.root / "journal.db"
    app = make_app(path, output_bytes=3000)
    run_ids = app.engine.start_many([{"n": n} for n in range(30)], claim=True)
    disk.fill(leave=512 * 1024)  # the group commits of a few phases fit, not of twelve

    async def drive() -> list[Any]:
        return await asyncio.gather(
            *(app.engine.arun(run_id) for run_id in run_ids), return_exceptions=True
        )

    results = asyncio.run(drive())
    failures = [result for result in results if isinstance(result, BaseException)]
    assert failures, "the disk never filled"
    for failure in failures:
        assert_full_error(failure, path)
    stopped_in = {run_id: app.rows[run_id].state for run_id in run_ids}
    assert_as_committed(path, app, run_ids)

    disk.free()
    for run_id in run_ids:
        assert app.engine.run(run_id).state == "done"
    interrupted = {run_id: state for run_id, state in stopped_in.items() if state != "done"}
    assert interrupted
    assert_no_phase_ran_twice(app, run_ids, interrupted)
    assert_as_committed(path, app, run_ids)
    app.engine.close()
    app.journal.close()


# -- 4. the checkpoint thread ----------------------------------------------------------------


def _cpu_seconds(thread: threading.Thread) -> float:
    """The CPU time ``thread`` has used (Linux's schedstat, in nanoseconds)."""
    text = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text()
    return int(text.split()[0]) / 1e9


def _copied(path: Path) -> bool:
    """Whether the database file holds every page the journal has (the WAL copied back)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        pages, size = conn.execute("SELECT * FROM pragma_page_count, pragma_page_size").fetchone()
    finally:
        conn.close()
    return path.stat().st_size >= pages * size


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_the_checkpoint_thread_waits_out_a_full_disk_and_copies_once_space_is_back(
    small_disk, tmp_path
):
    disk = small_disk("4m")
    path = disk.root / "journal.db"
    app = make_app(path)
    inputs = [{"pad": "z" * 1000}] * 300
    first = app.engine.start_many(inputs)  # grows the WAL; the thread copies it back
    assert _wait_for(lambda: _copied(path))
    disk.fill()
    # The next write starts the WAL over, in its file's existing blocks: it commits, but its
    # new pages cannot be copied into the database file, which cannot grow.
    second = app.engine.start_many(inputs[:60])
    thread = next(t for t in threading.enumerate() if t.name.startswith("fsm_runner checkp"))
    before = _cpu_seconds(thread)
    time.sleep(1.0)
    busy = _cpu_seconds(thread) - before
    print(f"the checkpoint thread on a full disk: {busy * 1000:.1f} ms of CPU in 1 s")
    assert busy < 0.5, f"{busy:.2f} s of CPU in 1 s: the checkpoint thread spins"
    assert thread.is_alive()
    assert not _copied(path)
    with SqliteJournal(path, create=False) as journal:  # nothing lost: the WAL has it
        assert all_ids(journal) == sorted(first + second)
        assert check_journal(journal) == []

    disk.free()
    assert _wait_for(lambda: _copied(path)), "the thread never copied the WAL back"
    alone = tmp_path / "alone.db"  # the database file alone, without its WAL
    shutil.copyfile(path, alone)
    conn = sqlite3.connect(alone)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT count(*) FROM run_rows").fetchone() == (360,)
    finally:
        conn.close()
    app.engine.close()
    app.journal.close()


# -- 5. Engine.close letting go of claimed runs ----------------------------------------------


def test_close_on_a_full_disk_leaves_its_claimed_runs_leased_until_they_expire(small_disk, caplog):
    disk = small_disk("16m")
    path = disk.root / "journal.db"
    # No checkpoint thread: the WAL is not started over, so the release must grow it.
    app = make_app(path, checkpoint_thread=False, lease_ttl=0.5)
    run_ids = app.engine.start_many([{"n": n} for n in range(20)], claim=True)
    disk.fill()

    closing = threading.Thread(target=app.engine.close)
    with caplog.at_level(logging.WARNING, logger="fsm_runner.engine"):
        closing.start()
        closing.join(timeout=30)
    assert not closing.is_alive(), "Engine.close hangs on a full disk"
    assert f"could not release 20 leases: journal {path}: {FULL}" in caplog.text
    with SqliteJournal(path, create=False) as journal:
        for run_id in run_ids:
            run = journal.load(run_id)
            assert run.lease_owner == app.engine.worker_id  # still held: it expires
            assert journal.transitions(run_id) == app.committed[run_id]
        with pytest.raises(LeaseHeldError):
            journal.claim(run_ids[0], "someone-else", ttl=5)

    disk.free()
    other = make_app(path, lease_ttl=5)
    assert _wait_for(lambda: bool(other.engine.recover()))  # once the leases have expired
    other.engine.recover()
    for run_id in run_ids:
        assert other.journal.load(run_id).state == "done"
    assert sum(other.calls.values()) == 20 * len(PHASES)  # no phase of theirs had run
    other.engine.close()
    other.journal.close()
    app.journal.close()


# -- 6. the CLI ------------------------------------------------------------------------------

APP = f"{__name__}:make_cli_app"


def _cli(path: Path, *args: str) -> Any:
    return CliRunner().invoke(cli, ["--journal", str(path), *args], catch_exceptions=False)


def _journal_with_runs(path: Path) -> tuple[str, str]:
    """A closed journal (no -wal, no -shm left): a finished run and one in ``p3``."""
    app = make_app(path)
    done = app.engine.start(run_id="run-done")
    app.engine.run(done)
    going = app.engine.start(run_id="run-going")
    app.engine.run(going, max_steps=3)
    app.engine.close()
    app.journal.close()
    return done, going


def _snapshot(path: Path) -> list[Any]:
    with SqliteJournal(path, create=False) as journal:
        return [(journal.load(r), journal.transitions(r)) for r in all_ids(journal)]


READS = (("runs",), ("show", "run-going"), ("check",), ("replay", "run-done"))
WRITES = (
    ("resume", "run-going", "--app", APP),
    ("abort", "run-going", "--reason", "no room"),
    ("fork", "run-done", "--at", "2"),
)


@pytest.mark.parametrize("held_open", [False, True], ids=["closed", "held-open"])
def test_the_cli_reads_and_refuses_writes_in_one_line(small_disk, tmp_path, held_open):
    """``held-open``: a worker has the journal open (its -shm is there); ``closed``: none has."""
    disk = small_disk("2m")
    path = disk.root / "journal.db"
    _journal_with_runs(path)
    before = _snapshot(path)
    holder = SqliteJournal(path, create=False) if held_open else None
    if holder is not None:
        holder.load("run-going")
    disk.fill()

    for command in READS:
        result = _cli(path, *command)
        assert result.exit_code == 0, (command, result.output)
        assert "Error" not in result.output, (command, result.output)
    result = _cli(path, "export", "run-going", str(tmp_path / "exported"))
    assert result.exit_code == 0, result.output
    refusals = [(command, f"{FULL}; nothing was written") for command in WRITES]
    exported = disk.root / "exported"  # a write of the CLI's own, onto the full disk
    refusals.append((("export", "run-going", str(exported)), "No space left on device"))
    for command, reason in refusals:
        result = _cli(path, *command)
        assert result.exit_code == 1, (command, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1, (command, result.output)
        assert lines[0].startswith("Error: "), (command, lines[0])
        assert lines[0].endswith(reason), (command, lines[0])
    if holder is not None:
        holder.close()

    disk.free()
    assert _snapshot(path) == before
    assert _cli(path, *WRITES[0]).exit_code == 0
    with SqliteJournal(path, create=False) as journal:
        assert journal.load("run-going").state == "done"
        assert check_journal(journal) == []


def test_a_journal_opened_to_read_reads_between_refused_writes(small_disk):
    """No room for its -shm: each read gets the file alone; a refused write leaves no lock."""
    disk = small_disk("2m")
    path = disk.root / "journal.db"
    _journal_with_runs(path)
    before = _snapshot(path)
    disk.fill()
    # A short busy timeout: a lock left behind would fail the next read ("locked").
    journal = SqliteJournal(path, create=False, busy_timeout=1.0)
    engine = make_cli_app(journal)
    for _ in range(2):
        with pytest.raises(JournalError) as info:
            engine.run("run-going")
        assert_full_error(info.value, path)
        time.sleep(0.1)  # the checkpoint thread, started by the write, has looked meanwhile
        assert [(journal.load(r), journal.transitions(r)) for r in all_ids(journal)] == before

    disk.free()
    assert engine.run("run-going").state == "done"
    other = SqliteJournal(path, busy_timeout=1.0)  # the file is not held: another writes
    writer = make_cli_app(other)
    assert writer.run(writer.start(run_id="run-after")).state == "done"
    writer.close()
    other.close()
    engine.close()
    journal.close()


# -- 7. a journal created on a full disk -----------------------------------------------------


@pytest.mark.parametrize("leave", [0, 4, 8, 16, 32, 64, 128])
def test_a_journal_created_on_a_full_disk(small_disk, leave):
    """Whatever room there was (KiB), one clear error; what is left opens once space is back."""
    disk = small_disk("1m")
    path = disk.root / "journal.db"
    disk.fill(leave=leave * 1024)
    try:
        journal = SqliteJournal(path)
    except JournalError as error:
        assert_full_error(error, path)
    else:  # it fitted: a journal that takes no run
        with journal, pytest.raises(JournalError) as info:
            make_app(Path(":memory:")).engine.with_journal(journal).start({"pad": "x" * 200_000})
        assert_full_error(info.value, path)

    disk.free()
    result = _cli(path, "runs")  # a leftover is no journal yet, or an empty one
    assert result.exit_code in (0, 1, 3), result.output
    assert len(result.output.splitlines()) == 1, result.output
    app = make_app(path)
    assert app.engine.run(app.engine.start()).state == "done"
    app.engine.close()
    app.journal.close()
    with SqliteJournal(path, create=False) as journal:
        assert check_journal(journal) == []
