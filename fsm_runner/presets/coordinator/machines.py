"""The coordinator's two machines, :data:`SESSION` and :data:`TASK`, and the task's phases.

A session has one handler (``finalizing``, in :mod:`fsm_runner.presets.coordinator.summary`);
every other step is an event the :class:`fsm_runner.presets.coordinator.Coordinator` sends. A
task has a handler for each step: :class:`SchedulePhase`, :class:`DispatchPhase`,
:class:`GatePhase`, :class:`ApplyPhase`, :class:`VerifyPhase` and :class:`RevertPhase`. Every
name here is re-exported by :mod:`fsm_runner.presets.coordinator`, which is where hosts import
them from.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from fsm_runner import (
    ArtifactRecord,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RunEvent,
    RunRecord,
    State,
    Transition,
)
from fsm_runner.presets.agent_loop import VerificationReport, Verifier
from fsm_runner.presets.agent_loop.services import TemplateFeedbackGenerator
from fsm_runner.presets.coordinator.tasks import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_ROLES,
    AgentRole,
    Gate,
    GateVerdict,
    Proposal,
    Task,
    Workspace,
)

__all__ = [
    "SESSION",
    "TASK",
    "ApplyPhase",
    "DispatchPhase",
    "GatePhase",
    "RevertPhase",
    "SchedulePhase",
    "SessionEvent",
    "TaskEvent",
    "VerifyPhase",
]

# -- the machines ------------------------------------------------------------------------------


class SessionEvent(str, enum.Enum):
    """The events of a session (:data:`SESSION`)."""

    PLAN_SUBMITTED = "PLAN_SUBMITTED"
    PLAN_APPROVED = "PLAN_APPROVED"
    TASK_FINISHED = "TASK_FINISHED"
    TASK_FAILED = "TASK_FAILED"
    TASK_SKIPPED = "TASK_SKIPPED"
    TASK_ABORTED = "TASK_ABORTED"
    FINALIZE_REQUESTED = "FINALIZE_REQUESTED"
    SESSION_FINALIZED = "SESSION_FINALIZED"
    SESSION_FAILED = "SESSION_FAILED"
    RESET_TO_IDEA = "RESET_TO_IDEA"
    RESET_TO_PLAN_REVIEW = "RESET_TO_PLAN_REVIEW"

    def __str__(self) -> str:
        return self.value


class TaskEvent(str, enum.Enum):
    """The events of a task (:data:`TASK`)."""

    TASK_DISPATCHED = "TASK_DISPATCHED"
    PROPOSAL_READY = "PROPOSAL_READY"
    AGENT_FAILED = "AGENT_FAILED"
    GATES_PASSED = "GATES_PASSED"
    GATE_BLOCKED = "GATE_BLOCKED"
    DIFF_APPLIED = "DIFF_APPLIED"
    APPLY_FAILED = "APPLY_FAILED"
    DIFF_REVERTED = "DIFF_REVERTED"
    TASK_SKIPPED = "TASK_SKIPPED"

    def __str__(self) -> str:
        return self.value


_E = SessionEvent
_T = TaskEvent

#: A session: idea → plan_review → execution → finalizing → complete (or failed, aborted).
SESSION = MachineSpec(
    "coordinator-session",
    states=[
        State("idea", description="the idea; waits for a plan"),
        State("plan_review", description="the plan; waits for approval"),
        State("execution", description="tasks run, one child run each"),
        State(
            "finalizing",
            handler="finalize",
            description="global verification, then the run summary",
        ),
        State("complete", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("aborted", terminal=True, outcome="aborted"),
    ],
    transitions=[
        Transition("idea", _E.PLAN_SUBMITTED, "plan_review"),
        Transition("plan_review", _E.PLAN_APPROVED, "execution"),
        Transition("execution", _E.TASK_FINISHED, "execution"),
        Transition("execution", _E.TASK_FAILED, "execution"),
        Transition("execution", _E.TASK_SKIPPED, "execution"),
        # A reset or an abort calls off the running task wherever the session is.
        Transition("idea", _E.TASK_ABORTED, "idea"),
        Transition("plan_review", _E.TASK_ABORTED, "plan_review"),
        Transition("execution", _E.TASK_ABORTED, "execution"),
        Transition("execution", _E.FINALIZE_REQUESTED, "finalizing", guards=["tasks_settled"]),
        Transition("finalizing", _E.SESSION_FINALIZED, "complete"),
        Transition(
            "finalizing", RunEvent.VERIFY_FAILED, "execution", reason="global verification failed"
        ),
        Transition("finalizing", RunEvent.SYSTEM_ERROR, "execution", reason="finalizing failed"),
        Transition("execution", _E.SESSION_FAILED, "failed"),
        Transition(["plan_review", "execution"], _E.RESET_TO_IDEA, "idea"),
        Transition("execution", _E.RESET_TO_PLAN_REVIEW, "plan_review"),
        Transition("*", RunEvent.USER_ABORTED, "aborted"),
    ],
)

_RETRIES_SPENT = "retries exhausted"

#: A task: scheduled → dispatched → gated → applied → verified → done, with explicit retries.
TASK = MachineSpec(
    "coordinator-task",
    states=[
        State("scheduled", handler="schedule", description="pick the role by failures so far"),
        State("dispatched", handler="dispatch", description="the agent proposes a diff"),
        State("gated", handler="gate", description="the gates judge the proposal"),
        State("applied", handler="apply", description="apply the diff, whole or not at all"),
        State("verified", handler="verify", description="run the task's verification"),
        State("reverted", handler="revert", description="take a failed diff out again"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("blocked", terminal=True, outcome="failed", description="a gate blocked it"),
        # Called off because a dependency did not get done; it did not fail itself.
        State("skipped", terminal=True, outcome="aborted"),
        State("aborted", terminal=True, outcome="aborted"),
    ],
    transitions=[
        Transition("scheduled", _T.TASK_DISPATCHED, "dispatched"),
        Transition("scheduled", _T.TASK_SKIPPED, "skipped"),
        Transition("dispatched", _T.PROPOSAL_READY, "gated"),
        Transition("dispatched", _T.AGENT_FAILED, "scheduled", guards=["attempts_left"]),
        Transition("dispatched", _T.AGENT_FAILED, "failed", reason=_RETRIES_SPENT),
        Transition("gated", _T.GATES_PASSED, "applied"),
        Transition("gated", _T.GATE_BLOCKED, "blocked"),
        Transition("applied", _T.DIFF_APPLIED, "verified"),
        Transition("applied", _T.APPLY_FAILED, "scheduled", guards=["attempts_left"]),
        Transition("applied", _T.APPLY_FAILED, "failed", reason=_RETRIES_SPENT),
        Transition("verified", RunEvent.VERIFY_PASSED, "done"),
        Transition("verified", RunEvent.VERIFY_FAILED, "reverted"),
        Transition("reverted", _T.DIFF_REVERTED, "scheduled", guards=["attempts_left"]),
        Transition("reverted", _T.DIFF_REVERTED, "failed", reason=_RETRIES_SPENT),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "aborted"),
    ],
)

_TASK_ENDS = frozenset(TASK.terminal_states)
# Ends that leave the tasks downstream unable to run.
_UNSUCCESSFUL = frozenset({"failed", "blocked", "skipped", "aborted"})
# States in which a task's diff may be in the workspace.
_DIFF_STATES = frozenset({"applied", "verified", "reverted"})
# Events that end a task in the middle of a step, with its diff possibly in the workspace
# (every other way out of those states has settled where the diff is).
_CUT_SHORT = frozenset({RunEvent.SYSTEM_ERROR.value, RunEvent.USER_ABORTED.value})
_RECORD_EVENTS = {
    "done": _E.TASK_FINISHED,
    "failed": _E.TASK_FAILED,
    "blocked": _E.TASK_FAILED,
    "skipped": _E.TASK_SKIPPED,
    "aborted": _E.TASK_ABORTED,
}
_RECORD_EVENT_NAMES = frozenset(event.value for event in _RECORD_EVENTS.values())
_RESET_EVENTS = {"idea": _E.RESET_TO_IDEA, "plan_review": _E.RESET_TO_PLAN_REVIEW}


def _attempts_left(run: RunRecord) -> bool:
    task = run.input.get("task", {}) if isinstance(run.input, Mapping) else {}
    limit = int(task.get("max_attempts", DEFAULT_MAX_ATTEMPTS))
    return int(run.context.get("failures", 0)) < limit


# -- the task phases ---------------------------------------------------------------------------


def _task(ctx: PhaseContext) -> Task:
    return Task.from_dict(ctx.input["task"])


def _failures(ctx: PhaseContext) -> int:
    return int(ctx.context.get("failures", 0))


def _attempt(ctx: PhaseContext) -> int:
    return int(ctx.context.get("attempt", _failures(ctx) + 1))


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _plain(record: Any) -> dict[str, Any]:
    """An attrs record (a verdict, a verification report) as JSON-ready data.

    In the form the journal writes its own records, so what is journaled stays the same, down
    to the order of the keys: the fields that differ from their default (in records nested
    inside too), then the rest of ``record``'s own fields; tuples as lists.
    """
    data: dict[str, Any] = _plain_value(record)
    for field in attrs.fields(type(record)):
        if field.name not in data:
            data[field.name] = _plain_value(getattr(record, field.name))
    return data


def _plain_value(value: Any) -> Any:
    if attrs.has(type(value)):
        return {
            field.name: _plain_value(item)
            for field in attrs.fields(type(value))
            if not _is_default(field, item := getattr(value, field.name))
        }
    if isinstance(value, list | tuple):
        return [_plain_value(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain_value(item) for key, item in value.items()}
    return value


def _is_default(field: attrs.Attribute[Any], value: Any) -> bool:
    default: Any = field.default
    if default is attrs.NOTHING:
        return False
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()  # the records nested here take no `self`
    return bool(value == default)


def _report_data(report: VerificationReport) -> dict[str, Any]:
    """The short form of a verification report journaled with a transition."""
    failed = report.failed_levels[0] if report.failed_levels else None
    check = next((c for c in failed.checks if not c.passed), None) if failed else None
    return {
        "passed": report.passed,
        "levels_run": list(report.levels_run),
        "failed": (
            None
            if failed is None
            else {
                "level": failed.level,
                "check": check.command if check else None,
                "exit_code": check.exit_code if check else None,
            }
        ),
        "duration_ms": report.duration_ms,
    }


def _failure_message(data: Mapping[str, Any]) -> str:
    failed = data.get("failed") or {}
    message = f"level {failed.get('level')} failed"
    if failed.get("check"):
        message += f": {failed['check']} (exit code {failed.get('exit_code')})"
    return message


class SchedulePhase:
    """``scheduled``: route the next attempt to a role, by the task's failures so far."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report TASK_DISPATCHED with the role and attempt (journaled before the agent runs)."""
        failures = _failures(ctx)
        roles = tuple(ctx.input.get("roles") or DEFAULT_ROLES)
        role = roles[min(failures, len(roles) - 1)]
        routing = {"role": role, "attempt": failures + 1}
        return PhaseResult(_T.TASK_DISPATCHED, output=routing, context=routing)


