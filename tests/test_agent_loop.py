"""The agent-loop preset: each phase handler alone, then whole runs over every journal."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fsm_runner import PhaseContext, RunEvent, RunLifecycle, RunRecord
from fsm_runner.presets.agent_loop import (
    AGENT_LOOP,
    AgentDriver,
    AgentResult,
    BuildPhase,
    CheckResult,
    FeedbackGenerator,
    FeedbackPhase,
    LevelResult,
    QueuePhase,
    ResultPersister,
    SnapshotPhase,
    Snapshotter,
    VerificationReport,
    Verifier,
    VerifyPhase,
    agent_loop_engine,
    classify_agent_exit,
    fallback_feedback,
)
from fsm_runner.records import ErrorType, unstructure
from fsm_runner.testing import FakeClock

from .fake_services import (
    FakeAgent,
    FakeFeedback,
    FakePersister,
    FakeSnapshotter,
    FakeVerifier,
    agent_result,
    failing_report,
    passing_report,
)

TASK = "make the tests pass"
WORKSPACE = "/work/ws"
INPUT: dict[str, Any] = {"task": TASK, "workspace": WORKSPACE}


def make_ctx(
    state: str,
    *,
    input: Any = None,  # noqa: A002 - the name the run record uses
    context: dict[str, Any] | None = None,
    iteration: int = 1,
    deadline: float | None = None,
    clock: FakeClock | None = None,
    **services: Any,
) -> PhaseContext:
    """A context for one phase of a hand-built run, with these services."""
    run = RunRecord(
        run_id="run-1",
        machine=AGENT_LOOP.name,
        spec_hash=AGENT_LOOP.spec_hash,
        state=state,
        iteration=iteration,
        input=INPUT if input is None else input,
        context=context or {},
    )
    return PhaseContext(
        run, services, clock or FakeClock(), deadline, None, "fsm_runner.phase.test"
    )


class TestFakes:
    """The fakes satisfy the service protocols they stand in for."""

    @pytest.mark.parametrize(
        ("fake", "protocol"),
        [
            (FakeAgent(), AgentDriver),
            (FakeSnapshotter(), Snapshotter),
            (FakeVerifier(), Verifier),
            (FakeFeedback(), FeedbackGenerator),
            (FakePersister(), ResultPersister),
        ],
    )
    def test_protocol(self, fake, protocol):
        assert isinstance(fake, protocol)


# -- the phases, one at a time -----------------------------------------------------------------


class TestQueuePhase:
    """``queued`` accepts a run with a task and a workspace, and nothing less."""

    def test_accepts_good_input(self):
        result = QueuePhase().run(make_ctx("queued", iteration=0))
        assert result.event == "RUN_ACCEPTED"

    @pytest.mark.parametrize(
        ("input", "missing"),
        [
            ({"workspace": WORKSPACE}, "task"),
            ({"task": TASK}, "workspace"),
            ({"task": "", "workspace": WORKSPACE}, "task"),
            ({"other": 1}, "task, workspace"),
            (["not", "a", "mapping"], "task, workspace"),
        ],
    )
    def test_refuses_missing_task_or_workspace(self, input, missing):  # noqa: A002
        with pytest.raises(ValueError, match=f"lacks {missing}$"):
            QueuePhase().run(make_ctx("queued", input=input, iteration=0))


class TestBuildPhase:
    """``building`` runs the agent once and reports what came of it."""

    def test_success(self):
        agent = FakeAgent(agent_result(2))
        result = BuildPhase().run(make_ctx("building", iteration=2, agent=agent))

        assert result.event == RunEvent.BUILD_SUCCEEDED.value
        assert result.error is None
        assert result.iteration == {
            "agent_session_id": "session-2",
            "agent_result_ref": "agent-2",
            "agent_duration_ms": 5.0,
            "success": True,
            "model": "model-x",
            "tokens_input": 200,
            "tokens_output": 20,
            "tokens_total": 220,
            "cost_usd": 0.02,
        }
        assert result.output == {"session_id": "session-2", "exit_code": 0}
        assert result.context["session_id"] == "session-2"
        assert result.context["build_failure"] is None
        (artifact,) = result.artifacts
        assert (artifact.name, artifact.kind, artifact.status) == (
            "agent-2",
            "agent_result",
            "stored",
        )
        assert artifact.content == unstructure(agent_result(2))

    def test_request_carries_task_feedback_session_and_options(self):
        agent = FakeAgent()
        ctx = make_ctx(
            "building",
            input={**INPUT, "agent": {"command": "claude -p", "model": "big"}},
            context={"feedback": "fix the import", "session_id": "session-7"},
            iteration=3,
            agent=agent,
        )
        BuildPhase().run(ctx)

        (request,) = agent.requests
        assert request.task == TASK
        assert request.workspace == WORKSPACE
        assert request.iteration == 3
        assert request.feedback == "fix the import"
        assert request.session_id == "session-7"
        assert request.options == {"command": "claude -p", "model": "big"}
        assert request.timeout is None  # the state has no deadline

    def test_first_build_has_no_feedback_session_or_options(self):
        agent = FakeAgent()
        BuildPhase().run(make_ctx("building", agent=agent))
        (request,) = agent.requests
        assert (request.feedback, request.session_id, request.options) == (None, None, {})

    def test_timeout_is_what_remains_of_the_deadline(self):
        agent = FakeAgent()
        clock = FakeClock(100.0)
        BuildPhase().run(make_ctx("building", deadline=130.0, clock=clock, agent=agent))
        assert agent.requests[0].timeout == 30.0

    def test_keeps_the_last_session_when_the_agent_reports_none(self):
        ctx = make_ctx(
            "building",
            context={"session_id": "session-1"},
            agent=FakeAgent(agent_result(session_id=None)),
        )
        result = BuildPhase().run(ctx)
        assert result.context["session_id"] == "session-1"

    @pytest.mark.parametrize(
        ("changes", "error_type"),
        [
            ({"exit_code": 1}, ErrorType.AGENT_FAILURE),
            ({"exit_code": 0}, ErrorType.AGENT_FAILURE),  # exited cleanly but said it failed
            ({"exit_code": 137}, ErrorType.TIMEOUT),
            ({"exit_code": 1, "timed_out": True}, ErrorType.TIMEOUT),
            ({"exit_code": None, "timed_out": True}, ErrorType.TIMEOUT),
            ({"exit_code": -11}, ErrorType.AGENT_CRASH),
            ({"exit_code": 139}, ErrorType.AGENT_CRASH),
            ({"exit_code": None}, ErrorType.AGENT_CRASH),
        ],
    )
    def test_failure_is_classified(self, changes, error_type):
        failed = agent_result(1, success=False, stderr="Traceback: boom\n", **changes)
        result = BuildPhase().run(make_ctx("building", agent=FakeAgent(failed)))

        assert result.event == RunEvent.BUILD_FAILED.value
        head = (
            "agent timed out"
            if changes.get("timed_out")
            else f"agent exited with {changes['exit_code']}"
        )
        message = f"{head}: Traceback: boom"
        assert result.error == {"type": error_type.value, "message": message}
        assert result.iteration["success"] is False
        assert result.iteration["error_type"] is error_type
        assert result.iteration["error_message"] == message
        assert result.iteration["agent_result_ref"] == "agent-1"
        assert result.context["build_failure"] == message
        assert result.context["session_id"] == "session-1"
        assert [a.name for a in result.artifacts] == ["agent-1"]

    def test_failure_message_uses_stdout_without_stderr(self):
        failed = agent_result(success=False, exit_code=2, stdout="no such file", stderr="")
        result = BuildPhase().run(make_ctx("building", agent=FakeAgent(failed)))
        assert result.iteration["error_message"] == "agent exited with 2: no such file"

    def test_agent_raising_is_a_crash_not_an_error(self):
        agent = FakeAgent(OSError("no such binary"))
        result = BuildPhase().run(make_ctx("building", agent=agent))

        assert result.event == RunEvent.BUILD_FAILED.value
        message = "OSError: no such binary"
        assert result.error == {"type": "agent_crash", "message": message}
        assert result.iteration == {
            "success": False,
            "error_type": ErrorType.AGENT_CRASH,
            "error_message": message,
        }
        assert result.context == {"build_failure": message}
        assert result.artifacts == ()

    def test_persister_raising_does_not_fail_the_phase(self, caplog):
        persister = FakePersister(error=OSError("disk full"))
        ctx = make_ctx("building", agent=FakeAgent(), persister=persister)
        with caplog.at_level(logging.WARNING):
            result = BuildPhase().run(ctx)

        assert result.event == RunEvent.BUILD_SUCCEEDED.value
        (artifact,) = result.artifacts
        assert (artifact.name, artifact.kind, artifact.status) == (
            "agent-1",
            "agent_result",
            "failed",
        )
        assert artifact.error == "OSError: disk full"
        assert artifact.content is None
        assert "could not persist artifact agent-1" in caplog.text
        assert [(c.run_id, c.name, c.kind) for c in persister.calls] == [
            ("run-1", "agent-1", "agent_result")
        ]

    def test_persister_reporting_a_failure_is_recorded_as_is(self):
        ctx = make_ctx("building", agent=FakeAgent(), persister=FakePersister(fail=True))
        result = BuildPhase().run(ctx)
        assert result.event == RunEvent.BUILD_SUCCEEDED.value
        (artifact,) = result.artifacts
        assert (artifact.status, artifact.error) == ("failed", "disk full")

    def test_persister_gets_the_agent_result(self):
        persister = FakePersister()
        ctx = make_ctx("building", agent=FakeAgent(agent_result(4)), persister=persister)
        result = BuildPhase().run(ctx)
        (call,) = persister.calls
        assert call.data == unstructure(agent_result(4))
        assert result.artifacts[0].path == "/artifacts/run-1/agent-1.json"


class TestSnapshotPhase:
    """``snapshotting`` captures the workspace, or reports that it could not."""

    def test_snapshot_taken(self):
        snapshotter = FakeSnapshotter()
        result = SnapshotPhase().run(make_ctx("snapshotting", snapshotter=snapshotter))

        assert result.event == RunEvent.SNAPSHOT_TAKEN.value
        assert snapshotter.workspaces == [WORKSPACE]
        assert result.iteration == {"snapshot_id": "snap-1"}
        assert result.context == {"snapshot": "snap-1"}
        assert result.output["snapshot_id"] == "snap-1"
        assert result.output["changed_files"] == ["a.py"]

    def test_snapshotter_raising_is_snapshot_failed(self):
        snapshotter = FakeSnapshotter(error=RuntimeError("not a git repository"))
        result = SnapshotPhase().run(make_ctx("snapshotting", snapshotter=snapshotter))

        assert result.event == RunEvent.SNAPSHOT_FAILED.value
        assert result.error == {
            "type": "snapshot_failed",
            "message": "RuntimeError: not a git repository",
        }
        assert dict(result.iteration) == {
            "error_type": ErrorType.SYSTEM_ERROR,
            "error_message": "snapshot failed: RuntimeError: not a git repository",
        }

    def test_bad_iteration_limit_is_refused(self):
        from fsm_runner.presets.agent_loop import QueuePhase

        ctx = make_ctx("queued", input={"task": "t", "workspace": "/w", "max_iterations": 0})
        with pytest.raises(ValueError, match="max_iterations"):
            QueuePhase().run(ctx)


class TestVerifyPhase:
    """``verifying`` runs the levels and names what failed."""

    def test_passed(self):
        verifier = FakeVerifier(passing_report("L0", "L1", "L2"))
        result = VerifyPhase().run(make_ctx("verifying", iteration=2, verifier=verifier))

        assert result.event == RunEvent.VERIFY_PASSED.value
        assert result.error is None
        assert result.iteration == {
            "verification_ref": "verification-2",
            "passed": True,
            "levels_run": ["L0", "L1", "L2"],
            "verification_duration_ms": 3.0,
        }
        assert result.output == {"levels_run": ["L0", "L1", "L2"]}
        assert result.context == {"verification": unstructure(passing_report("L0", "L1", "L2"))}
        (artifact,) = result.artifacts
        assert (artifact.name, artifact.kind) == ("verification-2", "verification_report")
        assert artifact.content == unstructure(passing_report("L0", "L1", "L2"))

    def test_failed(self):
        verifier = FakeVerifier(failing_report("L1", "pytest -q", exit_code=5))
        result = VerifyPhase().run(make_ctx("verifying", verifier=verifier))

        assert result.event == RunEvent.VERIFY_FAILED_RETRYABLE.value
        details = {"level": "L1", "check": "pytest -q", "exit_code": 5}
        message = "level L1 failed: pytest -q"
        assert result.error == {"type": "verification_failed", "message": message}
        assert result.iteration["error_type"] is ErrorType.VERIFICATION_FAILED
        assert result.iteration["error_message"] == message
        assert result.iteration["error_details"] == details
        assert result.iteration["passed"] is False
        assert result.iteration["levels_run"] == ["L0", "L1"]
        assert result.iteration["verification_ref"] == "verification-1"
        assert result.output == {"levels_run": ["L0", "L1"], "failed": details}
        assert [a.name for a in result.artifacts] == ["verification-1"]

    def test_failed_level_without_a_failed_check(self):
        report = VerificationReport(passed=False, levels=(LevelResult("L2", passed=False),))
        result = VerifyPhase().run(make_ctx("verifying", verifier=FakeVerifier(report)))
        assert result.iteration["error_details"] == {
            "level": "L2",
            "check": None,
            "exit_code": None,
        }
        assert result.iteration["error_message"] == "level L2 failed"

    def test_levels_and_workspace_from_the_input(self):
        verifier = FakeVerifier()
        levels = {"L0": ["ruff check ."], "L1": ["pytest -q"]}
        ctx = make_ctx("verifying", input={**INPUT, "verify": levels}, verifier=verifier)
        VerifyPhase().run(ctx)
        (call,) = verifier.calls
        assert (call.workspace, call.levels, call.timeout) == (WORKSPACE, levels, None)

    def test_the_verifiers_own_levels_without_input(self):
        verifier = FakeVerifier()
        VerifyPhase().run(make_ctx("verifying", verifier=verifier))
        assert verifier.calls[0].levels is None

    def test_persister_raising_does_not_fail_the_phase(self):
        ctx = make_ctx(
            "verifying", verifier=FakeVerifier(), persister=FakePersister(error=OSError("ro fs"))
        )
        result = VerifyPhase().run(ctx)
        assert result.event == RunEvent.VERIFY_PASSED.value
        (artifact,) = result.artifacts
        assert (artifact.name, artifact.status, artifact.error) == (
            "verification-1",
            "failed",
            "OSError: ro fs",
        )


def feedback_ctx(report: VerificationReport | None = None, **services: Any) -> PhaseContext:
    context = {"verification": unstructure(report or failing_report())}
    return make_ctx("feedback", context=context, **services)


class TestFeedbackPhase:
    """``feedback`` turns the iteration's failure into feedback for the next build."""

    def test_generator_output_is_the_feedback(self):
        generator = FakeFeedback("import os in a.py")
        result = FeedbackPhase().run(feedback_ctx(feedback=generator))

        assert result.event == RunEvent.FEEDBACK_READY.value
        assert result.output == {"feedback": "import os in a.py", "fallback": False}
        assert result.context == {"feedback": "import os in a.py", "feedback_fallback": False}
        assert result.iteration == {"feedback": "import os in a.py", "feedback_fallback": False}
        assert generator.reports == [failing_report()]  # the report, rebuilt from the context
        assert generator.tasks == [TASK]

    def test_generator_raising_falls_back(self, caplog):
        report = VerificationReport(
            passed=False,
            levels=(
                LevelResult(
                    "L1",
                    passed=False,
                    checks=(
                        CheckResult("pytest -q", passed=False),
                        CheckResult("ruff check", passed=True),
                        CheckResult("mypy", passed=False),
                    ),
                ),
                LevelResult("L2", passed=False, checks=(CheckResult("e2e", passed=False),)),
            ),
        )
        ctx = feedback_ctx(report, feedback=FakeFeedback(RuntimeError("model overloaded")))
        with caplog.at_level(logging.WARNING):
            result = FeedbackPhase().run(ctx)

        text = result.output["feedback"]
        assert text == fallback_feedback(report)
        assert "- level L1: pytest -q, mypy" in text
        assert "ruff check" not in text
        assert "- level L2: e2e" in text
        assert result.output["fallback"] is True
        assert result.context == {"feedback": text, "feedback_fallback": True}
        assert result.iteration == {"feedback": text, "feedback_fallback": True}
        assert "model overloaded" in caplog.text

    def test_no_generator_falls_back(self):
        result = FeedbackPhase().run(feedback_ctx())
        assert result.output == {"feedback": fallback_feedback(failing_report()), "fallback": True}

    def test_build_failure_skips_the_generator(self):
        generator = FakeFeedback()
        ctx = make_ctx(
            "feedback",
            # a stale report from an earlier iteration must not be used
            context={"build_failure": "agent exited with 1", "verification": None},
            feedback=generator,
        )
        result = FeedbackPhase().run(ctx)

        text = "The previous attempt failed before verification: agent exited with 1"
        assert result.output == {"feedback": text, "fallback": False}
        assert result.context["feedback"] == text
        assert result.iteration["feedback"] == text
        assert generator.reports == []


