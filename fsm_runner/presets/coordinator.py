r"""The coordinator preset: a session that walks a task graph, one task at a time.

A *session* (:data:`SESSION`) goes from an idea to a reviewed plan to the execution of a graph of
tasks, and is finalized by a global verification::

    idea ─PLAN_SUBMITTED─▶ plan_review ─PLAN_APPROVED─▶ execution ─FINALIZE_REQUESTED─▶ finalizing
     ▲                       │  ▲                          │  ▲ │                               │
     └─────RESET_TO_IDEA─────┘  └───RESET_TO_PLAN_REVIEW───┘  │ └─VERIFY_FAILED, SYSTEM_ERROR───┤
                                                              │                                 │
                   failed ◀─SESSION_FAILED────────────────────┘       SESSION_FINALIZED─▶ complete

and ``USER_ABORTED → aborted`` from every phase that has not ended. Only ``finalizing`` has a
handler: the host moves a session through the other phases with the :class:`Coordinator`'s
methods, each of which journals one event. The spec itself enforces the rules — an event a
phase does not allow raises :class:`fsm_runner.InvalidTransitionError` — and the coordinator
checks them first, to raise a clearer :class:`SessionStateError`:

- tasks run only in ``execution``; ``finalizing`` is entered only from ``execution`` and only
  when no task is pending or running (the ``tasks_settled`` guard), and ``complete`` only from
  ``finalizing``, after global verification passed;
- a failed global verification (or a finalize phase that raised) returns the session to
  ``execution`` with the reason journaled as the run's error: it stays resumable, and
  :meth:`Coordinator.finalize_session` may be called again;
- a session is reset only to ``idea`` or ``plan_review``.

Each task of the graph runs as a child run (``parent_run_id`` = the session) of :data:`TASK`::

    scheduled ─▶ dispatched ─▶ gated ─▶ applied ─▶ verified ─▶ done
        ▲            │           │         │          │
        │            │           └▶ blocked│          └VERIFY_FAILED▶ reverted
        └────────────┴─AGENT_FAILED────────┴APPLY_FAILED─────────────────┴DIFF_REVERTED
                          (while attempts are left; past the limit: failed)

plus ``scheduled ─TASK_SKIPPED▶ skipped``, ``SYSTEM_ERROR → failed`` and ``USER_ABORTED →
aborted``. A state is entered when the task reaches that step, and its handler performs the
step: ``scheduled`` picks the agent role from the task's failures so far (``worker`` →
``strong_worker`` → ``fixer``), ``dispatched`` runs the agent, ``gated`` runs the gates,
``applied`` applies the diff to the workspace (whole or not at all, and never twice), ``verified``
runs the task's verification commands and ``reverted`` takes a diff that failed verification out
of the workspace again. Every retry is an explicit, journaled transition guarded by the attempts
left (``attempts_left``).

The session's progress is read off the journal — the child runs and their transitions — never
kept only in memory, so a session killed anywhere resumes (:meth:`Coordinator.resume`) with the
first task not yet done; a task that is done is never dispatched again. The session also
journals each task's end as a self transition of ``execution`` (``TASK_FINISHED``,
``TASK_FAILED``, ``TASK_SKIPPED``, ``TASK_ABORTED``; the last also of ``idea`` and
``plan_review``, where a reset calls a task off), for readers of its timeline. The workspace
holds exactly the work of the tasks that are done: a diff goes in whole or not at all, and the
diff of a task that fails verification, is aborted or fails mid-step is taken out again.

The services (:class:`AgentRole`, :class:`Gate`, :class:`Workspace`, a
:class:`fsm_runner.presets.agent_loop.Verifier` and a :class:`Summarizer`) are injected;
:mod:`fsm_runner.presets.coordinator_services` has real ones (git, shell commands) and scripted
agents for tests and examples::

    from fsm_runner import SqliteJournal
    from fsm_runner.presets.coordinator import Coordinator, Task, TaskGraph
    from fsm_runner.presets.coordinator_services import GitWorkspace, ScriptedAgents, file_diff

    graph = TaskGraph(
        [Task("hello", verify="test -f hello.txt"), Task("readme", depends_on=["hello"])],
        verify={"test": "test -f README"},
    )
    agents = ScriptedAgents({
        "hello": file_diff("hello.txt", None, "hello\n"),
        "readme": file_diff("README", None, "see hello.txt\n"),
    })
    with SqliteJournal("coordinator.db") as journal:
        coordinator = Coordinator(journal, workspace=GitWorkspace("repo"), agents=agents)
        session = coordinator.start(graph, idea="say hello")
        coordinator.submit_plan(session, "write hello.txt, then a README")
        coordinator.approve_plan(session)
        run = coordinator.run_until_done(session)   # run.state == "complete"

This module uses only fsm_runner's public API, as a host app would.
"""

from __future__ import annotations