def _proposal(value: object) -> Proposal:
    """What an agent returned, as a proposal (a bare diff is a proposal without notes).

    Raises:
        TypeError: it is neither.
    """
    if isinstance(value, str):
        return Proposal(value)
    if not isinstance(value, Proposal):
        raise TypeError(f"the agent returned {type(value).__name__}, not a Proposal")
    return value


class DispatchPhase:
    """``dispatched``: the agent in the chosen role proposes a diff."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report PROPOSAL_READY with the proposal, or AGENT_FAILED if the agent raised."""
        agents: AgentRole = ctx.services["agents"]
        workspace: Workspace = ctx.services["workspace"]
        task = _task(ctx)
        role = str(ctx.context.get("role", DEFAULT_ROLES[0]))
        attempt = _attempt(ctx)
        routing = {"role": role, "attempt": attempt}
        try:
            proposal = _proposal(
                agents.produce(
                    task,
                    role=role,
                    attempt=attempt,
                    feedback=ctx.context.get("feedback"),
                    workspace=workspace.path,
                )
            )
        except Exception as exc:  # noqa: BLE001 - an agent failing is retried with escalation
            message = _one_line(exc)
            return PhaseResult(
                _T.AGENT_FAILED,
                output=routing,
                error={"type": "agent_failed", "message": message},
                context={
                    "failures": _failures(ctx) + 1,
                    "feedback": f"Attempt {attempt} ({role}) failed: {message}",
                },
            )
        artifact = ArtifactRecord(
            f"proposal-{attempt}",
            "proposal",
            {**routing, "diff": proposal.diff, "notes": proposal.notes},
        )
        return PhaseResult(
            _T.PROPOSAL_READY,
            output={**routing, "notes": proposal.notes, "diff_lines": proposal.diff.count("\n")},
            context={"diff": proposal.diff, "notes": proposal.notes},
            artifacts=[artifact],
        )


