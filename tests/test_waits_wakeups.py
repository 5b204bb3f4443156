"""Idle workers woken when work may have come (issue 29): ``Journal.idle`` on every journal.

A worker with nothing to claim waits on its journal's ``idle`` instead of sleeping its poll out:
a signal journaled (PostgreSQL: its ``NOTIFY``; SQLite: the file's ``data_version``; the memory
journal: its doorbell) or a run let go of ends the wait, so a signal is acted on at once rather
than at the next poll. Every wait here that must end early has a timeout of a minute or more:
ending with ``True`` (work may have come) rather than ``False`` (the time was up) is what is
checked, never how long it took. The latency itself is measured by
``tests/bench/bench_waits.py``.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from fsm_runner import Engine, PostgresJournal, SqliteJournal
from fsm_runner.exceptions import RunTerminalError
from fsm_runner.records import SignalRecord
from tests.test_waits import APPROVAL, HANDLERS, parked
from tests.test_waits_processes import ROOT, fsm_runner_command

LONG = 120.0  # seconds: a wait that must end early is given this long
SHORT = 0.2  # seconds: a wait that nothing should end


def other(journal, request):
    """Another journal object on the same store, a connection of its own (memory: the same)."""
    if isinstance(journal, SqliteJournal):
        return SqliteJournal(journal.path)
    if isinstance(journal, PostgresJournal):
        server = request.getfixturevalue("postgres_server")
        return PostgresJournal(server.url, schema=journal.schema)
    return journal


def settle(journal, stop: threading.Event | None = None) -> None:
    """Wait until a short wait ends because its time is up.

    The first wait of a thread ends at once (what came before it is unknown), and so does
    PostgreSQL's first wait on its new listening connection.
    """
    stop = stop or threading.Event()
    for _ in range(10):
        if journal.idle(timeout=SHORT, stop=stop) is False:
            return
    pytest.fail("the journal's idle wait never settled")


def later(action, delay: float = 0.1) -> threading.Thread:
    """Run ``action`` on a thread of its own, ``delay`` seconds from now."""

    def act() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def engine(journal):
    engine = Engine(APPROVAL, handlers=HANDLERS, journal=journal)
    yield engine
    engine.close()


class TestTheWait:
    def test_the_first_wait_of_a_thread_ends_at_once_then_the_time_is_up(self, journal):
        stop = threading.Event()
        assert journal.idle(timeout=LONG, stop=stop) is True
        settle(journal, stop)
        began = time.monotonic()
        assert journal.idle(timeout=SHORT, stop=stop) is False
        assert time.monotonic() - began >= SHORT

    def test_stop_ends_it(self, journal):
        settle(journal)
        stop = threading.Event()
        later(stop.set)
        assert journal.idle(timeout=LONG, stop=stop) is False
        assert stop.is_set()

    def test_a_signal_ends_it(self, journal, engine):
        run_id = parked(engine)
        settle(journal)
        sender = later(lambda: journal.put_signal(SignalRecord(run_id, 0, "APPROVE")))
        assert journal.idle(timeout=LONG, stop=threading.Event()) is True
        sender.join()

    def test_a_signal_sent_before_the_wait_ends_it_at_once(self, journal, engine):
        """Sent between a worker's fruitless claim and its wait: not left to the next poll."""
        run_id = parked(engine)
        settle(journal)
        journal.put_signal(SignalRecord(run_id, 0, "APPROVE"))
        assert journal.idle(timeout=LONG, stop=threading.Event()) is True

    def test_a_run_let_go_of_ends_it(self, journal, engine):
        """As when ``Engine.signal`` consumed a signal at once and lets go of the run."""
        run_id = engine.start()
        held = journal.claim(run_id, "holder", ttl=60)
        settle(journal)
        later(lambda: journal.release(run_id, "holder", held.lease_token))
        assert journal.idle(timeout=LONG, stop=threading.Event()) is True

    def test_each_waiting_thread_is_woken(self, journal, engine):
        run_id = parked(engine)
        woke: list[bool] = []
        ready = threading.Barrier(4)

        def wait() -> None:
            settle(journal)
            ready.wait()
            woke.append(journal.idle(timeout=LONG, stop=threading.Event()))

        waiters = [threading.Thread(target=wait) for _ in range(3)]
        for waiter in waiters:
            waiter.start()
        ready.wait()
        journal.put_signal(SignalRecord(run_id, 0, "APPROVE"))
        for waiter in waiters:
            waiter.join(LONG)
        assert woke == [True, True, True]