import enum
import heapq
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from fsm_runner import (
    Engine,
    FsmRunnerError,
    InvalidTransitionError,
    Journal,
    Listener,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    RunEvent,
    RunRecord,
    RunTerminalError,
    State,
    Transition,
    TransitionRecord,
)
from fsm_runner.exceptions import RunConflictError
from fsm_runner.presets.agent_loop import VerificationReport, Verifier
from fsm_runner.presets.agent_services import CommandVerifier, TemplateFeedbackGenerator
from fsm_runner.records import ArtifactRecord, unstructure, utc_now

__all__ = [
    "DEFAULT_ROLES",
    "SESSION",
    "TASK",
    "AgentRole",
    "ApplyPhase",
    "Coordinator",
    "DispatchPhase",
    "FinalizePhase",
    "Gate",
    "GatePhase",
    "GateVerdict",
    "JournalSummarizer",
    "NextStatus",
    "NextTask",
    "PatchResult",
    "Proposal",
    "RevertPhase",
    "SchedulePhase",
    "SessionEvent",
    "SessionStateError",
    "SessionStatus",
    "Summarizer",
    "Task",
    "TaskEvent",
    "TaskGraph",
    "TaskGraphError",
    "TaskStatus",
    "VerifyPhase",
    "Workspace",
    "fallback_summary",
]

_log = logging.getLogger("fsm_runner.presets.coordinator")

#: The roles a task is routed to by its failures so far: the first attempt goes to a worker,
#: the second to a stronger worker, every later one to a fixer.
DEFAULT_ROLES: tuple[str, ...] = ("worker", "strong_worker", "fixer")
DEFAULT_MAX_ATTEMPTS = 3

# -- errors ------------------------------------------------------------------------------------


class TaskGraphError(FsmRunnerError, ValueError):
    """A task graph is invalid; ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        super().__init__(self.problems)

    @property
    def message(self) -> str:
        """Every problem, in one message."""
        return "invalid task graph: " + "; ".join(self.problems)


class SessionStateError(InvalidTransitionError):
    """A coordinator operation that the session's phase (or its tasks) does not allow.

    Nothing was changed. A subclass of :class:`fsm_runner.InvalidTransitionError`, whose
    ``event`` here names the operation.

    Attributes:
        run_id: the session.
        state: the phase the session is in.
        operation: what was asked (``execute_next_task``, ``finalize_session`` …).
        reason: why it is not allowed.
    """

    def __init__(self, *, run_id: str, state: str, operation: str, reason: str) -> None:
        self.operation = operation
        super().__init__(run_id=run_id, state=state, event=operation, reason=reason)

    @property
    def message(self) -> str:
        """Name the session, its phase, the operation and why it was refused."""
        return (
            f"session {self.run_id} (in phase {self.state!r}): {self.operation} is not "
            f"allowed: {self.reason}"
        )


# -- the task graph ----------------------------------------------------------------------------


def _str_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(item) for item in value)


def _to_levels(value: Any) -> dict[str, tuple[str, ...]]:
    """Verification commands as ``{level: (command, ...)}``.

    A string is one command and a list several; either way they make one level, ``check``.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        value = {"check": [value]}
    elif not isinstance(value, Mapping):
        value = {"check": list(value)}
    return {str(name): _str_tuple(commands) for name, commands in value.items()}


