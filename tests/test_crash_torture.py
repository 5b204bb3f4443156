"""Crash torture: workers SIGKILLed (and stopped past their lease) at random; every run ends right.

The session and its checks live in ``tests/torture.py``, shared with the longer
``tests/bench/bench_torture.py``; its workers drive runs sync (``Engine.work``) or async
(rounds of ``arun``, batches of their own from ``start_many``). The seed is random per session
and printed on failure; set ``FSM_TORTURE_SEED`` to replay a session's choices (inputs,
victims, moments — process timing still differs from one session to the next).

The fast tests below show that the checks catch what they claim to, on a journal whose
runs were run in-process and then tampered with.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import threading
import time

import pytest

from fsm_runner import Engine, MachineSpec, RunLifecycle, SqliteJournal, State, Transition
from fsm_runner.exceptions import LeaseLostError
from fsm_runner.journal._sqlite_chain import fill_digests
from tests.torture import (
    PHASES,
    SPEC,
    AsyncRecorder,
    Recorder,
    Report,
    decide,
    expected_path,
    make_input,
    torture,
    verify,
)

SEED = int(os.environ.get("FSM_TORTURE_SEED") or random.SystemRandom().randrange(2**31))


@pytest.mark.slow
@pytest.mark.every_python
@pytest.mark.skipif(
    not (hasattr(signal, "SIGKILL") and hasattr(signal, "SIGSTOP")),
    reason="needs POSIX SIGKILL and SIGSTOP",
)
@pytest.mark.parametrize(
    ("kills", "pauses", "drive"),
    # Stopping workers past their lease is what makes them try to commit under a lost lease:
    # those commits must be fenced out (a killed worker never writes again). Async workers
    # drive many runs at once (group commit) and start batches of their own (start_many).
    # The suite's share (kills every 0.2 s: ~4 s each; the seed differs each run, so CI runs
    # add up to many sessions); tests/bench/bench_torture.py runs the long ones (--kills 1000).
    [
        pytest.param(20, 0, "sync", id="kills"),
        pytest.param(10, 5, "sync", id="kills+stops"),
        pytest.param(14, 4, "async", id="async-kills+stops"),
    ],
)
def test_crash_torture(tmp_path, kills, pauses, drive):
    report = torture(
        tmp_path / "journal.db",
        runs=60,
        workers=4,
        kills=kills,
        pauses=pauses,
        seed=SEED,
        kill_interval=0.2,
        lease_ttl=1.0,
        timeout=600,
        drive=drive,
    )
    print(report.summary())
    context = f"replay with FSM_TORTURE_SEED={SEED}\n{report.summary()}"
    assert report.problems == [], context
    assert (report.kills, report.pauses) == (kills, pauses), context
    # A worker killed holding a run (inside its phase, or after it before the commit) leaves
    # a lease that only a takeover ends, and a phase that must run again under a later token.
    held = report.kills_mid_phase + report.kills_before_commit
    assert report.recoveries >= held, context
    assert report.re_executions >= held, context
    assert report.transitions > report.runs, context
    if drive == "async":
        assert report.worker_runs > 0, context


def test_a_lost_lease_does_not_abort_a_later_claim(tmp_path):
    """Found by the torture: a lease lost under the heartbeat once became a USER_ABORTED."""
    path = tmp_path / "journal.db"
    entered, first = threading.Event(), [True]

    def working(ctx):
        if first[0]:
            first[0] = False
            entered.set()
            deadline = time.monotonic() + 10
            while not ctx.cancelled and time.monotonic() < deadline:  # the heartbeat's notice
                time.sleep(0.005)
        return "DONE"

    spec = MachineSpec(
        "lost-lease",
        [State("working", handler="working"), State("done", terminal=True)],
        [Transition("working", "DONE", "done")],
    )
    with SqliteJournal(path) as journal, SqliteJournal(path) as other:
        engine = Engine(
            spec,
            handlers={"working": working},
            journal=journal,
            worker_id="A",
            heartbeat_interval=0.01,
        )
        run_id = engine.start()
        errors = []

        def first_attempt():
            try:
                engine.run(run_id)
            except LeaseLostError as exc:
                errors.append(exc)

        thread = threading.Thread(target=first_attempt)
        thread.start()
        assert entered.wait(10)
        stolen = other.claim(run_id, "B", ttl=30, take_over="A")
        thread.join(20)
        assert len(errors) == 1  # fenced out, as it must be
        other.release(run_id, "B", stolen.lease_token)  # B lets go without writing anything

        run = engine.run(run_id)  # A claims the run again, under a new token
        engine.close()
        assert (run.state, run.status) == ("done", RunLifecycle.SUCCEEDED), journal.transitions(
            run_id
        )[-1]


class TestExpectedPaths:
    """The driver knows each run's path from its input alone."""

    def test_decisions_follow_the_input(self):
        run_input = {"outcome": "canceled", "rebuilds": 2, "work_ms": dict.fromkeys(PHASES, 0)}
        assert [t[1] for t in expected_path(run_input)] == [
            "STARTED",
            "FETCHED",
            "BUILT",
            "REBUILD_REQUESTED",
            "BUILT",
            "REBUILD_REQUESTED",
            "BUILT",
            "TESTS_PASSED",
            "SIGNING_REFUSED",
        ]
        assert decide("testing", run_input, 6) == "TESTS_PASSED"

    @pytest.mark.parametrize(
        ("outcome", "end"),
        [("published", "published"), ("failed", "failed"), ("canceled", "canceled")],
    )
    def test_every_outcome_ends_in_its_terminal(self, outcome, end):
        run_input = {"outcome": outcome, "rebuilds": 1, "work_ms": dict.fromkeys(PHASES, 0)}
        path = expected_path(run_input)
        assert path[-1][2] == end
        assert SPEC.state(end).terminal


