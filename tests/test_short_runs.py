"""The per-run fixed cost of short runs (issue 20): what a run costs besides its steps.

A run this engine just started is claimed without a load, by one conditional UPDATE, and only
while the journal still holds it as written; anything else is claimed the usual way. The commit
that ends a run ends its lease too, so no release follows it. A run started with
``claim=True`` is stored holding the lease and written no claim at all; ``start_many`` stores a
batch in one transaction. On every journal."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from fsm_runner import (
    Engine,
    MachineSpec,
    RunEvent,
    RunLifecycle,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.engine import abort_run
from fsm_runner.engine.core import StepCore
from fsm_runner.engine.leases import LeaseKeeper
from fsm_runner.engine.sync_driver import SyncDriver
from fsm_runner.exceptions import LeaseHeldError, PayloadError, RunExistsError
from fsm_runner.journal._postgres_groups import BULK_STARTS
from fsm_runner.journal.base import Renewal
from fsm_runner.replay import verify
from tests.helpers import NEXT, Counting, linear_spec

ROOT = Path(__file__).resolve().parents[1]

SPEC = linear_spec("a", "b", "c", name="short")


def noop(_ctx):
    return NEXT


async def anoop(_ctx):
    return NEXT


def engine_for(journal, **options) -> Engine:
    return Engine(SPEC, handlers={"a": noop, "b": noop, "c": noop}, journal=journal, **options)


def parts_for(journal, **lease_options) -> tuple[StepCore, LeaseKeeper]:
    """An engine's step core and lease keeper, on their own: what this process holds, readable."""
    core = StepCore(SPEC, handlers={"a": noop, "b": noop, "c": noop}, journal=journal)
    return core, LeaseKeeper(core, core.held, **lease_options)


