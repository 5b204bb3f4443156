"""Leases with fencing on every journal, the engine's use of them (heartbeat, release, dead
holders, work, recover, dead-letter parking), and the CLI's `worker` and `recover`."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from fsm_runner import Engine, RunLifecycle, RunTerminalError, SqliteJournal
from fsm_runner.cli import EXIT_CONFLICT, cli
from fsm_runner.effects import MUTATE
from fsm_runner.exceptions import LeaseHeldError, LeaseLostError
from fsm_runner.records import EffectRecord, utc_now
from fsm_runner.replay import check_journal
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("a", "b", "c", name="leased")


def noop(_ctx):
    return NEXT


def engine_for(journal, **options) -> Engine:
    return Engine(SPEC, handlers={"a": noop, "b": noop, "c": noop}, journal=journal, **options)


class TestJournalLeases:
    """claim / renew / release / claim_next: the journal's side of the contract."""

    def test_claim_takes_a_free_run_and_raises_the_token(self, journal):
        run_id = engine_for(journal).start()
        first = journal.claim(run_id, "w1", ttl=60)
        assert (first.lease_owner, first.lease_token, first.recoveries) == ("w1", 1, 0)
        assert first.lease_expires_at > utc_now()
        again = journal.claim(run_id, "w1", ttl=60)  # the holder may claim again
        assert again.lease_token == 2
        assert journal.load(run_id) == again

    def test_a_live_lease_is_refused_naming_holder_and_expiry(self, journal):
        run_id = engine_for(journal).start()
        held = journal.claim(run_id, "w1", ttl=60)
        with pytest.raises(LeaseHeldError) as info:
            journal.claim(run_id, "w2", ttl=60)
        assert info.value.owner == "w1"
        assert info.value.expires_at.startswith(held.lease_expires_at.strftime("%Y-%m-%dT%H"))
        assert f"run {run_id}: lease held by w1 until" in str(info.value)
        assert journal.load(run_id) == held  # nothing changed

    def test_an_expired_lease_is_taken_over_and_counted(self, journal):
        run_id = engine_for(journal).start()
        journal.claim(run_id, "w1", ttl=-1)  # expired at once
        taken = journal.claim(run_id, "w2", ttl=60)
        assert (taken.lease_owner, taken.lease_token, taken.recoveries) == ("w2", 2, 1)
        assert journal.load(run_id) == taken  # what claim returns is what it stored

    def test_take_over_names_a_live_holder_known_dead(self, journal):
        run_id = engine_for(journal).start()
        journal.claim(run_id, "w1", ttl=60)
        taken = journal.claim(run_id, "w2", ttl=60, take_over="w1")
        assert (taken.lease_owner, taken.recoveries) == ("w2", 1)
        with pytest.raises(LeaseHeldError):
            journal.claim(run_id, "w3", ttl=60, take_over="w1")  # w1 no longer holds it

    def test_renew_and_release_need_the_current_token(self, journal):
        run_id = engine_for(journal).start()
        held = journal.claim(run_id, "w1", ttl=1)
        later = journal.renew(run_id, "w1", held.lease_token, ttl=600)
        assert later > utc_now() + dt.timedelta(seconds=500)
        with pytest.raises(LeaseLostError) as info:
            journal.renew(run_id, "w1", held.lease_token - 1, ttl=600)
        assert info.value.token == held.lease_token - 1
        assert journal.release(run_id, "w2", held.lease_token) is False
        assert journal.release(run_id, "w1", held.lease_token) is True
        freed = journal.load(run_id)
        assert (freed.lease_owner, freed.lease_expires_at, freed.lease_token) == (None, None, 1)

    def test_an_ended_run_cannot_be_claimed(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        engine.run(run_id)
        with pytest.raises(RunTerminalError):
            journal.claim(run_id, "w1", ttl=60)

    def test_a_commit_under_an_old_token_is_refused_and_writes_nothing(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        mine = journal.claim(run_id, "w1", ttl=-1)
        journal.claim(run_id, "w2", ttl=60)  # taken over
        from fsm_runner.records import utc_now
        from fsm_runner.rules.reducer import take

        transition, after = take(SPEC, mine, NEXT, "b", result=None, duration_ms=0.0, at=utc_now())
        assert transition.lease_token == mine.lease_token
        before = journal.transitions(run_id)
        with pytest.raises(LeaseLostError):
            journal.commit(after, transition)
        assert journal.transitions(run_id) == before
        assert journal.load(run_id).state == "a"

    def test_an_effect_under_an_old_token_is_refused(self, journal):
        run_id = engine_for(journal).start()
        mine = journal.claim(run_id, "w1", ttl=-1)
        journal.claim(run_id, "w2", ttl=60)
        record = EffectRecord(run_id=run_id, visit_seq=0, name="x", state="a", kind=MUTATE)
        with pytest.raises(LeaseLostError):
            journal.put_effect(record, run_seq=0, lease_token=mine.lease_token)
        assert journal.effects(run_id) == []

    def test_claim_next_takes_the_longest_waiting_runnable_run(self, journal):
        engine = engine_for(journal)
        first, second, third = engine.start(), engine.start(), engine.start()
        journal.claim(second, "w0", ttl=60)  # live: skipped
        engine.run(third)  # ended: skipped
        got = journal.claim_next("w1", ttl=60, machine="leased", states=["a", "b", "c"])
        assert got is not None
        assert (got.run_id, got.lease_owner) == (first, "w1")
        assert journal.claim_next("w1", ttl=60, machine="leased", states=["a", "b", "c"]) is None
        assert journal.claim_next("w1", ttl=60, machine="other", states=["a"]) is None

    def test_claim_next_filters_states_and_spec(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        assert journal.claim_next("w1", ttl=60, machine="leased", states=["b"]) is None
        assert (
            journal.claim_next("w1", ttl=60, machine="leased", states=["a"], spec_hash="x" * 64)
            is None
        )
        got = journal.claim_next(
            "w1", ttl=60, machine="leased", states=["a"], spec_hash=SPEC.spec_hash
        )
        assert got is not None
        assert got.run_id == run_id


class TestEngineLeases:
    """The engine claims, renews and releases; transitions carry its token."""

    def test_run_claims_and_releases(self, journal):
        seen = []
        engine = Engine(
            SPEC,
            handlers={
                "a": lambda ctx: seen.append(ctx.run.lease_owner) or NEXT,
                "b": noop,
                "c": noop,
            },
            journal=journal,
            worker_id="me",
        )
        run_id = engine.start()
        run = engine.run(run_id, max_steps=2)
        assert seen == ["me"]
        assert (run.lease_owner, run.lease_expires_at) == (None, None)
        assert journal.load(run_id) == run
        assert [t.lease_token for t in journal.transitions(run_id)] == [0, 1, 1]
        engine.run(run_id)
        assert [t.lease_token for t in journal.transitions(run_id)] == [0, 1, 1, 2]

    def test_resume_of_a_live_lease_names_the_holder(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        journal.claim(run_id, "elsewhere:1:abc", ttl=60)
        with pytest.raises(LeaseHeldError, match="lease held by elsewhere:1:abc until"):
            engine.resume(run_id)
        assert journal.load(run_id).seq == 0

    def test_resume_takes_over_an_expired_lease(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        journal.claim(run_id, "gone:1:abc", ttl=-1)
        run = engine.resume(run_id)
        assert (run.state, run.recoveries) == ("done", 1)

    def test_a_dead_holder_on_this_host_is_taken_over_at_once(self, journal):
        import socket

        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        engine = engine_for(journal)
        run_id = engine.start()
        journal.claim(run_id, f"{socket.gethostname()}:{dead.pid}:abc", ttl=600)
        run = engine.resume(run_id)
        assert (run.state, run.recoveries) == ("done", 1)

    def test_a_live_holder_on_this_host_is_not_taken_over(self, journal):
        import os
        import socket

        engine = engine_for(journal)
        run_id = engine.start()
        journal.claim(run_id, f"{socket.gethostname()}:{os.getppid()}:abc", ttl=600)
        with pytest.raises(LeaseHeldError):
            engine.resume(run_id)

    def test_the_heartbeat_renews_while_a_phase_runs(self, journal):
        expiries = []
        renewed = threading.Event()

        def slow(ctx):
            expiries.append(journal.load(ctx.run_id).lease_expires_at)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = journal.load(ctx.run_id).lease_expires_at
                if now > expiries[0]:
                    expiries.append(now)
                    renewed.set()
                    break
                time.sleep(0.005)
            return NEXT

        engine = Engine(
            SPEC,
            handlers={"a": slow, "b": noop, "c": noop},
            journal=journal,
            lease_ttl=60,
            heartbeat_interval=0.01,
        )
        run_id = engine.start()
        engine.run(run_id)
        engine.close()
        assert renewed.is_set()
        assert expiries[1] > expiries[0]

    def test_one_engine_does_not_run_a_run_twice_at_once(self, journal):
        refused = []

        def reentrant(ctx):
            with pytest.raises(LeaseHeldError) as info:
                engine.run(ctx.run_id)
            refused.append(info.value.owner)
            return NEXT

        engine = Engine(
            SPEC, handlers={"a": reentrant, "b": noop, "c": noop}, journal=journal, worker_id="me"
        )
        run_id = engine.start()
        assert engine.run(run_id).state == "done"
        assert refused == ["me"]


class TestWork:
    """Engine.work: workers sharing a journal claim runs one at a time."""

    def test_threads_share_a_journal_and_each_phase_runs_once(self, tmp_path):
        path = tmp_path / "journal.db"
        executions: list[tuple[str, str]] = []
        lock = threading.Lock()

        def record(ctx):
            with lock:
                executions.append((ctx.run_id, ctx.state))
            return NEXT

        setup = SqliteJournal(path)
        starter = Engine(SPEC, handlers={"a": record, "b": record, "c": record}, journal=setup)
        run_ids = [starter.start() for _ in range(60)]
        journals = [SqliteJournal(path) for _ in range(3)]
        workers = [
            Engine(SPEC, handlers={"a": record, "b": record, "c": record}, journal=j)
            for j in journals
        ]
        taken: list[int] = []
        threads = [
            threading.Thread(target=lambda w=w: taken.append(w.work(exit_when_idle=True)))
            for w in workers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sum(taken) == 60
        assert sorted(executions) == sorted((r, s) for r in run_ids for s in ("a", "b", "c"))
        assert all(setup.load(r).state == "done" for r in run_ids)
        assert check_journal(setup) == []
        for journal in [setup, *journals]:
            journal.close()
        for worker in workers:
            worker.close()

    def test_stop_and_max_runs(self, journal):
        engine = engine_for(journal)
        for _ in range(3):
            engine.start()
        assert engine.work(max_runs=2) == 2
        stop = threading.Event()
        stop.set()
        assert engine.work(stop=stop) == 0
        assert engine.work(exit_when_idle=True) == 1

    def test_a_run_failing_in_the_worker_backs_off_then_is_parked(self, journal):
        spec = linear_spec("a", name="poison")
        calls = []

        def poison(ctx):
            calls.append(ctx.run.recoveries)
            return "NO_SUCH_EVENT"  # no transition: the worker gives up on the run

        engine = Engine(
            spec, handlers={"a": poison}, journal=journal, lease_ttl=1e-6, max_recoveries=2
        )
        run_id = engine.start()
        for _ in range(4):  # its lease expires at once: each round is a takeover
            engine.work(max_runs=1, exit_when_idle=True)
        run = journal.load(run_id)
        assert calls == [0, 1, 2]
        assert (run.state, run.status, run.recoveries) == ("a", RunLifecycle.DEAD_LETTER, 3)
        last = journal.transitions(run_id)[-1]
        assert (last.event, last.from_state, last.to_state) == ("DEAD_LETTERED", "a", "a")
        assert "lost 3 times" in run.error["message"]
        assert check_journal(journal) == []
        with pytest.raises(RunTerminalError):
            engine.resume(run_id)
        assert engine.fork(run_id, at_seq=0).status is RunLifecycle.ACTIVE


class TestRecover:
    """Engine.recover: runs whose worker is gone."""

    def test_recovers_expired_leases_only(self, journal):
        engine = engine_for(journal)
        stale, live, free = engine.start(), engine.start(), engine.start()
        journal.claim(stale, "gone", ttl=-1)
        journal.claim(live, "alive", ttl=600)
        recovered = engine.recover()
        assert [(r.run_id, r.state, r.recoveries) for r in recovered] == [(stale, "done", 1)]
        assert journal.load(live).state == "a"
        assert journal.load(free).state == "a"

    def test_parks_a_run_lost_too_often(self, journal):
        engine = engine_for(journal, max_recoveries=1)
        run_id = engine.start()
        for owner in ("w1", "w2"):
            journal.claim(run_id, owner, ttl=-1)
        (parked,) = engine.recover()
        assert (parked.status, parked.recoveries, parked.lease_owner) == (
            RunLifecycle.DEAD_LETTER,
            2,
            None,
        )
        assert [r.run_id for r in journal.runs(status="dead_letter")] == [run_id]


APP = "tests.test_leases:make_engine"


def make_engine() -> Engine:
    return Engine(SPEC, handlers={"a": noop, "b": noop, "c": noop}, journal=SqliteJournal("x.db"))


class TestCli:
    """`worker`, `recover`, and `resume` of a held run."""

    @pytest.fixture(autouse=True)
    def in_tmp_path(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)

    def invoke(self, path, *args):
        return CliRunner().invoke(cli, ["--journal", str(path), *args], catch_exceptions=False)

    def test_worker_runs_everything_then_exits_when_idle(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            engine = engine_for(journal)
            ids = [engine.start() for _ in range(3)]
        result = self.invoke(path, "worker", "--app", APP, "--exit-when-idle")
        assert result.exit_code == 0, result.output
        assert "ran 3 runs" in result.output
        with SqliteJournal(path) as journal:
            assert {journal.load(r).state for r in ids} == {"done"}

    def test_recover_and_stale_listing(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run_id = engine_for(journal).start()
            journal.claim(run_id, "gone:1:x", ttl=-1)
        listed = json.loads(self.invoke(path, "runs", "--stale", "--json").output)
        assert [r["run_id"] for r in listed] == [run_id]
        result = self.invoke(path, "recover", "--app", APP)
        assert result.exit_code == 0, result.output
        assert f"run {run_id} has ended (succeeded) in state 'done'" in result.output
        assert "recovered 1 runs" in result.output

    def test_resume_of_a_held_run_is_a_conflict(self, tmp_path):
        path = tmp_path / "j.db"
        with SqliteJournal(path) as journal:
            run_id = engine_for(journal).start()
            journal.claim(run_id, "elsewhere:1:x", ttl=600)
        result = self.invoke(path, "resume", run_id, "--app", APP)
        assert result.exit_code == EXIT_CONFLICT
        lines = result.output.strip().splitlines()
        assert len(lines) == 1
        assert "lease held by elsewhere:1:x until" in lines[0]


def test_cli_lists_and_colours_dead_letter_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "j.db"
    with SqliteJournal(path) as journal:
        engine = engine_for(journal, max_recoveries=0)
        parked = engine.start()
        engine.start()
        journal.claim(parked, "gone:1:x", ttl=-1)
        engine.recover()
    result = CliRunner().invoke(
        cli, ["--journal", str(path), "runs", "--status", "dead_letter", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert [r["run_id"] for r in json.loads(result.output)] == [parked]
    watched = CliRunner().invoke(cli, ["--journal", str(path), "watch", parked])
    assert watched.exit_code == 1
    assert "DEAD_LETTERED" in watched.output
