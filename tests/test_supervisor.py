"""The supervisor: start and health, restarts within a budget, backoff, and the recovery phase."""

from __future__ import annotations

import pytest

from fsm_runner import (
    RETURN,
    Engine,
    MachineSpec,
    MemoryJournal,
    PhaseContext,
    PhaseStatus,
    RetryPolicy,
    RunEvent,
    RunRecord,
    State,
    Transition,
)
from fsm_runner.exceptions import SupervisorError
from fsm_runner.supervisor import (
    RecoveryPhase,
    Resource,
    RestartOutcome,
    RestartRecord,
    Supervisor,
)
from fsm_runner.testing import FakeClock, ScriptedHandler

BACKOFF = RetryPolicy(wait_initial=0.5, wait_max=3.0, wait_exp_base=2.0)


class FakeResource:
    """A resource whose starts follow a script: "ok", "slow" (healthy after 3 checks), "hang", "exit", "oserror"."""

    name = "fake"

    def __init__(self, *script: str) -> None:
        self.script = list(script) or ["ok"]
        self.calls: list[str] = []
        self.starts = 0
        self._mode: str | None = None
        self._checks = 0

    def start(self) -> None:
        self.calls.append("start")
        mode = self.script[min(self.starts, len(self.script) - 1)]
        self.starts += 1
        if mode == "oserror":
            raise OSError("no such interpreter")
        self._mode, self._checks = mode, 0

    def health(self) -> bool:
        self._checks += 1
        if self._mode == "exit":
            raise SupervisorError(self.name, "process exited with 1")
        if self._mode == "slow":
            return self._checks >= 3
        return self._mode == "ok"

    def stop(self) -> None:
        self.calls.append("stop")
        self._mode = None

    def client(self) -> object:
        return object()


def supervisor(resource: FakeResource, clock: FakeClock, **options) -> Supervisor:
    options.setdefault("backoff", BACKOFF)
    return Supervisor(
        resource, health_timeout=1.0, health_interval=0.1, clock=clock, sleep=clock.sleep, **options
    )


class TestStart:
    """start() launches and waits until healthy, or stops the resource and raises."""

    def test_fake_resource_is_a_resource(self):
        assert isinstance(FakeResource(), Resource)

    def test_waits_until_healthy(self):
        clock, resource = FakeClock(), FakeResource("slow")
        supervisor(resource, clock).start()
        assert resource.calls == ["start"]
        assert clock.slept == [0.1, 0.1]  # healthy at the third check

    def test_timeout_stops_and_raises(self):
        clock, resource = FakeClock(), FakeResource("hang")
        with pytest.raises(SupervisorError) as caught:
            supervisor(resource, clock).start()
        assert caught.value.resource == "fake"
        assert caught.value.detail == "not healthy within 1s"
        assert resource.calls == ["start", "stop"]
        assert clock.now == pytest.approx(1.0)

    def test_an_exited_resource_fails_at_once(self):
        clock, resource = FakeClock(), FakeResource("exit")
        with pytest.raises(SupervisorError, match="exited with 1"):
            supervisor(resource, clock).start()
        assert clock.slept == []
        assert resource.calls == ["start", "stop"]

    def test_a_launch_failure_is_a_supervisor_error(self):
        clock, resource = FakeClock(), FakeResource("oserror")
        with pytest.raises(SupervisorError, match="could not start: no such interpreter"):
            supervisor(resource, clock).start()

    def test_context_manager_starts_and_stops(self):
        clock, resource = FakeClock(), FakeResource()
        with supervisor(resource, clock) as sup:
            assert resource.calls == ["start"]
            assert sup.restarts == 0
        assert resource.calls == ["start", "stop"]

    @pytest.mark.parametrize(
        ("options", "message"),
        [({"max_restarts": -1}, "max_restarts"), ({"window": 0}, "window")],
    )
    def test_bad_options(self, options, message):
        with pytest.raises(ValueError, match=message):
            Supervisor(FakeResource(), **options)