class TestClassifyAgentExit:
    """An agent's exit code and deadline say how it went wrong."""

    @pytest.mark.parametrize(
        ("exit_code", "timed_out", "expected"),
        [
            (0, False, ErrorType.NONE),
            (1, False, ErrorType.AGENT_FAILURE),
            (2, False, ErrorType.AGENT_FAILURE),
            (128, False, ErrorType.AGENT_FAILURE),
            (137, False, ErrorType.TIMEOUT),
            (0, True, ErrorType.TIMEOUT),
            (1, True, ErrorType.TIMEOUT),
            (None, True, ErrorType.TIMEOUT),
            (-9, False, ErrorType.AGENT_CRASH),
            (-11, False, ErrorType.AGENT_CRASH),
            (139, False, ErrorType.AGENT_CRASH),
            (255, False, ErrorType.AGENT_CRASH),
            (None, False, ErrorType.AGENT_CRASH),
        ],
    )
    def test_table(self, exit_code, timed_out, expected):
        assert classify_agent_exit(exit_code, timed_out=timed_out) is expected


class TestFallbackFeedback:
    """The fallback names each failed level and its failed checks."""

    def test_content(self):
        assert fallback_feedback(failing_report("L1", "pytest -q")) == (
            "Verification failed. Fix the following and try again:\n- level L1: pytest -q"
        )

    def test_level_without_checks(self):
        report = VerificationReport(passed=False, levels=(LevelResult("L3", passed=False),))
        assert fallback_feedback(report).endswith("- level L3: (no check)")