@pytest.fixture
def session(tmp_path):
    """Twelve runs run to their end in-process, with their executions recorded."""
    path = tmp_path / "journal.db"
    rng = random.Random(7)
    inputs = {}
    with SqliteJournal(path) as journal:
        recorder = Recorder(path)  # after the journal: it creates its table in the journal file
        engine = Engine(SPEC, handlers=recorder.handlers, journal=journal, lease_ttl=5.0)
        for index in range(12):
            run_input = make_input(rng)
            run_input["work_ms"] = dict.fromkeys(PHASES, 0)
            inputs[engine.start(run_input, run_id=f"r{index:02d}")] = run_input
        assert engine.work(exit_when_idle=True) == 12
        engine.close()
    recorder.close()
    conn = sqlite3.connect(path, isolation_level=None)
    yield path, inputs, conn
    conn.close()


def check(path, inputs, killed=()):
    report = Report(seed=0)
    with SqliteJournal(path) as journal:
        verify(journal, inputs, list(killed), report)
    return report


def first_execution(conn):
    return conn.execute(
        "SELECT id, run_id, state, visit_seq, lease_token, worker FROM executions ORDER BY id"
    ).fetchone()


class TestChecks:
    """Each check of the torture session catches the violation it is there for."""

    def test_a_clean_session_passes(self, session):
        path, inputs, _ = session
        report = check(path, inputs)
        assert report.problems == []
        assert report.runs == 0  # set by the driver, not by verify
        assert report.executions == report.transitions - len(inputs)
        assert (report.re_executions, report.fenced_out, report.stale_starts) == (0, 0, 0)

    def test_a_wrong_end_is_caught(self, session):
        path, inputs, _ = session
        run_id = next(r for r, i in inputs.items() if i["outcome"] == "published")
        inputs[run_id] = {**inputs[run_id], "outcome": "failed"}
        problems = check(path, inputs).problems
        assert any(f"run {run_id}: ended published" in p for p in problems), problems
        assert any(f"run {run_id}: journaled path" in p for p in problems), problems

    def test_a_phase_run_again_after_its_transition_is_caught(self, session):
        path, inputs, conn = session
        _, run_id, state, visit, token, worker = first_execution(conn)
        conn.execute(
            "INSERT INTO executions (run_id, state, visit_seq, lease_token, worker, pid,"
            " started_at, finished_at) VALUES (?, ?, ?, ?, ?, 0, 0, 1)",
            (run_id, state, visit, token + 1, worker),
        )
        problems = check(path, inputs).problems
        assert any("ran again after its transition was journaled" in p for p in problems)

    def test_a_journaled_result_without_its_execution_is_caught(self, session):
        path, inputs, conn = session
        row_id, run_id, state, *_ = first_execution(conn)
        conn.execute("UPDATE executions SET finished_at = NULL WHERE id = ?", (row_id,))
        problems = check(path, inputs).problems
        assert any(f"run {run_id} seq 1: 1 execution(s) of {state!r}" in p for p in problems)
        conn.execute("DELETE FROM executions WHERE id = ?", (row_id,))
        problems = check(path, inputs).problems
        assert any(f"run {run_id} seq 1: 0 execution(s) of {state!r}" in p for p in problems)

    def test_an_execution_of_a_visit_never_journaled_is_caught(self, session):
        path, inputs, conn = session
        _, run_id, state, _, token, worker = first_execution(conn)
        conn.execute(
            "INSERT INTO executions (run_id, state, visit_seq, lease_token, worker, pid,"
            " started_at) VALUES (?, ?, 99, ?, ?, 0, 0)",
            (run_id, state, token, worker),
        )
        problems = check(path, inputs).problems
        assert any("visits the journal never left" in p for p in problems), problems

    def test_two_processes_under_one_lease_token_are_caught(self, session):
        path, inputs, conn = session
        _, run_id, _, visit, token, _ = first_execution(conn)
        conn.execute(
            "INSERT INTO executions (run_id, state, visit_seq, lease_token, worker, pid,"
            " started_at, finished_at) VALUES (?, ?, ?, ?, 'another', 0, 0, 1)",
            (run_id, "building", visit + 1, token),
        )
        problems = check(path, inputs).problems
        assert any("lease tokens used by more than one worker" in p for p in problems)

    def test_lease_tokens_going_back_are_caught(self, session):
        path, inputs, conn = session
        run_id = next(iter(inputs))
        conn.execute(
            "UPDATE transitions SET lease_token = 99 WHERE run_id = ? AND seq = 1", (run_id,)
        )
        problems = check(path, inputs).problems
        assert any(f"run {run_id}: transition lease tokens go back" in p for p in problems)
        assert any(p.startswith("check_journal:") for p in problems), problems

    def test_earlier_executions_are_counted_and_kills_placed(self, session):
        path, inputs, conn = session
        _, run_id, state, visit, token, _ = first_execution(conn)
        for table in ("transitions", "run_rows"):
            conn.execute(
                f"UPDATE {table} SET lease_token = lease_token + 3 WHERE run_id = ?", (run_id,)
            )
        conn.execute(
            "UPDATE executions SET lease_token = lease_token + 3 WHERE run_id = ?", (run_id,)
        )
        fill_digests(conn)  # the journal as those workers would have written it (its digests)
        # The same visit ran under three earlier tokens: w1 was killed in the phase, w2 after
        # the phase returned but before its commit, and w3 (stopped, then continued) started
        # the phase after its transition was journaled and went on: its commit was refused.
        conn.executemany(
            "INSERT INTO executions (run_id, state, visit_seq, lease_token, worker, pid,"
            " started_at, finished_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?)",
            [
                (run_id, state, visit, token, "w1", 0, None),
                (run_id, state, visit, token + 1, "w2", 0, 1),
                (run_id, state, visit, token + 2, "w3", 4e9, 4e9 + 1),
            ],
        )
        report = check(path, inputs, killed=["w1", "w2", "w4"])
        assert report.problems == []
        assert report.re_executions == 3
        assert (report.kills_mid_phase, report.kills_before_commit) == (1, 1)
        assert report.kills_between_phases == 1  # w4 ran nothing
        assert report.fenced_out == 1  # w3; w2's lost result was its last act before the kill
        assert report.stale_starts == 1  # w3


