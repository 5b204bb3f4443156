"""The PostgreSQL journal against a real server whose backends die under it.

A second (admin) connection ends the journal's backend with ``pg_terminate_backend``: at random
moments while an engine drives runs (sync ``Engine.run`` and ``asyncio.gather(engine.arun(...))``
with ``start_many(claim=True)`` and group commits), and at chosen points — right after a write
has committed on the server, before its answer reaches the journal (a wrapper around the
journal's real connection ends the backend there and lets the journal read the real error of a
dead connection), so every resolver (``commit``, ``commit_many``, ``create_runs``, ``claim``,
``renew_many``, ``release_many``, a prune's batch) has to find out whether its write is stored. After each session
the journal must be as sound as one that never lost its connection. A server that refuses new
connections (the journal's own role limited to 0 connections) must end in one
:class:`JournalError` after ``retry_for`` with nothing half-written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import random
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from fsm_runner import Engine, RunLifecycle
from fsm_runner.exceptions import JournalError
from fsm_runner.journal import _postgres_connection
from fsm_runner.journal.base import Commit, Renewal
from fsm_runner.journal.postgres import PostgresJournal
from fsm_runner.replay import check_journal
from tests.helpers import NEXT, linear_spec
from tests.test_postgres_journal import T0, next_step, start

SPEC = linear_spec("a", "b", "c", "d", name="attacked")
#: Kills each random-kill test lands at least.
KILLS = 50


class Admin:
    """A connection of the test's own that ends the journal's backend (thread-safe)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
        self.lock = threading.Lock()
        self.kills = 0

    def kill(self, pid: int | None) -> bool:
        """Send backend ``pid`` the signal that ends it; ``True`` if it was there."""
        if pid is None:
            return False
        with self.lock:
            if self.conn.broken or self.conn.closed:  # the server restarted (another suite's test)
                self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            try:
                row = self.conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
            except psycopg.OperationalError:
                return False
        ended = bool(row and row[0])
        self.kills += ended
        return ended

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def killer(postgres_server, monkeypatch):
    # Getting a connection back waits 50 ms and more (kind to a restarting server); here the
    # server is up and the kills are many: a short backoff keeps the tests short.
    monkeypatch.setattr(_postgres_connection, "_FIRST_BACKOFF", 0.002)
    monkeypatch.setattr(_postgres_connection, "_MAX_BACKOFF", 0.02)
    admin = Admin(postgres_server.url)
    yield admin
    admin.close()


class Calls:
    """Handler calls counted by (run id, seq): a phase that ran twice for one step shows here."""

    def __init__(self) -> None:
        self.seen: collections.Counter[tuple[str, int]] = collections.Counter()
        self.lock = threading.Lock()

    def sync(self, ctx: Any) -> str:
        with self.lock:
            self.seen[(ctx.run.run_id, ctx.run.seq)] += 1
        return NEXT

    async def asynchronous(self, ctx: Any) -> str:
        return self.sync(ctx)

    def handlers(self, *, use_async: bool = False) -> dict[str, Any]:
        handler = self.asynchronous if use_async else self.sync
        return dict.fromkeys(("a", "b", "c", "d"), handler)


def check_session(journal, engine, batches, reported, calls: Calls) -> None:
    """What must hold after a session of lost connections (the brief's list)."""
    for batch in batches:  # start_many: every id the engine returned is stored
        assert all(journal.load(run_id).run_id == run_id for run_id in batch)
    for run_id, final in reported.items():
        stored = journal.load(run_id)
        assert final.status is RunLifecycle.SUCCEEDED
        assert (stored.state, stored.seq, stored.ended) == (final.state, final.seq, True)
        transitions = journal.transitions(run_id)
        assert [t.seq for t in transitions] == list(range(stored.seq + 1))  # gapless
        written = [(t.event, t.at, t.from_state, t.lease_token) for t in transitions]
        assert len(set(written)) == len(written)  # no transition written twice
        assert stored.lease_owner is None
        assert stored.lease_token == 1  # claimed once, by start_many: no claim done twice
    # every phase ran once for its step: exactly the steps that were committed
    assert all(count == 1 for count in calls.seen.values()), calls.seen.most_common(3)
    assert len(calls.seen) == sum(journal.load(run_id).seq for run_id in reported)
    leased = [run.run_id for run in journal.runs() if run.lease_owner == engine.worker_id]
    assert leased == []  # the engine that closed holds nothing
    assert check_journal(journal) == []
    assert journal.integrity_problems() == []