# -- whole runs --------------------------------------------------------------------------------


def engine_with(
    journal,
    *,
    agent: FakeAgent | None = None,
    verifier: FakeVerifier | None = None,
    feedback: FakeFeedback | None = None,
    snapshotter: FakeSnapshotter | None = None,
    persister: FakePersister | None = None,
):
    return agent_loop_engine(
        journal=journal,
        agent=agent or FakeAgent(),
        snapshotter=snapshotter or FakeSnapshotter(),
        verifier=verifier or FakeVerifier(),
        feedback=feedback,
        persister=persister,
    )


def events(journal, run_id: str) -> list[str]:
    return [t.event for t in journal.transitions(run_id)]


class TestWholeRuns:
    """Runs through ``agent_loop_engine`` with fake services, on every journal."""

    def test_passes_on_the_first_try(self, journal):
        engine = engine_with(journal)
        run = engine.run(engine.start(INPUT))
        assert (run.state, run.status, run.iteration) == ("succeeded", RunLifecycle.SUCCEEDED, 1)
        assert events(journal, run.run_id) == [
            "STARTED",
            "RUN_ACCEPTED",
            "BUILD_SUCCEEDED",
            "SNAPSHOT_TAKEN",
            "VERIFY_PASSED",
        ]

    def test_two_failed_verifications_then_success(self, journal):
        agent = FakeAgent(agent_result(1), agent_result(2), agent_result(3))
        verifier = FakeVerifier(
            failing_report("L1"), failing_report("L2", "mypy"), passing_report()
        )
        feedback = FakeFeedback()
        engine = engine_with(journal, agent=agent, verifier=verifier, feedback=feedback)
        run = engine.run(engine.start(INPUT))

        assert (run.state, run.status, run.iteration) == ("succeeded", RunLifecycle.SUCCEEDED, 3)
        assert run.error is None

        records = journal.iterations(run.run_id)
        assert [r.iteration for r in records] == [1, 2, 3]
        assert [r.passed for r in records] == [False, False, True]
        assert [r.success for r in records] == [True, True, True]
        assert [r.tokens_total for r in records] == [110, 220, 330]
        assert [r.tokens_input for r in records] == [100, 200, 300]
        assert [r.cost_usd for r in records] == [0.01, 0.02, 0.03]
        assert [r.model for r in records] == ["model-x"] * 3
        assert [r.agent_session_id for r in records] == ["session-1", "session-2", "session-3"]
        assert [r.snapshot_id for r in records] == ["snap-1", "snap-2", "snap-3"]
        assert [r.error_type for r in records] == [
            ErrorType.VERIFICATION_FAILED,
            ErrorType.VERIFICATION_FAILED,
            ErrorType.NONE,
        ]
        assert [r.error_details for r in records] == [
            {"level": "L1", "check": "pytest -q", "exit_code": 1},
            {"level": "L2", "check": "mypy", "exit_code": 1},
            None,
        ]
        assert [r.feedback for r in records] == ["fix #1", "fix #2", None]
        assert [r.feedback_fallback for r in records] == [False, False, False]
        assert [r.levels_run for r in records] == [("L0", "L1"), ("L0", "L2"), ("L0", "L1")]
        assert [r.agent_result_ref for r in records] == ["agent-1", "agent-2", "agent-3"]
        assert [r.verification_ref for r in records] == [
            "verification-1",
            "verification-2",
            "verification-3",
        ]
        assert [r.state for r in records] == ["feedback", "feedback", "succeeded"]

        artifacts = {(a.name, a.kind, a.iteration, a.status) for a in journal.artifacts(run.run_id)}
        assert artifacts == {
            *((f"agent-{n}", "agent_result", n, "stored") for n in (1, 2, 3)),
            *((f"verification-{n}", "verification_report", n, "stored") for n in (1, 2, 3)),
        }
        by_name = {a.name: a for a in journal.artifacts(run.run_id)}
        assert by_name["agent-2"].content["session_id"] == "session-2"
        assert by_name["verification-1"].content["passed"] is False

        # the feedback phase's output is the next build's feedback; the session carries over
        feedback_outputs = [
            t.output["feedback"]
            for t in journal.transitions(run.run_id)
            if t.event == "FEEDBACK_READY"
        ]
        assert feedback_outputs == ["fix #1", "fix #2"]
        assert [r.feedback for r in agent.requests] == [None, "fix #1", "fix #2"]
        assert [r.session_id for r in agent.requests] == [None, "session-1", "session-2"]
        assert [r.iteration for r in agent.requests] == [1, 2, 3]
        assert feedback.reports == [failing_report("L1"), failing_report("L2", "mypy")]
        assert len(verifier.calls) == 3

    def test_iteration_limit_spent(self, journal):
        agent = FakeAgent(agent_result(1), agent_result(2), agent_result(3))
        verifier = FakeVerifier(failing_report())
        engine = engine_with(journal, agent=agent, verifier=verifier, feedback=FakeFeedback())
        run = engine.run(engine.start({**INPUT, "max_iterations": 2}))

        assert (run.state, run.status, run.iteration) == ("failed", RunLifecycle.FAILED, 2)
        assert run.error is not None
        assert run.error["message"] == "iteration limit spent"
        assert journal.transitions(run.run_id)[-1].result["reason"] == "iteration limit spent"
        records = journal.iterations(run.run_id)
        assert [r.iteration for r in records] == [1, 2]
        assert [r.passed for r in records] == [False, False]
        assert len(agent.requests) == 2

    def test_default_iteration_limit_is_three(self, journal):
        agent = FakeAgent()
        engine = engine_with(journal, agent=agent, verifier=FakeVerifier(failing_report()))
        run = engine.run(engine.start(INPUT))
        assert (run.state, run.iteration) == ("failed", 3)
        assert run.error["message"] == "iteration limit spent"
        assert len(agent.requests) == 3

    def test_wall_clock_limit_spent(self, journal):
        agent = FakeAgent()
        feedback = FakeFeedback()
        verifier = FakeVerifier(failing_report())
        engine = engine_with(journal, agent=agent, verifier=verifier, feedback=feedback)
        run = engine.run(engine.start({**INPUT, "max_seconds": 0}))

        assert (run.state, run.status, run.iteration) == ("failed", RunLifecycle.FAILED, 1)
        assert run.error["message"] == "wall-clock limit spent"
        assert len(agent.requests) == 1
        assert len(feedback.reports) == 1
        assert events(journal, run.run_id)[-1] == "FEEDBACK_READY"
        (record,) = journal.iterations(run.run_id)
        assert record.feedback == "fix #1"

    def test_wall_clock_limit_not_spent(self, journal):
        verifier = FakeVerifier(failing_report(), passing_report())
        engine = engine_with(journal, verifier=verifier)
        run = engine.run(engine.start({**INPUT, "max_seconds": 3600}))
        assert (run.state, run.iteration) == ("succeeded", 2)

    def test_build_failure_loops_to_feedback_then_builds_again(self, journal):
        failed = agent_result(1, success=False, exit_code=1, stderr="SyntaxError in a.py")
        agent = FakeAgent(failed, agent_result(2))
        feedback = FakeFeedback()
        verifier = FakeVerifier()
        engine = engine_with(journal, agent=agent, verifier=verifier, feedback=feedback)
        run = engine.run(engine.start(INPUT))

        assert (run.state, run.iteration) == ("succeeded", 2)
        assert events(journal, run.run_id) == [
            "STARTED",
            "RUN_ACCEPTED",
            "BUILD_FAILED",
            "FEEDBACK_READY",
            "BUILD_SUCCEEDED",
            "SNAPSHOT_TAKEN",
            "VERIFY_PASSED",
        ]
        text = "The previous attempt failed before verification: agent exited with 1: SyntaxError in a.py"
        first, second = journal.iterations(run.run_id)
        assert (first.success, first.error_type, first.feedback) == (
            False,
            ErrorType.AGENT_FAILURE,
            text,
        )
        assert first.passed is None
        assert first.snapshot_id is None
        assert (second.success, second.passed, second.error_type) == (True, True, ErrorType.NONE)
        assert agent.requests[1].feedback == text
        assert agent.requests[1].session_id == "session-1"  # the failed build's session
        assert feedback.reports == []  # no report to generate feedback from
        assert len(verifier.calls) == 1
        assert run.context["build_failure"] is None

    def test_agent_crash_after_a_failed_verification(self, journal):
        agent = FakeAgent(agent_result(1), RuntimeError("agent binary vanished"), agent_result(3))
        verifier = FakeVerifier(failing_report(), passing_report())
        feedback = FakeFeedback()
        engine = engine_with(journal, agent=agent, verifier=verifier, feedback=feedback)
        run = engine.run(engine.start(INPUT))

        assert (run.state, run.iteration) == ("succeeded", 3)
        records = journal.iterations(run.run_id)
        assert [r.error_type for r in records] == [
            ErrorType.VERIFICATION_FAILED,
            ErrorType.AGENT_CRASH,
            ErrorType.NONE,
        ]
        crash = records[1]
        assert crash.error_message == "RuntimeError: agent binary vanished"
        assert crash.feedback.endswith("RuntimeError: agent binary vanished")
        # the generator ran once, for the failed verification, not for the crash
        assert len(feedback.reports) == 1
        assert agent.requests[2].feedback == crash.feedback
        assert agent.requests[2].session_id == "session-1"
        names = sorted(a.name for a in journal.artifacts(run.run_id))
        assert names == ["agent-1", "agent-3", "verification-1", "verification-3"]

    def test_snapshot_failure_fails_the_run(self, journal):
        snapshotter = FakeSnapshotter(error=RuntimeError("not a git repository"))
        verifier = FakeVerifier()
        engine = engine_with(journal, snapshotter=snapshotter, verifier=verifier)
        run = engine.run(engine.start(INPUT))
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        assert run.error["type"] == "snapshot_failed"
        assert verifier.calls == []

    def test_generator_failure_falls_back_in_the_journal(self, journal):
        feedback = FakeFeedback(RuntimeError("model overloaded"))
        agent = FakeAgent()
        verifier = FakeVerifier(failing_report(), passing_report())
        engine = engine_with(journal, agent=agent, verifier=verifier, feedback=feedback)
        run = engine.run(engine.start(INPUT))

        assert run.state == "succeeded"
        first, _ = journal.iterations(run.run_id)
        assert first.feedback == fallback_feedback(failing_report())
        assert first.feedback_fallback is True
        assert agent.requests[1].feedback == first.feedback

    def test_persistence_failure_never_fails_the_run(self, journal):
        engine = engine_with(journal, persister=FakePersister(error=OSError("disk full")))
        run = engine.run(engine.start(INPUT))
        assert run.state == "succeeded"
        artifacts = {(a.name, a.status, a.error) for a in journal.artifacts(run.run_id)}
        assert artifacts == {
            ("agent-1", "failed", "OSError: disk full"),
            ("verification-1", "failed", "OSError: disk full"),
        }

    def test_verifier_raising_is_a_system_error(self, journal):
        verifier = FakeVerifier(RuntimeError("bug in the verifier"))
        engine = engine_with(journal, verifier=verifier)
        run = engine.run(engine.start(INPUT))

        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        assert events(journal, run.run_id)[-1] == RunEvent.SYSTEM_ERROR.value
        assert run.error["type"] == "RuntimeError"
        assert run.error["message"] == "bug in the verifier"
        assert "Traceback" in run.error["traceback"]
        (record,) = journal.iterations(run.run_id)
        assert record.error_type is ErrorType.SYSTEM_ERROR
        assert record.error_message == "RuntimeError: bug in the verifier"
        assert record.success is True  # the build before it is still on record
        assert record.passed is None

    def test_queue_refusal_is_a_system_error(self, journal):
        agent = FakeAgent()
        engine = engine_with(journal, agent=agent)
        run = engine.run(engine.start({"task": TASK}))
        assert (run.state, run.iteration) == ("failed", 0)
        assert run.error["type"] == "ValueError"
        assert "lacks workspace" in run.error["message"]
        assert agent.requests == []
        assert journal.iterations(run.run_id) == []

    def test_abort_between_phases(self, journal):
        agent = FakeAgent()
        snapshotter = FakeSnapshotter()
        engine = engine_with(journal, agent=agent, snapshotter=snapshotter)
        run_id = engine.start(INPUT)
        run = engine.run(run_id, max_steps=2)
        assert run.state == "snapshotting"

        run = engine.abort(run_id, "operator said stop")

        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
        assert run.error == {"type": "USER_ABORTED", "message": "operator said stop"}
        assert journal.load(run_id).state == "canceled"
        assert events(journal, run_id)[-1] == RunEvent.USER_ABORTED.value
        assert snapshotter.workspaces == []
        # nothing already journaled is removed
        assert [a.name for a in journal.artifacts(run_id)] == ["agent-1"]

    def test_abort_while_the_agent_runs(self, journal):
        run_id = "run-abort"

        def build_then_abort(request):  # engine is bound below, before the agent runs
            engine.abort(run_id, "user pressed stop")
            return agent_result(request.iteration)

        agent = FakeAgent(build_then_abort)
        snapshotter = FakeSnapshotter()
        engine = engine_with(journal, agent=agent, snapshotter=snapshotter)
        engine.start(INPUT, run_id=run_id)
        run = engine.run(run_id)

        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
        # the build's outcome came after the request: refused, the abort taken from building
        assert events(journal, run_id)[-2:] == ["RUN_ACCEPTED", RunEvent.USER_ABORTED.value]
        assert journal.transitions(run_id)[-1].from_state == "building"
        assert snapshotter.workspaces == []
        assert journal.load(run_id).abort_reason is None
        (record,) = journal.iterations(run_id)
        assert record.success is None