@pytest.fixture
def batch_session(tmp_path):
    """Three runs the driver started and a batch of four a worker started, driven by ``arun``."""
    path = tmp_path / "journal.db"
    rng = random.Random(11)
    inputs = {}

    def quick(run_input):
        return {**run_input, "work_ms": dict.fromkeys(PHASES, 0)}

    with SqliteJournal(path) as journal:
        recorder = AsyncRecorder(path)
        engine = Engine(SPEC, handlers=recorder.handlers, journal=journal, worker_id="w/1")
        recorder.worker_id = engine.worker_id
        for index in range(3):
            inputs[engine.start(quick(make_input(rng)), run_id=f"r{index:02d}")] = None
        inputs = {run_id: journal.load(run_id).input for run_id in inputs}
        batch = [
            {**quick(make_input(rng)), "batch": "w#1", "of": 4, "index": index}
            for index in range(4)
        ]
        started = engine.start_many(batch, claim=True)
        recorder.record_batch("w#1", started, 0)

        async def drive():
            return await asyncio.gather(*(engine.arun(run_id) for run_id in [*inputs, *started]))

        assert all(run.ended for run in asyncio.run(drive()))
        engine.close()
    recorder.close()
    conn = sqlite3.connect(path, isolation_level=None)
    yield path, inputs, started, conn
    conn.close()