class GatePhase:
    """``gated``: every gate judges the proposal; the first block ends the task."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report GATES_PASSED, or GATE_BLOCKED with the gate and its reason."""
        gates: Sequence[Gate] = ctx.services["gates"]
        workspace: Workspace = ctx.services["workspace"]
        task = _task(ctx)
        proposal = Proposal(str(ctx.context.get("diff", "")), str(ctx.context.get("notes", "")))
        verdicts: list[dict[str, Any]] = []
        for gate in gates:
            try:
                verdict = gate.check(task, proposal, workspace=workspace.path)
            except Exception as exc:  # noqa: BLE001 - a gate that cannot judge blocks
                name = str(getattr(gate, "name", type(gate).__name__))
                verdict = GateVerdict(
                    name, passed=False, reason=f"the gate raised {_one_line(exc)}"
                )
            verdicts.append(_plain(verdict))
            if not verdict.passed:
                return PhaseResult(
                    _T.GATE_BLOCKED,
                    output={"gate": verdict.gate, "reason": verdict.reason, "verdicts": verdicts},
                    error={"type": "gate_blocked", "message": f"{verdict.gate}: {verdict.reason}"},
                )
        return PhaseResult(_T.GATES_PASSED, output={"verdicts": verdicts})


class ApplyPhase:
    """``applied``: apply the diff to the workspace, whole or not at all, and never twice."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report DIFF_APPLIED (saying if it was applied already), or APPLY_FAILED."""
        workspace: Workspace = ctx.services["workspace"]
        # The seq that entered this visit: the same when the phase runs again after a crash,
        # another for the next attempt's visit.
        result = workspace.apply(str(ctx.context["diff"]), key=f"{ctx.run_id}@{ctx.run.seq}")
        if result.done:
            return PhaseResult(
                _T.DIFF_APPLIED,
                output={"already_applied": result.already, "files": list(result.files)},
            )
        message = f"the diff does not apply: {result.detail}"
        return PhaseResult(
            _T.APPLY_FAILED,
            output={"detail": result.detail, "attempt": _attempt(ctx)},
            error={"type": "apply_failed", "message": message},
            context={"failures": _failures(ctx) + 1, "feedback": message},
        )


