"""The coordinator's vocabulary: its errors, the task graph, and the services and their protocols.

A :class:`TaskGraph` of :class:`Task` s is what a session executes (an invalid one raises
:class:`TaskGraphError`; an operation a session does not allow, :class:`SessionStateError`).
An :class:`AgentRole` turns a task into a :class:`Proposal`, each :class:`Gate` gives a
:class:`GateVerdict` on it, the :class:`Workspace` applies it (a :class:`PatchResult`) and a
:class:`Summarizer` writes the run summary. :mod:`fsm_runner.presets.coordinator` drives them;
every name here is re-exported there, which is where hosts import them from.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from fsm_runner import (
    FsmRunnerError,
    InvalidRunIdError,
    InvalidTransitionError,
    Journal,
    RunRecord,
    check_run_id,
)

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_ROLES",
    "AgentRole",
    "Gate",
    "GateVerdict",
    "PatchResult",
    "Proposal",
    "SessionStateError",
    "Summarizer",
    "Task",
    "TaskGraph",
    "TaskGraphError",
    "Workspace",
]

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


def _run_id_problems(task_id: str) -> Iterator[str]:
    """Why a task's runs, ``SESSION:ROUND:TASK``, could not have a run id with ``task_id`` in it."""
    try:
        check_run_id(f"s:1:{task_id}")
    except InvalidRunIdError as exc:
        yield f"task {task_id!r} cannot be part of its runs' ids: {exc.reason}"


@attrs.frozen
class TaskGraph:
    """A DAG of tasks, and the global verification that finalizes a session.

    Args:
        tasks: the tasks; declaration order breaks ties, so the order they run in is stable.
        verify: the global verification (build and test commands), as
            ``{level: command or [commands]}``, run when the session is finalized; levels run
            in the natural order of their names.

    Raises:
        TaskGraphError: with every problem: no tasks, empty or duplicate ids, ids a run id
            cannot hold (whitespace, a slash; see :mod:`fsm_runner.run_ids`), unknown or
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
            else:
                yield from _run_id_problems(task.id)
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
