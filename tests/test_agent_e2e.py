"""The agent loop end to end with its real services: git, subprocesses, pytest, SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsm_runner import SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.presets.agent_loop.commands import loop_input, make_engine
from fsm_runner.records import ErrorType

REPO = Path(__file__).parents[1]
PY = sys.executable
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]

TEST_CALC = """from calc import add


def test_add():
    assert add(2, 3) == 5
"""

# The agent: attempt N writes VERSIONS[N] (the last one repeats), logs its call, reports JSON.
AGENT = textwrap.dedent(
    """
    import json, os, sys, pathlib
    versions = {versions!r}
    request = json.loads(sys.stdin.read())
    n = int(os.environ["FSM_ITERATION"])
    log = pathlib.Path({log!r})
    with log.open("a") as f:
        f.write(json.dumps({{"iteration": n, "feedback": os.environ["FSM_FEEDBACK"],
                            "session": request["session_id"]}}) + "\\n")
    pathlib.Path("calc.py").write_text(versions[min(n, len(versions)) - 1])
    print(json.dumps({{"session_id": "s-%d" % n, "model": "fake-1", "tokens_input": 100 * n,
                      "tokens_output": 10 * n, "cost_usd": 0.01 * n}}))
    """
)

WRONG = "def add(a, b):\n    return a * b\n"
WRONG_TOO = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"


def make_repo(path: Path) -> Path:
    path.mkdir()
    (path / "calc.py").write_text("def add(a, b):\n    raise NotImplementedError\n")
    (path / "test_calc.py").write_text(TEST_CALC)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "start"]):
        subprocess.run([*GIT, *args], cwd=path, check=True, capture_output=True)
    return path


def agent_command(tmp_path: Path, *versions: str) -> tuple[str, Path]:
    log = tmp_path / "agent-calls.jsonl"
    script = tmp_path / "agent.py"
    script.write_text(AGENT.format(versions=list(versions), log=str(log)))
    return f"{PY} {script}", log


def levels(extra_l2: str | None = None) -> dict[str, str]:
    found = {
        "L0": f"{PY} -m compileall -q calc.py",
        "L1": f"{PY} -m pytest -q -p no:cacheprovider test_calc.py",
    }
    if extra_l2:
        found["L2"] = extra_l2
    return found


class TestRealServices:
    """Two failed verifications, then success, with git, subprocesses and pytest."""

    def test_two_failures_then_success(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        command, log = agent_command(tmp_path, WRONG, WRONG_TOO, FIXED)
        journal_path = tmp_path / "journal.db"
        journal = SqliteJournal(journal_path)
        engine = make_engine(journal)
        run_id = engine.start(
            loop_input(task="make add add", workspace=repo, agent=command, verify=levels())
        )
        run = engine.run(run_id)
        assert (run.state, run.iteration) == ("succeeded", 3)

        records = journal.iterations(run_id)
        assert [r.passed for r in records] == [False, False, True]
        assert [r.levels_run for r in records] == [("L0", "L1")] * 3
        assert [r.error_type for r in records] == [
            ErrorType.VERIFICATION_FAILED,
            ErrorType.VERIFICATION_FAILED,
            ErrorType.NONE,
        ]
        assert records[0].error_details["level"] == "L1"
        assert [r.tokens_total for r in records] == [110, 220, 330]
        assert [r.model for r in records] == ["fake-1"] * 3
        assert [r.agent_session_id for r in records] == ["s-1", "s-2", "s-3"]
        assert all(r.feedback for r in records[:2])
        assert records[2].feedback is None
        assert len({r.snapshot_id for r in records}) == 3

        calls = [json.loads(line) for line in log.read_text().splitlines()]
        assert [c["iteration"] for c in calls] == [1, 2, 3]
        assert calls[0]["feedback"] == ""
        assert calls[1]["feedback"] == records[0].feedback  # feedback's output feeds the build
        assert "test_add" in calls[1]["feedback"]
        assert [c["session"] for c in calls] == [None, "s-1", "s-2"]  # sessions are handed on

        names = [a.name for a in journal.artifacts(run_id)]
        assert sorted(names) == sorted(
            [f"agent-{n}" for n in (1, 2, 3)] + [f"verification-{n}" for n in (1, 2, 3)]
        )
        journal.close()

        out = tmp_path / "export"
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_path), "export", run_id, str(out)]
        )
        assert result.exit_code == 0, result.output
        written = sorted(p.name for p in out.iterdir())
        assert written == sorted(
            ["run.json", "effects.json"]
            + [
                f"{kind}-{n}.json"
                for kind in ("iteration", "agent", "verification")
                for n in (1, 2, 3)
            ]
        )
        verification = json.loads((out / "verification-1.json").read_text())
        assert verification["passed"] is False
        assert json.loads((out / "agent-3.json").read_text())["session_id"] == "s-3"
        assert json.loads((out / "run.json").read_text())["run"]["state"] == "succeeded"

        shown = CliRunner().invoke(cli, ["--journal", str(journal_path), "show", run_id])
        assert "ITER" in shown.output
        assert "verification_failed" in shown.output
        check_show_output(shown.output, journal_path, run_id)


def value_lines(output: str, key: str) -> list[str]:
    """The lines of ``key``'s value in `show`'s summary (continuations are indented)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{key:<9}"))
    found = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 9):
            break
        found.append(line)
    return [line[9:] for line in found]