@attrs.frozen
class Task:
    """One task of a graph.

    Args:
        id: the task's id, unique in its graph.
        description: what the agent is asked to do.
        depends_on: ids of the tasks that must be done before this one starts.
        verify: the task's verification commands: one command, a list, or
            ``{level: command or [commands]}``; run in the workspace after its diff is
            applied. No commands: the task passes once its diff applies.
        max_attempts: attempts in all (the first included) before the task fails.
    """

    id: str
    description: str = ""
    depends_on: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    verify: dict[str, tuple[str, ...]] = attrs.field(factory=dict, converter=_to_levels, hash=False)
    max_attempts: int = attrs.field(default=DEFAULT_MAX_ATTEMPTS, converter=int)

    def to_dict(self) -> dict[str, Any]:
        """The task as JSON-ready data."""
        return {
            "id": self.id,
            "description": self.description,
            "depends_on": list(self.depends_on),
            "verify": {name: list(commands) for name, commands in self.verify.items()},
            "max_attempts": self.max_attempts,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Task:
        """Build a task from :meth:`to_dict` output (or hand-written data of that shape).

        Raises:
            TaskGraphError: the data does not describe a task.
        """
        if not isinstance(data, Mapping) or "id" not in data:
            raise TaskGraphError([f"a task must be a mapping with an 'id', not {data!r:.80}"])
        fields = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise TaskGraphError([f"task {data['id']!r} has unknown fields {unknown}"])
        try:
            return cls(**{key: value for key, value in data.items() if key in fields})
        except (TypeError, ValueError) as exc:
            raise TaskGraphError([f"task {data['id']!r}: {exc}"]) from None


def _task_tuple(value: Iterable[Task | Mapping[str, Any]]) -> tuple[Task, ...]:
    return tuple(item if isinstance(item, Task) else Task.from_dict(item) for item in value)


@attrs.frozen
class TaskGraph:
    """A DAG of tasks, and the global verification that finalizes a session.

    Args:
        tasks: the tasks; declaration order breaks ties, so the order they run in is stable.
        verify: the global verification (build and test commands), as
            ``{level: command or [commands]}``, run when the session is finalized; levels run
            in the natural order of their names.

    Raises:
        TaskGraphError: with every problem: no tasks, empty or duplicate ids, unknown or
            self dependencies, cycles, ``max_attempts < 1``, empty commands.
    """

    tasks: tuple[Task, ...] = attrs.field(converter=_task_tuple)
    verify: dict[str, tuple[str, ...]] = attrs.field(factory=dict, converter=_to_levels, hash=False)
    _order: tuple[str, ...] = attrs.field(init=False, default=(), repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        problems = list(self._problems())
        order = self._topological()
        if len(order) < len({task.id for task in self.tasks}) and not problems:
            cyclic = sorted({task.id for task in self.tasks} - set(order))
            problems.append(f"tasks {', '.join(cyclic)} depend on each other in a cycle")
        if problems:
            raise TaskGraphError(problems)
        object.__setattr__(self, "_order", order)

    def _problems(self) -> Iterator[str]:
        if not self.tasks:
            yield "the graph has no tasks"
        ids = [task.id for task in self.tasks]
        for task_id, count in Counter(ids).items():
            if count > 1:
                yield f"task {task_id!r} is declared {count} times"
        for task in self.tasks:
            if not task.id or not task.id.strip():
                yield "a task has an empty id"
            for dependency in task.depends_on:
                if dependency == task.id:
                    yield f"task {task.id!r} depends on itself"
                elif dependency not in ids:
                    yield f"task {task.id!r} depends on unknown task {dependency!r}"
            if task.max_attempts < 1:
                yield f"task {task.id!r} has max_attempts {task.max_attempts} (must be >= 1)"
            yield from _level_problems(f"task {task.id!r}", task.verify)
        yield from _level_problems("the global verification", self.verify)

    def _topological(self) -> tuple[str, ...]:
        """Kahn's algorithm, always taking the earliest declared task that is ready."""
        index = {task.id: i for i, task in enumerate(self.tasks)}
        waiting = {
            task.id: {d for d in task.depends_on if d in index and d != task.id}
            for task in self.tasks
        }
        ready = [index[task_id] for task_id, deps in waiting.items() if not deps]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            task_id = self.tasks[heapq.heappop(ready)].id
            order.append(task_id)
            for other, deps in waiting.items():
                if task_id in deps:
                    deps.discard(task_id)
                    if not deps:
                        heapq.heappush(ready, index[other])
        return tuple(order)

    @property
    def order(self) -> tuple[str, ...]:
        """Task ids in the order they run: dependencies first, then declaration order."""
        return self._order

    def task(self, task_id: str) -> Task:
        """Return the task called ``task_id``.

        Raises:
            KeyError: no such task.
        """
        for task in self.tasks:
            if task.id == task_id:
                return task
        raise KeyError(task_id)

    def downstream(self, task_id: str) -> tuple[str, ...]:
        """Every task that depends on ``task_id``, directly or not, in run order."""
        found = {task_id}
        for other in self.order:
            if found.intersection(self.task(other).depends_on):
                found.add(other)
        return tuple(other for other in self.order if other in found and other != task_id)

    def to_dict(self) -> dict[str, Any]:
        """The graph as JSON-ready data (journaled as the session's input)."""
        return {
            "tasks": [task.to_dict() for task in self.tasks],
            "verify": {name: list(commands) for name, commands in self.verify.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TaskGraph:
        """Build a graph from :meth:`to_dict` output.

        Raises:
            TaskGraphError: the data does not describe a valid graph.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("tasks"), list):
            raise TaskGraphError(["a task graph must be a mapping with a list of 'tasks'"])
        return cls(data["tasks"], verify=data.get("verify"))


def _level_problems(owner: str, levels: Mapping[str, Sequence[str]]) -> Iterator[str]:
    for name, commands in levels.items():
        if not commands:
            yield f"{owner}: level {name!r} has no commands"
        if any(not command.strip() for command in commands):
            yield f"{owner}: level {name!r} has an empty command"


# -- what the services exchange ----------------------------------------------------------------


@attrs.frozen
class Proposal:
    """What an agent proposes for a task: a unified diff against the workspace.

    Attributes:
        diff: the change, as ``git diff`` writes it (paths relative to the workspace).
        notes: anything the agent wants to say about it.
    """

    diff: str
    notes: str = ""


@attrs.frozen
class GateVerdict:
    """What one gate said about a proposal.

    Attributes:
        gate: the gate's name.
        passed: whether the proposal may be applied.
        reason: why it was blocked (or a note on why it passed).
    """

    gate: str
    passed: bool
    reason: str = ""


@attrs.frozen
class PatchResult:
    """What applying (or taking out) a diff came to.

    Attributes:
        done: the workspace now holds the diff (after an apply) or no longer holds it (after
            a revert).
        already: it did so before: nothing was changed (a repeat after a crash).
        files: the files the diff touches.
        detail: why it could not be done (git's message), if it could not.
    """

    done: bool
    already: bool = False
    files: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    detail: str = ""


# -- the service protocols ---------------------------------------------------------------------


@runtime_checkable
class AgentRole(Protocol):
    """The agents, one per role, that turn a task into a proposed diff."""

    def produce(
        self, task: Task, *, role: str, attempt: int, feedback: str | None, workspace: str
    ) -> Proposal:
        """Propose a diff for ``task``.

        Args:
            task: the task.
            role: the role to play (``worker``, ``strong_worker``, ``fixer`` …).
            attempt: which attempt this is (1-based).
            feedback: why the previous attempt failed, if one did.
            workspace: the directory the diff will be applied in (read it, do not write it).

        Returns:
            The proposal. Raising is an agent failure: the task is retried while attempts
            are left.
        """


@runtime_checkable
class Gate(Protocol):
    """Judges a proposal before it is applied; a block ends the task as ``blocked``."""

    def check(self, task: Task, proposal: Proposal, *, workspace: str) -> GateVerdict:
        """Say whether ``proposal`` may be applied. A gate that raises blocks (fails closed)."""


@runtime_checkable
class Workspace(Protocol):
    """The working copy tasks change: diffs go in whole or not at all, and never twice."""

    @property
    def path(self) -> str:
        """The workspace's directory."""

    def apply(self, diff: str, *, key: str | None = None) -> PatchResult:
        """Apply ``diff`` atomically, unless it is already applied.

        Args:
            diff: a unified diff.
            key: identifies this application (a run and its visit); an application repeated
                with the same key after a crash never applies the diff a second time.
        """

    def revert(self, diff: str, *, key: str | None = None) -> PatchResult:
        """Take ``diff`` out atomically, if it is applied (``key`` as for :meth:`apply`)."""

    def commit(self, message: str) -> str | None:
        """Record the workspace as it is (a commit); return its id, or ``None``."""


@runtime_checkable
class Summarizer(Protocol):
    """Writes the run summary a finalized session keeps as its ``summary`` artifact."""

    def summarize(
        self, journal: Journal, session: RunRecord, *, verification: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Summarize ``session`` (JSON-ready); if this raises, a fallback summary is kept."""


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
_VERIFY_PASSED = RunEvent.VERIFY_PASSED.value
_VERIFY_FAILED = RunEvent.VERIFY_FAILED.value

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
            verdicts.append(unstructure(verdict))
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
        artifact = ArtifactRecord(
            f"verification-{attempt}", "verification_report", unstructure(report)
        )
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
            "duration_ms": (utc_now() - session.created_at).total_seconds() * 1000.0,
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
            unstructure(report),
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
    """What :meth:`Coordinator.execute_next_task` came to."""

    RAN = "ran"  # a task ran to its end (see NextTask.outcome)
    ALL_DONE = "all_done"  # every task is done: finalize next
    BLOCKED = "blocked"  # every task has ended, and some did not get done
    WAITING = "waiting"  # a task is being advanced elsewhere; try again later
    ABORTED = "aborted"  # an abort requested earlier was carried out instead

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class NextTask:
    """What one call of :meth:`Coordinator.execute_next_task` did.

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


# -- the coordinator ---------------------------------------------------------------------------


class Coordinator:
    """Drives coordinator sessions: plan, execute the task graph, finalize, abort, reset.

    One coordinator holds two engines over one journal: :attr:`session_engine` for
    :data:`SESSION` and :attr:`task_engine` for :data:`TASK`. Every method reads where a
    session stands from the journal, so any coordinator (in any process) built with the same
    services can pick up any session.

    Args:
        journal: where sessions and their tasks are journaled (the host closes it).
        workspace: the working copy the tasks change.
        agents: the agents, by role.
        gates: the gates each proposal must pass, in order.
        verifier: runs task and global verification commands; a
            :class:`fsm_runner.presets.agent_services.CommandVerifier` when not given.
        summarizer: writes the run summary; a :class:`JournalSummarizer` when not given.
        roles: the roles attempts escalate through, for sessions started by this
            coordinator (the last one takes every later attempt).
        listeners: called with each committed transition of sessions and tasks.

    Raises:
        ValueError: ``roles`` is empty.
    """

    def __init__(
        self,
        journal: Journal,
        /,
        *,
        workspace: Workspace,
        agents: AgentRole,
        gates: Sequence[Gate] = (),
        verifier: Verifier | None = None,
        summarizer: Summarizer | None = None,
        roles: Sequence[str] = DEFAULT_ROLES,
        listeners: Iterable[Listener] = (),
    ) -> None:
        if not roles:
            raise ValueError("a coordinator needs at least one role")
        self.journal = journal
        self.workspace = workspace
        self.roles = tuple(roles)
        verifier = verifier if verifier is not None else CommandVerifier()
        listeners = list(listeners)
        self.task_engine = Engine(
            TASK,
            handlers={
                "schedule": SchedulePhase(),
                "dispatch": DispatchPhase(),
                "gate": GatePhase(),
                "apply": ApplyPhase(),
                "verify": VerifyPhase(),
                "revert": RevertPhase(),
            },
            journal=journal,
            guards={"attempts_left": _attempts_left},
            services={
                "agents": agents,
                "gates": tuple(gates),
                "workspace": workspace,
                "verifier": verifier,
                "feedback": TemplateFeedbackGenerator(),
            },
            listeners=listeners,
        )
        self.session_engine = Engine(
            SESSION,
            handlers={"finalize": FinalizePhase()},
            journal=journal,
            guards={"tasks_settled": self._tasks_settled},
            services={
                "journal": journal,
                "workspace": workspace,
                "verifier": verifier,
                "summarizer": summarizer if summarizer is not None else JournalSummarizer(),
            },
            listeners=listeners,
        )

    def __repr__(self) -> str:
        return f"Coordinator(journal={self.journal!r}, workspace={self.workspace!r})"

    def close(self) -> None:
        """Release the engines' resources (the journal is the host's to close)."""
        self.task_engine.close()
        self.session_engine.close()

    # -- the plan ------------------------------------------------------------------------------

    def start(self, graph: TaskGraph, /, *, idea: str = "", session_id: str | None = None) -> str:
        """Start a session in ``idea`` with its task graph.

        Args:
            graph: the tasks and the global verification (journaled as the session's input).
            idea: what the session is about.
            session_id: the session's run id; a new random one when not given.

        Returns:
            The session's id.

        Raises:
            RunExistsError: a run with ``session_id`` exists.
        """
        return self.session_engine.start(
            {"idea": idea, "graph": graph.to_dict(), "roles": list(self.roles)},
            run_id=session_id,
        )

    def submit_plan(
        self, session_id: str, plan: Any, *, graph: TaskGraph | None = None
    ) -> RunRecord:
        """Submit the plan for review: ``idea`` → ``plan_review``.

        Args:
            session_id: the session.
            plan: the plan (JSON: text or structured), journaled with the event.
            graph: a revised task graph, replacing the one before from the next round on.

        Raises:
            InvalidTransitionError: the session is not in ``idea``.
            RunTerminalError: the session has ended.
        """
        output: dict[str, Any] = {"plan": plan}
        if graph is not None:
            output["graph"] = graph.to_dict()
        return self.session_engine.send(session_id, _E.PLAN_SUBMITTED, output=output)

    def approve_plan(self, session_id: str, *, note: str | None = None) -> RunRecord:
        """Approve the plan: ``plan_review`` → ``execution``, starting a new round of tasks.

        Raises:
            InvalidTransitionError: the session is not in ``plan_review``.
            RunTerminalError: the session has ended.
        """
        session = self._load(session_id)
        round_number = _history(self.journal, session).round + 1
        return self.session_engine.send(
            session_id, _E.PLAN_APPROVED, output={"round": round_number, "note": note}
        )

    # -- execution -----------------------------------------------------------------------------

    def execute_next_task(self, session_id: str) -> NextTask:
        """Run the next task to its end: the one a crash left running, else the next ready one.

        A task is ready when its dependencies are done; ties go to the order the graph
        declares. A task that does not get done (failed, blocked) has every task downstream
        of it marked skipped, with the reason.

        Returns:
            What was done; when no task could run, whether all are done, the session is
            blocked by tasks that did not get done, or a task is in progress elsewhere.

        Raises:
            SessionStateError: the session is not in ``execution``.
            RunTerminalError: the session has ended.
        """
        session = self._load(session_id)
        if session.abort_reason is not None:
            self.abort_session(session_id, session.abort_reason)
            return NextTask(NextStatus.ABORTED, reason=session.abort_reason)
        self._require(session, "execution", "execute_next_task")
        history = _history(self.journal, session)
        self._tidy(session_id, history)
        graph = history.graph
        children = _round_children(self.journal, session_id, history.round)
        # First a task a crash left in progress (its dependencies were done when it started).
        for task_id in graph.order:
            child = children.get(task_id)
            if child is not None and not child.ended and self._deps_done(graph, task_id, children):
                return self._run(session_id, history, task_id, child.run_id)
        self._skip_downstream(session_id, history)
        children = _round_children(self.journal, session_id, history.round)
        for task_id in graph.order:
            if task_id not in children and self._deps_done(graph, task_id, children):
                run_id = self._start_task(session, history, task_id)
                return self._run(session_id, history, task_id, run_id)
        return self._idle(graph, children)

    def run_until_done(
        self, session_id: str, *, finalize: bool = True, fail_when_blocked: bool = True
    ) -> RunRecord:
        """Execute tasks until none is left, then finalize the session.

        Args:
            session_id: the session, in ``execution``.
            finalize: finalize once every task is done.
            fail_when_blocked: when every task has ended and some did not get done, end the
                session as ``failed`` with the reason (otherwise it stays in ``execution``).

        Returns:
            The session as it stands at the end: ``complete``; ``execution`` after a failed
            finalize (its ``error`` says why) or while a task is in progress elsewhere;
            ``failed``; or ``aborted``.

        Raises:
            SessionStateError: the session is not in ``execution``.
            RunTerminalError: the session has ended.
        """
        while True:
            step = self.execute_next_task(session_id)
            if step.status is NextStatus.RAN:
                continue
            if step.status is NextStatus.ALL_DONE and finalize:
                return self.finalize_session(session_id)
            if step.status is NextStatus.BLOCKED and fail_when_blocked:
                return self.fail_session(session_id, step.reason or "tasks did not get done")
            return self.journal.load(session_id)

    def finalize_session(self, session_id: str) -> RunRecord:
        """Run the global verification; on success keep the run summary and complete.

        Only in ``execution``, and only when no task is pending or running. On failure the
        session returns to ``execution`` with the reason as its ``error``, and this may be
        called again.

        Returns:
            The session: ``complete``, or back in ``execution``.

        Raises:
            SessionStateError: the session is not in ``execution``, or tasks are pending or
                running.
            RunTerminalError: the session has ended.
        """
        session = self._load(session_id)
        if session.abort_reason is not None:
            return self.abort_session(session_id, session.abort_reason)
        self._require(session, "execution", "finalize_session")
        history = _history(self.journal, session)
        self._tidy(session_id, history)  # every ended task recorded before the summary
        unsettled = self._unsettled(session_id, history)
        if unsettled:
            raise SessionStateError(
                run_id=session_id,
                state=session.state,
                operation="finalize_session",
                reason=f"tasks are pending or running: {', '.join(unsettled)}",
            )
        self.session_engine.send(session_id, _E.FINALIZE_REQUESTED)
        return self.session_engine.run(session_id)

    def fail_session(self, session_id: str, reason: str) -> RunRecord:
        """End a session in ``execution`` as ``failed``, with the reason journaled.

        Raises:
            SessionStateError: the session is not in ``execution``.
            RunTerminalError: the session has ended.
        """
        self._require(self._load(session_id), "execution", "fail_session")
        return self.session_engine.send(session_id, _E.SESSION_FAILED, output={"reason": reason})

    # -- abort, reset, resume ------------------------------------------------------------------

    def abort_session(self, session_id: str, reason: str) -> RunRecord:
        """Abort a session from any phase that has not ended.

        The abort is requested in the journal first, so a crash half-way is finished by the
        next call on the session. A task in progress is aborted and, if its diff may be in
        the workspace, the diff is taken out again (whole, or not at all) — the workspace
        keeps exactly the work of the tasks that are done. Nothing journaled is removed:
        every transition and artifact of the session and its tasks stays. (A task whose phase
        is running in this very process, on another thread, is only asked to stop — the engine
        aborts it between phases — and its diff is not touched under it.)

        Returns:
            The session, ``aborted``.

        Raises:
            RunTerminalError: the session has ended.
        """
        session = self._load(session_id)
        if session.ended:
            raise RunTerminalError(
                run_id=session_id, state=session.state, status=session.status.value
            )
        if session.abort_reason is None:
            session = self.journal.request_abort(session_id, reason)
        reason = session.abort_reason or reason
        self._tidy(session_id, _history(self.journal, session), abort_reason=reason)
        return self.session_engine.abort(session_id, reason)

    def reset_to_phase(self, session_id: str, target: str, *, reason: str = "") -> RunRecord:
        """Send a session back to ``idea`` or ``plan_review``.

        The reset is validated against :data:`SESSION` (``idea`` from ``plan_review`` or
        ``execution``; ``plan_review`` from ``execution``) and journaled with its reason. A
        task of the round in progress is aborted and its diff taken out; tasks that are done
        stay done, and their work stays in the workspace. The next approval starts a new
        round, whose tasks are new child runs.

        Raises:
            SessionStateError: ``target`` is not ``idea`` or ``plan_review``.
            InvalidTransitionError: the session's phase cannot be reset to ``target``.
            RunTerminalError: the session has ended.
        """
        session = self._load(session_id)
        event = _RESET_EVENTS.get(target)
        if event is None or not SESSION.has_state(target):
            raise SessionStateError(
                run_id=session_id,
                state=session.state,
                operation=f"reset_to_phase({target!r})",
                reason="a session can only be reset to 'idea' or 'plan_review'",
            )
        if session.ended:
            raise RunTerminalError(
                run_id=session_id, state=session.state, status=session.status.value
            )
        if (session.state, event.value) not in SESSION.edges:
            raise InvalidTransitionError(run_id=session_id, state=session.state, event=event.value)
        history = _history(self.journal, session)
        self.session_engine.send(
            session_id, event, output={"target": target, "reason": reason, "round": history.round}
        )
        self._tidy(session_id, history, abort_reason=f"session reset to {target}")
        return self.journal.load(session_id)

    def resume(self, session_id: str) -> RunRecord:
        """Continue a session after a crash, a kill or a stop, from what the journal says.

        A pending abort is carried out; a session killed while finalizing finalizes again; a
        session in ``execution`` continues with the first task not yet done (a task that is
        done never runs again) and is finalized; one in ``idea`` or ``plan_review`` waits for
        the host and is returned as it is.

        Returns:
            The session as it stands at the end.

        Raises:
            RunTerminalError: the session has ended.
        """
        session = self._load(session_id)
        if session.ended:
            raise RunTerminalError(
                run_id=session_id, state=session.state, status=session.status.value
            )
        if session.abort_reason is not None:
            return self.abort_session(session_id, session.abort_reason)
        if session.state == "finalizing":
            return self.session_engine.run(session_id)
        if session.state == "execution":
            return self.run_until_done(session_id)
        return session

    # -- reading -------------------------------------------------------------------------------

    def status(self, session_id: str) -> SessionStatus:
        """Where the session and each task of its current round stand.

        Raises:
            RunNotFoundError: no such session.
        """
        session = self._load(session_id)
        history = _history(self.journal, session)
        children = _round_children(self.journal, session_id, history.round)
        tasks: list[TaskStatus] = []
        for task_id in history.graph.order:
            child = children.get(task_id)
            if child is None or history.round == 0:
                tasks.append(TaskStatus(task_id, "pending"))
                continue
            transitions = self.journal.transitions(child.run_id)
            roles = [str(routing.get("role")) for routing in _attempts(transitions)]
            tasks.append(
                TaskStatus(
                    task_id,
                    child.state,
                    child.run_id,
                    attempts=len(roles),
                    roles=roles,
                    reason=_task_reason(child, transitions[-1] if transitions else None),
                )
            )
        return SessionStatus(session, history.round, tuple(tasks))

    def summary(self, session_id: str) -> Mapping[str, Any] | None:
        """The run summary a finalized session keeps, or ``None`` before it has one."""
        for artifact in self.journal.artifacts(session_id):
            if artifact.name == "summary":
                content: Mapping[str, Any] = artifact.content
                return content
        return None

    # -- the parts -----------------------------------------------------------------------------

    def _load(self, session_id: str) -> RunRecord:
        session = self.journal.load(session_id)
        if session.machine != SESSION.name:
            raise SessionStateError(
                run_id=session_id,
                state=session.state,
                operation="a coordinator operation",
                reason=f"the run is a {session.machine!r} run, not a coordinator session",
            )
        return session

    @staticmethod
    def _require(session: RunRecord, phase: str, operation: str) -> None:
        if session.ended:
            raise RunTerminalError(
                run_id=session.run_id, state=session.state, status=session.status.value
            )
        if session.state != phase:
            raise SessionStateError(
                run_id=session.run_id,
                state=session.state,
                operation=operation,
                reason=f"only allowed in phase {phase!r}",
            )

    @staticmethod
    def _deps_done(graph: TaskGraph, task_id: str, children: Mapping[str, RunRecord]) -> bool:
        return all(
            dep in children and children[dep].state == "done"
            for dep in graph.task(task_id).depends_on
        )

    def _unsettled(self, session_id: str, history: _History) -> list[str]:
        children = _round_children(self.journal, session_id, history.round)
        return [
            task_id
            for task_id in history.graph.order
            if task_id not in children or not children[task_id].ended
        ]

    def _tasks_settled(self, session: RunRecord) -> bool:
        """Guard ``tasks_settled``: no task of the session's round is pending or running."""
        return not self._unsettled(session.run_id, _history(self.journal, session))

    def _run(self, session_id: str, history: _History, task_id: str, run_id: str) -> NextTask:
        try:
            child = self.task_engine.run(run_id)
        except RunConflictError:
            return NextTask(
                NextStatus.WAITING,
                task_id=task_id,
                run_id=run_id,
                reason=f"task {task_id!r} is being advanced by another worker",
            )
        if not child.ended:  # pragma: no cover - every non-terminal task state has a handler
            return NextTask(NextStatus.WAITING, task_id=task_id, run_id=run_id)
        self._settle(session_id, child)
        skipped: tuple[str, ...] = ()
        if child.state != "done" and not self.journal.load(session_id).ended:
            skipped = self._skip_downstream(session_id, history)
        transitions = self.journal.transitions(run_id)
        roles = [str(routing.get("role")) for routing in _attempts(transitions)]
        return NextTask(
            NextStatus.RAN,
            task_id=task_id,
            outcome=child.state,
            run_id=run_id,
            attempts=len(roles),
            roles=roles,
            reason=_task_reason(child, transitions[-1] if transitions else None),
            skipped=skipped,
        )

    def _start_task(self, session: RunRecord, history: _History, task_id: str) -> str:
        """Start the child run of ``task_id`` in the current round; return its id.

        The id is derived from the session, round and task, so a resumed session finds it.
        """
        return self.task_engine.start(
            {
                "session_id": session.run_id,
                "round": history.round,
                "task": history.graph.task(task_id).to_dict(),
                "roles": list(session.input.get("roles") or self.roles),
            },
            run_id=f"{session.run_id}:{history.round}:{task_id}",
            parent_run_id=session.run_id,
        )

    def _skip_downstream(self, session_id: str, history: _History) -> tuple[str, ...]:
        """Mark skipped every task with a dependency that did not get done; return them."""
        session = self.journal.load(session_id)
        graph = history.graph
        children = _round_children(self.journal, session_id, history.round)
        states = {task_id: child.state for task_id, child in children.items()}
        reasons: dict[str, str] = {}
        skipped: list[str] = []
        for task_id in graph.order:  # dependencies first, so skips carry on downstream
            child = children.get(task_id)
            if child is not None and child.ended:
                continue
            depends_on = graph.task(task_id).depends_on
            bad = [dep for dep in depends_on if states.get(dep) in _UNSUCCESSFUL]
            if not bad:
                continue
            dep = bad[0]
            cause = reasons.get(dep)
            if cause is None:
                dep_child = children[dep]
                dep_last = self.journal.transitions(dep_child.run_id, from_seq=dep_child.seq)
                cause = _task_reason(dep_child, dep_last[0] if dep_last else None) or ""
            reason = f"dependency {dep!r} {states[dep]}" + (f": {cause}" if cause else "")
            if child is None:
                child = self.journal.load(self._start_task(session, history, task_id))
            if child.state == "scheduled":
                child = self.task_engine.send(
                    child.run_id, _T.TASK_SKIPPED, output={"reason": reason}
                )
            else:  # pragma: no cover - started tasks have their dependencies done
                child = self.task_engine.abort(child.run_id, reason)
            self._settle(session_id, child)
            states[task_id], reasons[task_id] = child.state, reason
            skipped.append(task_id)
        return tuple(skipped)

    def _idle(self, graph: TaskGraph, children: Mapping[str, RunRecord]) -> NextTask:
        states = {
            task_id: (children[task_id].state if task_id in children else "pending")
            for task_id in graph.order
        }
        if all(state == "done" for state in states.values()):
            return NextTask(NextStatus.ALL_DONE)
        running = [task_id for task_id, state in states.items() if state not in _TASK_ENDS]
        if running:
            return NextTask(
                NextStatus.WAITING,
                task_id=running[0],
                reason=f"tasks in progress: {', '.join(running)}",
            )
        not_done = [f"{task_id} {state}" for task_id, state in states.items() if state != "done"]
        return NextTask(NextStatus.BLOCKED, reason=f"tasks did not get done: {', '.join(not_done)}")

    def _tidy(self, session_id: str, history: _History, *, abort_reason: str | None = None) -> None:
        """Bring the journal and workspace in line with the session's child runs.

        Every task whose end the session has not journaled yet (a crash came between) is
        cleaned up and recorded; a task of an earlier round still in progress (a crash during
        a reset) is aborted; with ``abort_reason``, so is every task in progress.
        """
        for child in sorted(_children(self.journal, session_id), key=lambda run: run.created_at):
            if child.run_id in history.recorded:
                continue
            current = child
            if not current.ended and (abort_reason or _round_of(current) != history.round):
                try:
                    current = self.task_engine.abort(
                        current.run_id, abort_reason or "superseded by a reset of the session"
                    )
                except RunTerminalError:
                    current = self.journal.load(current.run_id)
            if current.ended:
                self._settle(session_id, current)

    def _settle(self, session_id: str, child: RunRecord) -> None:
        """After a task ended: take its diff out if it did not get done, and record its end."""
        last = self.journal.transitions(child.run_id, from_seq=child.seq)
        last_transition = last[0] if last else None
        reverted = False
        if (
            last_transition is not None
            and last_transition.event in _CUT_SHORT
            and last_transition.from_state in _DIFF_STATES
            and child.context.get("diff")
        ):
            # The diff may be in the workspace (git apply is all or nothing, so it is in whole
            # or not at all): take it out, so the workspace holds only tasks that are done.
            result = self.workspace.revert(
                str(child.context["diff"]), key=f"{child.run_id}@cleanup"
            )
            reverted = result.done and not result.already
            if not result.done:
                _log.warning(
                    "task run %s ended in %s; its diff could not be taken out: %s",
                    child.run_id,
                    child.state,
                    result.detail,
                )
        event = _RECORD_EVENTS.get(child.state)
        session = self.journal.load(session_id)
        if event is None or session.ended or (session.state, event.value) not in SESSION.edges:
            return  # the child's own journal keeps its end; the session's phase cannot record it
        self.session_engine.send(
            session_id,
            event,
            output={
                "task_id": _task_id_of(child),
                "run_id": child.run_id,
                "round": _round_of(child),
                "outcome": child.state,
                "reason": _task_reason(child, last_transition),
                "reverted": reverted,
            },
        )