class TestRestart:
    """restart() stops, backs off, starts and waits; every try counts against the budget."""

    def test_one_restart(self):
        clock, resource = FakeClock(), FakeResource()
        sup = supervisor(resource, clock)
        sup.start()
        outcome = sup.restart("connection refused")
        assert outcome == RestartOutcome(ok=True, restarts=1, attempts=1)
        assert resource.calls == ["start", "stop", "start"]
        assert clock.slept == [BACKOFF.wait(1)]
        assert sup.history == [RestartRecord(at=0.0, reason="connection refused", ok=True)]

    def test_failed_tries_back_off_by_the_policy(self):
        clock, resource = FakeClock(), FakeResource("ok", "exit", "exit", "ok")
        sup = supervisor(resource, clock, max_restarts=5)
        sup.start()
        outcome = sup.restart("reset")
        assert outcome == RestartOutcome(ok=True, restarts=3, attempts=3)
        assert clock.slept == [BACKOFF.wait(1), BACKOFF.wait(2), BACKOFF.wait(3)]
        assert clock.slept == [0.5, 1.0, 2.0]
        assert [(r.ok, r.error) for r in sup.history] == [
            (False, "process exited with 1"),
            (False, "process exited with 1"),
            (True, None),
        ]
        assert resource.calls == ["start"] + ["stop", "start", "stop"] * 2 + ["stop", "start"]

    def test_backoff_is_capped(self):
        clock, resource = FakeClock(), FakeResource("ok", "exit", "exit", "exit", "exit", "ok")
        sup = supervisor(resource, clock, max_restarts=10)
        sup.start()
        assert sup.restart("reset").ok
        assert clock.slept == [0.5, 1.0, 2.0, 3.0, 3.0]

    def test_budget_spent_overall(self):
        clock, resource = FakeClock(), FakeResource("ok", "exit")
        sup = supervisor(resource, clock, max_restarts=2)
        sup.start()
        outcome = sup.restart("connection refused")
        assert outcome == RestartOutcome(
            ok=False,
            restarts=2,
            attempts=2,
            error="restart budget spent: 2 restarts; last: process exited with 1",
        )
        assert resource.starts == 3
        # Spent for good when there is no window: no further start is tried.
        again = sup.restart("still down")
        assert (again.ok, again.attempts, again.restarts) == (False, 0, 2)
        assert again.error == "restart budget spent: 2 restarts; last: still down"
        assert resource.starts == 3

    def test_successful_restarts_count_too(self):
        clock, resource = FakeClock(), FakeResource()
        sup = supervisor(resource, clock, max_restarts=1)
        sup.start()
        assert sup.restart("first").ok
        outcome = sup.restart("second")
        assert not outcome.ok
        assert outcome.error == "restart budget spent: 1 restart; last: second"

    def test_window_slides(self):
        clock, resource = FakeClock(), FakeResource()
        sup = supervisor(resource, clock, max_restarts=2, window=60.0)
        sup.start()
        assert sup.restart("a").ok  # at t=0
        clock.advance(10)
        assert sup.restart("b").ok  # at t=10.5 (after the first backoff)
        clock.advance(10)
        spent = sup.restart("c")
        assert not spent.ok
        assert spent.error == "restart budget spent: 2 restarts within 60s; last: c"
        clock.advance(40)  # the first try (t=0) is now more than 60 s old
        outcome = sup.restart("d")
        assert outcome == RestartOutcome(ok=True, restarts=3, attempts=1)
        assert [r.reason for r in sup.history] == ["a", "b", "d"]

    def test_a_launch_failure_is_a_failed_try(self):
        clock, resource = FakeClock(), FakeResource("ok", "oserror", "ok")
        sup = supervisor(resource, clock)
        sup.start()
        outcome = sup.restart("gone")
        assert (outcome.ok, outcome.attempts) == (True, 2)
        assert sup.history[0].error == "could not start: no such interpreter"