class TestStartedRunsClaim:
    """The first claim of a run this engine started: no load, one conditional UPDATE."""

    def test_a_started_run_is_claimed_without_a_load(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start()
        counting.calls.clear()
        ended = engine.run(run_id)
        assert ended.status is RunLifecycle.SUCCEEDED
        assert counting.calls[0] == "claim_unchanged"
        assert "load" not in counting.calls
        assert "claim" not in counting.calls
        stored = journal.load(run_id)
        assert (stored.lease_owner, stored.lease_expires_at, stored.lease_token) == (None, None, 1)

    def test_a_started_run_is_unleased_and_any_worker_may_claim_it_at_once(self, journal):
        run_id = engine_for(journal).start()
        assert journal.load(run_id).lease_owner is None
        other = engine_for(journal, worker_id="elsewhere")
        assert other.work(exit_when_idle=True) == 1
        assert journal.load(run_id).status is RunLifecycle.SUCCEEDED

    def test_a_run_claimed_elsewhere_since_is_claimed_the_usual_way(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start()
        # An owner of its own: on PostgreSQL a holder is alive while a session holds its
        # advisory lock, and another test's "elsewhere" (an engine not yet collected) held it,
        # then let it go mid-test: this run's holder read as gone and its run taken over.
        owner = f"elsewhere-{uuid.uuid4().hex[:8]}"
        journal.claim(run_id, owner, ttl=60)
        counting.calls.clear()
        with pytest.raises(LeaseHeldError):
            engine.run(run_id)
        assert counting.calls[:2] == ["claim_unchanged", "load"]
        journal.release(run_id, owner, 1)
        assert engine.run(run_id).status is RunLifecycle.SUCCEEDED  # token 2: a normal claim

    def test_a_run_advanced_elsewhere_since_goes_on_from_where_it_is(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        assert engine_for(journal, worker_id="elsewhere").run(run_id, max_steps=1).state == "b"
        ended = engine.run(run_id)
        assert (ended.status, ended.seq) == (RunLifecycle.SUCCEEDED, 3)

    def test_an_abort_requested_since_is_carried_out(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        journal.request_abort(run_id, "stop it")
        ended = engine.run(run_id)
        assert (ended.status, ended.seq) == (RunLifecycle.ABORTED, 1)

    def test_the_conditional_claim_refuses_a_changed_run(self, journal):
        run_id = engine_for(journal).start()
        started = journal.load(run_id)
        claimed = journal.claim_unchanged(started, "w1", ttl=60)
        assert (claimed.lease_owner, claimed.lease_token) == ("w1", 1)
        assert journal.load(run_id) == claimed
        assert journal.claim_unchanged(started, "w2", ttl=60) is None  # token and owner moved
        assert journal.load(run_id) == claimed  # nothing written

    def test_input_reads_as_json_like_a_loaded_run(self, journal):
        seen = []

        def a(ctx):
            seen.append(ctx.input)
            return NEXT

        engine = Engine(SPEC, handlers={"a": a, "b": noop, "c": noop}, journal=journal)
        given = {"items": (1, 2)}
        run_id = engine.start(given)
        engine.run(run_id)
        assert seen == [journal.load(run_id).input]  # SQL journals: {"items": [1, 2]}


class TestTheLastCommitEndsTheLease:
    """The commit that ends a run clears its lease: no release transaction after it."""

    def test_a_run_to_its_end_writes_no_release(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start()
        counting.calls.clear()
        assert engine.run(run_id).status is RunLifecycle.SUCCEEDED
        assert "release" not in counting.calls
        stored = journal.load(run_id)
        assert (stored.lease_owner, stored.lease_expires_at, stored.lease_token) == (None, None, 1)

    def test_a_run_that_stops_before_its_end_is_released(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start()
        assert engine.run(run_id, max_steps=1).state == "b"
        assert counting.calls[-1] == "release"
        assert journal.load(run_id).lease_owner is None
        assert engine_for(journal, worker_id="elsewhere").run(run_id).seq == 3

    def test_an_abort_carried_out_ends_the_lease(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        held = journal.claim(run_id, "w1", ttl=60)
        journal.request_abort(run_id, "stop")
        engine_for(journal, worker_id="w1").run(run_id)
        stored = journal.load(run_id)
        assert stored.status is RunLifecycle.ABORTED
        assert (stored.lease_owner, stored.lease_token) == (None, held.lease_token + 1)

    def test_an_abort_from_outside_that_ends_the_run_writes_no_release(self, journal):
        run_id = engine_for(journal).start()
        counting = Counting(journal)
        aborted = abort_run(counting, run_id, "operator", spec=SPEC)
        assert aborted.status is RunLifecycle.ABORTED
        assert "release" not in counting.calls
        assert journal.load(run_id).lease_owner is None

    def test_an_abort_that_leads_to_a_phase_releases_its_short_lease(self, journal):
        spec = MachineSpec(
            "cleanup",
            [State("a", handler="a"), State("cleaning", handler="a"), State("done", terminal=True)],
            [
                Transition("a", NEXT, "done"),
                Transition("a", RunEvent.USER_ABORTED, "cleaning"),
                Transition("cleaning", NEXT, "done"),
            ],
        )
        run_id = Engine(spec, handlers={"a": noop}, journal=journal).start()
        counting = Counting(journal)
        moved = abort_run(counting, run_id, "operator", spec=spec)
        assert (moved.state, moved.status) == ("cleaning", RunLifecycle.ACTIVE)
        assert counting.calls[-1] == "release"
        assert journal.load(run_id).lease_owner is None
        assert Engine(spec, handlers={"a": noop}, journal=journal).run(run_id).state == "done"

    def test_workers_leave_no_lease_on_the_runs_they_end(self, journal):
        engine = engine_for(journal)
        run_ids = [engine.start() for _ in range(3)]
        counting = Counting(journal)
        assert engine_for(counting, worker_id="w").work(exit_when_idle=True) == 3
        assert "release" not in counting.calls
        assert all(journal.load(r).lease_owner is None for r in run_ids)

    def test_a_heartbeat_after_the_last_commit_reports_no_lost_lease(self, journal, caplog):
        run_id = engine_for(journal).start()
        core, keeper = parts_for(journal, worker_id="w")
        claimed = journal.claim(run_id, "w", ttl=60)
        keeper.hold(claimed)
        journal.request_abort(run_id, "stop")
        # the run ends (aborted) by a commit under the lease the heartbeat renews
        after = SyncDriver(core, keeper, sleep=time.sleep).drive(claimed, None)
        assert after.ended
        keeper.renew(run_id, claimed.lease_token)
        assert "taken over" not in caplog.text
        keeper.let_go(run_id, ended=True)
        keeper.stop()


class TestStartedHolding:
    """``start(claim=True)``: the run is stored holding this engine's lease; its first drive
    here writes no claim. Nobody else takes it meanwhile; close() lets go of it."""

    def test_the_run_is_stored_holding_the_lease_and_driven_without_a_claim(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start(claim=True)
        stored = journal.load(run_id)
        assert (stored.lease_owner, stored.lease_token) == (engine.worker_id, 1)
        assert stored.lease_expires_at is not None
        counting.calls.clear()
        ended = engine.run(run_id)
        assert (ended.status, ended.seq) == (RunLifecycle.SUCCEEDED, 3)
        assert counting.calls == ["commit", "commit", "commit"]  # no claim, load or release
        stored = journal.load(run_id)
        assert (stored.lease_owner, stored.lease_expires_at, stored.lease_token) == (None, None, 1)
        assert verify(SPEC, stored, journal.transitions(run_id)) == []
        engine.close()

    def test_no_other_worker_takes_it_while_held(self, journal):
        engine = engine_for(journal)
        run_id = engine.start(claim=True)
        other = engine_for(journal, worker_id="elsewhere")
        with pytest.raises(LeaseHeldError):
            other.run(run_id)
        assert other.work(exit_when_idle=True) == 0
        assert engine.run(run_id).status is RunLifecycle.SUCCEEDED
        engine.close()

    def test_one_engine_drives_it_in_one_place_at_a_time(self, journal):
        entered, release = threading.Event(), threading.Event()

        def waiting(_ctx):
            entered.set()
            release.wait(10)
            return NEXT

        engine = Engine(SPEC, handlers={"a": waiting, "b": noop, "c": noop}, journal=journal)
        run_id = engine.start(claim=True)
        first = threading.Thread(target=engine.run, args=(run_id,))
        first.start()  # drives it in another thread, first
        assert entered.wait(10)
        with pytest.raises(LeaseHeldError):
            engine.run(run_id)
        release.set()
        first.join()
        assert journal.load(run_id).status is RunLifecycle.SUCCEEDED
        engine.close()

    def test_close_lets_go_of_runs_never_driven(self, journal):
        engine = engine_for(journal)
        run_ids = [engine.start(claim=True) for _ in range(2)]
        engine.close()
        assert all(journal.load(r).lease_owner is None for r in run_ids)
        assert engine_for(journal, worker_id="elsewhere").work(exit_when_idle=True) == 2

    def test_an_abort_here_is_carried_out_at_once(self, journal):
        engine = engine_for(journal)
        run_id = engine.start(claim=True)
        aborted = engine.abort(run_id, "not needed")
        assert (aborted.status, aborted.state, aborted.lease_owner) == (
            RunLifecycle.ABORTED,
            "canceled",
            None,
        )
        assert journal.load(run_id).status is RunLifecycle.ABORTED
        engine.close()

    def test_an_abort_from_elsewhere_is_carried_out_when_driven(self, journal):
        engine = engine_for(journal)
        run_id = engine.start(claim=True)
        requested = abort_run(journal, run_id, "operator")  # the holder's to carry out
        assert requested.lease_owner == engine.worker_id
        ended = engine.run(run_id)
        assert (ended.status, ended.state) == (RunLifecycle.ABORTED, "canceled")
        engine.close()

    def test_an_abort_from_elsewhere_is_carried_out_by_close(self, journal):
        engine = engine_for(journal)
        run_id = engine.start(claim=True)
        abort_run(journal, run_id, "operator")
        engine.close()  # never driven: close carries the abort out rather than leave it asked
        stored = journal.load(run_id)
        assert (stored.status, stored.state, stored.lease_owner) == (
            RunLifecycle.ABORTED,
            "canceled",
            None,
        )

    def test_a_run_held_by_a_killed_process_is_taken_over(self, tmp_path):
        path = tmp_path / "journal.db"
        code = (
            "import os, signal, sys\n"
            "from fsm_runner import Engine, SqliteJournal\n"
            "from tests.test_short_runs import SPEC, noop\n"
            f"engine = Engine(SPEC, handlers={{'a': noop, 'b': noop, 'c': noop}},"
            f" journal=SqliteJournal({str(path)!r}), lease_ttl=600)\n"
            "print(engine.start(claim=True), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
        )
        assert done.returncode == -signal.SIGKILL
        run_id = done.stdout.strip()
        with SqliteJournal(path) as journal:
            assert journal.load(run_id).lease_owner is not None  # held by the dead process
            recovered = engine_for(journal).run(run_id)  # its holder is gone: taken over
            assert (recovered.status, recovered.seq) == (RunLifecycle.SUCCEEDED, 3)


class TestStartMany:
    """``start_many``: one journal transaction for a batch of runs; all are stored, or none."""

    def test_runs_are_stored_in_order_with_their_inputs(self, journal):
        engine = engine_for(journal)
        run_ids = engine.start_many([{"n": n} for n in range(5)])
        assert [journal.load(r).input for r in run_ids] == [{"n": n} for n in range(5)]
        assert all(journal.load(r).lease_owner is None for r in run_ids)
        assert engine.work(exit_when_idle=True) == 5
        engine.close()

    def test_held_runs_are_driven_at_once_without_claims(self, journal):
        counting = Counting(journal)
        engine = Engine(SPEC, handlers={"a": anoop, "b": anoop, "c": anoop}, journal=counting)
        run_ids = engine.start_many(range(20), claim=True)
        assert counting.calls == ["create_runs"]

        async def drive():
            return await asyncio.gather(*(engine.arun(r) for r in run_ids))

        ended = asyncio.run(drive())
        assert {(run.status, run.seq) for run in ended} == {(RunLifecycle.SUCCEEDED, 3)}
        assert not {"claim", "claim_many", "claim_unchanged", "load", "release"} & set(
            counting.calls
        )
        for run_id in run_ids[::7]:
            assert verify(SPEC, journal.load(run_id), journal.transitions(run_id)) == []
        engine.close()

    def test_a_bad_input_stores_none_of_them(self, journal):
        engine = engine_for(journal)
        with pytest.raises(PayloadError):
            engine.start_many([1, 2, float("nan"), 4])
        assert list(journal.runs()) == []

    def test_an_existing_id_refuses_the_whole_batch(self, journal):
        core, _ = parts_for(journal)
        runs = [core.new_run(n, f"run-{n}", None, None, None) for n in range(3)]
        journal.create_run(*runs[1][:2], spec_json=SPEC.to_json())
        with pytest.raises(RunExistsError) as raised:
            journal.create_runs(runs, spec_json=SPEC.to_json())
        assert raised.value.run_id == "run-1"
        assert [run.run_id for run in journal.runs()] == ["run-1"]

    def test_a_large_batch_reads_back_as_written(self, journal):
        """More runs than PostgreSQL's BULK_STARTS: its one statement of arrays, NULLs too."""
        core, _ = parts_for(journal)
        lease = ("w", dt.timedelta(seconds=30))
        batch = [
            core.new_run(
                {"n": n} if n % 3 else None,
                f"big-{n}",
                {"k": n} if n % 5 == 0 else None,
                "parent" if n % 7 == 0 else None,
                lease if n % 2 else None,
            )
            for n in range(BULK_STARTS + 50)
        ]
        journal.create_runs(batch, spec_json=SPEC.to_json())
        for run, first, _ in batch[::7]:
            assert journal.load(run.run_id) == run
            assert journal.transitions(run.run_id) == [first]
        assert len(list(journal.runs())) == len(batch)
        assert journal.integrity_problems() == []

    def test_an_existing_id_refuses_a_large_batch(self, journal):
        core, _ = parts_for(journal)
        runs = [core.new_run(n, f"run-{n}", None, None, None) for n in range(BULK_STARTS + 50)]
        journal.create_run(*runs[120][:2], spec_json=SPEC.to_json())
        with pytest.raises(RunExistsError) as raised:
            journal.create_runs(runs, spec_json=SPEC.to_json())
        assert raised.value.run_id == "run-120"
        assert [run.run_id for run in journal.runs()] == ["run-120"]

    def test_runs_under_two_specs_are_refused(self, journal):
        other = linear_spec("x", name="other")
        batch = [
            parts_for(journal)[0].new_run(None, None, None, None, None),
            StepCore(other, handlers={"x": noop}, journal=journal).new_run(
                None, None, None, None, None
            ),
        ]
        with pytest.raises(ValueError, match="one spec"):
            journal.create_runs(batch, spec_json=SPEC.to_json())
        assert list(journal.runs()) == []

    def test_a_journal_without_create_runs_stores_them_one_by_one(self, journal):
        class Plain(Counting):
            def __getattr__(self, name):
                if name == "create_runs":
                    raise AttributeError(name)
                return super().__getattr__(name)

        plain = Plain(journal)
        run_ids = engine_for(plain).start_many(["x", "y"])
        assert plain.calls == ["create_run", "create_run"]
        assert [journal.load(r).input for r in run_ids] == ["x", "y"]


def held_by_w(journal, count, *, ttl):
    """``count`` runs whose leases worker ``w`` took: the 2nd then taken over by ``other``
    (token 2), an abort asked of the 3rd. Their ids, and the rows as ``w`` claimed them."""
    engine = engine_for(journal)
    run_ids = [engine.start() for _ in range(count)]
    held = [journal.claim(run_id, "w", ttl=ttl) for run_id in run_ids]
    journal.release(run_ids[1], "w", 1)
    journal.claim(run_ids[1], "other", ttl=60)
    journal.request_abort(run_ids[2], "stop it")
    return run_ids, held


class TestRenewMany:
    """The heartbeat renews every lease an engine holds in one transaction (``renew_many``),
    reading in it what it passes on: a lease taken over, an abort requested, a run ended."""

    def test_every_lease_is_renewed_and_reported(self, journal):
        run_ids, held = held_by_w(journal, 4, ttl=5)
        engine_for(journal, worker_id="w").run(run_ids[3])  # ended by the holder: lease cleared
        found = journal.renew_many(
            [(r.run_id, r.lease_token) for r in held] + [("no-such-run", 1)], "w", ttl=600
        )
        assert found[run_ids[0]] == Renewal(renewed=True)
        assert found[run_ids[1]] == Renewal(renewed=False)
        assert found[run_ids[2]] == Renewal(renewed=True, abort_reason="stop it")
        assert found[run_ids[3]] == Renewal(renewed=False, ended=True)
        assert found["no-such-run"] == Renewal(renewed=False)
        renewed = journal.load(run_ids[0]).lease_expires_at
        assert renewed > held[0].lease_expires_at + dt.timedelta(seconds=500)
        taken = journal.load(run_ids[1])
        assert (taken.lease_owner, taken.lease_token) == ("other", 2)  # left as it was

    def test_hundreds_of_leases_in_one_call(self, journal):
        engine = engine_for(journal)
        run_ids = engine.start_many([None] * 1200)
        leases = [(journal.claim(r, "w", ttl=5).run_id, 1) for r in run_ids]
        found = journal.renew_many(leases, "w", ttl=600)
        assert len(found) == 1200
        assert all(renewal.renewed for renewal in found.values())

    def test_the_heartbeat_renews_all_held_leases_in_one_call(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting, heartbeat_interval=0.02)
        run_ids = engine.start_many([None] * 3, claim=True)
        journal.request_abort(run_ids[0], "from elsewhere")
        # two beats more: at least one began after the request
        after = counting.calls.count("renew_many") + 2
        deadline = time.monotonic() + 10
        while counting.calls.count("renew_many") < after and time.monotonic() < deadline:
            time.sleep(0.01)
        beats = [call for call in counting.calls if call != "create_runs"]
        assert beats
        assert set(beats) == {"renew_many"}  # no renew or load run by run
        engine.close()  # carries the abort out: the run was never driven
        assert journal.load(run_ids[0]).status is RunLifecycle.ABORTED
        assert journal.load(run_ids[1]).lease_owner is None

    def test_the_heartbeat_passes_on_an_abort_requested_elsewhere(self, journal):
        run_ids = engine_for(journal).start_many([None] * 3)
        core, keeper = parts_for(Counting(journal), worker_id="w", heartbeat_interval=0.02)
        for run_id in run_ids:
            keeper.hold(journal.claim(run_id, "w", ttl=60))
        journal.request_abort(run_ids[0], "from elsewhere")
        deadline = time.monotonic() + 10
        while run_ids[0] not in core.held.aborts and time.monotonic() < deadline:
            time.sleep(0.01)
        keeper.stop()
        assert core.held.aborts == {run_ids[0]: "from elsewhere"}  # for its next step here
        assert set(core.journal.calls) == {"renew_many"}  # no renew or load run by run


class TestReleaseMany:
    """``close()`` lets go of the runs it started holding and never drove in one transaction
    (``release_many``), reading in it which of them an abort was asked of."""

    def test_only_the_owners_own_leases_are_given_up(self, journal):
        run_ids, held = held_by_w(journal, 3, ttl=60)
        found = journal.release_many(
            [(r.run_id, r.lease_token) for r in held] + [("no-such-run", 1)], "w"
        )
        assert found == {
            run_ids[0]: None,
            run_ids[1]: None,
            run_ids[2]: "stop it",
            "no-such-run": None,
        }
        assert journal.load(run_ids[0]).lease_owner is None
        assert journal.load(run_ids[2]).lease_owner is None
        taken = journal.load(run_ids[1])
        assert (taken.lease_owner, taken.lease_token) == ("other", 2)  # left as it was

    def test_close_lets_go_of_hundreds_in_one_call(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_ids = engine.start_many([None] * 1200, claim=True)
        abort_run(journal, run_ids[7], "operator")
        abort_run(journal, run_ids[1100], "operator")
        counting.calls.clear()
        engine.close()
        assert counting.calls.count("release_many") == 1
        assert "release" not in counting.calls
        assert "load" not in counting.calls[: counting.calls.index("release_many") + 1]
        runs = {run_id: journal.load(run_id) for run_id in run_ids}
        assert all(run.lease_owner is None for run in runs.values())
        aborted = {run_id for run_id, run in runs.items() if run.status is RunLifecycle.ABORTED}
        assert aborted == {run_ids[7], run_ids[1100]}  # carried out, the rest left for workers
        left = [run_id for run_id in run_ids if run_id not in aborted]
        assert all(runs[run_id].status is RunLifecycle.ACTIVE for run_id in left)
        # ... which another worker takes (a few of them: each of the 1,198 is as claimable)
        assert engine_for(journal, worker_id="elsewhere").work(max_runs=3, exit_when_idle=True) == 3

    def test_a_journal_without_it_is_let_go_of_run_by_run(self, tmp_path):
        class NoBatch(SqliteJournal):
            release_many = None  # as a journal that does not offer it

        journal = NoBatch(tmp_path / "j.db")
        engine = engine_for(journal)
        run_ids = engine.start_many([None] * 3, claim=True)
        abort_run(journal, run_ids[0], "operator")
        engine.close()
        assert journal.load(run_ids[0]).status is RunLifecycle.ABORTED
        assert all(journal.load(r).lease_owner is None for r in run_ids)
        journal.close()