def test_whole_run_results_are_json_data(journal):
    """What a run journals reads back as plain data, whichever journal holds it."""
    engine = engine_with(journal, verifier=FakeVerifier(failing_report(), passing_report()))
    run = engine.run(engine.start(INPUT))
    reloaded = journal.load(run.run_id)
    assert reloaded.context["session_id"] == "session-1"
    assert reloaded.context["feedback"] == fallback_feedback(failing_report())
    assert reloaded.context["verification"] == unstructure(passing_report())
    assert isinstance(AgentResult(**journal.artifacts(run.run_id)[0].content), AgentResult)


class TestAgentThatCannotRun:
    """An agent command that was not found or cannot be executed fails the run at once."""

    @pytest.mark.parametrize(
        ("exit_code", "reason"), [(127, "was not found"), (126, "cannot be executed")]
    )
    def test_build_reports_a_system_error_naming_the_command(self, exit_code, reason):
        agent = FakeAgent(
            agent_result(success=False, exit_code=exit_code, stderr="sh: 1: my-agent: not found")
        )
        ctx = make_ctx(
            "building", input={**INPUT, "agent": {"command": "my-agent --json"}}, agent=agent
        )

        result = BuildPhase().run(ctx)

        assert result.event == RunEvent.SYSTEM_ERROR.value
        message = f"the agent command 'my-agent --json' {reason} (exit code {exit_code})"
        assert result.error == {
            "type": "agent_not_runnable",
            "message": f"{message}: sh: 1: my-agent: not found",
        }
        assert result.iteration["error_type"] is ErrorType.SYSTEM_ERROR
        assert result.iteration["success"] is False

    def test_the_run_fails_without_spending_its_iterations(self, journal):
        agent = FakeAgent(agent_result(success=False, exit_code=127, stderr="not found"))
        verifier = FakeVerifier()
        engine = engine_with(journal, agent=agent, verifier=verifier)

        run = engine.run(engine.start({**INPUT, "max_iterations": 3}))

        assert (run.state, run.iteration) == ("failed", 1)
        assert run.error["message"] == "the agent command was not found (exit code 127): not found"
        assert len(agent.requests) == 1
        assert verifier.calls == []
        (record,) = journal.iterations(run.run_id)
        assert record.error_type is ErrorType.SYSTEM_ERROR

    def test_a_failing_agent_still_gets_its_iterations(self, journal):
        agent = FakeAgent(agent_result(success=False, exit_code=1))
        engine = engine_with(journal, agent=agent)

        run = engine.run(engine.start({**INPUT, "max_iterations": 2}))

        assert run.error["message"] == "iteration limit spent"
        assert len(agent.requests) == 2


