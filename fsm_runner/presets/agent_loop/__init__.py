"""The agent-loop preset: an AI coding agent's build → snapshot → verify → feedback loop.

::

    queued → building → snapshotting → verifying → succeeded
                ↑                          │
                └──── feedback ←───────────┘   (VERIFY_FAILED_RETRYABLE, BUILD_FAILED)

plus ``failed`` and ``canceled``. Each pass through ``building`` starts a new iteration; the
loop back from ``feedback`` is guarded by the iteration limit (``max_iterations`` in the run's
input) and an optional wall-clock limit (``max_seconds``), and when either is spent the run fails
with that reason. Every iteration keeps an :class:`fsm_runner.records.IterationRecord` (tokens,
cost, levels run, errors …) in the journal, written with the transitions that update it.

**The approval gate** (optional: ``agent_loop_spec(approval=True)``,
``agent_loop_engine(..., approval=True)``, ``fsm-runner demo --ask``): a change that passed
verification is not done until a person says so::

    verifying --VERIFY_PASSED--> awaiting_approval --APPROVE--> succeeded
                                        │ REJECT {"comment": "..."}  → feedback → building …
                                        └ TIMEOUT (no answer in 24 h) → canceled

``awaiting_approval`` is a waiting state (``State(wait=Wait(timeout=..., prompt=...,
schema=...))``): the run holds no lease and no process there, and continues on a signal —
``Engine.signal(run_id, "APPROVE")``, or from a shell ``fsm-runner signal RUN APPROVE`` (then
``REJECT --data '{"comment": "..."}'``). The reviewer's comment is the next build's feedback
(:func:`rejection_feedback`), and the iteration and wall-clock limits still apply: a
rejection with no iteration left fails the run. The gate's own ``TIMEOUT`` exit cancels the
run (it comes before the wildcard ``TIMEOUT`` that fails it). After ``REJECT`` the run stands
in ``feedback``, a phase to run: a worker of the app, or ``fsm-runner resume RUN``, takes it
on to the next build and back to the gate. :data:`AGENT_LOOP` itself is unchanged (its runs
and spec hash stay as they were); the gated machine is named ``agent-loop-approval``, and only
an engine built with ``approval=True`` (the same ``approval_timeout``) continues its runs — on
the command line ``fsm_runner.presets.agent_loop.commands:make_approval_engine``, which the
runs of ``--ask`` name as their app.

The phase handlers are thin: each uses services injected through ``ctx.services``:

``agent``       :class:`AgentDriver` — runs the agent on the task, feedback and last session.
``snapshotter`` :class:`Snapshotter` — captures the workspace after the build.
``verifier``    :class:`Verifier` — runs verification levels L0 to L3.
``feedback``    :class:`FeedbackGenerator` — turns a failed report into feedback.
``persister``   :class:`ResultPersister` — stores agent results and reports as artifacts.

Real implementations live in :mod:`fsm_runner.presets.agent_loop.services`; this module uses only
fsm_runner's public API, as a host app would.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from fsm_runner import (
    ArtifactRecord,
    Engine,
    ErrorType,
    Journal,
    Listener,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RunEvent,
    RunRecord,
    State,
    Transition,
    Wait,
    structure,
    unstructure,
)

__all__ = [
    "AGENT_LOOP",
    "APPROVAL_PROMPT",
    "APPROVAL_SCHEMA",
    "APPROVAL_TIMEOUT",
    "AWAITING_APPROVAL",
    "AgentDriver",
    "AgentRequest",
    "AgentResult",
    "BuildPhase",
    "CheckResult",
    "FeedbackGenerator",
    "FeedbackPhase",
    "JournalPersister",
    "LevelResult",
    "QueuePhase",
    "ResultPersister",
    "Snapshot",
    "SnapshotPhase",
    "Snapshotter",
    "VerificationReport",
    "Verifier",
    "VerifyPhase",
    "agent_loop_engine",
    "agent_loop_spec",
    "classify_agent_exit",
    "fallback_feedback",
    "guards",
    "rejection_feedback",
]

_log = logging.getLogger("fsm_runner.presets.agent_loop")

# -- the machine -------------------------------------------------------------------------------

RUN_ACCEPTED = "RUN_ACCEPTED"
BUILD_SUCCEEDED = RunEvent.BUILD_SUCCEEDED.value
BUILD_FAILED = RunEvent.BUILD_FAILED.value
SNAPSHOT_TAKEN = RunEvent.SNAPSHOT_TAKEN.value
SNAPSHOT_FAILED = RunEvent.SNAPSHOT_FAILED.value
VERIFY_PASSED = RunEvent.VERIFY_PASSED.value
VERIFY_FAILED_RETRYABLE = RunEvent.VERIFY_FAILED_RETRYABLE.value
FEEDBACK_READY = RunEvent.FEEDBACK_READY.value

APPROVE = "APPROVE"
REJECT = "REJECT"

#: The approval gate's waiting state (``agent_loop_spec(approval=True)``).
AWAITING_APPROVAL = "awaiting_approval"
#: How long the approval gate waits for an answer by default: 24 hours, then the run is canceled.
APPROVAL_TIMEOUT = 24 * 3600.0
#: What the approval gate asks, and the JSON schema of an answer's payload.
APPROVAL_PROMPT = "Verification passed. Apply the change?"
APPROVAL_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "comment": {
            "type": "string",
            "description": "with REJECT: what to change (the next build's feedback)",
        }
    },
    "additionalProperties": False,
}

_STATES = [
    State("queued", handler="queue", description="check the task and workspace"),
    State(
        "building",
        handler="build",
        starts_iteration=True,
        description="run the agent on the task and feedback",
    ),
    State("snapshotting", handler="snapshot", description="capture the workspace"),
    State("verifying", handler="verify", description="run verification levels"),
    State("feedback", handler="feedback", description="turn failures into feedback"),
]
_ENDS = [
    State("succeeded", terminal=True),
    State("failed", terminal=True, outcome="failed"),
    State("canceled", terminal=True, outcome="aborted"),
]
_BUILD_TO_VERIFY = [
    Transition("queued", RUN_ACCEPTED, "building"),
    Transition("building", BUILD_SUCCEEDED, "snapshotting"),
    Transition("building", BUILD_FAILED, "feedback"),
    Transition("snapshotting", SNAPSHOT_TAKEN, "verifying"),
    Transition("snapshotting", SNAPSHOT_FAILED, "failed", reason="snapshot failed"),
]
_FEEDBACK_AND_ENDS = [
    Transition("verifying", VERIFY_FAILED_RETRYABLE, "feedback"),
    Transition(
        "feedback",
        FEEDBACK_READY,
        "failed",
        unless=["iterations_left"],
        reason="iteration limit spent",
    ),
    Transition(
        "feedback",
        FEEDBACK_READY,
        "failed",
        unless=["time_left"],
        reason="wall-clock limit spent",
    ),
    Transition("feedback", FEEDBACK_READY, "building"),
    Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    Transition("*", RunEvent.TIMEOUT, "failed"),
    Transition("*", RunEvent.USER_ABORTED, "canceled"),
]

#: The agent loop's machine.
AGENT_LOOP = MachineSpec(
    "agent-loop",
    states=[*_STATES, *_ENDS],
    transitions=[
        *_BUILD_TO_VERIFY,
        Transition("verifying", VERIFY_PASSED, "succeeded"),
        *_FEEDBACK_AND_ENDS,
    ],
)


def agent_loop_spec(
    *, approval: bool = False, approval_timeout: float = APPROVAL_TIMEOUT
) -> MachineSpec:
    """The agent loop's machine: :data:`AGENT_LOOP`, or with a person's approval after verifying.

    With ``approval``, a change that passed verification waits in ``awaiting_approval`` for a
    signal (see the module): ``APPROVE`` ends the run ``succeeded``; ``REJECT`` (its payload's
    ``comment`` becomes the feedback) goes on to ``feedback`` and another build, under the
    same iteration and wall-clock limits; no answer in ``approval_timeout`` seconds (24 hours
    by default) cancels the run. The machine is named ``agent-loop-approval``: its runs are
    never taken for :data:`AGENT_LOOP`'s.
    """
    if not approval:
        return AGENT_LOOP
    gate = State(
        AWAITING_APPROVAL,
        wait=Wait(timeout=approval_timeout, prompt=APPROVAL_PROMPT, schema=APPROVAL_SCHEMA),
        description="wait for a person to approve the verified change",
    )
    return MachineSpec(
        "agent-loop-approval",
        states=[*_STATES, gate, *_ENDS],
        transitions=[
            *_BUILD_TO_VERIFY,
            Transition("verifying", VERIFY_PASSED, AWAITING_APPROVAL),
            Transition(AWAITING_APPROVAL, APPROVE, "succeeded"),
            Transition(AWAITING_APPROVAL, REJECT, "feedback"),
            # the gate's own TIMEOUT comes before the wildcard's (which fails the run)
            Transition(
                AWAITING_APPROVAL,
                RunEvent.TIMEOUT,
                "canceled",
                reason="no answer to the approval in time",
            ),
            *_FEEDBACK_AND_ENDS,
        ],
    )


DEFAULT_MAX_ITERATIONS = 3


def _iterations_left(run: RunRecord) -> bool:
    return run.iteration < int(run.input.get("max_iterations", DEFAULT_MAX_ITERATIONS))


def _time_left(run: RunRecord) -> bool:
    limit = run.input.get("max_seconds")
    if limit is None:
        return True
    return (dt.datetime.now(dt.timezone.utc) - run.created_at) < dt.timedelta(seconds=float(limit))


#: The guards :data:`AGENT_LOOP` names, to pass as ``Engine(guards=...)``.
guards: Mapping[str, Any] = {"iterations_left": _iterations_left, "time_left": _time_left}

# -- what the services exchange ----------------------------------------------------------------


@attrs.frozen
class AgentRequest:
    """What the agent is asked to do in one build.

    Attributes:
        task: the task prompt.
        workspace: the directory the agent works in.
        iteration: the run's iteration.
        feedback: feedback on the previous attempt, if any.
        session_id: the previous build's agent session, to continue it.
        timeout: seconds the agent may take, if limited.
        options: the run's agent options (e.g. ``{"command": "..."}`` for a command agent).
    """

    task: str
    workspace: str
    iteration: int
    feedback: str | None = None
    session_id: str | None = None
    timeout: float | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class AgentResult:
    """What one agent run came to."""

    success: bool
    exit_code: int | None = None
    session_id: str | None = None
    stdout: str = ""
    stderr: str = ""
    model: str | None = None
    tokens_input: int | None = None
    tokens_output: int | None = None
    tokens_total: int | None = None
    cost_usd: float | None = None
    duration_ms: float | None = None
    timed_out: bool = False


@attrs.frozen
class Snapshot:
    """The workspace after a build, against before it."""

    snapshot_id: str
    before: str | None = None
    after: str | None = None
    changed_files: tuple[str, ...] = ()
    insertions: int = 0
    deletions: int = 0


@attrs.frozen
class CheckResult:
    """One verification command."""

    command: str
    passed: bool
    exit_code: int | None = None
    output_tail: str = ""
    duration_ms: float = 0.0
    timed_out: bool = False


@attrs.frozen
class LevelResult:
    """One verification level (L0 … L3) and its checks."""

    level: str
    passed: bool
    checks: tuple[CheckResult, ...] = ()
    duration_ms: float = 0.0


@attrs.frozen
class VerificationReport:
    """All levels run in one verification, in order (it stops at the first failed level)."""

    passed: bool
    levels: tuple[LevelResult, ...] = ()
    duration_ms: float = 0.0

    @property
    def levels_run(self) -> tuple[str, ...]:
        """Names of the levels that ran."""
        return tuple(level.level for level in self.levels)

    @property
    def failed_levels(self) -> tuple[LevelResult, ...]:
        """The levels that failed."""
        return tuple(level for level in self.levels if not level.passed)


# -- the service protocols ---------------------------------------------------------------------


@runtime_checkable
class AgentDriver(Protocol):
    """Runs the coding agent."""

    def run(self, request: AgentRequest) -> AgentResult:
        """Run the agent once; a failed run is a result with ``success=False``, not an error."""


@runtime_checkable
class Snapshotter(Protocol):
    """Captures the workspace's state.

    A snapshotter may also have a ``check_workspace(workspace)`` method (as
    :class:`~fsm_runner.presets.agent_loop.services.GitSnapshotter` has): ``queued`` calls it, so a
    workspace that could never be captured fails the run before the agent works in it.
    """

    def capture(self, workspace: str, *, since: str | None = None) -> Snapshot:
        """Capture the workspace now, against the snapshot ``since`` (the last one) if given."""


@runtime_checkable
class Verifier(Protocol):
    """Runs the verification levels."""

    def verify(
        self,
        workspace: str,
        *,
        levels: Mapping[str, Sequence[str] | str] | None = None,
        timeout: float | None = None,
    ) -> VerificationReport:
        """Run the levels (the verifier's own, or ``levels`` when given) in order.

        A level is one command or a list of commands.
        """


@runtime_checkable
class FeedbackGenerator(Protocol):
    """Turns a failed verification into feedback for the next build."""

    def generate(self, report: VerificationReport, *, task: str) -> str:
        """Write the feedback."""


@runtime_checkable
class ResultPersister(Protocol):
    """Stores agent results and verification reports as artifacts."""

    def persist(self, run_id: str, name: str, kind: str, data: Any) -> ArtifactRecord:
        """Store ``data``; return the artifact to journal (its status says if storing failed)."""


class JournalPersister:
    """Keeps artifacts in the journal itself (the default: nothing else to set up)."""

    def persist(self, run_id: str, name: str, kind: str, data: Any) -> ArtifactRecord:
        """Return the artifact with its content; the engine journals it with the transition."""
        return ArtifactRecord(name, kind, data)


def classify_agent_exit(exit_code: int | None, *, timed_out: bool = False) -> ErrorType:
    """How an agent run that exited with ``exit_code`` went wrong.

    Exit code 137 (killed, as by an out-of-memory or deadline kill) or a deadline is a timeout;
    a death by another signal (negative codes, 128+N) is a crash; any other non-zero code is a
    failure.
    """
    if timed_out or exit_code == 137:
        return ErrorType.TIMEOUT
    if exit_code == 0:
        return ErrorType.NONE
    if exit_code is None or exit_code < 0 or exit_code > 128:
        return ErrorType.AGENT_CRASH
    return ErrorType.AGENT_FAILURE


def fallback_feedback(report: VerificationReport) -> str:
    """Feedback naming each failed level and check, for when the generator fails."""
    lines = ["Verification failed. Fix the following and try again:"]
    for level in report.failed_levels:
        failed = [check.command for check in level.checks if not check.passed] or ["(no check)"]
        lines.append(f"- level {level.level}: {', '.join(failed)}")
    return "\n".join(lines)


# -- the phase handlers ------------------------------------------------------------------------


def _persist(ctx: PhaseContext, name: str, kind: str, data: Any) -> ArtifactRecord:
    """Persist through the run's persister; a failure is logged and recorded, never raised."""
    persister: ResultPersister = ctx.services.get("persister") or JournalPersister()
    try:
        return persister.persist(ctx.run_id, name, kind, data)
    except Exception as exc:  # noqa: BLE001 - persisting an artifact never fails the phase
        ctx.logger.warning("could not persist artifact %s: %s", name, exc)
        return ArtifactRecord(name, kind, status="failed", error=f"{type(exc).__name__}: {exc}")


def _input(ctx: PhaseContext, key: str, default: Any = None) -> Any:
    data = ctx.input if isinstance(ctx.input, Mapping) else {}
    return data.get(key, default)


class QueuePhase:
    """``queued``: check the run's input before the first build."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Accept the run, or fail it with what is missing."""
        missing = [key for key in ("task", "workspace") if not _input(ctx, key)]
        if missing:
            raise ValueError(f"the run's input lacks {', '.join(missing)}")
        limit = _input(ctx, "max_iterations", DEFAULT_MAX_ITERATIONS)
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_iterations must be a whole number >= 1, not {limit!r}")
        # Before any agent edits the workspace: one the snapshotter cannot capture (not a git
        # repository, say) would only be found after the first build.
        check = getattr(ctx.services.get("snapshotter"), "check_workspace", None)
        if callable(check):
            check(str(_input(ctx, "workspace")))
        return PhaseResult(RUN_ACCEPTED)


# Exit codes with which a shell reports that a command could not be run at all. Running it again
# cannot help, so the run fails at once instead of spending its iterations on it.
_NOT_RUNNABLE = {126: "cannot be executed", 127: "was not found"}


def _not_runnable(result: AgentResult, options: Mapping[str, Any]) -> str | None:
    """Why the agent command could not be run at all, or ``None`` if it ran."""
    reason = None if result.success else _NOT_RUNNABLE.get(result.exit_code or 0)
    if reason is None:
        return None
    command = options.get("command")
    named = f"the agent command {command!r}" if command else "the agent command"
    tail = (result.stderr or result.stdout)[-500:].strip()
    return f"{named} {reason} (exit code {result.exit_code})" + (f": {tail}" if tail else "")


class BuildPhase:
    """``building``: run the agent on the task, the last feedback and the last session.

    An agent command that could not be run at all (exit code 127: not found; 126: not
    executable) fails the run at once with ``SYSTEM_ERROR`` naming the command: another
    iteration would only fail the same way.
    """

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Run the agent once and report BUILD_SUCCEEDED or BUILD_FAILED (classified)."""
        agent: AgentDriver = ctx.services["agent"]
        request = AgentRequest(
            task=str(_input(ctx, "task")),
            workspace=str(_input(ctx, "workspace")),
            iteration=ctx.iteration,
            feedback=ctx.context.get("feedback"),
            session_id=ctx.context.get("session_id"),
            timeout=ctx.remaining,
            options=dict(_input(ctx, "agent") or {}),
        )
        try:
            result = agent.run(request)
        except Exception as exc:  # noqa: BLE001 - the agent crashing is a build failure
            message = f"{type(exc).__name__}: {exc}"
            return PhaseResult(
                BUILD_FAILED,
                error={"type": ErrorType.AGENT_CRASH.value, "message": message},
                context={"build_failure": message},
                iteration={
                    "success": False,
                    "error_type": ErrorType.AGENT_CRASH,
                    "error_message": message,
                },
            )
        name = f"agent-{ctx.iteration}"
        artifact = _persist(ctx, name, "agent_result", unstructure(result))
        updates: dict[str, Any] = {
            "agent_session_id": result.session_id,
            "agent_result_ref": name,
            "agent_duration_ms": result.duration_ms,
            "success": result.success,
            "model": result.model,
            "tokens_input": result.tokens_input,
            "tokens_output": result.tokens_output,
            "tokens_total": result.tokens_total,
            "cost_usd": result.cost_usd,
        }
        context = {"session_id": result.session_id or ctx.context.get("session_id")}
        not_runnable = _not_runnable(result, request.options)
        if not_runnable is not None:
            return PhaseResult(
                RunEvent.SYSTEM_ERROR,
                output={"exit_code": result.exit_code},
                error={"type": "agent_not_runnable", "message": not_runnable},
                context={**context, "build_failure": not_runnable},
                iteration=updates
                | {"error_type": ErrorType.SYSTEM_ERROR, "error_message": not_runnable},
                artifacts=[artifact],
            )
        if result.success:
            return PhaseResult(
                BUILD_SUCCEEDED,
                output={"session_id": result.session_id, "exit_code": result.exit_code},
                context={**context, "build_failure": None},
                iteration=updates,
                artifacts=[artifact],
            )
        error_type = classify_agent_exit(result.exit_code, timed_out=result.timed_out)
        if error_type is ErrorType.NONE:
            error_type = ErrorType.AGENT_FAILURE  # exit code 0 but the agent said it failed
        tail = (result.stderr or result.stdout)[-500:].strip()
        message = (
            "agent timed out" if result.timed_out else f"agent exited with {result.exit_code}"
        ) + (f": {tail}" if tail else "")
        updates |= {"error_type": error_type, "error_message": message}
        return PhaseResult(
            BUILD_FAILED,
            output={"session_id": result.session_id, "exit_code": result.exit_code},
            error={"type": error_type.value, "message": message},
            context={**context, "build_failure": message},
            iteration=updates,
            artifacts=[artifact],
        )


class SnapshotPhase:
    """``snapshotting``: capture what the build changed in the workspace."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report SNAPSHOT_TAKEN with the snapshot, or SNAPSHOT_FAILED."""
        snapshotter: Snapshotter = ctx.services["snapshotter"]
        try:
            snapshot = snapshotter.capture(
                str(_input(ctx, "workspace")), since=ctx.context.get("snapshot")
            )
        except Exception as exc:  # noqa: BLE001 - a failed snapshot is an event, not a crash
            message = f"{type(exc).__name__}: {exc}"
            return PhaseResult(
                SNAPSHOT_FAILED,
                error={"type": "snapshot_failed", "message": message},
                iteration={
                    "error_type": ErrorType.SYSTEM_ERROR,
                    "error_message": f"snapshot failed: {message}",
                },
            )
        data = unstructure(snapshot)
        return PhaseResult(
            SNAPSHOT_TAKEN,
            output=data,
            context={"snapshot": snapshot.snapshot_id},
            iteration={"snapshot_id": snapshot.snapshot_id},
        )


class VerifyPhase:
    """``verifying``: run the verification levels on the workspace."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report VERIFY_PASSED, or VERIFY_FAILED_RETRYABLE with the failed level and check."""
        verifier: Verifier = ctx.services["verifier"]
        levels = _input(ctx, "verify")
        report = verifier.verify(
            str(_input(ctx, "workspace")), levels=levels or None, timeout=ctx.remaining
        )
        name = f"verification-{ctx.iteration}"
        data = unstructure(report)
        artifact = _persist(ctx, name, "verification_report", data)
        updates: dict[str, Any] = {
            "verification_ref": name,
            "passed": report.passed,
            "levels_run": list(report.levels_run),
            "verification_duration_ms": report.duration_ms,
        }
        if report.passed:
            return PhaseResult(
                VERIFY_PASSED,
                output={"levels_run": list(report.levels_run)},
                context={"verification": data},
                iteration=updates,
                artifacts=[artifact],
            )
        failed = report.failed_levels[0] if report.failed_levels else None
        check = next((c for c in failed.checks if not c.passed), None) if failed else None
        details = {
            "level": failed.level if failed else None,
            "check": check.command if check else None,
            "exit_code": check.exit_code if check else None,
        }
        message = f"level {details['level']} failed" + (f": {details['check']}" if check else "")
        updates |= {
            "error_type": ErrorType.VERIFICATION_FAILED,
            "error_message": message,
            "error_details": details,
        }
        return PhaseResult(
            VERIFY_FAILED_RETRYABLE,
            output={"levels_run": list(report.levels_run), "failed": details},
            error={"type": ErrorType.VERIFICATION_FAILED.value, "message": message},
            context={"verification": data},
            iteration=updates,
            artifacts=[artifact],
        )


def rejection_feedback(answer: Any) -> str:
    """The feedback a reviewer's ``REJECT`` at the approval gate gives the next build.

    ``answer`` is the signal's payload (``{"comment": "..."}``, or anything else).
    """
    comment = answer.get("comment") if isinstance(answer, Mapping) else answer
    if isinstance(comment, str) and comment.strip():
        return f"The change passed verification, but the reviewer rejected it: {comment.strip()}"
    return "The change passed verification, but the reviewer rejected it (without a comment)."


class FeedbackPhase:
    """``feedback``: turn the iteration's failure into feedback for the next build.

    After a ``REJECT`` at the approval gate (:func:`agent_loop_spec`) the feedback is the
    reviewer's comment: the payload of the signal that began this visit (``ctx.signal``).
    """

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report FEEDBACK_READY; the next build gets this phase's output as its feedback."""
        build_failure = ctx.context.get("build_failure")
        fallback = False
        signal = ctx.signal  # the REJECT that began this visit, if one did
        if signal is not None and signal.name == REJECT:
            text = rejection_feedback(signal.payload)
            return PhaseResult(
                FEEDBACK_READY,
                output={"feedback": text, "fallback": False, "rejected": True},
                context={"feedback": text, "feedback_fallback": False},
                iteration={"feedback": text, "feedback_fallback": False},
            )
        if build_failure:
            text = f"The previous attempt failed before verification: {build_failure}"
        else:
            report = structure(ctx.context["verification"], VerificationReport)
            generator: FeedbackGenerator | None = ctx.services.get("feedback")
            text, fallback = fallback_feedback(report), True
            if generator is not None:
                try:
                    text = generator.generate(report, task=str(_input(ctx, "task")))
                    fallback = False
                except Exception as exc:  # noqa: BLE001 - the fallback exists for exactly this
                    ctx.logger.warning("feedback generator failed, using the fallback: %s", exc)
        return PhaseResult(
            FEEDBACK_READY,
            output={"feedback": text, "fallback": fallback},
            context={"feedback": text, "feedback_fallback": fallback},
            iteration={"feedback": text, "feedback_fallback": fallback},
        )


def agent_loop_engine(
    *,
    journal: Journal,
    agent: AgentDriver,
    snapshotter: Snapshotter,
    verifier: Verifier,
    feedback: FeedbackGenerator | None = None,
    persister: ResultPersister | None = None,
    listeners: Sequence[Listener] = (),
    approval: bool = False,
    approval_timeout: float = APPROVAL_TIMEOUT,
) -> Engine:
    """An engine running the agent loop with the preset's handlers and these services.

    Its machine is :data:`AGENT_LOOP`, or with ``approval`` the loop with the approval gate
    (:func:`agent_loop_spec`; ``approval_timeout`` seconds to answer). An engine continues
    only runs of its own machine: resume a run with an engine built as the one that started it.
    """
    return Engine(
        agent_loop_spec(approval=approval, approval_timeout=approval_timeout),
        handlers={
            "queue": QueuePhase(),
            "build": BuildPhase(),
            "snapshot": SnapshotPhase(),
            "verify": VerifyPhase(),
            "feedback": FeedbackPhase(),
        },
        guards=guards,
        journal=journal,
        services={
            "agent": agent,
            "snapshotter": snapshotter,
            "verifier": verifier,
            "feedback": feedback,
            "persister": persister or JournalPersister(),
        },
        listeners=listeners,
    )