def forget_run(conn, run_id):
    """Delete a run and all it owns, as if it had never been started."""
    conn.execute(
        "DELETE FROM transitions WHERE run_key = (SELECT run_key FROM run_rows WHERE run_id = ?)",
        (run_id,),
    )
    for table in ("iterations", "run_rows", "executions"):
        conn.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))


class TestBatchChecks:
    """What the async drive adds to the checks: every run of the journal, batches whole."""

    def test_a_clean_async_session_passes(self, batch_session):
        path, inputs, started, conn = batch_session
        report = check(path, inputs)
        assert report.problems == []
        assert (report.worker_runs, report.batches, report.undriven) == (4, 1, 0)
        assert report.transitions - report.executions == len(inputs) + len(started)
        workers = conn.execute("SELECT DISTINCT worker FROM executions").fetchall()
        assert workers == [("w/1",)]

    def test_a_batch_stored_in_part_is_caught(self, batch_session):
        path, inputs, started, conn = batch_session
        forget_run(conn, started[2])
        problems = check(path, inputs).problems
        assert any("batch w#1: the journal holds indexes [0, 1, 3] of 4" in p for p in problems)
        assert any("batch w#1: start_many returned" in p for p in problems), problems

    def test_a_batch_whose_run_ids_differ_is_caught(self, batch_session):
        path, inputs, started, conn = batch_session
        conn.execute("UPDATE batches SET run_ids = ?", (json.dumps(started[::-1]),))
        problems = check(path, inputs).problems
        assert any("batch w#1: start_many returned" in p for p in problems), problems

    def test_a_run_nobody_started_is_caught(self, batch_session):
        path, inputs, started, conn = batch_session
        conn.execute(
            "UPDATE run_rows SET input = json_remove(input, '$.batch') WHERE run_id = ?",
            (started[0],),
        )
        problems = check(path, inputs).problems
        assert any(f"run {started[0]}: started by neither" in p for p in problems), problems

    def test_a_driver_run_missing_or_with_another_input_is_caught(self, batch_session):
        path, inputs, _, conn = batch_session
        conn.execute(
            "UPDATE run_rows SET input = json_set(input, '$.extra', 1) WHERE run_id = 'r01'"
        )
        problems = check(path, {**inputs, "r99": inputs["r00"]}).problems
        assert any(
            "run(s) the driver started are not in the journal: ['r99']" in p for p in problems
        )
        assert any("run r01: journaled input" in p for p in problems), problems

    def test_results_lost_to_a_kill_are_not_counted_as_fenced_out(self, batch_session):
        path, inputs, started, conn = batch_session
        # Two runs' first phases ran in killed worker k (its results waited for their group
        # commit) and again under the next token, whose results were journaled.
        for run_id in started[:2]:
            for table in ("transitions", "run_rows", "executions"):
                conn.execute(
                    f"UPDATE {table} SET lease_token = lease_token + 1 WHERE run_id = ?", (run_id,)
                )
            conn.execute(
                "INSERT INTO executions (run_id, state, visit_seq, lease_token, worker, pid,"
                " started_at, finished_at) VALUES (?, 'fetching', 0, 1, 'k/2', 0, 1, 2)",
                (run_id,),
            )
        fill_digests(conn)  # the journal as those workers would have written it (its digests)
        report = check(path, inputs, killed=["k"])
        assert report.problems == []
        assert report.re_executions == 2
        assert (report.fenced_out, report.kills_before_commit) == (0, 1)
        # The same results, their worker never killed: committed, and refused.
        assert check(path, inputs).fenced_out == 2