def random_kills(journal, admin: Admin, stop: threading.Event) -> threading.Thread:
    """A thread that ends the journal's backend every few milliseconds until ``stop``.

    Up to 30 ms apart (15 on average): on a loaded machine a write through the connection the
    journal gets back takes several milliseconds, and kills up to 10 ms apart starved it past
    its 15 s of reconnecting now and then (schema 7 writes a little more a commit).
    """
    rng = random.Random(7)

    def loop() -> None:
        killed = None
        while not stop.wait(rng.uniform(0.0, 0.03)):
            pid = journal.backend_pid
            if pid != killed and admin.kill(pid):
                killed = pid

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def drive_sessions(journal, admin: Admin, *, use_async: bool) -> int:
    """Sessions of 12 runs (start_many claiming them), each checked, until KILLS kills landed."""
    sessions = 0
    while admin.kills < KILLS:
        sessions += 1
        calls = Calls()
        engine = Engine(
            SPEC,
            handlers=calls.handlers(use_async=use_async),
            journal=journal,
            lease_ttl=60,
            heartbeat_interval=0.01,
        )
        stop = threading.Event()
        thread = random_kills(journal, admin, stop)
        try:
            batches = [engine.start_many([{"n": n} for n in range(6)], claim=True)]
            batches.append(engine.start_many([{"n": n} for n in range(6)], claim=True))
            run_ids = [run_id for batch in batches for run_id in batch]
            if use_async:

                async def main(ids=run_ids, engine=engine):
                    return await asyncio.gather(*(engine.arun(run_id) for run_id in ids))

                finals = asyncio.run(main())
            else:
                finals = [engine.run(run_id) for run_id in run_ids]
        finally:
            stop.set()
            thread.join()
            engine.close()
        check_session(journal, engine, batches, dict(zip(run_ids, finals, strict=True)), calls)
    return sessions


class TestRandomKills:
    """The backend ends at random moments while an engine works."""

    def test_sync_runs(self, postgres_journal, killer):
        assert drive_sessions(postgres_journal, killer, use_async=False) >= 1
        assert killer.kills >= KILLS

    def test_async_runs_with_group_commits(self, postgres_journal, killer):
        assert drive_sessions(postgres_journal, killer, use_async=True) >= 1
        assert killer.kills >= KILLS


class Trap:
    """Ends the backend right after the n-th write committed, before the journal reads that.

    Wraps the journal's real connection: a write done in autocommit mode (an ``execute`` or
    ``executemany`` that changes rows) or a transaction that committed is done on the server;
    then the admin connection ends the backend and the journal reads the real error of a
    connection the server closed, as if the answer had been lost on the wire.
    """

    WRITES = ("insert", "update", "with", "delete")

    def __init__(self, journal: PostgresJournal, admin: Admin, seed: int) -> None:
        self.journal, self.admin = journal, admin
        self.rng = random.Random(seed)
        self.armed = True
        self.sprung = 0
        self.countdown = self.rng.randint(1, 3)
        connect = journal._connection.connect

        def trapped_connect(*, timeout: float | None = None) -> Any:
            journal._connection.conn = _Trapped(connect(timeout=timeout), self)  # type: ignore[assignment]
            return journal._connection.conn

        journal._connection.connect = trapped_connect  # type: ignore[method-assign]
        journal._connection.disconnect()

    def written(self, conn: psycopg.Connection[Any]) -> None:
        """A write committed on ``conn``: maybe end the backend before the caller hears of it."""
        if not self.armed:
            return
        self.countdown -= 1
        if self.countdown:
            return
        self.countdown = self.rng.randint(1, 3)
        assert self.admin.kill(conn.info.backend_pid)
        self.sprung += 1
        # Until the server closed it: the real OperationalError. By the clock, not a count of
        # queries: on a loaded machine 1,000 of them were answered before the backend ended.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            conn.execute("SELECT 1")
        raise AssertionError("the terminated backend goes on answering after 30 s")