def check_show_output(output: str, journal_path: Path, run_id: str) -> None:
    """`show` of a run whose first two iterations failed L1: every word whole, lines wrapped."""
    with SqliteJournal(journal_path) as journal:
        run = journal.load(run_id)
        records = journal.iterations(run_id)
    summary, rest = output.split("\nSEQ ", 1)
    # Long values wrap between words: no line is longer than 100 characters unless it is a
    # single word, and the lines hold the value's words, each one whole.
    for line in summary.splitlines():
        assert len(line) <= 100 or len(line[9:].split()) == 1, line
    for key, value in (("context", run.context), ("input", run.input)):
        shown = " ".join(value_lines(output, key)).split()
        assert shown == json.dumps(value, ensure_ascii=False).split()
    # The iterations table names each iteration's model and session, and each failed check's
    # command whole, wrapped onto continuation lines rather than cut.
    table = rest[rest.index("\nITER ") :].split("\n\n")[0]
    header, *rows = table.strip().splitlines()
    assert header.split()[-3:] == ["MODEL", "SESSION", "ERROR"]
    words = table.split()
    for record in records:
        assert record.model in words
        assert record.agent_session_id in words
    assert words.count("test_calc.py") == 2  # the command of L1, failed in iterations 1 and 2
    assert len(rows) > len(records)  # the errors took continuation lines
    # So does the timeline's ERROR column.
    timeline = rest.split("\n\n")[0]
    assert timeline.split().count("test_calc.py") == 2


