"""What the journal says about a coordinator session: its history, its tasks, its summary.

A session's progress is never kept only in memory: its own transitions say which graph and
round it is on and which task ends it has recorded (:func:`_history`), and its child runs say
where each task stands (:class:`TaskStatus`, :class:`SessionStatus`; what one step of the
coordinator did is a :class:`NextTask`). ``finalizing``'s handler,
:class:`FinalizePhase`, runs the global verification and keeps the run summary that a
:class:`JournalSummarizer` writes from the journal (or :func:`fallback_summary`, if the
summarizer fails). Every public name here is re-exported by
:mod:`fsm_runner.presets.coordinator`, which is where hosts import them from.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from fsm_runner import (
    ArtifactRecord,
    Journal,
    PhaseContext,
    PhaseResult,
    RunEvent,
    RunRecord,
    TransitionRecord,
)
from fsm_runner.presets.agent_loop import VerificationReport, Verifier
from fsm_runner.presets.coordinator.machines import (
    _RECORD_EVENT_NAMES,
    _TASK_ENDS,
    TASK,
    SessionEvent,
    TaskEvent,
    _failure_message,
    _one_line,
    _plain,
    _report_data,
)
from fsm_runner.presets.coordinator.tasks import Summarizer, TaskGraph, Workspace, _str_tuple

__all__ = [
    "FinalizePhase",
    "JournalSummarizer",
    "NextStatus",
    "NextTask",
    "SessionStatus",
    "TaskStatus",
    "fallback_summary",
]

_E = SessionEvent
_T = TaskEvent
_VERIFY_PASSED = RunEvent.VERIFY_PASSED.value
_VERIFY_FAILED = RunEvent.VERIFY_FAILED.value


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# -- finalizing and summaries ------------------------------------------------------------------


@attrs.frozen
class _History:
    """What a session's own transitions say: its current graph, round and records."""

    graph: TaskGraph
    round: int
    recorded: frozenset[str]  # child run ids whose end the session has journaled
    finalize_attempts: int


def _history(journal: Journal, session: RunRecord) -> _History:
    graph_data = session.input["graph"]
    round_number = finalizes = 0
    recorded: set[str] = set()
    for transition in journal.transitions(session.run_id):
        output = transition.output if isinstance(transition.output, Mapping) else {}
        if transition.event == _E.PLAN_SUBMITTED and output.get("graph") is not None:
            graph_data = output["graph"]
        elif transition.event == _E.PLAN_APPROVED:
            round_number += 1
        elif transition.event in _RECORD_EVENT_NAMES and output.get("run_id"):
            recorded.add(str(output["run_id"]))
        elif transition.event == _E.FINALIZE_REQUESTED:
            finalizes += 1
    return _History(TaskGraph.from_dict(graph_data), round_number, frozenset(recorded), finalizes)


def _children(journal: Journal, session_id: str) -> list[RunRecord]:
    return [run for run in journal.runs(parent_run_id=session_id) if run.machine == TASK.name]


def _round_of(child: RunRecord) -> int:
    return int(child.input.get("round", 0)) if isinstance(child.input, Mapping) else 0


def _task_id_of(child: RunRecord) -> str:
    task = child.input.get("task", {}) if isinstance(child.input, Mapping) else {}
    return str(task.get("id", ""))


def _round_children(journal: Journal, session_id: str, round_number: int) -> dict[str, RunRecord]:
    return {
        _task_id_of(child): child
        for child in _children(journal, session_id)
        if _round_of(child) == round_number
    }


def _attempts(transitions: Sequence[TransitionRecord]) -> list[Mapping[str, Any]]:
    """The routing of each attempt: ``{"role": ..., "attempt": ...}``, in order."""
    return [
        t.output
        for t in transitions
        if t.event == _T.TASK_DISPATCHED and isinstance(t.output, Mapping)
    ]


def _task_reason(child: RunRecord, last: TransitionRecord | None) -> str | None:
    """Why a task did not get done: the transition's reason, a skip's reason, the error."""
    if child.state == "done" or not child.ended:
        return None
    result: Mapping[str, Any] = (last.result or {}) if last is not None else {}
    found = result.get("output")
    output: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    skipped = last is not None and last.event == _T.TASK_SKIPPED
    error = child.error or {}
    message = error.get("message")
    if last is not None and last.event == RunEvent.SYSTEM_ERROR and message:
        message = f"{error.get('type')}: {message}"  # what raised, not just what it said
    parts = [
        result.get("reason"),  # the transition's, e.g. "retries exhausted"
        output.get("reason") if skipped else None,
        message,
    ]
    unique = list(dict.fromkeys(str(part) for part in parts if part))
    return ": ".join(unique) or None


