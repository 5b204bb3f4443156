"""The agent loop's approval gate: a verified change waits for a person's APPROVE or REJECT.

The machine alone, then whole runs with the fake services on a real SQLite file (and the memory
journal, the reference), then ``fsm-runner demo --ask`` end to end on the command line with its
real services: git, the scripted agent subprocess, pytest.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsm_runner import (
    MemoryJournal,
    RunLifecycle,
    RunRecord,
    RunTerminalError,
    SignalStatus,
    SqliteJournal,
)
from fsm_runner.cli import cli
from fsm_runner.engine.waits import signal_run
from fsm_runner.machine import compile_spec
from fsm_runner.presets.agent_loop import (
    AGENT_LOOP,
    APPROVAL_PROMPT,
    APPROVAL_TIMEOUT,
    AWAITING_APPROVAL,
    agent_loop_engine,
    agent_loop_spec,
    guards,
    rejection_feedback,
)
from fsm_runner.presets.agent_loop.commands import APPROVAL_APP
from fsm_runner.records import utc_now

from .fake_services import (
    FakeAgent,
    FakeFeedback,
    FakeSnapshotter,
    FakeVerifier,
    agent_result,
    failing_report,
    passing_report,
)
from .test_agent_e2e import FIXED, agent_command, levels, make_repo

#: The gated machine with its default 24-hour wait.
AGENT_LOOP_WITH_APPROVAL = agent_loop_spec(approval=True)
INPUT = {"task": "make the tests pass", "workspace": "/work/ws"}
COMMENT = "Name the helper add_numbers, not add."


@pytest.fixture(params=["sqlite", "memory"])
def journal(request, tmp_path):
    """A real SQLite file (and the memory journal, the reference implementation)."""
    j = SqliteJournal(tmp_path / "journal.db") if request.param == "sqlite" else MemoryJournal()
    yield j
    j.close()


def gated(journal, *, agent=None, verifier=None, timeout=APPROVAL_TIMEOUT):
    return agent_loop_engine(
        journal=journal,
        agent=agent or FakeAgent(agent_result(1), agent_result(2), agent_result(3)),
        snapshotter=FakeSnapshotter(),
        verifier=verifier or FakeVerifier(passing_report()),
        feedback=FakeFeedback(),
        approval=True,
        approval_timeout=timeout,
    )


def events(journal, run_id: str) -> list[str]:
    return [t.event for t in journal.transitions(run_id)]


def parked_at_the_gate(engine, run_input=INPUT) -> str:
    run_id = engine.start(run_input)
    run = engine.run(run_id)
    assert (run.state, run.status) == (AWAITING_APPROVAL, RunLifecycle.ACTIVE)
    assert engine.journal.load(run_id).lease_owner is None  # parked: no lease, no process
    return run_id


# -- the machine -------------------------------------------------------------------------------


class TestMachine:
    def test_the_plain_loop_is_unchanged(self):
        # Journals hold runs under this hash: the gate must not change the plain machine.
        assert AGENT_LOOP.spec_hash == (
            "89eb4b91784edf09e5fa483c9598c9f361584afe8a9d312689d5cf4f330c1e85"
        )
        assert agent_loop_spec() is AGENT_LOOP
        assert agent_loop_spec(approval=False) is AGENT_LOOP
        assert AGENT_LOOP.waiting_states == frozenset()

    def test_the_gated_loop_is_valid_and_named_apart(self):
        AGENT_LOOP_WITH_APPROVAL.validate()
        assert AGENT_LOOP_WITH_APPROVAL.name == "agent-loop-approval"
        assert agent_loop_spec(approval=True) == AGENT_LOOP_WITH_APPROVAL
        assert AGENT_LOOP_WITH_APPROVAL.waiting_states == {AWAITING_APPROVAL}
        assert AGENT_LOOP_WITH_APPROVAL.accepts(AWAITING_APPROVAL) == {"APPROVE", "REJECT"}
        assert AGENT_LOOP_WITH_APPROVAL.signal_names == {"APPROVE", "REJECT"}

    def test_the_gate_waits_a_day_and_says_what_it_asks(self):
        wait = AGENT_LOOP_WITH_APPROVAL.wait_of(AWAITING_APPROVAL)
        assert wait.timeout == APPROVAL_TIMEOUT == 86_400
        assert wait.prompt == APPROVAL_PROMPT == "Verification passed. Apply the change?"
        assert wait.schema["properties"]["comment"]["type"] == "string"
        shorter = agent_loop_spec(approval=True, approval_timeout=60)
        assert shorter.wait_of(AWAITING_APPROVAL).timeout == 60
        assert shorter.spec_hash != AGENT_LOOP_WITH_APPROVAL.spec_hash

    @pytest.mark.parametrize(
        ("state", "event", "dest"),
        [
            ("verifying", "VERIFY_PASSED", AWAITING_APPROVAL),
            (AWAITING_APPROVAL, "APPROVE", "succeeded"),
            (AWAITING_APPROVAL, "REJECT", "feedback"),
            (AWAITING_APPROVAL, "TIMEOUT", "canceled"),  # its own exit, not the wildcard's
            (AWAITING_APPROVAL, "USER_ABORTED", "canceled"),
            ("building", "TIMEOUT", "failed"),  # every other state's timeout still fails
        ],
    )
    def test_where_each_event_leads(self, state, event, dest):
        machine = compile_spec(AGENT_LOOP_WITH_APPROVAL)
        run = RunRecord(run_id="r", machine="m", spec_hash="h", state=state, iteration=1)
        assert machine.resolve(state, event, run, guards) == dest

    @pytest.mark.parametrize(
        ("answer", "says"),
        [
            ({"comment": COMMENT}, f"rejected it: {COMMENT}"),
            ({"comment": "  "}, "(without a comment)."),
            (None, "(without a comment)."),
            ("plain words", "rejected it: plain words"),
        ],
    )
    def test_rejection_feedback(self, answer, says):
        assert rejection_feedback(answer).endswith(says)


# -- whole runs with fake services -------------------------------------------------------------


class TestRuns:
    def test_approve_ends_the_run_succeeded(self, journal):
        engine = gated(journal)
        run_id = parked_at_the_gate(engine)
        assert journal.wake_time(run_id) is not None  # its deadline, a day away
        signal = engine.signal(run_id, "APPROVE")
        assert signal.status is SignalStatus.CONSUMED
        run = journal.load(run_id)
        assert (run.state, run.status, run.iteration) == ("succeeded", RunLifecycle.SUCCEEDED, 1)
        assert events(journal, run_id)[-2:] == ["VERIFY_PASSED", "APPROVE"]
        assert journal.wake_time(run_id) is None

    def test_reject_builds_again_with_the_comment_then_approve(self, journal):
        agent = FakeAgent(agent_result(1), agent_result(2))
        engine = gated(journal, agent=agent)
        run_id = parked_at_the_gate(engine)
        assert agent.requests[0].feedback is None

        rejected = engine.signal(run_id, "REJECT", {"comment": COMMENT})
        assert rejected.status is SignalStatus.CONSUMED
        assert journal.load(run_id).state == "feedback"  # a phase to run: resume or a worker

        run = engine.run(run_id)
        assert run.state == AWAITING_APPROVAL  # built, verified, back at the gate
        assert len(agent.requests) == 2
        assert COMMENT in agent.requests[1].feedback
        assert agent.requests[1].session_id == "session-1"  # the agent continues its session

        engine.signal(run_id, "APPROVE")
        run = journal.load(run_id)
        assert (run.state, run.status, run.iteration) == ("succeeded", RunLifecycle.SUCCEEDED, 2)
        assert events(journal, run_id) == [
            "STARTED", "RUN_ACCEPTED", "BUILD_SUCCEEDED", "SNAPSHOT_TAKEN", "VERIFY_PASSED",
            "REJECT", "FEEDBACK_READY",
            "BUILD_SUCCEEDED", "SNAPSHOT_TAKEN", "VERIFY_PASSED", "APPROVE",
        ]  # fmt: skip
        first, second = journal.iterations(run_id)
        assert first.passed
        assert COMMENT in first.feedback
        assert not first.feedback_fallback
        assert second.passed
        assert second.feedback is None
        assert [s.name for s in journal.signals(run_id)] == ["REJECT", "APPROVE"]
        assert {s.status for s in journal.signals(run_id)} == {SignalStatus.CONSUMED}

    def test_a_failed_verification_still_loops_before_the_gate(self, journal):
        agent = FakeAgent(agent_result(1), agent_result(2))
        feedback = FakeFeedback()
        engine = agent_loop_engine(
            journal=journal,
            agent=agent,
            snapshotter=FakeSnapshotter(),
            verifier=FakeVerifier(failing_report("L1"), passing_report()),
            feedback=feedback,
            approval=True,
        )
        run_id = parked_at_the_gate(engine)
        assert agent.requests[1].feedback == "fix #1"  # the generator's, not a reviewer's
        assert journal.load(run_id).iteration == 2

    def test_each_rejection_gives_its_own_comment_or_none(self, journal):
        agent = FakeAgent(agent_result(1), agent_result(2), agent_result(3))
        engine = gated(journal, agent=agent)
        run_id = parked_at_the_gate(engine)
        engine.signal(run_id, "REJECT", {"comment": COMMENT})
        assert engine.run(run_id).state == AWAITING_APPROVAL
        engine.signal(run_id, "REJECT")  # no payload: not the last rejection's comment again
        assert engine.run(run_id).state == AWAITING_APPROVAL
        assert COMMENT in agent.requests[1].feedback
        assert agent.requests[2].feedback.endswith("(without a comment).")
        assert journal.load(run_id).iteration == 3

    def test_a_rejection_with_no_iteration_left_fails_the_run(self, journal):
        engine = gated(journal)
        run_id = parked_at_the_gate(engine, {**INPUT, "max_iterations": 1})
        engine.signal(run_id, "REJECT", {"comment": COMMENT})
        run = engine.run(run_id)
        assert (run.state, run.status) == ("failed", RunLifecycle.FAILED)
        assert run.error["message"] == "iteration limit spent"

    def test_a_signal_sent_before_the_gate_waits_for_it(self, journal):
        engine = gated(journal)
        run_id = engine.start(INPUT)
        early = engine.signal(run_id, "APPROVE")
        assert early.status is SignalStatus.PENDING  # the run is still queued
        run = engine.run(run_id)
        assert (run.state, run.iteration) == ("succeeded", 1)

    def test_no_answer_in_time_cancels_the_run_exactly_once(self, journal):
        engine = gated(journal, timeout=0.05)
        other = gated(journal, timeout=0.05)  # a second worker of the same app
        run_id = parked_at_the_gate(engine)
        deadline = journal.wake_time(run_id)
        assert deadline is not None
        while utc_now() <= deadline:
            time.sleep(0.01)

        counts: list[int] = []
        workers = [
            threading.Thread(target=lambda e=e: counts.append(e.work(exit_when_idle=True)))
            for e in (engine, other)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

        run = journal.load(run_id)
        assert (run.state, run.status) == ("canceled", RunLifecycle.ABORTED)
        assert events(journal, run_id).count("TIMEOUT") == 1
        assert events(journal, run_id)[-2:] == ["VERIFY_PASSED", "TIMEOUT"]
        assert sum(counts) == 1
        assert journal.wake_time(run_id) is None
        with pytest.raises(RunTerminalError):
            engine.signal(run_id, "APPROVE")
        assert engine.work(exit_when_idle=True) == 0  # nothing left to do, nothing journaled
        assert events(journal, run_id).count("TIMEOUT") == 1

    def test_a_signal_from_outside_any_engine_moves_the_run(self, journal):
        engine = gated(journal)
        run_id = parked_at_the_gate(engine)
        signal = signal_run(journal, run_id, "REJECT", {"comment": COMMENT})
        assert signal.status is SignalStatus.CONSUMED
        run = engine.resume(run_id)
        assert run.state == AWAITING_APPROVAL
        assert COMMENT in (journal.iterations(run_id)[0].feedback or "")

    def test_the_plain_engine_does_not_take_gated_runs(self, journal):
        gated_engine = gated(journal)
        run_id = parked_at_the_gate(gated_engine)
        signal_run(journal, run_id, "REJECT", {"comment": COMMENT})
        plain = agent_loop_engine(
            journal=journal,
            agent=FakeAgent(),
            snapshotter=FakeSnapshotter(),
            verifier=FakeVerifier(),
        )
        assert plain.work(exit_when_idle=True) == 0
        assert journal.load(run_id).state == "feedback"


# -- on the command line, with the real services -----------------------------------------------


def printed(output: str, label: str) -> list[str]:
    """The command a ``demo --ask`` line labelled ``label`` prints, as argv after ``fsm-runner``."""
    (line,) = [line for line in output.splitlines() if line.strip().startswith(label)]
    command = line.split(": ", 1)[1]
    argv = shlex.split(command)
    assert argv[0] == "fsm-runner"
    return argv[1:]


class TestCommandLine:
    def test_demo_ask_then_reject_resume_and_approve_as_printed(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        monkeypatch.delenv("FSM_RUNNER_JOURNAL", raising=False)
        runner = CliRunner()

        asked = runner.invoke(cli, ["demo", "--ask"], catch_exceptions=False)
        assert asked.exit_code == 0, asked.output
        assert "--VERIFY_PASSED--> awaiting_approval" in asked.output
        assert "is active in state 'awaiting_approval'" in asked.output
        assert f"waiting for your answer: {APPROVAL_PROMPT}" in asked.output
        assert "no answer in 24 h cancels the run." in asked.output
        approve = printed(asked.output, "approve it with:")
        reject = printed(asked.output, "reject it with:")
        resume = printed(asked.output, "then the next build")
        assert "--journal" not in [*approve, *reject, *resume]  # ./fsm-runner.db is implied
        assert approve[0] == reject[0] == "signal"
        assert reject[2:] == ["REJECT", "--data", '{"comment": "what to change"}']
        with SqliteJournal(tmp_path / "fsm-runner.db") as journal:
            (run,) = journal.runs()
            assert (run.state, run.iteration, run.lease_owner) == (AWAITING_APPROVAL, 2, None)
            assert run.input["app"] == APPROVAL_APP
            assert journal.wake_time(run.run_id) is not None
        workspace = Path(run.input["workspace"])

        rejected = runner.invoke(cli, reject, catch_exceptions=False)
        assert rejected.exit_code == 0, rejected.output
        assert "consumed" in rejected.output
        resumed = runner.invoke(cli, resume, catch_exceptions=False)
        assert resumed.exit_code == 0, resumed.output
        assert "feedback --FEEDBACK_READY--> building" in resumed.output
        assert "is active in state 'awaiting_approval'" in resumed.output
        assert '"what to change"' in (workspace / "calc.py").read_text()  # the agent heeded it

        approved = runner.invoke(cli, approve, catch_exceptions=False)
        assert approved.exit_code == 0, approved.output
        with SqliteJournal(tmp_path / "fsm-runner.db") as journal:
            run = journal.load(run.run_id)
            assert (run.state, run.status, run.iteration) == (
                "succeeded",
                RunLifecycle.SUCCEEDED,
                3,
            )
            third = journal.iterations(run.run_id)[1]
            assert "what to change" in third.feedback
            assert [s.name for s in journal.signals(run.run_id)] == ["REJECT", "APPROVE"]

    def test_agent_loop_ask_names_its_journal_and_a_new_process_approves(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        command, log = agent_command(tmp_path, FIXED)
        journal_path = tmp_path / "elsewhere.db"
        args = ["--journal", str(journal_path), "agent-loop", "--workspace", str(repo), "--ask"]
        args += ["--agent", command, "--task", "fix add", "--verify", f"L1={levels()['L1']}"]

        asked = CliRunner().invoke(cli, args, catch_exceptions=False)

        assert asked.exit_code == 0, asked.output
        approve = printed(asked.output, "approve it with:")
        assert approve[:2] == ["--journal", str(journal_path)]
        done = subprocess.run(
            [sys.executable, "-m", "fsm_runner", *approve],
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "now in state 'succeeded'" in done.stdout
        with SqliteJournal(journal_path) as journal:
            (run,) = journal.runs()
            assert (run.machine, run.state, run.iteration) == (
                "agent-loop-approval",
                "succeeded",
                1,
            )
        assert len(log.read_text().splitlines()) == 1

    def test_without_ask_the_loop_does_not_wait(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        command, _ = agent_command(tmp_path, FIXED)
        args = ["--journal", str(tmp_path / "j.db"), "agent-loop", "--workspace", str(repo)]
        args += ["--agent", command, "--task", "fix add", "--verify", f"L1={levels()['L1']}"]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "(succeeded) in state 'succeeded'" in result.output
        assert "approve it with" not in result.output


@pytest.fixture(autouse=True)
def _no_git_prompts(monkeypatch):
    monkeypatch.setenv("GIT_TERMINAL_PROMPT", "0")