@pytest.mark.parametrize("journal", ["sqlite", "postgres"], indirect=True)
class TestAnotherConnection:
    def test_a_signal_through_another_journal_ends_it(self, journal, engine, request):
        """SQLite: the file's data_version changed; PostgreSQL: the signal's NOTIFY."""
        run_id = parked(engine)
        sender = Engine(APPROVAL, handlers=HANDLERS, journal=other(journal, request))
        settle(journal)
        thread = later(lambda: sender.signal(run_id, "APPROVE"))
        try:
            assert journal.idle(timeout=LONG, stop=threading.Event()) is True
        finally:
            thread.join(LONG)
            sender.close()
            sender.journal.close()

    def test_a_signal_from_another_process_ends_it(self, journal, engine):
        run_id = parked(engine)
        settle(journal)
        argv = [*fsm_runner_command(), "--journal", journal.location, "signal", run_id, "APPROVE"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as proc:
            woke = journal.idle(timeout=LONG, stop=threading.Event())
            output = proc.communicate(timeout=LONG)[0]
        assert proc.returncode == 0, output
        assert woke is True


class TestPostgres:
    def test_a_refused_signal_notifies_nobody(self, postgres_journal):
        """Refused (the run ended): its transaction is rolled back, NOTIFY with it."""
        engine = Engine(APPROVAL, handlers=HANDLERS, journal=postgres_journal)
        run_id = parked(engine)
        engine.signal(run_id, "APPROVE")
        assert engine.run(run_id).state == "applied"
        settle(postgres_journal)
        with pytest.raises(RunTerminalError):
            postgres_journal.put_signal(SignalRecord(run_id, 0, "APPROVE"))
        assert postgres_journal.idle(timeout=SHORT, stop=threading.Event()) is False
        engine.close()

    def test_a_lost_listening_connection_is_made_again(
        self, postgres_journal, postgres_server, caplog, request
    ):
        engine = Engine(APPROVAL, handlers=HANDLERS, journal=postgres_journal)
        run_id = parked(engine)
        settle(postgres_journal)
        listener = postgres_journal._waits._listener
        postgres_server.terminate(listener._conn.info.backend_pid)
        # The loss is logged, never raised; the wait goes on as a poll until its time is up.
        stop = threading.Event()
        postgres_journal.idle(timeout=SHORT, stop=stop)
        assert "lost its connection" in caplog.text
        settle(postgres_journal)  # a new connection (after a second), which listens again
        sender = other(postgres_journal, request)
        try:
            sender.put_signal(SignalRecord(run_id, 0, "APPROVE"))
            assert postgres_journal.idle(timeout=LONG, stop=stop) is True
        finally:
            sender.close()
            engine.close()


class TestTheWorker:
    def test_an_idle_worker_acts_on_a_signal_long_before_its_poll(self, journal, request):
        """``Engine.work(idle_wait=...)`` far longer than the test waits: woken, not polling."""
        sender_journal = other(journal, request)
        sender = Engine(APPROVAL, handlers=HANDLERS, journal=sender_journal)
        run_id = parked(sender)
        worker = Engine(APPROVAL, handlers=HANDLERS, journal=journal)
        stop = threading.Event()
        thread = threading.Thread(target=lambda: worker.work(stop=stop, idle_wait=10 * LONG))
        thread.start()
        try:
            settle(journal)  # this thread waits too, on the worker's journal: one listens
            sender.signal(run_id, "APPROVE")  # consumed here at once; the worker applies it
            deadline = time.monotonic() + LONG
            while journal.load(run_id).state != "applied":
                assert time.monotonic() < deadline, journal.load(run_id)
                time.sleep(0.01)
        finally:
            stop.set()
            thread.join(LONG)
            worker.close()
            sender.close()
            if sender_journal is not journal:
                sender_journal.close()
        assert not thread.is_alive()