class VerifyPhase:
    """``verified``: run the task's verification on the workspace with its diff applied."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report VERIFY_PASSED (and commit the workspace), or VERIFY_FAILED with feedback."""
        verifier: Verifier = ctx.services["verifier"]
        workspace: Workspace = ctx.services["workspace"]
        task = _task(ctx)
        attempt = _attempt(ctx)
        report = VerificationReport(passed=True)
        if task.verify:
            try:
                report = verifier.verify(workspace.path, levels=task.verify, timeout=ctx.remaining)
            except Exception as exc:  # noqa: BLE001 - a verification that cannot run fails
                message = f"verification could not run: {_one_line(exc)}"
                return PhaseResult(
                    RunEvent.VERIFY_FAILED,
                    output={"passed": False, "attempt": attempt, "levels_run": [], "failed": None},
                    error={"type": "verification_failed", "message": message},
                    context={"feedback": message},
                )
        data = {**_report_data(report), "attempt": attempt}
        artifact = ArtifactRecord(f"verification-{attempt}", "verification_report", _plain(report))
        if report.passed:
            commit = workspace.commit(f"{task.id}: {task.description or 'done'}")
            return PhaseResult(
                RunEvent.VERIFY_PASSED, output={**data, "commit": commit}, artifacts=[artifact]
            )
        generator: TemplateFeedbackGenerator = ctx.services["feedback"]
        return PhaseResult(
            RunEvent.VERIFY_FAILED,
            output=data,
            error={"type": "verification_failed", "message": _failure_message(data)},
            context={"feedback": generator.generate(report, task=task.description or task.id)},
            artifacts=[artifact],
        )


class RevertPhase:
    """``reverted``: take the diff that failed verification out of the workspace."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report DIFF_REVERTED; the failure counts now, so the guard sees it."""
        workspace: Workspace = ctx.services["workspace"]
        result = workspace.revert(str(ctx.context["diff"]), key=f"{ctx.run_id}@{ctx.run.seq}")
        if not result.done:
            # Neither applied nor cleanly taken out: the workspace moved under us. Nothing
            # sensible can follow automatically; SYSTEM_ERROR ends the task as failed.
            raise RuntimeError(f"cannot take the diff out of the workspace: {result.detail}")
        # Keep the failure that brought the task here as the run's error.
        error = {k: v for k, v in (ctx.run.error or {}).items() if k in ("type", "message")}
        return PhaseResult(
            _T.DIFF_REVERTED,
            output={"reverted": not result.already, "attempt": _attempt(ctx)},
            error=error or None,
            context={"failures": _failures(ctx) + 1},
        )
