"""Durable waits on PostgreSQL (issue 29): wake times, the signal mailbox, claims of due runs.

The journal's side of the contract (``Journal.park``, ``put_signal``, ``signals``,
``consume_signal``, ``wake_time``, ``next_wake``, and ``claim_next`` offering due runs), on a
real server: each test gets a journal of its own (``tests/conftest.py``). Times that decide
what is due are either long past (``T0``, 2024) or far ahead (2999), never a race with the
clock.
"""

from __future__ import annotations

import datetime as dt
import threading

import attrs
import pytest

from fsm_runner import PostgresJournal, RunLifecycle
from fsm_runner.exceptions import (
    JournalError,
    LeaseLostError,
    RunConflictError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.records import SignalRecord, SignalStatus
from tests.test_postgres_journal import SPEC, T0, next_step, table_rows
from tests.test_postgres_scale import FAR_AHEAD, HANDLED, claim, end, start

APPROVED = "APPROVED"
REJECTED = "REJECTED"
SOON = T0 - dt.timedelta(days=1)  # a wake time long past: due


@pytest.fixture
def admin(postgres_server):
    """A connection of the test's own, beside the journal's."""
    return postgres_server.admin


def signal(run_id: str, name: str = APPROVED, payload=None, signal_id=None) -> SignalRecord:
    return SignalRecord(run_id, 0, name, payload, signal_id)


def signal_rows(admin, journal) -> list[tuple]:
    return table_rows(
        admin,
        journal.schema,
        "SELECT number, run_id, name, payload, signal_id, consumed_seq FROM signals"
        " ORDER BY number",
    )


def server_now(admin) -> dt.datetime:
    return admin.execute("SELECT clock_timestamp()").fetchone()[0]


def parked(journal, run_id: str, *, state: str = "waiting", wake_at, created: float = 0):
    """A run in ``state``, claimed and parked until ``wake_at`` (accepting ``APPROVED``)."""
    start(journal, run_id, state=state, created=created)
    held = journal.claim(run_id, "w0", ttl=60)
    assert journal.park(run_id, "w0", held.lease_token, wake_at=wake_at, accepts={APPROVED})
    return journal.load(run_id)


class TestPutSignal:
    """Signals are journaled in arrival order, once per signal id, never to an ended run."""

    def test_signals_are_numbered_in_arrival_order(self, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        start(postgres_journal, "other", state="waiting")
        payloads = [{"a": [1, 2.5, "x"], "b": None}, None, "text", {}]
        stored = [
            postgres_journal.put_signal(signal("r", APPROVED if n % 2 else REJECTED, payload))
            for n, payload in enumerate(payloads)
        ]
        postgres_journal.put_signal(signal("other"))
        numbers = [record.number for record in stored]
        assert numbers == sorted(numbers)
        assert len(set(numbers)) == 4
        assert [record.payload for record in stored] == payloads
        assert all(record.status is SignalStatus.PENDING for record in stored)
        assert all(record.received_at.tzinfo is not None for record in stored)
        assert [r.received_at for r in stored] == sorted(r.received_at for r in stored)
        assert postgres_journal.signals("r") == stored
        assert [s.name for s in postgres_journal.signals("r")] == [
            REJECTED,
            APPROVED,
            REJECTED,
            APPROVED,
        ]

    def test_a_signal_makes_its_run_due_at_once(self, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        assert postgres_journal.wake_time("r") is None
        stored = postgres_journal.put_signal(signal("r"))
        assert postgres_journal.wake_time("r") == stored.received_at

    def test_a_held_run_is_due_once_released(self, postgres_journal):
        # A signal while a worker holds the run: due, but not claimable until released.
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        postgres_journal.put_signal(signal("r"))
        assert claim(postgres_journal, "w1") is None
        assert postgres_journal.release("r", "w0", held.lease_token)
        taken = claim(postgres_journal, "w1")
        assert (taken.run_id, taken.lease_owner) == ("r", "w1")

    def test_a_repeated_signal_id_returns_the_first(self, postgres_journal, admin):
        start(postgres_journal, "r", state="waiting")
        start(postgres_journal, "s", state="waiting")
        first = postgres_journal.put_signal(signal("r", payload=1, signal_id="hook-1"))
        wake = postgres_journal.wake_time("r")
        again = postgres_journal.put_signal(signal("r", REJECTED, payload=2, signal_id="hook-1"))
        assert again == first
        assert postgres_journal.wake_time("r") == wake
        elsewhere = postgres_journal.put_signal(signal("s", signal_id="hook-1"))  # per run
        assert [row[0] for row in signal_rows(admin, postgres_journal)] == [
            first.number,
            elsewhere.number,
        ]

    def test_a_repeated_signal_id_after_the_end_returns_it_expired(self, postgres_journal, admin):
        start(postgres_journal, "r")
        first = postgres_journal.put_signal(signal("r", signal_id="hook-1"))
        end(postgres_journal, "r")
        again = postgres_journal.put_signal(signal("r", signal_id="hook-1"))
        assert again == attrs.evolve(first, status=SignalStatus.EXPIRED)
        assert len(signal_rows(admin, postgres_journal)) == 1

    def test_a_consumed_signal_id_returns_it_consumed(self, postgres_journal):
        run = start(postgres_journal, "r")
        first = postgres_journal.put_signal(signal("r", signal_id="hook-1"))
        after, transition = next_step(run, "verifying")
        postgres_journal.consume_signal(after, transition, first.number)
        again = postgres_journal.put_signal(signal("r", signal_id="hook-1"))
        assert (again.number, again.status, again.consumed_seq) == (
            first.number,
            SignalStatus.CONSUMED,
            1,
        )

    def test_a_signal_to_an_ended_run_is_refused(self, postgres_journal, admin):
        start(postgres_journal, "r")
        ended = end(postgres_journal, "r")
        with pytest.raises(RunTerminalError) as info:
            postgres_journal.put_signal(signal("r", signal_id="late"))
        assert (info.value.run_id, info.value.state) == ("r", "done")
        assert signal_rows(admin, postgres_journal) == []
        assert postgres_journal.wake_time("r") is None
        assert postgres_journal.load("r") == ended

    def test_a_signal_to_an_unknown_run_is_refused(self, postgres_journal, admin):
        with pytest.raises(RunNotFoundError):
            postgres_journal.put_signal(signal("nobody"))
        with pytest.raises(RunNotFoundError):
            postgres_journal.wake_time("nobody")
        assert signal_rows(admin, postgres_journal) == []

    @pytest.mark.parametrize("payload", [float("nan"), {"x": object()}, "\ud800"])
    def test_a_payload_that_is_not_json_is_refused(self, postgres_journal, admin, payload):
        start(postgres_journal, "r", state="waiting")
        with pytest.raises(JournalError, match="nothing was written"):
            postgres_journal.put_signal(signal("r", payload=payload))
        assert signal_rows(admin, postgres_journal) == []
        assert postgres_journal.wake_time("r") is None

    def test_the_payload_is_stored_as_the_sqlite_journal_stores_it(self, postgres_journal, admin):
        start(postgres_journal, "r", state="waiting")
        postgres_journal.put_signal(signal("r", payload={"b": 1, "a": [True, None]}))
        assert signal_rows(admin, postgres_journal)[0][3] == '{"b":1,"a":[true,null]}'


class TestSignals:
    """A run's mailbox as it stands: pending, consumed, expired."""

    def test_pending_only(self, postgres_journal):
        run = start(postgres_journal, "r")
        first = postgres_journal.put_signal(signal("r"))
        second = postgres_journal.put_signal(signal("r", REJECTED))
        after, transition = next_step(run, "verifying")
        postgres_journal.consume_signal(after, transition, first.number)
        assert postgres_journal.signals("r", pending=True) == [second]
        assert [s.status for s in postgres_journal.signals("r")] == [
            SignalStatus.CONSUMED,
            SignalStatus.PENDING,
        ]

    def test_a_pending_signal_of_an_ended_run_is_expired(self, postgres_journal):
        start(postgres_journal, "r")
        stored = postgres_journal.put_signal(signal("r"))
        end(postgres_journal, "r")
        assert postgres_journal.signals("r") == [attrs.evolve(stored, status=SignalStatus.EXPIRED)]
        assert postgres_journal.signals("r", pending=True) == []

    def test_runs_without_signals(self, postgres_journal):
        start(postgres_journal, "r")
        assert postgres_journal.signals("r") == []
        assert postgres_journal.signals("r", pending=True) == []
        assert postgres_journal.signals("nobody") == []


class TestConsumeSignal:
    """The commit and the signal's consumption are one transaction, or nothing."""

    def test_a_signal_is_consumed_by_the_transition(self, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        stored = postgres_journal.put_signal(signal("r", payload={"ok": True}))
        after, transition = next_step(held, "building")
        transition = attrs.evolve(
            transition, event=APPROVED, result={"output": {"ok": True}, "signal": stored.number}
        )
        postgres_journal.consume_signal(after, transition, stored.number)
        assert postgres_journal.load("r").seq == 1
        assert postgres_journal.transitions("r")[-1] == transition
        [consumed] = postgres_journal.signals("r")
        assert consumed == attrs.evolve(
            stored,
            status=SignalStatus.CONSUMED,
            consumed_seq=transition.seq,
            consumed_at=transition.at,
        )

    def test_a_signal_is_consumed_once(self, postgres_journal, admin):
        run = start(postgres_journal, "r")
        stored = postgres_journal.put_signal(signal("r"))
        after, transition = next_step(run, "verifying")
        postgres_journal.consume_signal(after, transition, stored.number)
        again = next_step(after, "building")
        with pytest.raises(RunConflictError):
            postgres_journal.consume_signal(*again, stored.number)
        assert postgres_journal.load("r") == postgres_journal.load("r")
        assert postgres_journal.load("r").seq == 1  # no transition either
        assert [t.seq for t in postgres_journal.transitions("r")] == [0, 1]
        assert signal_rows(admin, postgres_journal)[0][5] == 1

    def test_another_runs_signal_is_refused(self, postgres_journal):
        run = start(postgres_journal, "r")
        start(postgres_journal, "s")
        theirs = postgres_journal.put_signal(signal("s"))
        with pytest.raises(RunConflictError):
            postgres_journal.consume_signal(*next_step(run, "verifying"), theirs.number)
        assert postgres_journal.load("r").seq == 0
        assert postgres_journal.signals("s") == [theirs]

    def test_a_refused_commit_leaves_the_signal_pending(self, postgres_journal):
        start(postgres_journal, "r")
        held = postgres_journal.claim("r", "w0", ttl=60)
        stored = postgres_journal.put_signal(signal("r"))
        stale = attrs.evolve(held, lease_token=held.lease_token - 1)
        with pytest.raises(LeaseLostError):
            postgres_journal.consume_signal(*next_step(stale, "verifying"), stored.number)
        with pytest.raises(RunConflictError):  # a seq the run is not at
            postgres_journal.consume_signal(
                *next_step(attrs.evolve(held, seq=5), "verifying"), stored.number
            )
        assert postgres_journal.signals("r", pending=True) == [stored]
        assert postgres_journal.load("r").seq == 0

    def test_the_consuming_commit_that_ends_the_run_clears_its_wake_time(self, postgres_journal):
        run = start(postgres_journal, "r")
        stored = postgres_journal.put_signal(signal("r"))
        after, transition = next_step(run, "done", status=RunLifecycle.SUCCEEDED)
        postgres_journal.consume_signal(after, transition, stored.number)
        assert postgres_journal.wake_time("r") is None
        assert postgres_journal.signals("r")[0].status is SignalStatus.CONSUMED


class TestPark:
    """Park releases the lease and sets the wake time, at once."""

    @pytest.mark.parametrize("wake_at", [None, FAR_AHEAD, SOON])
    def test_without_an_accepted_signal(self, postgres_journal, wake_at):
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        postgres_journal.put_signal(signal("r", REJECTED))  # pending, not accepted
        assert postgres_journal.park(
            "r", "w0", held.lease_token, wake_at=wake_at, accepts={APPROVED}
        )
        run = postgres_journal.load("r")
        assert (run.lease_owner, run.lease_expires_at, run.lease_token) == (
            None,
            None,
            held.lease_token,
        )
        assert postgres_journal.wake_time("r") == wake_at

    def test_with_an_accepted_signal_the_run_is_due_now(self, postgres_journal, admin):
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        stored = postgres_journal.put_signal(signal("r"))
        assert postgres_journal.park(
            "r", "w0", held.lease_token, wake_at=None, accepts={APPROVED, REJECTED}
        )
        wake = postgres_journal.wake_time("r")
        assert wake is not None
        assert stored.received_at <= wake <= server_now(admin)

    def test_a_consumed_signal_does_not_count(self, postgres_journal):
        run = start(postgres_journal, "r")
        held = postgres_journal.claim("r", "w0", ttl=60)
        stored = postgres_journal.put_signal(signal("r"))
        after, transition = next_step(held, "verifying")
        postgres_journal.consume_signal(after, transition, stored.number)
        assert run.seq == 0
        assert postgres_journal.park(
            "r", "w0", held.lease_token, wake_at=FAR_AHEAD, accepts={APPROVED}
        )
        assert postgres_journal.wake_time("r") == FAR_AHEAD

    def test_a_lease_no_longer_held_is_not_parked(self, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        for owner, token in (("w1", held.lease_token), ("w0", held.lease_token - 1)):
            assert not postgres_journal.park("r", owner, token, wake_at=SOON, accepts={APPROVED})
        assert postgres_journal.load("r") == held
        assert postgres_journal.wake_time("r") is None
        assert not postgres_journal.park("nobody", "w0", 1, wake_at=SOON, accepts=())

    def test_naive_wake_times_are_utc(self, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        naive = FAR_AHEAD.replace(tzinfo=None)
        assert postgres_journal.park("r", "w0", held.lease_token, wake_at=naive, accepts=())
        assert postgres_journal.wake_time("r") == FAR_AHEAD

    def test_a_signal_racing_a_park_is_never_left_behind(self, postgres_server, postgres_journal):
        # A worker parks the run (until far ahead) while a sender's signal, which the waiting
        # state accepts, arrives on another connection at the same moment: whichever commits
        # first, the run ends up due by now, so a claim finds it with its signal pending.
        rounds = 50
        with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as sender:
            for n in range(rounds):
                run_id = f"race{n}"
                start(postgres_journal, run_id, state="waiting", created=n)
                held = postgres_journal.claim(run_id, "w0", ttl=60)
                barrier = threading.Barrier(2)
                outcomes: dict[str, object] = {}

                def park(run_id=run_id, held=held, barrier=barrier, outcomes=outcomes) -> None:
                    barrier.wait()
                    outcomes["park"] = postgres_journal.park(
                        run_id, "w0", held.lease_token, wake_at=FAR_AHEAD, accepts={APPROVED}
                    )

                def send(run_id=run_id, barrier=barrier, outcomes=outcomes) -> None:
                    barrier.wait()
                    outcomes["signal"] = sender.put_signal(signal(run_id))

                threads = [threading.Thread(target=park), threading.Thread(target=send)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                assert outcomes["park"] is True
                wake = postgres_journal.wake_time(run_id)
                assert wake is not None
                assert wake < FAR_AHEAD
                assert wake >= outcomes["signal"].received_at
                taken = claim(postgres_journal, "w1")
                assert (taken.run_id, taken.lease_owner) == (run_id, "w1")
                assert postgres_journal.signals(run_id, pending=True) == [outcomes["signal"]]
                assert postgres_journal.park(
                    run_id, "w1", taken.lease_token, wake_at=None, accepts=()
                )
        assert claim(postgres_journal, "w1") is None


class TestClaimsOfDueRuns:
    """claim_next also offers a run whose wake time has come, whatever its state."""

    def test_due_runs_are_claimed_and_future_ones_not(self, postgres_journal):
        parked(postgres_journal, "later", wake_at=FAR_AHEAD, created=0)
        parked(postgres_journal, "forever", wake_at=None, created=1)
        due = parked(postgres_journal, "due", wake_at=SOON, created=2)
        taken = claim(postgres_journal, "w1")
        assert (taken.run_id, taken.state, taken.lease_owner) == ("due", "waiting", "w1")
        assert (taken.lease_token, taken.recoveries) == (due.lease_token + 1, 0)
        assert postgres_journal.wake_time("due") == SOON  # a claim leaves it as is
        assert claim(postgres_journal, "w1") is None

    def test_a_held_due_run_is_not_claimed(self, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        postgres_journal.claim("r", "w0", ttl=60)
        postgres_journal.put_signal(signal("r"))
        assert postgres_journal.wake_time("r") is not None
        assert claim(postgres_journal, "w1") is None

    def test_a_due_run_whose_lease_expired_is_taken_over(self, postgres_journal, admin):
        start(postgres_journal, "r", state="waiting")
        first = postgres_journal.claim("r", "w0", ttl=60)
        postgres_journal.put_signal(signal("r"))
        table_rows(
            admin,
            postgres_journal.schema,
            "UPDATE runs SET lease_expires_at = clock_timestamp() - interval '1 minute'"
            " RETURNING run_id",
        )
        assert postgres_journal.next_wake(machine=SPEC.name) is not None
        taken = claim(postgres_journal, "w1")
        assert (taken.run_id, taken.lease_owner) == ("r", "w1")
        assert (taken.lease_token, taken.recoveries) == (first.lease_token + 1, 1)

    def test_the_oldest_runnable_run_goes_first(self, postgres_journal):
        start(postgres_journal, "ready", created=1)
        parked(postgres_journal, "due", wake_at=SOON, created=0)
        # due later than "due" (the earliest due is the due range's candidate)
        parked(postgres_journal, "due-later", wake_at=SOON + dt.timedelta(seconds=1), created=2)
        assert [getattr(claim(postgres_journal), "run_id", None) for _ in range(4)] == [
            "due",
            "ready",
            "due-later",
            None,
        ]

    def test_a_due_run_in_a_handled_state_is_claimed_once(self, postgres_journal):
        parked(postgres_journal, "r", state=HANDLED[0], wake_at=SOON)
        assert getattr(claim(postgres_journal), "run_id", None) == "r"
        assert claim(postgres_journal) is None

    def test_a_due_run_is_claimed_by_a_worker_without_handled_states(self, postgres_journal):
        start(postgres_journal, "ready")
        parked(postgres_journal, "due", wake_at=SOON, created=1)
        taken = postgres_journal.claim_next("w1", ttl=60, machine=SPEC.name, states=())
        assert getattr(taken, "run_id", None) == "due"
        assert postgres_journal.claim_next("w1", ttl=60, machine=SPEC.name, states=()) is None

    def test_the_spec_and_machine_filters_apply(self, postgres_journal):
        parked(postgres_journal, "due", wake_at=SOON)
        other = "0" * 64
        assert (
            postgres_journal.claim_next(
                "w1", ttl=60, machine=SPEC.name, states=HANDLED, spec_hash=other
            )
            is None
        )
        assert postgres_journal.claim_next("w1", ttl=60, machine="other", states=HANDLED) is None
        taken = postgres_journal.claim_next(
            "w1", ttl=60, machine=SPEC.name, states=HANDLED, spec_hash=SPEC.spec_hash
        )
        assert getattr(taken, "run_id", None) == "due"

    def test_an_ended_run_is_due_no_more(self, postgres_journal):
        start(postgres_journal, "r")
        postgres_journal.put_signal(signal("r"))
        end(postgres_journal, "r")
        assert postgres_journal.wake_time("r") is None
        assert claim(postgres_journal) is None
        assert postgres_journal.next_wake(machine=SPEC.name) is None

    def test_a_plain_step_keeps_the_wake_time(self, postgres_journal):
        run = start(postgres_journal, "r")
        stored = postgres_journal.put_signal(signal("r"))
        postgres_journal.commit(*next_step(run, "verifying"))
        assert postgres_journal.wake_time("r") == stored.received_at


class TestNextWake:
    """The earliest wake time of the machine's active runs nobody holds."""

    def test_none_without_wake_times(self, postgres_journal):
        assert postgres_journal.next_wake(machine=SPEC.name) is None
        start(postgres_journal, "r", state="waiting")
        assert postgres_journal.next_wake(machine=SPEC.name) is None

    def test_the_earliest_unheld(self, postgres_journal):
        later = FAR_AHEAD - dt.timedelta(days=1)
        parked(postgres_journal, "a", wake_at=FAR_AHEAD, created=0)
        parked(postgres_journal, "b", wake_at=later, created=1)
        parked(postgres_journal, "c", wake_at=None, created=2)
        assert postgres_journal.next_wake(machine=SPEC.name) == later
        postgres_journal.claim("b", "w1", ttl=60)  # held: not counted
        assert postgres_journal.next_wake(machine=SPEC.name) == FAR_AHEAD
        assert postgres_journal.next_wake(machine="other") is None


class TestPruneAndFork:
    """A pruned run's signals go with it; a fork takes none, nor the wake time."""

    def test_prune_deletes_the_signals_of_pruned_runs(self, postgres_journal, admin):
        start(postgres_journal, "gone")
        start(postgres_journal, "kept", created=1)
        postgres_journal.put_signal(signal("gone"))
        postgres_journal.put_signal(signal("gone", REJECTED, signal_id="x"))
        kept = postgres_journal.put_signal(signal("kept"))
        end(postgres_journal, "gone")
        dry = postgres_journal.prune(ended_before=T0 + dt.timedelta(days=1), dry_run=True)
        assert dry.run_ids == ("gone",)
        assert len(signal_rows(admin, postgres_journal)) == 3
        report = postgres_journal.prune(ended_before=T0 + dt.timedelta(days=1), batch_size=1)
        assert report.run_ids == ("gone",)
        assert [row[0] for row in signal_rows(admin, postgres_journal)] == [kept.number]
        assert postgres_journal.signals("gone") == []

    def test_a_fork_copies_no_signals_and_no_wake_time(self, postgres_journal):
        run = start(postgres_journal, "source")
        postgres_journal.put_signal(signal("source", signal_id="x"))
        fork = attrs.evolve(run, run_id="fork", forked_from="source")
        postgres_journal.fork_run(fork, source_run_id="source", at_seq=0)
        assert postgres_journal.signals("fork") == []
        assert postgres_journal.wake_time("fork") is None
        assert postgres_journal.wake_time("source") is not None
        assert len(postgres_journal.signals("source")) == 1
        again = postgres_journal.put_signal(signal("fork", signal_id="x"))  # its own ids
        assert again.run_id == "fork"


class TestLostConnections:
    """Each wait operation gets a lost connection back; one whose answer was lost is done once."""

    def test_every_operation_after_a_lost_connection(
        self, postgres_server, postgres_journal, admin
    ):
        def lose() -> None:
            postgres_server.terminate(postgres_journal.backend_pid)

        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        lose()
        stored = postgres_journal.put_signal(signal("r", signal_id="once"))
        lose()
        assert postgres_journal.put_signal(signal("r", signal_id="once")) == stored
        lose()
        assert postgres_journal.park("r", "w0", held.lease_token, wake_at=None, accepts={APPROVED})
        lose()
        assert postgres_journal.wake_time("r") is not None
        lose()
        assert postgres_journal.next_wake(machine=SPEC.name) is not None
        lose()
        assert postgres_journal.signals("r", pending=True) == [stored]
        taken = claim(postgres_journal, "w1")
        after, transition = next_step(taken, "building")
        lose()
        postgres_journal.consume_signal(after, transition, stored.number)
        assert [row[5] for row in signal_rows(admin, postgres_journal)] == [1]

    def test_a_consumption_whose_answer_was_lost_is_not_done_twice(
        self, postgres_server, postgres_journal
    ):
        run = start(postgres_journal, "r")
        stored = postgres_journal.put_signal(signal("r"))
        after, transition = next_step(run, "verifying")
        with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as twin:
            twin.consume_signal(after, transition, stored.number)  # the cut-off try's work
        postgres_server.terminate(postgres_journal.backend_pid)
        postgres_journal.consume_signal(after, transition, stored.number)  # ours: no error
        assert [t.seq for t in postgres_journal.transitions("r")] == [0, 1]
        with pytest.raises(RunConflictError):  # on a sound connection, a second is refused
            postgres_journal.consume_signal(after, transition, stored.number)

    def test_a_park_whose_answer_was_lost_is_not_refused(self, postgres_server, postgres_journal):
        start(postgres_journal, "r", state="waiting")
        held = postgres_journal.claim("r", "w0", ttl=60)
        with PostgresJournal(postgres_server.url, schema=postgres_journal.schema) as twin:
            assert twin.park("r", "w0", held.lease_token, wake_at=FAR_AHEAD, accepts=())
        postgres_server.terminate(postgres_journal.backend_pid)
        assert postgres_journal.park("r", "w0", held.lease_token, wake_at=FAR_AHEAD, accepts=())
        assert postgres_journal.wake_time("r") == FAR_AHEAD