class _Cursor:
    def __init__(self, cursor: Any, trap: Trap, conn: _Trapped) -> None:
        self._cursor, self._trap, self._owner = cursor, trap, conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._cursor.close()

    def executemany(self, query: Any, params: Any, **kwargs: Any) -> None:
        self._cursor.executemany(query, params, **kwargs)
        if not self._owner.depth:
            self._trap.written(self._owner.conn)


class _Trapped:
    """The journal's connection, with a trap after each committed write."""

    def __init__(self, conn: psycopg.Connection[Any], trap: Trap) -> None:
        self.conn, self.trap, self.depth = conn, trap, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        cursor = self.conn.execute(query, params, **kwargs)
        text = str(query).lstrip().lower()
        if not self.depth and text.startswith(Trap.WRITES) and cursor.rowcount:
            self.trap.written(self.conn)
        return cursor

    def cursor(self, *args: Any, **kwargs: Any) -> _Cursor:
        return _Cursor(self.conn.cursor(*args, **kwargs), self.trap, self)

    @contextlib.contextmanager
    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        self.depth += 1
        try:
            with self.conn.transaction(*args, **kwargs) as tx:
                yield tx
        finally:
            self.depth -= 1
        if not self.depth:  # committed
            self.trap.written(self.conn)


class TestKilledAfterTheCommit:
    """The write is stored, its answer is lost: the resolvers must see it is theirs."""

    @pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
    def test_engine_sessions(self, postgres_journal, killer, use_async):
        trap = Trap(postgres_journal, killer, seed=int(use_async))
        sessions = 0
        while trap.sprung < 25:
            sessions += 1
            calls = Calls()
            engine = Engine(
                SPEC, handlers=calls.handlers(use_async=use_async), journal=postgres_journal
            )
            batch = engine.start_many([{"n": n} for n in range(5)], claim=True)
            if use_async:

                async def main(ids=batch, engine=engine):
                    return await asyncio.gather(*(engine.arun(run_id) for run_id in ids))

                finals = asyncio.run(main())
            else:
                finals = [engine.run(run_id) for run_id in batch]
            engine.close()
            trap.armed = False
            check_session(
                postgres_journal, engine, [batch], dict(zip(batch, finals, strict=True)), calls
            )
            trap.armed = True
        assert sessions >= 1

    def test_claims_renewals_and_releases(self, postgres_journal, killer):
        journal = postgres_journal
        engine = Engine(SPEC, handlers=Calls().handlers(), journal=journal)
        run_ids = engine.start_many([{"n": n} for n in range(8)])
        engine.close()
        trap = Trap(journal, killer, seed=3)
        for round_ in range(12):
            owner = f"w{round_}"
            claimed = journal.claim_many(run_ids, owner, ttl=60)
            assert all(not isinstance(run, Exception) for run in claimed), claimed
            tokens = {run.run_id: run.lease_token for run in claimed}  # type: ignore[union-attr]
            assert set(tokens.values()) == {round_ + 1}  # one claim each, whatever the kills
            trap.armed = False
            for run_id in run_ids:  # each claim took the lease exactly once
                stored = journal.load(run_id)
                assert (stored.lease_owner, stored.lease_token) == (owner, tokens[run_id])
            before = {run_id: journal.load(run_id).lease_expires_at for run_id in run_ids}
            trap.armed = True
            renewed = run_ids[::2]
            found = journal.renew_many([(r, tokens[r]) for r in renewed], owner, ttl=120)
            assert sorted(found) == sorted(renewed)
            assert set(found.values()) == {Renewal(renewed=True)}
            released = run_ids[1::3]
            reasons = journal.release_many([(r, tokens[r]) for r in released], owner)
            assert reasons == dict.fromkeys(released)
            trap.armed = False
            for run_id in run_ids:  # exactly the intended leases: released, renewed, kept
                stored = journal.load(run_id)
                assert stored.lease_token == tokens[run_id]
                if run_id in released:
                    assert stored.lease_owner is None
                    continue
                assert stored.lease_owner == owner
                if run_id in renewed:
                    assert stored.lease_expires_at > before[run_id]
                else:
                    assert stored.lease_expires_at == before[run_id]
            journal.release_many([(r, tokens[r]) for r in run_ids], owner)
            trap.armed = True
        assert trap.sprung >= 8
        assert check_journal(journal) == []

    def test_claims_of_runs_as_written(self, postgres_journal, killer):
        """``claim_unchanged_many`` cut off after its commit: each run claimed exactly once."""
        journal = postgres_journal
        trap = Trap(journal, killer, seed=5)
        for round_ in range(10):
            trap.armed = False
            engine = Engine(SPEC, handlers=Calls().handlers(), journal=journal)
            run_ids = engine.start_many([{"n": n} for n in range(6)])
            engine.close()
            written = [journal.load(run_id) for run_id in run_ids]
            trap.armed = True
            owner = f"w{round_}"
            claimed = journal.claim_unchanged_many(written, owner, ttl=60)
            assert [(run.lease_owner, run.lease_token) for run in claimed] == [(owner, 1)] * 6
            trap.armed = False
            assert [journal.load(run_id) for run_id in run_ids] == claimed  # as stored
            assert journal.claim_unchanged_many(written, owner, ttl=60) == [None] * 6
        assert trap.sprung >= 3
        assert check_journal(journal) == []

    def test_a_group_commit(self, postgres_journal, killer):
        """commit_many of many runs' steps, the group's COMMIT answer lost every time."""
        journal = postgres_journal
        engine = Engine(SPEC, handlers=Calls().handlers(), journal=journal)
        runs = [journal.load(r) for r in engine.start_many([{}] * 10, claim=True)]
        engine.close()
        runs = [journal.claim(run.run_id, "w", ttl=60) for run in runs]
        trap = Trap(journal, killer, seed=4)
        trap.countdown = 1
        for state in ("b", "c", "d"):
            commits = [Commit(*next_step(run, state)) for run in runs]
            trap.countdown = 1  # the group's own transaction
            assert journal.commit_many(commits) == [None] * len(commits)
            runs = [commit.run for commit in commits]
        trap.armed = False
        assert trap.sprung >= 3
        for run in runs:
            assert journal.load(run.run_id) == run
            assert [t.seq for t in journal.transitions(run.run_id)] == list(range(4))
        assert journal.integrity_problems() == []

    def test_a_batched_prune(self, postgres_journal, killer):
        """Each batch's COMMIT answer lost: the report holds every run pruned, once."""
        journal = postgres_journal
        ids = [f"run-{n:02d}" for n in range(20)]
        for n, run_id in enumerate(ids):
            run = start(journal, run_id, created=n)
            journal.commit(*next_step(run, "verifying"))
            journal.commit(*next_step(journal.load(run_id), "done", status=RunLifecycle.SUCCEEDED))
        trap = Trap(journal, killer, seed=5)
        trap.countdown = 1
        report = journal.prune(ended_before=T0 + dt.timedelta(days=1), batch_size=3)
        trap.armed = False
        assert trap.sprung >= 3  # after one batch in one to three
        assert (report.run_ids, report.transitions) == (tuple(ids), 3 * len(ids))
        assert journal.runs() == []


