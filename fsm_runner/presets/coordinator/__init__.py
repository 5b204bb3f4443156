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
:mod:`fsm_runner.presets.coordinator.services` has real ones (git, shell commands) and scripted
agents for tests and examples::

    from fsm_runner import SqliteJournal
    from fsm_runner.presets.coordinator import Coordinator, Task, TaskGraph
    from fsm_runner.presets.coordinator.services import GitWorkspace, ScriptedAgents, file_diff

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

This module uses only fsm_runner's public API, as a host app would. It holds the
:class:`Coordinator`, whose operations are the session's rules; the rest of the preset lives
beside it, and every name is re-exported here: the errors, the task graph and the service
protocols in :mod:`~fsm_runner.presets.coordinator.tasks`, the machines and the task phases
in :mod:`~fsm_runner.presets.coordinator.machines`, and what the journal says about a session
(finalizing, summaries, what the coordinator reports) in
:mod:`~fsm_runner.presets.coordinator.summary`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fsm_runner import (
    Engine,
    InvalidTransitionError,
    Journal,
    Listener,
    RunRecord,
    RunTerminalError,
    TransitionRecord,
)
from fsm_runner.exceptions import RunConflictError
from fsm_runner.presets.agent_loop import Verifier
from fsm_runner.presets.agent_loop.services import CommandVerifier, TemplateFeedbackGenerator
from fsm_runner.presets.coordinator.machines import (
    _CUT_SHORT,
    _DIFF_STATES,
    _RECORD_EVENTS,
    _RESET_EVENTS,
    _TASK_ENDS,
    _UNSUCCESSFUL,
    SESSION,
    TASK,
    ApplyPhase,
    DispatchPhase,
    GatePhase,
    RevertPhase,
    SchedulePhase,
    SessionEvent,
    TaskEvent,
    VerifyPhase,
    _attempts_left,
)
from fsm_runner.presets.coordinator.summary import (
    FinalizePhase,
    JournalSummarizer,
    NextStatus,
    NextTask,
    SessionStatus,
    TaskStatus,
    _children,
    _History,
    _history,
    _progress,
    _round_children,
    _round_of,
    _session_status,
    _task_id_of,
    _task_reason,
    _unsettled,
    fallback_summary,
)
from fsm_runner.presets.coordinator.tasks import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_ROLES,
    AgentRole,
    Gate,
    GateVerdict,
    PatchResult,
    Proposal,
    SessionStateError,
    Summarizer,
    Task,
    TaskGraph,
    TaskGraphError,
    Workspace,
)

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
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

_E = SessionEvent
_T = TaskEvent

# -- the rules the coordinator checks ----------------------------------------------------------


def _ended(session: RunRecord) -> RunTerminalError:
    """The error for an operation on a session that has ended."""
    return RunTerminalError(run_id=session.run_id, state=session.state, status=session.status.value)


def _load_session(journal: Journal, session_id: str) -> RunRecord:
    session = journal.load(session_id)
    if session.machine != SESSION.name:
        raise SessionStateError(
            run_id=session_id,
            state=session.state,
            operation="a coordinator operation",
            reason=f"the run is a {session.machine!r} run, not a coordinator session",
        )
    return session


def _require_phase(session: RunRecord, phase: str, operation: str) -> None:
    if session.ended:
        raise _ended(session)
    if session.state != phase:
        raise SessionStateError(
            run_id=session.run_id,
            state=session.state,
            operation=operation,
            reason=f"only allowed in phase {phase!r}",
        )


def _deps_done(graph: TaskGraph, task_id: str, children: Mapping[str, RunRecord]) -> bool:
    return all(
        dep in children and children[dep].state == "done" for dep in graph.task(task_id).depends_on
    )


def _idle(graph: TaskGraph, children: Mapping[str, RunRecord]) -> NextTask:
    """What :meth:`Coordinator.execute_next_task` reports when no task could run."""
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


