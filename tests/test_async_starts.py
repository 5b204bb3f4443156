"""Async starts, aborts, signals and reads, off the event loop; one engine shared by threads and tasks.

Issue 31, point 1. ``astart`` calls of one loop turn are written in one transaction on the
engine's journal thread; the loop never waits on the journal (a real second process holds the
SQLite write lock meanwhile and the loop keeps ticking); a repeated ``run_id`` is refused with
``RunExistsError`` for that call alone; a call cancelled before its turn ends writes nothing.
On every journal (memory, a SQLite file, PostgreSQL).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading

import pytest

from fsm_runner import SqliteJournal
from fsm_runner.exceptions import InvalidRunIdError, PayloadError, RunExistsError
from fsm_runner.replay import check_journal
from tests.helpers import approval_engine, two_phase_engine


class CountingJournal(SqliteJournal):
    """A SQLite journal that counts the transactions that store new runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def create_runs(self, runs, *, spec_json):
        self.batches.append(len(runs))
        return super().create_runs(runs, spec_json=spec_json)

    def create_run(self, run, first, *, spec_json, iterations=()):
        self.batches.append(1)
        return super().create_run(run, first, spec_json=spec_json, iterations=iterations)


class TestOnEveryJournal:
    def test_astart_then_arun(self, journal):
        async def main():
            with two_phase_engine(journal) as engine:
                run_id = await engine.astart({"order": 1}, run_id="order-1")
                stored = await engine.aload(run_id)
                assert (stored.state, stored.input) == ("a", {"order": 1})
                return await engine.arun(run_id)

        assert asyncio.run(main()).state == "done"

    def test_concurrent_astarts_each_get_their_own_answer(self, journal):
        async def main():
            with two_phase_engine(journal) as engine:
                await engine.astart({}, run_id="taken")
                return await asyncio.gather(
                    *(engine.astart({"n": n}, run_id=f"order-{n}") for n in range(10)),
                    engine.astart({}, run_id="taken"),
                    engine.astart({}, run_id="order-3"),
                    return_exceptions=True,
                )

        *started, taken, repeated = asyncio.run(main())
        assert started == [f"order-{n}" for n in range(10)]
        assert isinstance(taken, RunExistsError)
        assert isinstance(repeated, RunExistsError)  # the same id twice in one batch
        assert journal.load("order-3").input == {"n": 3}
        assert len(journal.runs()) == 11

    def test_aabort_and_asignal(self, journal):
        async def main():
            with approval_engine(journal) as engine:
                first, second = await engine.astart_many([{}, {}])
                await engine.arun(first)
                await engine.arun(second)  # both wait for approval
                signal = await engine.asignal(first, "APPROVED")
                aborted = await engine.aabort(second, "not wanted")
                return signal, await engine.aload(first), aborted

        signal, first, aborted = asyncio.run(main())
        assert signal.status.value in ("consumed", "pending")
        assert first.state in ("publishing", "published")
        assert (aborted.status.value, aborted.state) == ("aborted", "canceled")

    def test_refusals_write_nothing(self, journal):
        async def main():
            with two_phase_engine(journal) as engine:
                with pytest.raises(PayloadError):
                    await engine.astart({"x": math.nan})
                with pytest.raises(InvalidRunIdError):
                    await engine.astart({}, run_id="bad\nid")
                with pytest.raises(PayloadError):
                    await engine.astart_many([{}, {"x": math.inf}])

        asyncio.run(main())
        assert journal.runs() == []


def test_one_loop_turns_starts_are_one_transaction(tmp_path):
    with CountingJournal(tmp_path / "j.db") as journal, two_phase_engine(journal) as engine:

        async def main():
            return await asyncio.gather(*(engine.astart({"n": n}) for n in range(20)))

        run_ids = asyncio.run(main())
        assert len(set(run_ids)) == 20
        assert journal.batches == [20]
        assert len(journal.runs()) == 20


def test_a_call_cancelled_before_its_turn_ends_writes_nothing(tmp_path):
    with SqliteJournal(tmp_path / "j.db") as journal, two_phase_engine(journal) as engine:

        async def main():
            task = asyncio.ensure_future(engine.astart({}, run_id="cancelled"))
            await asyncio.sleep(0)  # the call is queued in this turn's batch
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await engine.astart({}, run_id="kept")  # a later turn's batch is written

        asyncio.run(main())
        assert [run.run_id for run in journal.runs()] == ["kept"]


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""


def test_the_loop_goes_on_while_another_process_holds_the_write_lock(tmp_path):
    path = tmp_path / "j.db"
    with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:
        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert locker.stdout.readline().strip() == "locked"

            async def main():
                ticks = 0
                start = asyncio.ensure_future(engine.astart({}, run_id="waited"))
                while ticks < 30:  # 0.3 s of ticks: the loop is free while the start waits
                    await asyncio.sleep(0.01)
                    ticks += 1
                waiting = not start.done()
                locker.stdin.close()  # the other process lets go: the start goes through
                return waiting, await start

            waiting, run_id = asyncio.run(main())
        finally:
            if not locker.stdin.closed:
                locker.stdin.close()
            locker.wait(timeout=30)
            locker.stdout.close()
        assert waiting, "the start did not wait for the other process's lock"
        assert journal.load(run_id).run_id == "waited"


class TestSharedEngine:
    """One engine, shared by a pool of threads, and by the tasks of one event loop."""

    def test_threads(self, tmp_path):
        path = tmp_path / "j.db"
        errors: list[BaseException] = []
        with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:

            def work(n: int) -> None:
                try:
                    for i in range(20):
                        run_id = engine.start({"thread": n, "i": i})
                        if i % 5 == 4:
                            engine.abort(run_id, "every fifth")
                        else:
                            assert engine.run(run_id).state == "done"
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert errors == []
            runs = journal.runs()
            assert len(runs) == 160
            assert sorted({run.state for run in runs}) == ["canceled", "done"]
            assert sum(run.state == "canceled" for run in runs) == 32
            assert check_journal(journal) == []

    def test_tasks_of_one_loop(self, tmp_path):
        with SqliteJournal(tmp_path / "j.db") as journal, two_phase_engine(journal) as engine:

            async def one(n: int) -> str:
                run_id = await engine.astart({"n": n})
                return (await engine.arun(run_id)).state

            async def main():
                return await asyncio.gather(*(one(n) for n in range(50)))

            assert asyncio.run(main()) == ["done"] * 50
            assert check_journal(journal) == []