class CheckingSnapshotter(FakeSnapshotter):
    """A snapshotter that checks the workspace before the first build (and refuses it)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.checked: list[str] = []
        self.refusal = error

    def check_workspace(self, workspace: str) -> str:
        self.checked.append(workspace)
        if self.refusal is not None:
            raise self.refusal
        return "commits on branch main"


class TestWorkspaceCheckedBeforeTheAgent:
    """``queued`` has the snapshotter check the workspace, so a bad one never meets the agent."""

    def test_a_workspace_the_snapshotter_refuses_fails_the_run_in_queued(self, journal):
        agent = FakeAgent()
        snapshotter = CheckingSnapshotter(ValueError("not a git repository"))
        engine = engine_with(journal, agent=agent, snapshotter=snapshotter)

        run = engine.run(engine.start(INPUT))

        assert run.state == "failed"
        assert "not a git repository" in run.error["message"]
        assert events(journal, run.run_id) == ["STARTED", "SYSTEM_ERROR"]
        assert snapshotter.checked == [WORKSPACE]
        assert agent.requests == []

    def test_a_real_workspace_outside_git(self, journal, tmp_path):
        from fsm_runner.presets.agent_loop.services import GitSnapshotter

        agent = FakeAgent()
        engine = agent_loop_engine(
            journal=journal, agent=agent, snapshotter=GitSnapshotter(), verifier=FakeVerifier()
        )

        run = engine.run(engine.start({**INPUT, "workspace": str(tmp_path)}))

        assert run.state == "failed"
        assert "not inside a git work tree" in run.error["message"]
        assert agent.requests == []

    def test_an_accepted_workspace(self, journal):
        snapshotter = CheckingSnapshotter()
        engine = engine_with(journal, snapshotter=snapshotter)

        assert engine.run(engine.start(INPUT)).state == "succeeded"
        assert snapshotter.checked == [WORKSPACE]
