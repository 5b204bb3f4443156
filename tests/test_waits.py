"""Durable waits (issue 29): signals with a mailbox, waiting states' deadlines, parking.

Engine-level, on every journal (the ``journal`` fixture: memory, SQLite, PostgreSQL). The
journals' own contract for the new methods is in ``test_journal.py`` and the dialect files;
real processes racing and killed are in ``test_waits_processes.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading

import pytest

from fsm_runner import (
    Engine,
    InvalidTransitionError,
    MachineSpec,
    PayloadError,
    RunNotFoundError,
    RunTerminalError,
    SignalStatus,
    SpecError,
    State,
    Transition,
    Wait,
)
from fsm_runner.engine import waits

CALLS: list[str] = []


def propose(ctx):
    CALLS.append(f"propose:{ctx.run.run_id}")
    return "PROPOSED"


def apply(ctx):
    CALLS.append(f"apply:{ctx.run.run_id}")
    return "APPLIED"


APPROVAL = MachineSpec(
    "approval",
    [
        State("proposing", handler="propose"),
        State(
            "awaiting",
            wait=Wait(timeout=86_400, prompt="apply the change?", schema={"type": "object"}),
        ),
        State("applying", handler="apply"),
        State("applied", terminal=True),
        State("cancelled", terminal=True, outcome="aborted"),
    ],
    [
        Transition("proposing", "PROPOSED", "awaiting"),
        Transition("awaiting", "APPROVE", "applying"),
        Transition("awaiting", "REJECT", "proposing"),
        Transition("awaiting", "TIMEOUT", "cancelled"),
        Transition("applying", "APPLIED", "applied"),
    ],
)
HANDLERS = {"propose": propose, "apply": apply}


def short(timeout: float) -> MachineSpec:
    """APPROVAL with a wait of ``timeout`` seconds."""
    states = [
        State("awaiting", wait=Wait(timeout=timeout)) if s.name == "awaiting" else s
        for s in APPROVAL.states
    ]
    return MachineSpec(APPROVAL.name, states, APPROVAL.transitions)


@pytest.fixture
def engine(journal):
    CALLS.clear()
    engine = Engine(APPROVAL, handlers=HANDLERS, journal=journal)
    yield engine
    engine.close()


def parked(engine: Engine) -> str:
    run_id = engine.start()
    run = engine.run(run_id)
    assert run.state == "awaiting"
    assert run.lease_owner is None
    return run_id


class TestSpec:
    def test_a_waiting_state_round_trips_and_keeps_old_hashes(self):
        assert MachineSpec.from_json(APPROVAL.to_json()) == APPROVAL
        assert APPROVAL.state("awaiting").wait.prompt == "apply the change?"
        plain = MachineSpec("m", [State("a", handler="h"), State("z", terminal=True)], [])
        assert '"wait"' not in plain.to_json()  # no field for states that do not wait

    def test_what_a_waiting_state_accepts(self):
        assert APPROVAL.waiting_states == {"awaiting"}
        assert APPROVAL.accepts("awaiting") == {"APPROVE", "REJECT"}  # not its TIMEOUT
        assert APPROVAL.accepts("proposing") == frozenset()
        assert APPROVAL.signal_names == {"APPROVE", "REJECT"}

    @pytest.mark.parametrize(
        ("wait", "transitions", "problem"),
        [
            (Wait(timeout=0), [Transition("w", "OK", "z")], "wait timeout <= 0"),
            (Wait(timeout=5), [Transition("w", "OK", "z")], "no exit for its on_timeout"),
            (Wait(), [Transition("w", "SYSTEM_ERROR", "z")], "no signal can move it"),
            (Wait(schema=[1]), [Transition("w", "OK", "z")], "schema must be a JSON object"),
        ],
    )
    def test_validate_names_a_waiting_state_without_a_way_out(self, wait, transitions, problem):
        spec = MachineSpec("m", [State("w", wait=wait), State("z", terminal=True)], transitions)
        with pytest.raises(SpecError, match=problem):
            spec.validate()

    def test_a_state_with_a_handler_cannot_wait(self):
        spec = MachineSpec(
            "m",
            [State("w", handler="h", wait=Wait()), State("z", terminal=True)],
            [Transition("w", "OK", "z")],
        )
        with pytest.raises(SpecError, match="cannot have a handler"):
            spec.validate()


class TestSignals:
    def test_a_waiting_run_holds_no_lease_and_is_not_claimed(self, engine):
        run_id = parked(engine)
        assert engine.journal.load(run_id).lease_owner is None
        assert engine.work(exit_when_idle=True) == 0
        assert CALLS == [f"propose:{run_id}"]  # noqa: SIM300 - CALLS is what is checked

    def test_a_signal_to_a_waiting_run_is_consumed_at_once(self, engine):
        run_id = parked(engine)
        signal = engine.signal(run_id, "APPROVE", {"by": "ana"})
        assert signal.status is SignalStatus.CONSUMED
        run = engine.journal.load(run_id)
        assert (run.state, run.seq, signal.consumed_seq) == ("applying", 2, 2)
        last = engine.journal.transitions(run_id)[-1]
        assert last.event == "APPROVE"
        assert last.result == {"output": {"by": "ana"}, "signal": signal.number}
        assert engine.run(run_id).state == "applied"

    def test_a_signal_sent_before_the_run_waits_is_consumed_when_it_gets_there(self, engine):
        run_id = engine.start()
        early = engine.signal(run_id, "APPROVE", {"early": True})
        assert early.status is SignalStatus.PENDING
        run = engine.run(run_id)
        assert run.state == "applied"
        (stored,) = engine.journal.signals(run_id)
        assert stored.status is SignalStatus.CONSUMED
        assert engine.journal.transitions(run_id)[stored.consumed_seq].event == "APPROVE"

    def test_two_signals_are_consumed_in_order_each_once(self, engine):
        run_id = engine.start()
        first = engine.signal(run_id, "REJECT", {"n": 1})
        second = engine.signal(run_id, "APPROVE", {"n": 2})
        assert first.number < second.number
        run = engine.run(run_id)
        assert run.state == "applied"
        events = [t.event for t in engine.journal.transitions(run_id)]
        assert events == [
            "STARTED", "PROPOSED", "REJECT", "PROPOSED", "APPROVE", "APPLIED",
        ]  # fmt: skip
        consumed = [s.consumed_seq for s in engine.journal.signals(run_id)]
        assert consumed == [2, 4]
        assert CALLS.count(f"propose:{run_id}") == 2

    def test_a_repeated_signal_id_changes_nothing(self, engine):
        run_id = parked(engine)
        first = engine.signal(run_id, "APPROVE", {"n": 1}, signal_id="hook-1")
        again = engine.signal(run_id, "REJECT", {"n": 2}, signal_id="hook-1")
        assert again == first
        assert len(engine.journal.signals(run_id)) == 1
        engine.run(run_id)
        # the run has ended: the same id still answers with the first signal
        assert engine.signal(run_id, "APPROVE", signal_id="hook-1").number == first.number

    def test_a_signal_to_an_ended_run_is_refused_and_writes_nothing(self, engine):
        run_id = parked(engine)
        engine.signal(run_id, "APPROVE")
        engine.run(run_id)
        with pytest.raises(RunTerminalError):
            engine.signal(run_id, "APPROVE")
        assert len(engine.journal.signals(run_id)) == 1

    def test_a_signal_no_state_accepts_is_refused_and_writes_nothing(self, engine):
        run_id = parked(engine)
        for name in ("DEPLOY", "TIMEOUT", "SYSTEM_ERROR", "PROPOSED"):
            with pytest.raises(InvalidTransitionError, match="accepts"):
                engine.signal(run_id, name)
        with pytest.raises(InvalidTransitionError):
            engine.signal(run_id, 42)
        assert engine.journal.signals(run_id) == []
        assert engine.journal.load(run_id).seq == 1

    def test_a_bad_payload_or_run_is_refused_and_writes_nothing(self, engine):
        run_id = parked(engine)
        with pytest.raises(PayloadError):
            engine.signal(run_id, "APPROVE", float("nan"))
        with pytest.raises(RunNotFoundError):
            engine.signal("no-such-run", "APPROVE")
        assert engine.journal.signals(run_id) == []

    def test_a_pending_signal_of_a_run_that_ended_is_expired(self, engine):
        run_id = engine.start()
        engine.signal(run_id, "REJECT")
        engine.abort(run_id, "not wanted")
        (signal,) = engine.journal.signals(run_id)
        assert signal.status is SignalStatus.EXPIRED
        assert engine.journal.signals(run_id, pending=True) == []

    def test_a_worker_consumes_a_signal_that_came_while_the_run_was_held(self, journal):
        CALLS.clear()
        gate, entered = threading.Event(), threading.Event()

        def slow_propose(ctx):
            entered.set()
            gate.wait(10)
            return "PROPOSED"

        engine = Engine(
            APPROVAL, handlers={"propose": slow_propose, "apply": apply}, journal=journal
        )
        try:
            run_id = engine.start()
            worker = threading.Thread(target=engine.run, args=(run_id,))
            worker.start()
            assert entered.wait(10)
            sender = Engine(APPROVAL, handlers=HANDLERS, journal=journal)
            assert sender.signal(run_id, "APPROVE").status is SignalStatus.PENDING
            sender.close()
            gate.set()
            worker.join(10)
            assert engine.journal.load(run_id).state == "applied"
        finally:
            gate.set()
            engine.close()

    def test_asignal(self, engine):
        run_id = parked(engine)

        async def main():
            signal = await engine.asignal(run_id, "APPROVE")
            assert signal.status is SignalStatus.CONSUMED
            return await engine.arun(run_id)

        # on a thread of its own: an earlier test on this worker may have left a loop set
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert pool.submit(asyncio.run, main()).result(30).state == "applied"


class TestWithoutAnEngine:
    def test_signal_run_reads_the_spec_from_the_journal(self, engine):
        run_id = parked(engine)
        signal = waits.signal_run(engine.journal, run_id, "APPROVE", {"cli": True})
        assert signal.status is SignalStatus.CONSUMED
        assert engine.journal.load(run_id).state == "applying"
        assert engine.journal.load(run_id).lease_owner is None

    def test_a_guarded_exit_is_left_to_a_worker_of_the_app(self, journal):
        spec = MachineSpec(
            "guarded",
            [State("w", wait=Wait()), State("go", handler="go"), State("z", terminal=True)],
            [Transition("w", "OK", "go", guards="allowed"), Transition("go", "DONE", "z")],
        )
        engine = Engine(
            spec,
            handlers={"go": lambda ctx: "DONE"},
            guards={"allowed": lambda run: True},
            journal=journal,
        )
        try:
            run_id = engine.start()
            signal = waits.signal_run(journal, run_id, "OK")
            assert signal.status is SignalStatus.PENDING  # no guard to ask here
            assert engine.work(exit_when_idle=True) == 1  # its wake time has come
            assert journal.load(run_id).state == "z"
        finally:
            engine.close()


class TestDeadlines:
    def test_a_wait_times_out_once_its_deadline_has_passed(self, journal):
        engine = Engine(short(0.2), handlers=HANDLERS, journal=journal)
        try:
            run_id = engine.start()
            engine.run(run_id)
            wake = journal.wake_time(run_id)
            assert wake is not None
            entered = journal.transitions(run_id)[-1].at
            assert abs((wake - entered) - dt.timedelta(seconds=0.2)) < dt.timedelta(milliseconds=5)
            assert engine.work(exit_when_idle=True) == 0  # not due yet
            stop = threading.Event()
            threading.Timer(3, stop.set).start()
            engine.work(stop=stop, max_runs=1, idle_wait=5)  # sleeps until the wake time
            run = journal.load(run_id)
            assert (run.state, run.status.value) == ("cancelled", "aborted")
            timeout = journal.transitions(run_id)[-1]
            assert timeout.event == "TIMEOUT"
            assert journal.wake_time(run_id) is None  # an ended run has none
        finally:
            engine.close()

    def test_a_signal_before_the_deadline_wins(self, journal):
        engine = Engine(short(30), handlers=HANDLERS, journal=journal)
        try:
            run_id = engine.start()
            engine.run(run_id)
            engine.signal(run_id, "APPROVE")
            assert engine.run(run_id).state == "applied"
            assert [t.event for t in journal.transitions(run_id)].count("TIMEOUT") == 0
        finally:
            engine.close()


class TestStartingToWait:
    SPEC = MachineSpec(
        "starts-waiting",
        [State("asked", wait=Wait(timeout=0.2)), State("z", terminal=True)],
        [Transition("asked", "OK", "z"), Transition("asked", "TIMEOUT", "z")],
    )

    @pytest.mark.parametrize("claim", [False, True])
    def test_a_run_that_starts_waiting_gets_its_deadline(self, journal, claim):
        engine = Engine(self.SPEC, handlers={}, journal=journal)
        try:
            first = engine.start(claim=claim)
            (second,) = engine.start_many([None], claim=claim)
            for run_id in (first, second):
                assert journal.wake_time(run_id) is not None
                assert journal.load(run_id).lease_owner is None
            stop = threading.Event()
            threading.Timer(3, stop.set).start()
            assert engine.work(stop=stop, max_runs=2, idle_wait=5) == 2
            for run_id in (first, second):
                assert [t.event for t in journal.transitions(run_id)] == ["STARTED", "TIMEOUT"]
        finally:
            engine.close()


REVIEWS: list[object] = []


def review(ctx):
    REVIEWS.append(ctx.effect("draft", lambda: "drafted", kind="read"))
    answer = ctx.wait_for("verdict", timeout=ctx.input.get("timeout") if ctx.input else None)
    REVIEWS.append(answer)
    return "DONE" if answer.get("ok") else "REDO"


def napping(ctx):
    ctx.sleep_until(dt.datetime.fromisoformat(ctx.input["until"]))
    return "DONE"


PHASE_WAITS = MachineSpec(
    "phase-waits",
    [
        State("reviewing", handler="review", signals=["verdict"]),
        State("done", terminal=True),
        State("late", terminal=True, outcome="failed"),
    ],
    [
        Transition("reviewing", "DONE", "done"),
        Transition("reviewing", "REDO", "reviewing"),
        Transition("reviewing", "TIMEOUT", "late"),
    ],
)


class TestPhaseWaits:
    @pytest.fixture
    def engine(self, journal):
        REVIEWS.clear()
        engine = Engine(PHASE_WAITS, handlers={"review": review}, journal=journal)
        yield engine
        engine.close()

    def test_wait_for_parks_the_run_until_the_signal_then_the_phase_runs_again(self, engine):
        journal = engine.journal
        run_id = engine.start()
        run = engine.run(run_id)
        assert (run.state, run.lease_owner) == ("reviewing", None)
        assert journal.transitions(run_id)[-1].event == "WAITING"
        assert journal.wake_time(run_id) is not None  # never, by itself
        assert engine.work(exit_when_idle=True) == 0  # not claimed while it waits
        signal = engine.signal(run_id, "verdict", {"ok": True})
        assert signal.status is SignalStatus.PENDING  # a worker of the app consumes it
        assert engine.work(exit_when_idle=True) == 1
        run = journal.load(run_id)
        assert run.state == "done"
        events = [t.event for t in journal.transitions(run_id)]
        assert events == ["STARTED", "WAITING", "WOKEN", "DONE"]
        assert REVIEWS == ["drafted", "drafted", {"ok": True}]  # the effect ran once
        assert journal.signals(run_id)[0].consumed_seq == 2

    def test_a_signal_sent_before_the_phase_waits_answers_it_at_once(self, engine):
        run_id = engine.start()
        engine.signal(run_id, "verdict", {"ok": True})
        assert engine.run(run_id).state == "done"
        events = [t.event for t in engine.journal.transitions(run_id)]
        assert events == ["STARTED", "WAITING", "WOKEN", "DONE"]

    def test_wait_for_times_out_as_the_phase_timing_out(self, engine):
        run_id = engine.start({"timeout": 0.2})
        engine.run(run_id)
        stop = threading.Event()
        threading.Timer(3, stop.set).start()
        engine.work(stop=stop, max_runs=1, idle_wait=5)
        run = engine.journal.load(run_id)
        assert (run.state, run.status.value) == ("late", "failed")
        events = [t.event for t in engine.journal.transitions(run_id)]
        assert events == ["STARTED", "WAITING", "WOKEN", "TIMEOUT"]

    def test_sleep_until_parks_the_run_until_then(self, journal):
        until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=0.3)
        spec = MachineSpec(
            "naps",
            [State("napping", handler="nap"), State("done", terminal=True)],
            [Transition("napping", "DONE", "done")],
        )
        napper = Engine(spec, handlers={"nap": napping}, journal=journal)
        try:
            run_id = napper.start({"until": until.isoformat()})
            assert napper.run(run_id).state == "napping"
            assert napper.work(exit_when_idle=True) == 0
            stop = threading.Event()
            threading.Timer(3, stop.set).start()
            napper.work(stop=stop, max_runs=1, idle_wait=5)
            assert journal.load(run_id).state == "done"
            assert dt.datetime.now(dt.timezone.utc) >= until
            events = [t.event for t in journal.transitions(run_id)]
            assert events == ["STARTED", "WAITING", "WOKEN", "DONE"]
        finally:
            napper.close()

    def test_a_signal_the_phase_does_not_declare_is_refused(self, engine):
        run_id = engine.start()
        with pytest.raises(InvalidTransitionError):
            engine.signal(run_id, "approval")

    def test_replay_reads_the_waits(self, engine):
        from fsm_runner.replay import replay_run

        run_id = engine.start()
        engine.run(run_id)
        engine.signal(run_id, "verdict", {"ok": False})
        engine.work(exit_when_idle=True, max_runs=1)
        engine.signal(run_id, "verdict", {"ok": True})
        engine.work(exit_when_idle=True, max_runs=1)
        assert engine.journal.load(run_id).state == "done"
        replay_run(engine.journal, run_id)  # raises ReplayMismatchError on a mismatch