def _take_out_diff(workspace: Workspace, child: RunRecord, last: TransitionRecord | None) -> bool:
    """Take an ended task's diff out of the workspace if it may be in; say if it was taken out.

    A diff can be left in the workspace only by a task cut short (``SYSTEM_ERROR``,
    ``USER_ABORTED``) in a state where its diff may be applied: every other way out of those
    states has settled where the diff is.
    """
    if not (
        last is not None
        and last.event in _CUT_SHORT
        and last.from_state in _DIFF_STATES
        and child.context.get("diff")
    ):
        return False
    # The diff may be in the workspace (git apply is all or nothing, so it is in whole or not at
    # all): take it out, so the workspace holds only tasks that are done.
    result = workspace.revert(str(child.context["diff"]), key=f"{child.run_id}@cleanup")
    if not result.done:
        _log.warning(
            "task run %s ended in %s; its diff could not be taken out: %s",
            child.run_id,
            child.state,
            result.detail,
        )
    return result.done and not result.already


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
            :class:`fsm_runner.presets.agent_loop.services.CommandVerifier` when not given.
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
        session = _load_session(self.journal, session_id)
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
        session = _load_session(self.journal, session_id)
        if session.abort_reason is not None:
            self.abort_session(session_id, session.abort_reason)
            return NextTask(NextStatus.ABORTED, reason=session.abort_reason)
        _require_phase(session, "execution", "execute_next_task")
        history = _history(self.journal, session)
        self._tidy(session_id, history)
        graph = history.graph
        children = _round_children(self.journal, session_id, history.round)
        # First a task a crash left in progress (its dependencies were done when it started).
        for task_id in graph.order:
            child = children.get(task_id)
            if child is not None and not child.ended and _deps_done(graph, task_id, children):
                return self._run(session_id, history, task_id, child.run_id)
        self._skip_downstream(session_id, history)
        children = _round_children(self.journal, session_id, history.round)
        for task_id in graph.order:
            if task_id not in children and _deps_done(graph, task_id, children):
                run_id = self._start_task(session, history, task_id)
                return self._run(session_id, history, task_id, run_id)
        return _idle(graph, children)

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
        session = _load_session(self.journal, session_id)
        if session.abort_reason is not None:
            return self.abort_session(session_id, session.abort_reason)
        _require_phase(session, "execution", "finalize_session")
        history = _history(self.journal, session)
        self._tidy(session_id, history)  # every ended task recorded before the summary
        unsettled = _unsettled(self.journal, session_id, history)
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
        _require_phase(_load_session(self.journal, session_id), "execution", "fail_session")
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
        session = _load_session(self.journal, session_id)
        if session.ended:
            raise _ended(session)
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
        session = _load_session(self.journal, session_id)
        event = _RESET_EVENTS.get(target)
        if event is None or not SESSION.has_state(target):
            raise SessionStateError(
                run_id=session_id,
                state=session.state,
                operation=f"reset_to_phase({target!r})",
                reason="a session can only be reset to 'idea' or 'plan_review'",
            )
        if session.ended:
            raise _ended(session)
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
        session = _load_session(self.journal, session_id)
        if session.ended:
            raise _ended(session)
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
        return _session_status(self.journal, _load_session(self.journal, session_id))

    def summary(self, session_id: str) -> Mapping[str, Any] | None:
        """The run summary a finalized session keeps, or ``None`` before it has one."""
        for artifact in self.journal.artifacts(session_id):
            if artifact.name == "summary":
                content: Mapping[str, Any] = artifact.content
                return content
        return None

    # -- the parts -----------------------------------------------------------------------------

    def _tasks_settled(self, session: RunRecord) -> bool:
        """Guard ``tasks_settled``: no task of the session's round is pending or running."""
        return not _unsettled(self.journal, session.run_id, _history(self.journal, session))

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
        roles, reason = _progress(self.journal, child)
        return NextTask(
            NextStatus.RAN,
            task_id=task_id,
            outcome=child.state,
            run_id=run_id,
            attempts=len(roles),
            roles=roles,
            reason=reason,
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
        reverted = _take_out_diff(self.workspace, child, last_transition)
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