def _progress(journal: Journal, child: RunRecord) -> tuple[list[str], str | None]:
    """A task's attempts so far (the role of each, in order) and why it did not get done."""
    transitions = journal.transitions(child.run_id)
    roles = [str(routing.get("role")) for routing in _attempts(transitions)]
    return roles, _task_reason(child, transitions[-1] if transitions else None)


def _unsettled(journal: Journal, session_id: str, history: _History) -> list[str]:
    """The tasks of the session's round that are pending or running, in run order."""
    children = _round_children(journal, session_id, history.round)
    return [
        task_id
        for task_id in history.graph.order
        if task_id not in children or not children[task_id].ended
    ]


def _duration_ms(run: RunRecord) -> float:
    return (run.updated_at - run.created_at).total_seconds() * 1000.0


@attrs.frozen
class JournalSummarizer:
    """The default summary: every task's outcome, attempts, roles, duration and verification."""

    def summarize(
        self, journal: Journal, session: RunRecord, *, verification: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Summarize the session's current round from the journal.

        Args:
            journal: the journal the session is in.
            session: the session's run row.
            verification: the global verification's result.

        Returns:
            ``{"source": "summarizer", "session_id", "round", "tasks": [...], "totals",
            "roles_used", "verification", "duration_ms"}``; each task with its ``outcome``,
            ``attempts``, ``roles``, ``duration_ms``, ``verification`` (one entry per
            verification run), ``reason`` and ``commit``.
        """
        history = _history(journal, session)
        children = _round_children(journal, session.run_id, history.round)
        tasks: list[dict[str, Any]] = []
        roles_used: Counter[str] = Counter()
        for task_id in history.graph.order:
            child = children.get(task_id)
            if child is None:
                tasks.append({"id": task_id, "outcome": "pending", "attempts": 0, "roles": []})
                continue
            transitions = journal.transitions(child.run_id)
            roles = [str(routing.get("role")) for routing in _attempts(transitions)]
            roles_used.update(roles)
            checks = [
                dict(t.output)
                for t in transitions
                if t.event in (_VERIFY_PASSED, _VERIFY_FAILED) and isinstance(t.output, Mapping)
            ]
            tasks.append(
                {
                    "id": task_id,
                    "run_id": child.run_id,
                    "outcome": child.state,
                    "attempts": len(roles),
                    "roles": roles,
                    "duration_ms": _duration_ms(child),
                    "verification": checks,
                    "reason": _task_reason(child, transitions[-1] if transitions else None),
                    "commit": next((c.get("commit") for c in checks if c.get("passed")), None),
                }
            )
        outcomes = Counter(str(task["outcome"]) for task in tasks)
        return {
            "source": "summarizer",
            "session_id": session.run_id,
            "round": history.round,
            "tasks": tasks,
            "totals": {
                "tasks": len(tasks),
                "attempts": sum(int(task["attempts"]) for task in tasks),
                **dict(sorted(outcomes.items())),
            },
            "roles_used": dict(sorted(roles_used.items())),
            "verification": dict(verification),
            "duration_ms": (_utc_now() - session.created_at).total_seconds() * 1000.0,
        }


def fallback_summary(
    journal: Journal, session_id: str, *, verification: Mapping[str, Any], error: str
) -> dict[str, Any]:
    """A plain summary straight from the journal, for when the summarizer failed.

    It assumes as little as it can: each child run's id, task, round, state, status and
    number of transitions.

    Args:
        journal: the journal the session is in.
        session_id: the session.
        verification: the global verification's result.
        error: why the summarizer failed.

    Returns:
        ``{"source": "fallback", "summary_error", "session_id", "tasks", "verification"}``.
    """
    tasks = [
        {
            "run_id": child.run_id,
            "task_id": _task_id_of(child),
            "round": _round_of(child),
            "state": child.state,
            "status": child.status.value,
            "transitions": child.seq + 1,
        }
        for child in sorted(_children(journal, session_id), key=lambda run: run.created_at)
    ]
    return {
        "source": "fallback",
        "summary_error": error,
        "session_id": session_id,
        "tasks": tasks,
        "verification": dict(verification),
    }


class FinalizePhase:
    """``finalizing``: the global verification, then the run summary (or its fallback)."""

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Report SESSION_FINALIZED with the summary artifact, or VERIFY_FAILED with why."""
        journal: Journal = ctx.services["journal"]
        workspace: Workspace = ctx.services["workspace"]
        verifier: Verifier = ctx.services["verifier"]
        summarizer: Summarizer = ctx.services["summarizer"]
        history = _history(journal, ctx.run)
        report = VerificationReport(passed=True)
        if history.graph.verify:
            report = verifier.verify(
                workspace.path, levels=history.graph.verify, timeout=ctx.remaining
            )
        verification = _report_data(report)
        report_artifact = ArtifactRecord(
            f"global-verification-{history.finalize_attempts}",
            "verification_report",
            _plain(report),
        )
        if not report.passed:
            return PhaseResult(
                RunEvent.VERIFY_FAILED,
                output=verification,
                error={"type": "verification_failed", "message": _failure_message(verification)},
                artifacts=[report_artifact],
            )
        try:
            summary = dict(summarizer.summarize(journal, ctx.run, verification=verification))
            json.dumps(summary)  # what the journal cannot keep counts as a failed summary
        except Exception as exc:  # noqa: BLE001 - the fallback exists for exactly this
            ctx.logger.warning("the summarizer failed, keeping the fallback summary: %s", exc)
            summary = fallback_summary(
                journal, ctx.run_id, verification=verification, error=_one_line(exc)
            )
        return PhaseResult(
            _E.SESSION_FINALIZED,
            output={"summary_source": summary.get("source"), "verification": verification},
            artifacts=[report_artifact, ArtifactRecord("summary", "run_summary", summary)],
        )


# -- what the coordinator reports --------------------------------------------------------------


class NextStatus(str, enum.Enum):
    """What :meth:`~fsm_runner.presets.coordinator.Coordinator.execute_next_task` came to."""

    RAN = "ran"  # a task ran to its end (see NextTask.outcome)
    ALL_DONE = "all_done"  # every task is done: finalize next
    BLOCKED = "blocked"  # every task has ended, and some did not get done
    WAITING = "waiting"  # a task is being advanced elsewhere; try again later
    ABORTED = "aborted"  # an abort requested earlier was carried out instead

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class NextTask:
    """What one call of :meth:`~fsm_runner.presets.coordinator.Coordinator.execute_next_task` did.

    Attributes:
        status: see :class:`NextStatus`.
        task_id: the task that ran (or is in progress elsewhere), if any.
        outcome: the state the task ended in (``done``, ``failed``, ``blocked``, ``aborted``).
        run_id: the task's child run.
        attempts: attempts the task took.
        roles: the role of each attempt, in order.
        reason: why the task did not get done, or why the session is blocked.
        skipped: tasks marked skipped because this one did not get done.
    """

    status: NextStatus
    task_id: str | None = None
    outcome: str | None = None
    run_id: str | None = None
    attempts: int = 0
    roles: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    reason: str | None = None
    skipped: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)