class TestKilledInsideAPipeline:
    """``executemany`` pipelines its statements: the backend ends while their results are read."""

    def test_start_many_goes_on(self, postgres_journal, killer):
        """Found by the random kills: the first such kill left psycopg's connection in pipeline
        mode, neither closed nor broken, and the journal took it for a sound connection that
        failed: ``JournalError`` at once, and every later call on it failed too."""
        journal = postgres_journal
        engine = Engine(SPEC, handlers=Calls().handlers(), journal=journal)
        rng = random.Random(5)
        connect = journal._connection.connect
        armed = []

        class Cursor:  # ends the backend a moment after executemany begins
            def __init__(self, cursor: Any, pid: int) -> None:
                self.cursor, self.pid = cursor, pid

            def __getattr__(self, name: str) -> Any:
                return getattr(self.cursor, name)

            def __enter__(self) -> Cursor:
                return self

            def __exit__(self, *exc_info: object) -> None:
                self.cursor.close()

            def executemany(self, *args: Any, **kwargs: Any) -> None:
                if armed:
                    armed.clear()
                    timer = threading.Timer(rng.uniform(0, 0.002), killer.kill, (self.pid,))
                    timer.start()
                self.cursor.executemany(*args, **kwargs)

        class Conn:
            def __init__(self, conn: Any) -> None:
                self.conn = conn

            def __getattr__(self, name: str) -> Any:
                return getattr(self.conn, name)

            def cursor(self, *args: Any, **kwargs: Any) -> Cursor:
                return Cursor(self.conn.cursor(*args, **kwargs), self.conn.info.backend_pid)

        def wrapped(*, timeout: float | None = None) -> Any:
            journal._connection.conn = Conn(connect(timeout=timeout))  # type: ignore[assignment]
            return journal._connection.conn

        journal._connection.connect = wrapped  # type: ignore[method-assign]
        journal._connection.disconnect()
        batches = []
        for _ in range(40):
            armed.append(True)
            batches.append(engine.start_many([{"n": n} for n in range(20)], claim=True))
        engine.close()
        assert killer.kills >= 20
        stored = {run.run_id for run in journal.runs()}
        assert stored == {run_id for batch in batches for run_id in batch}
        assert check_journal(journal) == []

    def test_a_connection_left_in_pipeline_mode_is_replaced(self, postgres_journal):
        """The state such a kill leaves, made on the real connection: pipeline mode with a
        query whose result was never read. It is not closed nor broken, yet no statement can
        run on it: the journal must take it as lost, not fail on it forever."""
        journal = postgres_journal
        pid = journal.backend_pid
        conn = journal._connection.conn
        assert conn is not None
        conn.pgconn.enter_pipeline_mode()
        conn.pgconn.send_query_params(b"SELECT 1", None)
        assert journal.meta()["format"] == "fsm_runner journal"
        assert journal.backend_pid not in (None, pid)

    def test_a_connection_left_busy_is_replaced(self, postgres_journal):
        """The state a kill inside a group commit's savepoints left in CI, made on the real
        connection: a query sent whose result was never read, outside pipeline mode. Not
        closed nor broken, yet every statement fails on it ("another command is already in
        progress", no SQLSTATE): the journal must take it as lost, not fail the commit."""
        journal = postgres_journal
        pid = journal.backend_pid
        conn = journal._connection.conn
        assert conn is not None
        conn.pgconn.send_query_params(b"SELECT 1", None)
        assert journal.meta()["format"] == "fsm_runner journal"
        assert journal.backend_pid not in (None, pid)


