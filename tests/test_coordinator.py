"""The coordinator preset with real git repositories, real `git apply`, real commands and SIGKILL."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsm_runner import InvalidTransitionError, RunLifecycle, RunTerminalError, SqliteJournal
from fsm_runner.presets.agent_loop.services import CommandVerifier
from fsm_runner.presets.coordinator import (
    SESSION,
    TASK,
    Coordinator,
    NextStatus,
    SessionStateError,
    Task,
    TaskGraph,
    TaskGraphError,
)
from fsm_runner.presets.coordinator.services import (
    DiffGate,
    GitWorkspace,
    PolicyGate,
    ScriptedAgents,
    WorkspaceError,
    diff_paths,
    file_diff,
)

ROOT = Path(__file__).parents[1]
PY = sys.executable
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]

# Checks that FILE holds WORD (exactly COUNT times, if given); exits 1 otherwise.
CHECK = """import pathlib, sys
path, word = pathlib.Path(sys.argv[1]), sys.argv[2]
found = path.read_text().count(word) if path.exists() else 0
want = int(sys.argv[3]) if len(sys.argv) > 3 else None
ok = found == want if want is not None else found > 0
print(f"{path}: {word!r} found {found} times")
sys.exit(0 if ok else 1)
"""

ITEMS = "item\n" * 20  # a file in which an inserted line would fit again, and again
WITH_NEW = "item\n" * 10 + "new\n" + "item\n" * 10


@pytest.fixture(autouse=True)
def _no_git_prompts(monkeypatch):
    monkeypatch.setenv("GIT_TERMINAL_PROMPT", "0")


def git(repo: Path, *args: str) -> str:
    done = subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True)
    return done.stdout


def make_repo(path: Path, files: dict[str, str] | None = None) -> Path:
    path.mkdir()
    for name, content in (files or {"README": "project\n"}).items():
        (path / name).write_text(content)
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "start")
    return path


class Env:
    """A repo, a journal and a checker script in tmp_path; builds coordinators over them."""

    def __init__(self, tmp_path: Path, files: dict[str, str] | None = None) -> None:
        self.tmp = tmp_path
        self.repo = make_repo(tmp_path / "repo", files)
        self.check_script = tmp_path / "check.py"
        self.check_script.write_text(CHECK)
        self.journal = SqliteJournal(tmp_path / "journal.db")
        self.coordinators: list[Coordinator] = []

    def check(self, path: str, word: str, count: int | None = None) -> str:
        args = [PY, str(self.check_script), path, word] + (
            [str(count)] if count is not None else []
        )
        return shlex.join(args)

    def coordinator(self, agents, **options) -> Coordinator:
        coordinator = Coordinator(
            self.journal, workspace=GitWorkspace(self.repo), agents=agents, **options
        )
        self.coordinators.append(coordinator)
        return coordinator

    def approved(self, coordinator: Coordinator, graph: TaskGraph) -> str:
        session = coordinator.start(graph, idea="test")
        coordinator.submit_plan(session, "the plan")
        coordinator.approve_plan(session)
        return session

    def read(self, name: str) -> str | None:
        path = self.repo / name
        return path.read_text() if path.exists() else None

    def close(self) -> None:
        for coordinator in self.coordinators:
            coordinator.close()
        self.journal.close()


@pytest.fixture
def env(tmp_path):
    environment = Env(tmp_path)
    yield environment
    environment.close()


def diamond(env: Env, **overrides: Task) -> TaskGraph:
    """a → (b, c) → d → e; every task writes one file and checks it."""
    tasks = {
        "a": Task("a", "write a", verify=env.check("a.txt", "alpha")),
        "b": Task("b", "write b", depends_on=["a"], verify=env.check("b.txt", "beta")),
        "c": Task("c", "write c", depends_on=["a"], verify=env.check("c.txt", "gamma")),
        "d": Task("d", "write d", depends_on=["b", "c"], verify=env.check("d.txt", "delta")),
        "e": Task("e", "write e", depends_on=["d"], verify=env.check("e.txt", "epsilon")),
    }
    tasks.update(overrides)
    return TaskGraph(
        list(tasks.values()),
        verify={"build": f"{PY} -m compileall -q .", "test": env.check("e.txt", "epsilon")},
    )


def diamond_script() -> dict:
    return {
        "a": file_diff("a.txt", None, "alpha\n"),
        "b": file_diff("b.txt", None, "beta\n"),
        "c": file_diff("c.txt", None, "gamma\n"),
        "d": file_diff("d.txt", None, "delta\n"),
        "e": file_diff("e.txt", None, "epsilon\n"),
    }


class TestHappyPath:
    """Five tasks with a diamond dependency, from idea to complete."""

    def test_diamond_runs_in_order_and_completes(self, env):
        agents = ScriptedAgents(diamond_script())
        coordinator = env.coordinator(agents)
        session = coordinator.start(diamond(env), idea="five files")
        assert env.journal.load(session).state == "idea"
        assert coordinator.submit_plan(session, {"steps": 5}).state == "plan_review"
        assert coordinator.approve_plan(session, note="go").state == "execution"

        steps = []
        while (step := coordinator.execute_next_task(session)).status is NextStatus.RAN:
            steps.append(step)
        assert [s.task_id for s in steps] == ["a", "b", "c", "d", "e"]
        assert all(s.outcome == "done" and s.roles == ("worker",) for s in steps)
        assert step.status is NextStatus.ALL_DONE

        run = coordinator.finalize_session(session)
        assert (run.state, run.status) == ("complete", RunLifecycle.SUCCEEDED)
        for name, word in [("a", "alpha"), ("b", "beta"), ("c", "gamma"), ("d", "delta")]:
            assert env.read(f"{name}.txt") == f"{word}\n"
        assert git(env.repo, "status", "--porcelain") == ""  # every task's work committed
        subjects = git(env.repo, "log", "--format=%s").splitlines()
        assert subjects == [
            "e: write e",
            "d: write d",
            "c: write c",
            "b: write b",
            "a: write a",
            "start",
        ]

        children = env.journal.runs(parent_run_id=session)
        assert sorted(c.run_id for c in children) == [f"{session}:1:{t}" for t in "abcde"]
        assert all(c.state == "done" and c.machine == TASK.name for c in children)
        path = [t.to_state for t in env.journal.transitions(f"{session}:1:d")]
        assert path == ["scheduled", "dispatched", "gated", "applied", "verified", "done"]

        events = [t.event for t in env.journal.transitions(session)]
        assert events == [
            "STARTED", "PLAN_SUBMITTED", "PLAN_APPROVED", *["TASK_FINISHED"] * 5,
            "FINALIZE_REQUESTED", "SESSION_FINALIZED",
        ]  # fmt: skip

        summary = coordinator.summary(session)
        assert summary["source"] == "summarizer"
        assert [t["id"] for t in summary["tasks"]] == list("abcde")
        assert all(t["attempts"] == 1 and t["roles"] == ["worker"] for t in summary["tasks"])
        assert all(t["duration_ms"] >= 0 and t["commit"] for t in summary["tasks"])
        assert summary["tasks"][0]["verification"][0]["passed"] is True
        assert summary["totals"] == {"tasks": 5, "attempts": 5, "done": 5}
        assert summary["roles_used"] == {"worker": 5}
        assert summary["verification"]["levels_run"] == ["build", "test"]
        names = {a.name for a in env.journal.artifacts(session)}
        assert names == {"summary", "global-verification-1"}
        assert {a.name for a in env.journal.artifacts(f"{session}:1:a")} == {
            "proposal-1",
            "verification-1",
        }

    def test_run_until_done_and_status(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = env.approved(coordinator, diamond(env))
        assert [t.state for t in coordinator.status(session).tasks] == ["pending"] * 5
        run = coordinator.run_until_done(session)
        assert run.state == "complete"
        status = coordinator.status(session)
        assert status.round == 1
        assert status.task("d").state == "done"
        assert all(t.settled and t.attempts == 1 for t in status.tasks)


class TestGates:
    """A gate block ends the task as blocked, with the reason, and skips what depends on it."""

    def test_policy_gate_blocks(self, env):
        script = diamond_script() | {"b": file_diff("secrets/key.txt", None, "hunter2\n")}
        agents = ScriptedAgents(script)
        gates = [DiffGate(max_changed_lines=50), PolicyGate(forbidden_paths=["secrets/*"])]
        coordinator = env.coordinator(agents, gates=gates)
        session = env.approved(coordinator, diamond(env))
        assert coordinator.execute_next_task(session).outcome == "done"
        step = coordinator.execute_next_task(session)
        assert (step.task_id, step.outcome) == ("b", "blocked")
        assert "policy" in step.reason
        assert "secrets/key.txt" in step.reason
        assert step.skipped == ("d", "e")
        assert not (env.repo / "secrets").exists()  # a blocked diff is never applied

        blocked = env.journal.load(f"{session}:1:b")
        assert blocked.status is RunLifecycle.FAILED
        assert blocked.error["type"] == "gate_blocked"
        gated = env.journal.transitions(blocked.run_id)[-1]
        assert gated.output["gate"] == "policy"
        assert [v["gate"] for v in gated.output["verdicts"]] == ["diff", "policy"]
        skipped = env.journal.load(f"{session}:1:e")
        assert skipped.state == "skipped"
        reason = coordinator.status(session).task("e").reason
        assert reason.startswith("dependency 'd' skipped: dependency 'b' blocked: policy")

        run = coordinator.run_until_done(session)  # c still runs; then the session fails
        assert coordinator.status(session).task("c").state == "done"
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        failed = env.journal.transitions(session)[-1]
        assert failed.event == "SESSION_FAILED"
        assert "b blocked" in failed.output["reason"]

    def test_diff_command_gate_blocks_with_its_output(self, env):
        script = {"a": file_diff("a.txt", None, "alpha TODO\n")}
        command = f"{PY} -c \"import sys; d = sys.stdin.read(); print('no TODOs'); sys.exit('TODO' in d)\""
        coordinator = env.coordinator(ScriptedAgents(script), gates=[DiffGate(command=command)])
        session = env.approved(
            coordinator, TaskGraph([Task("a", verify=env.check("a.txt", "alpha"))])
        )
        step = coordinator.execute_next_task(session)
        assert step.outcome == "blocked"
        assert "exited with 1: no TODOs" in step.reason

    def test_empty_and_broken_diffs_are_blocked(self, env):
        gate = DiffGate()
        task = Task("a")
        from fsm_runner.presets.coordinator import Proposal

        assert not gate.check(task, Proposal(""), workspace=str(env.repo)).passed
        broken = gate.check(
            task, Proposal("--- a/x\n+++ b/x\n@@ nonsense\n"), workspace=str(env.repo)
        )
        assert not broken.passed
        assert "not a valid patch" in broken.reason


class TestRetries:
    """Verification failures are retried with escalation; past the limit, downstream is skipped."""

    def test_verification_failure_escalates(self, env):
        script = diamond_script() | {
            ("b", 1): file_diff("b.txt", None, "wrong\n"),
            ("b", 2): file_diff("b.txt", None, "still wrong\n"),
            ("b", 3): file_diff("b.txt", None, "beta\n"),
        }
        agents = ScriptedAgents(script)
        coordinator = env.coordinator(agents)
        session = env.approved(coordinator, diamond(env))
        coordinator.execute_next_task(session)
        step = coordinator.execute_next_task(session)
        assert (step.task_id, step.outcome, step.attempts) == ("b", "done", 3)
        assert step.roles == ("worker", "strong_worker", "fixer")
        assert agents.roles_for("b") == ["worker", "strong_worker", "fixer"]
        feedback = [c.feedback for c in agents.calls if c.task_id == "b"]
        assert feedback[0] is None
        assert "b.txt" in feedback[1]
        assert "exited with code 1" in feedback[1]
        assert env.read("b.txt") == "beta\n"

        path = [(t.from_state, t.event) for t in env.journal.transitions(step.run_id)]
        assert path.count(("verified", "VERIFY_FAILED")) == 2
        assert path.count(("reverted", "DIFF_REVERTED")) == 2
        assert coordinator.run_until_done(session).state == "complete"
        summary = coordinator.summary(session)
        b = next(t for t in summary["tasks"] if t["id"] == "b")
        assert [v["passed"] for v in b["verification"]] == [False, False, True]
        assert summary["roles_used"] == {"fixer": 1, "strong_worker": 1, "worker": 5}

    def test_retries_exhausted_skips_downstream(self, env):
        script = diamond_script() | {"b": file_diff("b.txt", None, "wrong\n")}
        agents = ScriptedAgents(script)
        coordinator = env.coordinator(agents)
        graph = diamond(
            env, b=Task("b", depends_on=["a"], verify=env.check("b.txt", "beta"), max_attempts=2)
        )
        session = env.approved(coordinator, graph)
        coordinator.execute_next_task(session)
        step = coordinator.execute_next_task(session)
        assert (step.task_id, step.outcome, step.attempts) == ("b", "failed", 2)
        assert step.roles == ("worker", "strong_worker")
        assert step.reason.startswith("retries exhausted: level check failed")
        assert step.skipped == ("d", "e")
        assert env.read("b.txt") is None  # the failed diff was taken out again
        for task in ("d", "e"):
            child = env.journal.load(f"{session}:1:{task}")
            assert child.state == "skipped"
            reason = env.journal.transitions(child.run_id)[-1].output["reason"]
            assert "dependency 'b' failed: retries exhausted" in reason
        assert agents.roles_for("d") == []  # never dispatched

        assert coordinator.execute_next_task(session).task_id == "c"  # independent of b
        step = coordinator.execute_next_task(session)
        assert step.status is NextStatus.BLOCKED
        assert "b failed" in step.reason
        assert "d skipped" in step.reason
        with pytest.raises(InvalidTransitionError, match="PLAN_APPROVED"):
            coordinator.approve_plan(session)  # not in plan_review: the spec refuses
        run = coordinator.run_until_done(session)
        assert run.state == "failed"
        events = [t.event for t in env.journal.transitions(session)]
        assert events.count("TASK_SKIPPED") == 2
        assert events.count("TASK_FAILED") == 1

    def test_agent_failure_is_retried(self, env):
        script = {
            ("a", 1): RuntimeError("model overloaded"),
            ("a", 2): file_diff("a.txt", None, "alpha\n"),
        }
        agents = ScriptedAgents(script)
        coordinator = env.coordinator(agents)
        session = env.approved(
            coordinator, TaskGraph([Task("a", verify=env.check("a.txt", "alpha"))])
        )
        step = coordinator.execute_next_task(session)
        assert (step.outcome, step.roles) == ("done", ("worker", "strong_worker"))
        assert "model overloaded" in agents.calls[1].feedback

    def test_a_diff_that_does_not_apply_is_retried(self, env):
        script = {
            ("a", 1): file_diff("README", "not what is there\n", "changed\n"),
            ("a", 2): file_diff("README", "project\n", "changed\n"),
        }
        agents = ScriptedAgents(script)
        coordinator = env.coordinator(agents)
        graph = TaskGraph([Task("a", verify=env.check("README", "changed"))])
        session = env.approved(coordinator, graph)
        step = coordinator.execute_next_task(session)
        assert (step.outcome, step.roles) == ("done", ("worker", "strong_worker"))
        assert "the diff does not apply" in agents.calls[1].feedback
        events = [t.event for t in env.journal.transitions(step.run_id)]
        assert events.count("APPLY_FAILED") == 1
        assert env.read("README") == "changed\n"

    def test_a_step_that_crashes_leaves_no_diff_behind(self, env):
        class NoCommits(GitWorkspace):
            def commit(self, message):
                raise OSError("disk full")

        coordinator = Coordinator(
            env.journal, workspace=NoCommits(env.repo), agents=ScriptedAgents(diamond_script())
        )
        env.coordinators.append(coordinator)
        session = env.approved(coordinator, diamond(env))
        step = coordinator.execute_next_task(session)
        assert (step.task_id, step.outcome, step.attempts) == ("a", "failed", 1)
        assert "OSError: disk full" in step.reason
        assert env.read("a.txt") is None  # applied and verified, then taken out again
        record = next(t for t in env.journal.transitions(session) if t.event == "TASK_FAILED")
        assert (record.output["task_id"], record.output["reverted"]) == ("a", True)


class TestFinalize:
    """Global verification decides; the summary falls back when its builder fails."""

    def test_finalize_fails_then_passes(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        graph = TaskGraph(
            diamond(env).tasks,
            verify={"build": f"{PY} -m compileall -q .", "test": env.check("RELEASE", "ok")},
        )
        session = env.approved(coordinator, graph)
        with pytest.raises(SessionStateError, match="tasks are pending or running: a, b, c, d, e"):
            coordinator.finalize_session(session)
        with pytest.raises(InvalidTransitionError, match="rejected by every guard"):
            coordinator.session_engine.send(session, "FINALIZE_REQUESTED")  # the spec's guard
        run = coordinator.run_until_done(session)
        assert (run.state, run.status) == ("execution", RunLifecycle.ACTIVE)
        assert run.error["type"] == "verification_failed"
        assert "level test failed" in run.error["message"]
        last = env.journal.transitions(session)[-1]
        assert (last.from_state, last.event, last.to_state) == (
            "finalizing",
            "VERIFY_FAILED",
            "execution",
        )
        assert last.result["reason"] == "global verification failed"
        assert coordinator.summary(session) is None

        (env.repo / "RELEASE").write_text("ok\n")
        run = coordinator.finalize_session(session)
        assert run.state == "complete"
        names = sorted(a.name for a in env.journal.artifacts(session))
        assert names == ["global-verification-1", "global-verification-2", "summary"]

    def test_fallback_summary(self, env):
        class Broken:
            def summarize(self, journal, session, *, verification):
                raise RuntimeError("the summary model is down")

        coordinator = env.coordinator(ScriptedAgents(diamond_script()), summarizer=Broken())
        session = env.approved(coordinator, diamond(env))
        assert coordinator.run_until_done(session).state == "complete"
        summary = coordinator.summary(session)
        assert summary["source"] == "fallback"
        assert "the summary model is down" in summary["summary_error"]
        assert sorted(t["task_id"] for t in summary["tasks"]) == list("abcde")
        assert all(t["state"] == "done" and t["transitions"] == 6 for t in summary["tasks"])
        assert summary["verification"]["passed"] is True

    def test_finalize_only_in_execution(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = coordinator.start(diamond(env))
        with pytest.raises(SessionStateError, match="only allowed in phase 'execution'") as raised:
            coordinator.finalize_session(session)
        assert isinstance(raised.value, InvalidTransitionError)
        with pytest.raises(SessionStateError):
            coordinator.execute_next_task(session)
        with pytest.raises(InvalidTransitionError):  # the spec itself refuses it too
            coordinator.session_engine.send(session, "FINALIZE_REQUESTED")
        assert env.journal.load(session).seq == 0


class InterruptOnce:
    """A verifier that stops the process (Ctrl-C) the first time it runs a command containing TEXT."""

    def __init__(self, text: str) -> None:
        self.inner = CommandVerifier()
        self.text = text
        self.fired = False

    def verify(self, workspace, *, levels=None, timeout=None):
        commands = [c for cs in (levels or {}).values() for c in cs]
        if not self.fired and any(self.text in c for c in commands):
            self.fired = True
            raise KeyboardInterrupt
        return self.inner.verify(workspace, levels=levels, timeout=timeout)


class TestAbort:
    """Abort from every phase; the running task is aborted and the workspace left consistent."""

    @pytest.mark.parametrize("phase", ["idea", "plan_review"])
    def test_abort_before_execution(self, env, phase):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = coordinator.start(diamond(env))
        if phase == "plan_review":
            coordinator.submit_plan(session, "plan")
        run = coordinator.abort_session(session, "changed my mind")
        assert (run.state, run.status) == ("aborted", RunLifecycle.ABORTED)
        last = env.journal.transitions(session)[-1]
        assert (last.from_state, last.event) == (phase, "USER_ABORTED")
        assert last.error["message"] == "changed my mind"
        with pytest.raises(RunTerminalError):
            coordinator.resume(session)
        with pytest.raises(RunTerminalError):
            coordinator.abort_session(session, "again")

    def test_abort_in_execution_with_a_task_applied(self, env):
        coordinator = env.coordinator(
            ScriptedAgents(diamond_script()), verifier=InterruptOnce("c.txt")
        )
        session = env.approved(coordinator, diamond(env))
        for _ in range(2):
            coordinator.execute_next_task(session)
        with pytest.raises(KeyboardInterrupt):
            coordinator.execute_next_task(session)  # c's diff is applied, its verification stopped
        running = env.journal.load(f"{session}:1:c")
        assert running.state == "verified"
        assert env.read("c.txt") == "gamma\n"
        rows_before = len(env.journal.transitions(running.run_id))

        run = coordinator.abort_session(session, "stop everything")
        assert (run.state, run.status) == ("aborted", RunLifecycle.ABORTED)
        aborted = env.journal.load(running.run_id)
        assert (aborted.state, aborted.status) == ("aborted", RunLifecycle.ABORTED)
        assert env.read("c.txt") is None  # the aborted task's diff is out again, whole
        assert env.read("b.txt") == "beta\n"  # done tasks stay done
        assert git(env.repo, "status", "--porcelain") == ""
        transitions = env.journal.transitions(running.run_id)
        assert len(transitions) == rows_before + 1  # nothing removed, the abort added
        assert transitions[-1].from_state == "verified"
        assert {a.name for a in env.journal.artifacts(running.run_id)} == {"proposal-1"}
        record = env.journal.transitions(session)[-2]
        assert record.event == "TASK_ABORTED"
        assert record.output["reverted"] is True
        assert record.output["task_id"] == "c"
        assert env.journal.load(f"{session}:1:a").state == "done"
        assert env.journal.runs(parent_run_id=session, limit=None)
        with pytest.raises(RunTerminalError):
            coordinator.execute_next_task(session)

    def test_a_half_done_abort_is_finished_by_the_next_call(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = env.approved(coordinator, diamond(env))
        env.journal.request_abort(session, "requested, then the process died")
        step = coordinator.execute_next_task(session)
        assert step.status is NextStatus.ABORTED
        assert env.journal.load(session).state == "aborted"
        assert env.journal.runs(parent_run_id=session) == []


class TestReset:
    """Reset goes back to idea or plan_review only, validated against the spec and journaled."""

    def test_reset_from_plan_review_and_execution(self, env):
        agents = ScriptedAgents(diamond_script())
        coordinator = env.coordinator(agents, verifier=InterruptOnce("b.txt"))
        session = coordinator.start(diamond(env))
        coordinator.submit_plan(session, "v1")
        run = coordinator.reset_to_phase(session, "idea", reason="plan too vague")
        assert run.state == "idea"
        coordinator.submit_plan(session, "v2")
        coordinator.approve_plan(session)
        coordinator.execute_next_task(session)  # a done
        with pytest.raises(KeyboardInterrupt):
            coordinator.execute_next_task(session)  # b applied, then stopped
        assert env.read("b.txt") == "beta\n"

        run = coordinator.reset_to_phase(session, "plan_review", reason="rethink b")
        assert run.state == "plan_review"
        assert env.journal.load(f"{session}:1:b").state == "aborted"
        assert env.read("b.txt") is None  # b's diff is out; a's work stays
        assert env.read("a.txt") == "alpha\n"
        reset = next(
            t for t in env.journal.transitions(session) if t.event == "RESET_TO_PLAN_REVIEW"
        )
        assert reset.output == {"target": "plan_review", "reason": "rethink b", "round": 1}

        coordinator.approve_plan(session)  # round 2: new child runs
        run = coordinator.run_until_done(session)
        assert run.state == "complete"
        assert coordinator.status(session).round == 2
        again = env.journal.transitions(f"{session}:2:a")
        applied = next(t for t in again if t.event == "DIFF_APPLIED")
        assert applied.output["already_applied"] is True  # a's work was kept, not applied twice
        assert env.read("a.txt") == "alpha\n"
        assert len(env.journal.runs(parent_run_id=session)) == 7

    def test_a_revised_graph_takes_over_from_the_next_round(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = coordinator.start(diamond(env))
        coordinator.submit_plan(session, "v1")
        coordinator.reset_to_phase(session, "idea", reason="too much")
        smaller = TaskGraph([Task("a", verify=env.check("a.txt", "alpha"))])
        coordinator.submit_plan(session, "v2: just a", graph=smaller)
        coordinator.approve_plan(session)
        assert coordinator.run_until_done(session).state == "complete"
        assert [t.task_id for t in coordinator.status(session).tasks] == ["a"]
        assert env.read("b.txt") is None

    def test_invalid_resets(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = coordinator.start(diamond(env))
        for target in ("execution", "complete", "nowhere"):
            with pytest.raises(SessionStateError, match="only be reset to 'idea' or 'plan_review'"):
                coordinator.reset_to_phase(session, target)
        with pytest.raises(InvalidTransitionError, match="RESET_TO_PLAN_REVIEW"):
            coordinator.reset_to_phase(session, "plan_review")  # idea cannot go there
        with pytest.raises(InvalidTransitionError, match="RESET_TO_IDEA"):
            coordinator.reset_to_phase(session, "idea")
        assert env.journal.load(session).seq == 0  # nothing was journaled
        coordinator.abort_session(session, "done testing")
        with pytest.raises(RunTerminalError):
            coordinator.reset_to_phase(session, "idea")


class TestResume:
    """A stopped session continues with the first task not yet done, in a new coordinator."""

    def test_resume_after_interrupt_in_the_agent(self, env):
        script = diamond_script() | {("c", 1): KeyboardInterrupt()}
        first = env.coordinator(ScriptedAgents(script))
        session = env.approved(first, diamond(env))
        with pytest.raises(KeyboardInterrupt):
            first.run_until_done(session)
        assert env.journal.load(f"{session}:1:c").state == "dispatched"

        agents = ScriptedAgents(diamond_script())  # a new process: new services, same journal
        run = env.coordinator(agents).resume(session)
        assert run.state == "complete"
        assert [c.task_id for c in agents.calls] == ["c", "d", "e"]  # a, b never again
        assert [c.attempt for c in agents.calls] == [1, 1, 1]
        c_events = [t.event for t in env.journal.transitions(f"{session}:1:c")]
        assert c_events.count("INTERRUPTED") == 1

    def test_unrecorded_task_end_is_recorded_on_resume(self, env):
        coordinator = env.coordinator(ScriptedAgents(diamond_script()))
        session = env.approved(coordinator, diamond(env))
        # A crash between a task's end and the session's record of it.
        child = coordinator.task_engine.start(
            {
                "session_id": session,
                "round": 1,
                "task": diamond(env).task("a").to_dict(),
                "roles": ["worker"],
            },
            run_id=f"{session}:1:a",
            parent_run_id=session,
        )
        coordinator.task_engine.run(child)
        assert [t.event for t in env.journal.transitions(session)][-1] == "PLAN_APPROVED"
        assert coordinator.execute_next_task(session).task_id == "b"
        events = [t.event for t in env.journal.transitions(session)]
        assert events[-2:] == ["TASK_FINISHED", "TASK_FINISHED"]


class TestWorkspace:
    """`git apply`, all or nothing, and never twice."""

    def test_apply_is_atomic(self, tmp_path):
        repo = make_repo(tmp_path / "repo", {"x.txt": "one\n", "y.txt": "two\n"})
        workspace = GitWorkspace(repo)
        diff = file_diff("x.txt", "one\n", "ONE\n") + file_diff("y.txt", "not two\n", "TWO\n")
        result = workspace.apply(diff, key="k")
        assert not result.done
        assert "y.txt" in result.detail
        assert (repo / "x.txt").read_text() == "one\n"  # the good half was not applied either
        assert git(repo, "status", "--porcelain") == ""

    def test_apply_twice_with_the_same_key_applies_once(self, tmp_path):
        repo = make_repo(tmp_path / "repo", {"items.txt": ITEMS})
        workspace = GitWorkspace(repo)
        diff = file_diff("items.txt", ITEMS, WITH_NEW)
        first = workspace.apply(diff, key="run@3")
        assert (first.done, first.already, first.files) == (True, False, ("items.txt",))
        again = workspace.apply(diff, key="run@3")  # the same application, after a crash
        assert (again.done, again.already) == (True, True)
        assert (repo / "items.txt").read_text().count("new") == 1
        assert workspace.is_applied(diff)
        other = workspace.apply(diff, key="run@9")  # another application may apply it again
        assert other.done
        assert not other.already
        assert (repo / "items.txt").read_text().count("new") == 2

        reverted = workspace.revert(diff, key="undo")
        assert reverted.done
        assert not reverted.already
        assert workspace.revert(diff, key="undo").already
        assert (repo / "items.txt").read_text().count("new") == 1

    def test_new_and_deleted_files(self, tmp_path):
        repo = make_repo(tmp_path / "repo", {"old.txt": "bye\n"})
        workspace = GitWorkspace(repo)
        diff = file_diff("new.txt", None, "hi\nno newline") + file_diff("old.txt", "bye\n", None)
        assert diff_paths(diff) == ("new.txt", "old.txt")
        assert workspace.apply(diff).done
        assert (repo / "new.txt").read_text() == "hi\nno newline"
        assert not (repo / "old.txt").exists()
        assert workspace.apply(diff).already  # cannot be applied on top of itself
        commit = workspace.commit("t: files")
        assert commit == git(repo, "rev-parse", "HEAD").strip()
        assert workspace.commit("t: files") == commit  # a repeated commit finds the first
        assert workspace.commit("something else") is None

    def test_not_a_repository(self, tmp_path):
        (tmp_path / "plain").mkdir()
        with pytest.raises(WorkspaceError, match="exited with"):
            GitWorkspace(tmp_path / "plain").apply(file_diff("a", None, "a\n"), key="k")


class TestGraph:
    """Task graphs are validated as a whole and run in a stable order."""

    def test_every_problem_is_reported(self):
        with pytest.raises(TaskGraphError) as raised:
            TaskGraph(
                [
                    Task("a", depends_on=["a"]),
                    Task("b", depends_on=["zzz"], max_attempts=0),
                    Task("b"),
                    Task("c", verify={"L0": [" "]}),
                ]
            )
        problems = raised.value.problems
        assert "task 'b' is declared 2 times" in problems
        assert "task 'a' depends on itself" in problems
        assert "task 'b' depends on unknown task 'zzz'" in problems
        assert "task 'b' has max_attempts 0 (must be >= 1)" in problems
        assert "task 'c': level 'L0' has an empty command" in problems

    def test_cycles_and_order(self):
        with pytest.raises(TaskGraphError, match="x, y depend on each other in a cycle"):
            TaskGraph([Task("x", depends_on=["y"]), Task("y", depends_on=["x"])])
        graph = TaskGraph(
            [Task("e", depends_on=["d"]), Task("d"), Task("b", depends_on=["d"]), Task("a")]
        )
        assert graph.order == ("d", "e", "b", "a")
        assert graph.downstream("d") == ("e", "b")
        assert TaskGraph.from_dict(json.loads(json.dumps(graph.to_dict()))) == graph

    def test_specs_are_valid(self):
        SESSION.validate()
        TASK.validate()
        assert SESSION.terminal_states == ("complete", "failed", "aborted")
        into_complete = [t for t in SESSION.transitions if t.dest == "complete"]
        assert [(t.source, t.event) for t in into_complete] == [
            (("finalizing",), "SESSION_FINALIZED")
        ]


def test_the_module_example_runs(tmp_path, monkeypatch):
    import fsm_runner.presets.coordinator as module

    doc = module.__doc__
    block = doc[
        doc.index("    from fsm_runner import SqliteJournal") : doc.index("This module uses")
    ]
    make_repo(tmp_path / "repo", {"LICENSE": "MIT\n"})
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(textwrap.dedent(block), namespace)
    assert namespace["run"].state == "complete"
    assert (tmp_path / "repo" / "hello.txt").read_text() == "hello\n"
    assert (tmp_path / "repo" / "README").read_text() == "see hello.txt\n"


# -- killed for real ---------------------------------------------------------------------------

APP = [PY, "-m", "tests.apps.coordinator_app"]


def app_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSM_TEST_")}
    return env | extra


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")
class TestKilled:
    """SIGKILL between applying a task's diff and verifying it; resume in a new process."""

    def start_and_kill(self, config: Path, marker: Path, env: dict[str, str]) -> str:
        proc = subprocess.Popen(
            [*APP, str(config), "start"], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not marker.exists():
                if proc.poll() is not None:
                    pytest.fail(f"the app exited ({proc.returncode}): {proc.stderr.read()}")
                assert time.monotonic() < deadline, "the kill point was never reached"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        return stdout.split()[0]

    @pytest.mark.parametrize("where", ["after_apply", "in_verification"])
    def test_kill_then_resume(self, tmp_path, where):
        repo = make_repo(tmp_path / "repo", {"items.txt": ITEMS})
        check = tmp_path / "check.py"
        check.write_text(CHECK)
        marker, slow = tmp_path / "killed-here", tmp_path / "slow"
        # In verification: the check records its process group, then blocks while `slow` exists.
        blocker = tmp_path / "block.py"
        blocker.write_text(
            "import os, pathlib, sys, time\n"
            "with open(sys.argv[1], 'a') as f:\n"
            "    f.write(f'{os.getpgrp()} ')\n"
            "end = time.monotonic() + 60\n"
            "while pathlib.Path(sys.argv[2]).exists() and time.monotonic() < end:\n"
            "    time.sleep(0.05)\n"
        )
        c_verify = [shlex.join([PY, str(check), "items.txt", "new", "1"])]
        if where == "in_verification":
            slow.touch()
            c_verify.insert(0, shlex.join([PY, str(blocker), str(marker), str(slow)]))
        graph = TaskGraph(
            [
                Task("a", verify=shlex.join([PY, str(check), "a.txt", "alpha"])),
                Task("c", depends_on=["a"], verify={"check": c_verify}),
                Task("z", depends_on=["c"], verify=shlex.join([PY, str(check), "z.txt", "zed"])),
            ],
            verify={"test": shlex.join([PY, str(check), "items.txt", "new", "1"])},
        )
        log = tmp_path / "agents.jsonl"
        journal_path = tmp_path / "journal.db"
        config = tmp_path / "config.json"
        config.write_text(
            json.dumps(
                {
                    "journal": str(journal_path),
                    "workspace": str(repo),
                    "graph": graph.to_dict(),
                    "agent_log": str(log),
                    "script": {
                        "a": file_diff("a.txt", None, "alpha\n"),
                        "c": file_diff("items.txt", ITEMS, WITH_NEW),
                        "z": file_diff("z.txt", None, "zed\n"),
                    },
                }
            )
        )
        extra = {"FSM_TEST_BLOCK_FILE": str(marker), "FSM_TEST_BLOCK_TASK": "c"}
        session = self.start_and_kill(
            config, marker, app_env(**extra) if where == "after_apply" else app_env()
        )
        if where == "in_verification":
            # The check ran in a process group of its own: it outlived the app.
            os.killpg(int(marker.read_text().split()[0]), signal.SIGKILL)
            slow.unlink()

        with SqliteJournal(journal_path) as journal:
            killed = journal.load(f"{session}:1:c")
            assert killed.state == ("applied" if where == "after_apply" else "verified")
            assert journal.load(session).state == "execution"
        assert (repo / "items.txt").read_text().count("new") == 1  # applied before the kill

        resumed = subprocess.run(
            [*APP, str(config), "resume", session], cwd=ROOT, env=app_env(),
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.split() == [session, "complete"]

        assert (repo / "items.txt").read_text() == WITH_NEW  # the diff is in exactly once
        calls = [json.loads(line)["task_id"] for line in log.read_text().splitlines()]
        assert calls == ["a", "c", "z"]  # nothing dispatched twice
        with SqliteJournal(journal_path) as journal:
            c = journal.load(f"{session}:1:c")
            assert c.state == "done"
            events = [t.event for t in journal.transitions(c.run_id)]
            assert events.count("TASK_DISPATCHED") == 1
            applied = [t for t in journal.transitions(c.run_id) if t.event == "DIFF_APPLIED"]
            assert len(applied) == 1
            assert applied[0].output["already_applied"] is (where == "after_apply")
            assert journal.load(session).state == "complete"
            assert [t.event for t in journal.transitions(session)].count("TASK_FINISHED") == 3
        if where == "in_verification":
            assert len(marker.read_text().split()) == 2  # the verification ran again
        assert git(repo, "status", "--porcelain") == ""