@attrs.frozen
class TaskStatus:
    """Where one task of a session's current round stands.

    Attributes:
        task_id: the task.
        state: ``pending`` before its child run starts, then the child run's state.
        run_id: its child run, once started.
        attempts: attempts dispatched so far.
        roles: the role of each attempt, in order.
        reason: why it did not get done, if it ended otherwise.
    """

    task_id: str
    state: str
    run_id: str | None = None
    attempts: int = 0
    roles: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    reason: str | None = None

    @property
    def settled(self) -> bool:
        """Whether the task has ended (done or not)."""
        return self.state in _TASK_ENDS


@attrs.frozen
class SessionStatus:
    """A session and the tasks of its current round, read off the journal.

    Attributes:
        session: the session's run row.
        round: how many times its plan was approved (each approval starts a round of tasks).
        tasks: every task of the graph, in run order.
    """

    session: RunRecord
    round: int
    tasks: tuple[TaskStatus, ...]

    def task(self, task_id: str) -> TaskStatus:
        """Return the status of ``task_id``.

        Raises:
            KeyError: no such task.
        """
        for task in self.tasks:
            if task.task_id == task_id:
                return task
        raise KeyError(task_id)


def _session_status(journal: Journal, session: RunRecord) -> SessionStatus:
    """Where ``session`` and each task of its current round stand, read off ``journal``."""
    history = _history(journal, session)
    children = _round_children(journal, session.run_id, history.round)
    tasks: list[TaskStatus] = []
    for task_id in history.graph.order:
        child = children.get(task_id)
        if child is None or history.round == 0:
            tasks.append(TaskStatus(task_id, "pending"))
            continue
        roles, reason = _progress(journal, child)
        tasks.append(
            TaskStatus(
                task_id, child.state, child.run_id, attempts=len(roles), roles=roles, reason=reason
            )
        )
    return SessionStatus(session, history.round, tuple(tasks))