class TestRefusedConnections:
    """The server refuses the journal's new connections (its role may make none) for a while."""

    def test_one_clear_error_and_nothing_half_written(
        self, postgres_server, postgres_schema, killer
    ):
        admin = postgres_server.admin
        role = f"fsm_test_{uuid.uuid4().hex[:8]}"
        ident = sql.Identifier(role)
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        admin.execute(sql.SQL("GRANT CREATE ON DATABASE test TO {}").format(ident))
        url = postgres_server.url.replace("://root@", f"://{role}@")
        journal = PostgresJournal(url, schema=postgres_schema, retry_for=0.5)
        calls, refused = Calls(), []

        def refusing(ctx: Any) -> str:
            calls.sync(ctx)
            if not refused:  # from now on the server turns the journal away
                admin.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT 0").format(ident))
                killer.kill(journal.backend_pid)
                refused.append(ctx.run.run_id)
            return NEXT

        try:
            engine = Engine(SPEC, handlers={**calls.handlers(), "c": refusing}, journal=journal)
            batch = engine.start_many([{}] * 3, claim=True)
            with pytest.raises(JournalError) as info:
                engine.run(batch[0])
            message = str(info.value)
            assert "could not get it back within 0.5 s" in message
            assert "\n" not in message
            with pytest.raises(JournalError):  # a batch started now: nothing of it is stored
                engine.start_many([{"late": n} for n in range(4)], claim=True)
            admin.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(ident))
            stored = journal.load(batch[0])  # back again once the server lets it in
            assert (stored.state, stored.seq) == ("c", 2)  # c's step was not journaled
            assert calls.seen[(batch[0], 2)] == 1
            assert sorted(run.run_id for run in journal.runs()) == sorted(batch)
            assert [t.seq for t in journal.transitions(batch[0])] == [0, 1, 2]
            final = engine.run(batch[0])  # the engine goes on where the journal stands
            assert final.status is RunLifecycle.SUCCEEDED
            assert calls.seen[(batch[0], 2)] == 2  # c ran again: its step was never committed
            engine.close()
            assert check_journal(journal) == []
            journal.close()
        finally:
            admin.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(ident))
            postgres_server.drop(postgres_schema)
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))
