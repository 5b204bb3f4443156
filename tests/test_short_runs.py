"""The per-run fixed cost of short runs (issue 20): what a run costs besides its steps.

A run this engine just started is claimed without a load, by one conditional UPDATE, and only
while the journal still holds it as written; anything else is claimed the usual way. The commit
that ends a run ends its lease too, so no release follows it. On every journal."""

from __future__ import annotations

import pytest

from fsm_runner import Engine, RunOutcome
from fsm_runner.exceptions import LeaseHeldError
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("a", "b", "c", name="short")


def noop(_ctx):
    return NEXT


class Counting:
    """A journal wrapper counting the calls the engine makes to it, by name."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if callable(value):

            def counted(*args, **kwargs):
                self.calls.append(name)
                return value(*args, **kwargs)

            return counted
        return value


def engine_for(journal, **options) -> Engine:
    return Engine(SPEC, handlers={"a": noop, "b": noop, "c": noop}, journal=journal, **options)


class TestStartedRunsClaim:
    """The first claim of a run this engine started: no load, one conditional UPDATE."""

    def test_a_started_run_is_claimed_without_a_load(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start()
        counting.calls.clear()
        ended = engine.run(run_id)
        assert ended.status is RunOutcome.SUCCEEDED
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
        assert journal.load(run_id).status is RunOutcome.SUCCEEDED

    def test_a_run_claimed_elsewhere_since_is_claimed_the_usual_way(self, journal):
        counting = Counting(journal)
        engine = engine_for(counting)
        run_id = engine.start()
        journal.claim(run_id, "elsewhere", ttl=60)
        counting.calls.clear()
        with pytest.raises(LeaseHeldError):
            engine.run(run_id)
        assert counting.calls[:2] == ["claim_unchanged", "load"]
        journal.release(run_id, "elsewhere", 1)
        assert engine.run(run_id).status is RunOutcome.SUCCEEDED  # token 2: a normal claim

    def test_a_run_advanced_elsewhere_since_goes_on_from_where_it_is(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        assert engine_for(journal, worker_id="elsewhere").run(run_id, max_steps=1).state == "b"
        ended = engine.run(run_id)
        assert (ended.status, ended.seq) == (RunOutcome.SUCCEEDED, 3)

    def test_an_abort_requested_since_is_carried_out(self, journal):
        engine = engine_for(journal)
        run_id = engine.start()
        journal.request_abort(run_id, "stop it")
        ended = engine.run(run_id)
        assert (ended.status, ended.seq) == (RunOutcome.ABORTED, 1)

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
        assert engine.run(run_id).status is RunOutcome.SUCCEEDED
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
        assert stored.status is RunOutcome.ABORTED
        assert (stored.lease_owner, stored.lease_token) == (None, held.lease_token + 1)

    def test_workers_leave_no_lease_on_the_runs_they_end(self, journal):
        engine = engine_for(journal)
        run_ids = [engine.start() for _ in range(3)]
        counting = Counting(journal)
        assert engine_for(counting, worker_id="w").work(exit_when_idle=True) == 3
        assert "release" not in counting.calls
        assert all(journal.load(r).lease_owner is None for r in run_ids)

    def test_a_heartbeat_after_the_last_commit_reports_no_lost_lease(self, journal, caplog):
        engine = engine_for(journal)
        run_id = engine.start()
        claimed = journal.claim(run_id, engine.worker_id, ttl=60)
        engine._leases.hold(claimed)
        journal.request_abort(run_id, "stop")
        # the run ends (aborted) by a commit under the lease the heartbeat renews
        after = engine_for(journal, worker_id=engine.worker_id)._drive(claimed, None)
        assert after.ended
        engine._leases._renew(run_id, claimed.lease_token)
        assert "taken over" not in caplog.text
        engine._leases.let_go(run_id, ended=True)
        engine.close()