def context(error=None, return_to="1b") -> PhaseContext:
    run = RunRecord(
        run_id="r1",
        machine="m",
        spec_hash="h",
        state="recovering",
        error=error,
        return_to=return_to,
        return_attempt=1,
    )
    return PhaseContext(run, {}, FakeClock())


class TestRecoveryPhase:
    """The recovery state's handler reports SERVER_RECOVERED or RESTART_BUDGET_SPENT."""

    def test_recovered(self):
        clock, resource = FakeClock(), FakeResource()
        sup = supervisor(resource, clock)
        sup.start()
        result = RecoveryPhase(sup).run(context({"type": "X", "message": "connection reset"}))
        assert result.event == RunEvent.SERVER_RECOVERED.value
        assert result.output == {"restarts": 1, "attempts": 1, "return_to": "1b"}
        assert result.error is None
        assert sup.history[0].reason == "connection reset"

    def test_budget_spent(self):
        clock, resource = FakeClock(), FakeResource("ok", "hang")
        sup = supervisor(resource, clock, max_restarts=2, window=30)
        sup.start()
        result = RecoveryPhase(sup).run(context())
        assert result.event == RunEvent.RESTART_BUDGET_SPENT.value
        assert result.output == {"restarts": 2, "attempts": 2, "return_to": "1b"}
        assert result.error == (
            "restart budget spent: 2 restarts within 30s; last: not healthy within 1s"
        )
        assert sup.history[0].reason == "server unreachable"


class TestReentry:
    """In an engine: the run returns to the sub-phase that failed, never to a completed one."""

    SPEC = MachineSpec(
        "reentry",
        states=[
            State("work", children=[State("a", handler="a"), State("b", handler="b")]),
            State("recovering", handler="recover"),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        transitions=[
            Transition("work", RunEvent.PHASE_COMPLETED, "done"),
            Transition("work", RunEvent.SERVER_UNREACHABLE, "recovering"),
            Transition("recovering", RunEvent.SERVER_RECOVERED, RETURN),
            Transition("recovering", RunEvent.RESTART_BUDGET_SPENT, "failed", reason="spent"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )

    def run(self, resource: FakeResource, b: ScriptedHandler, **options):
        clock = FakeClock()
        sup = supervisor(resource, clock, **options)
        sup.start()
        a = ScriptedHandler(PhaseStatus.OK)
        with MemoryJournal() as journal:
            engine = Engine(
                self.SPEC,
                handlers={"a": a, "b": b, "recover": RecoveryPhase(sup)},
                journal=journal,
            )
            run = engine.run(engine.start())
            transitions = list(journal.transitions(run.run_id))
        return run, transitions, a, sup

    def test_returns_to_the_failed_sub_phase(self):
        b = ScriptedHandler(PhaseStatus.SERVER_UNREACHABLE, PhaseStatus.OK)
        run, transitions, a, sup = self.run(FakeResource(), b)
        assert run.state == "done"
        assert [(t.from_state, t.event, t.to_state) for t in transitions] == [
            (None, "STARTED", "a"),
            ("a", "PHASE_COMPLETED", "b"),
            ("b", "SERVER_UNREACHABLE", "recovering"),
            ("recovering", "SERVER_RECOVERED", "b"),
            ("b", "PHASE_COMPLETED", "done"),
        ]
        assert a.call_count == 1
        assert [ctx.attempt for ctx in b.calls] == [1, 2]
        assert transitions[3].output == {"restarts": 1, "attempts": 1, "return_to": "b"}
        assert sup.restarts == 1

    def test_spent_budget_fails_the_run_with_the_reason(self):
        b = ScriptedHandler(PhaseStatus.SERVER_UNREACHABLE)
        run, transitions, _a, _sup = self.run(FakeResource("ok", "exit"), b, max_restarts=1)
        assert (run.state, run.status.value) == ("failed", "failed")
        assert (
            run.error["message"] == "restart budget spent: 1 restart; last: process exited with 1"
        )
        assert transitions[-1].result["reason"] == "spent"
        assert [t.seq for t in transitions] == list(range(len(transitions)))