class TestCrashDuringVerification:
    """SIGKILL while verifying: on resume the build is not re-run; verification is."""

    def test_kill_and_resume(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        command, log = agent_command(tmp_path, FIXED)
        marker = tmp_path / "verifying"
        slow = tmp_path / "slow"
        slow.touch()
        # L2 records each verification; while `slow` exists it also blocks (so we can kill it).
        check = tmp_path / "l2.py"
        check.write_text(
            "import os, pathlib, sys, time\n"
            "with open(sys.argv[1], 'a') as f:\n"
            "    f.write(f'{os.getpgrp()} ')\n"
            "end = time.monotonic() + 30\n"
            "while pathlib.Path(sys.argv[2]).exists() and time.monotonic() < end:\n"
            "    time.sleep(0.05)\n"
        )
        l2 = f"{PY} {check} {marker} {slow}"
        journal_path = tmp_path / "journal.db"
        runner = subprocess.Popen(
            [PY, "-m", "fsm_runner.cli", "--journal", str(journal_path), "agent-loop",
             "--workspace", str(repo), "--agent", command, "--task", "fix add",
             "--verify", f"L0={PY} -m compileall -q calc.py",
             "--verify", f"L1={PY} -m pytest -q -p no:cacheprovider test_calc.py",
             "--verify", f"L2={l2}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            # Its process group written, not only the file made (open() makes it empty first).
            while not (marker.exists() and marker.read_text().strip()):
                assert runner.poll() is None, runner.stdout.read().decode()
                assert time.monotonic() < deadline, "verification never started"
                time.sleep(0.02)
            runner.send_signal(signal.SIGKILL)
            runner.wait(timeout=10)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait(timeout=10)  # reaped here, not warned of in a later test
            runner.stdout.close()
        # The verifier ran the check in its own process group: it outlived the runner.
        os.killpg(int(marker.read_text().split()[0]), signal.SIGKILL)
        slow.unlink()

        with SqliteJournal(journal_path) as journal:
            (run,) = journal.runs()
            assert run.state == "verifying"
        resumed = subprocess.run(
            [PY, "-m", "fsm_runner.cli", "--journal", str(journal_path), "resume", run.run_id],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        with SqliteJournal(journal_path) as journal:
            run = journal.load(run.run_id)
            events = [t.event for t in journal.transitions(run.run_id)]
        assert run.state == "succeeded"
        assert len(log.read_text().splitlines()) == 1  # the build ran once
        assert len(marker.read_text().split()) == 2  # verification ran twice
        assert events.count("BUILD_SUCCEEDED") == 1
        assert events.count("SNAPSHOT_TAKEN") == 1


# A slow first agent (it runs until released, a minute at most); the next one records whether
# the first one still ran when it started, then fixes calc.py.
SLOW_AGENT = textwrap.dedent(
    """
    import os, pathlib, sys, time
    state = pathlib.Path({state!r})
    calls = state / "calls"
    earlier = calls.read_text().split() if calls.exists() else []
    with calls.open("a") as f:
        f.write(f"{{os.getpid()}}\\n")
    if not earlier:
        # Written whole, then renamed: the test reads it once it exists (a write_text seen
        # half done read "" on a loaded CI machine).
        (state / "first-running.tmp").write_text(str(os.getpid()))
        os.replace(state / "first-running.tmp", state / "first-running")
        end = time.monotonic() + 60
        while time.monotonic() < end and not (state / "release").exists():
            time.sleep(0.05)
        sys.exit(1)
    try:
        stat = pathlib.Path(f"/proc/{{earlier[0]}}/stat").read_text()
        alive = stat[stat.rindex(")") + 2] != "Z"
    except OSError:
        alive = False
    (state / "first-alive-when-next-started").write_text(str(alive))
    pathlib.Path("calc.py").write_text({fixed!r})
    """
)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class TestKilledRunner:
    """SIGKILL of the runner's process group while the agent runs, then resume."""

    def test_the_old_agent_is_gone_before_the_new_one_starts(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        state = tmp_path / "agent-state"
        state.mkdir()
        script = tmp_path / "slow_agent.py"
        script.write_text(SLOW_AGENT.format(state=str(state), fixed=FIXED))
        # `; true`: the shell forks the agent rather than exec it, so the agent is the runner's
        # grandchild, which dies with neither the runner's group nor the shell.
        command = f"{PY} {script}; true"
        journal_path = tmp_path / "journal.db"
        runner = subprocess.Popen(
            [PY, "-m", "fsm_runner.cli", "--journal", str(journal_path), "agent-loop",
             "--workspace", str(repo), "--agent", command, "--task", "fix add",
             "--verify", f"L1={PY} -m pytest -q -p no:cacheprovider test_calc.py"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        first = None
        try:
            deadline = time.monotonic() + 60
            while not (state / "first-running").exists():
                assert runner.poll() is None, runner.stdout.read().decode()
                assert time.monotonic() < deadline, "the agent never started"
                time.sleep(0.02)
            first = int((state / "first-running").read_text())
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(timeout=10)

            with SqliteJournal(journal_path) as journal:
                (run,) = journal.runs()
                assert run.state == "building"
            resumed = subprocess.run(
                [PY, "-m", "fsm_runner.cli", "--journal", str(journal_path), "resume",
                 run.run_id],
                cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
            assert (state / "first-alive-when-next-started").read_text() == "False"
            assert len((state / "calls").read_text().split()) == 2
            with SqliteJournal(journal_path) as journal:
                assert journal.load(run.run_id).state == "succeeded"
            # The lock and the record are git-ignored: no snapshot committed them.
            tracked = subprocess.run(
                [*GIT, "ls-files"], cwd=repo, capture_output=True, text=True, check=True
            ).stdout
            assert ".fsm-runner" not in tracked
            assert not (repo / ".fsm-runner" / "child.json").exists()
        finally:
            (state / "release").touch()
            if runner.poll() is None:
                runner.kill()
                runner.wait(timeout=10)  # reaped here, not warned of in a later test
            runner.stdout.close()
            if first is not None and _running(first):
                os.kill(first, signal.SIGKILL)


class TestCommands:
    """`fsm-runner demo` and `fsm-runner agent-loop`."""

    def test_demo_twice_creates_two_runs(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        runner = CliRunner()
        for _ in range(2):
            result = runner.invoke(cli, ["demo"], catch_exceptions=False)
            assert result.exit_code == 0, result.output
            assert "(succeeded) in state 'succeeded'" in result.output
            assert "--VERIFY_FAILED_RETRYABLE--> feedback" in result.output
        with SqliteJournal(tmp_path / "fsm-runner.db") as journal:
            runs = journal.runs()
            assert len(runs) == 2
            assert all(run.state == "succeeded" and run.iteration == 2 for run in runs)
            assert [r.passed for r in journal.iterations(runs[0].run_id)] == [False, True]
        for command in (["show", runs[0].run_id], ["export", runs[0].run_id, "out"]):
            assert runner.invoke(cli, command).exit_code == 0
        assert (tmp_path / "out" / "agent-2.json").exists()
        resumed = runner.invoke(cli, ["resume", runs[0].run_id])
        assert resumed.exit_code == 4  # conflict: the run has ended
        assert "has ended" in resumed.output

    def test_agent_loop_command(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        command, log = agent_command(tmp_path, WRONG, FIXED)
        journal_path = tmp_path / "journal.db"
        args = ["--journal", str(journal_path), "agent-loop", "--workspace", str(repo)]
        args += ["--agent", command, "--task", "fix add", "--max-iterations", "2"]
        for level, cmd in levels().items():
            args += ["--verify", f"{level}={cmd}"]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "(succeeded) in state 'succeeded'" in result.output
        with SqliteJournal(journal_path) as journal:
            (run,) = journal.runs()
            assert run.input["verify"] == {"L0": [levels()["L0"]], "L1": [levels()["L1"]]}
            assert run.iteration == 2
        assert len(log.read_text().splitlines()) == 2

    def test_agent_loop_spends_its_iterations(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        command, _ = agent_command(tmp_path, WRONG)
        journal_path = tmp_path / "journal.db"
        args = ["--journal", str(journal_path), "agent-loop", "--workspace", str(repo)]
        args += ["--agent", command, "--task", "fix add", "--max-iterations", "2"]
        args += ["--verify", f"L1={levels()['L1']}"]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1
        assert "reason: iteration limit spent" in result.output

    def test_a_missing_agent_command_fails_the_run_at_once(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        journal_path = tmp_path / "journal.db"
        args = ["--journal", str(journal_path), "agent-loop", "--workspace", str(repo)]
        args += ["--agent", "no-such-agent-xyz --json", "--task", "fix add"]
        args += ["--max-iterations", "3", "--verify", f"L1={levels()['L1']}"]

        result = CliRunner().invoke(cli, args)

        assert result.exit_code == 1, result.output
        assert "reason: the agent command 'no-such-agent-xyz --json' was not found" in (
            result.output
        )
        assert "iteration limit spent" not in result.output
        with SqliteJournal(journal_path) as journal:
            (run,) = journal.runs()
            events = [t.event for t in journal.transitions(run.run_id)]
        assert run.iteration == 1
        assert events == ["STARTED", "RUN_ACCEPTED", "SYSTEM_ERROR"]

    def test_a_workspace_outside_git_is_refused_before_anything_starts(self, tmp_path):
        plain = tmp_path / "plain"
        plain.mkdir()
        marker = tmp_path / "agent-ran"
        journal_path = tmp_path / "journal.db"

        result = CliRunner().invoke(
            cli,
            ["--journal", str(journal_path), "agent-loop", "--workspace", str(plain),
             "--agent", f"touch {marker}", "--task", "t", "--verify", "L0=true"],
        )  # fmt: skip

        assert result.exit_code == 1
        (line,) = result.output.splitlines()
        assert line.startswith(f"Error: git snapshot of {plain} failed: the workspace is not")
        assert "git init" in line
        assert not marker.exists()
        assert not journal_path.exists()
        assert list(plain.iterdir()) == []

    def test_agent_loop_says_where_snapshots_go(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        subprocess.run([*GIT, "checkout", "-q", "-b", "agent-work"], cwd=repo, check=True)
        command, _ = agent_command(tmp_path, FIXED)
        args = ["--journal", str(tmp_path / "j.db"), "agent-loop", "--workspace", str(repo)]
        args += ["--agent", command, "--task", "fix add", "--verify", f"L1={levels()['L1']}"]

        result = CliRunner().invoke(cli, args)

        assert result.exit_code == 0, result.output
        assert "snapshots: commits on branch agent-work" in result.output
        log = subprocess.run(
            [*GIT, "log", "--format=%s", "agent-work"],
            cwd=repo, capture_output=True, text=True, check=True,
        ).stdout.split("\n")  # fmt: skip
        assert log[0] == "fsm-runner snapshot"

    def test_bad_verify_option(self, tmp_path):
        repo = make_repo(tmp_path / "repo")
        result = CliRunner().invoke(
            cli,
            ["--journal", str(tmp_path / "j.db"), "agent-loop", "--workspace", str(repo),
             "--agent", "true", "--task", "t", "--verify", "no-equals-sign"],
        )  # fmt: skip
        assert result.exit_code == 2
        assert "LEVEL=CMD" in result.output


@pytest.fixture(autouse=True)
def _no_git_prompts(monkeypatch):
    monkeypatch.setenv("GIT_TERMINAL_PROMPT", "0")
