"""The agent loop's real services, against real git repositories, subprocesses and files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.presets.agent_loop import (
    AgentDriver,
    AgentRequest,
    CheckResult,
    FeedbackGenerator,
    LevelResult,
    ResultPersister,
    Snapshotter,
    VerificationReport,
    Verifier,
    _children,
)
from fsm_runner.presets.agent_loop import _bytecode as agent_bytecode
from fsm_runner.presets.agent_loop import services as agent_services
from fsm_runner.presets.agent_loop.services import (
    CommandAgentDriver,
    CommandVerifier,
    FileResultPersister,
    GitSnapshotter,
    SnapshotError,
    TemplateFeedbackGenerator,
)

PY = sys.executable
QPY = shlex.quote(PY)
# The tests' own git commands: an identity of their own, no signing, whatever the machine has.
GIT = [
    "git",
    "-c", "user.name=test",
    "-c", "user.email=test@localhost",
    "-c", "commit.gpgsign=false",
    "-c", "init.defaultBranch=main",
]  # fmt: skip


@pytest.fixture(autouse=True)
def isolated_git(monkeypatch, tmp_path):
    """No global or system git configuration, and no repository above tmp_path."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_AUTHOR_NAME"):
        monkeypatch.delenv(name, raising=False)


def git(repo: Path, *args: str) -> str:
    done = subprocess.run([*GIT, *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    return path


def commit_all(repo: Path, message: str = "start") -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def exited(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or ends within ``timeout``), without polling."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs os.pidfd_open (Linux)")
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def write_script(tmp_path: Path, body: str, name: str = "agent.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


class TestPublicNames:
    """The module's names are listed, sorted, and its services fit the loop's protocols."""

    def test_all_is_sorted_and_complete(self):
        assert agent_services.__all__ == sorted(agent_services.__all__)
        for name in agent_services.__all__:
            assert getattr(agent_services, name).__doc__

    def test_services_fit_their_protocols(self, tmp_path):
        assert isinstance(CommandAgentDriver(), AgentDriver)
        assert isinstance(GitSnapshotter(), Snapshotter)
        assert isinstance(CommandVerifier(), Verifier)
        assert isinstance(TemplateFeedbackGenerator(), FeedbackGenerator)
        assert isinstance(FileResultPersister(tmp_path), ResultPersister)

    def test_snapshot_error_is_in_the_tree(self):
        assert issubclass(SnapshotError, FsmRunnerError)


class TestGitSnapshotter:
    """Snapshots are commits in the workspace's own repository."""

    def test_repository_without_commits(self, repo):
        (repo / "a.txt").write_text("one\ntwo\n")
        (repo / "sub").mkdir()
        (repo / "sub" / "b.txt").write_text("three\n")

        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.before is None
        assert snapshot.after == snapshot.snapshot_id == git(repo, "rev-parse", "HEAD")
        assert re.fullmatch(r"[0-9a-f]{40}", snapshot.snapshot_id)
        assert snapshot.changed_files == ("a.txt", "sub/b.txt")
        assert (snapshot.insertions, snapshot.deletions) == (3, 0)
        assert git(repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>|%s") == (
            "fsm-runner <fsm-runner@localhost>|fsm-runner <fsm-runner@localhost>|"
            "fsm-runner snapshot"
        )
        assert git(repo, "status", "--porcelain") == ""

    def test_changes_are_committed_and_counted(self, repo):
        (repo / "a.txt").write_text("one\ntwo\n")
        (repo / "b.txt").write_text("gone\n")
        start = commit_all(repo)
        (repo / "a.txt").write_text("one\nTWO\nthree\n")  # +2 -1
        (repo / "b.txt").unlink()  # -1
        (repo / "c").mkdir()
        (repo / "c" / "new.txt").write_text("new\n")  # +1

        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.before == start
        assert snapshot.after != start
        assert snapshot.snapshot_id == snapshot.after == git(repo, "rev-parse", "HEAD")
        assert git(repo, "rev-parse", "HEAD~1") == start
        assert snapshot.changed_files == ("a.txt", "b.txt", "c/new.txt")
        assert (snapshot.insertions, snapshot.deletions) == (3, 2)
        assert git(repo, "status", "--porcelain") == ""

    def test_no_changes_keep_the_same_commit(self, repo):
        (repo / "a.txt").write_text("one\n")
        start = commit_all(repo)

        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.before == snapshot.after == snapshot.snapshot_id == start
        assert snapshot.changed_files == ()
        assert (snapshot.insertions, snapshot.deletions) == (0, 0)
        assert git(repo, "rev-list", "--count", "HEAD") == "1"

    def test_successive_captures_each_see_their_own_changes(self, repo):
        snapshotter = GitSnapshotter()
        (repo / "a.txt").write_text("1\n")
        first = snapshotter.capture(str(repo))
        (repo / "b.txt").write_text("2\n")
        second = snapshotter.capture(str(repo))

        assert second.before == first.after
        assert second.changed_files == ("b.txt",)

    def test_empty_repository_gets_an_empty_first_commit(self, repo):
        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.before is None
        assert snapshot.snapshot_id == git(repo, "rev-parse", "HEAD")
        assert snapshot.changed_files == ()

    def test_ignored_and_binary_files(self, repo):
        (repo / ".gitignore").write_text("*.log\n")
        (repo / "debug.log").write_text("noise\n")
        (repo / "blob.bin").write_bytes(bytes(range(256)))

        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.changed_files == (".gitignore", "blob.bin")
        assert (snapshot.insertions, snapshot.deletions) == (1, 0)  # a binary file counts none

    def test_identity_and_message_are_options(self, repo):
        (repo / "a.txt").write_text("1\n")
        GitSnapshotter(author_name="Bot", author_email="bot@example.org", message="snap").capture(
            str(repo)
        )
        assert git(repo, "log", "-1", "--format=%an <%ae>|%s") == "Bot <bot@example.org>|snap"

    def test_commit_hooks_do_not_stop_a_snapshot(self, repo):
        hook = repo / ".git" / "hooks" / "pre-commit"
        hook.write_text("#!/bin/sh\necho 'hook says no' >&2\nexit 1\n")
        hook.chmod(0o755)
        (repo / "a.txt").write_text("1\n")

        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.changed_files == ("a.txt",)

    def test_not_a_repository(self, tmp_path):
        plain = tmp_path / "plain"
        plain.mkdir()
        with pytest.raises(SnapshotError, match="not a git repository") as caught:
            GitSnapshotter().capture(str(plain))
        error = caught.value
        assert isinstance(error, FsmRunnerError)
        assert error.workspace == str(plain)
        assert error.returncode == 128
        assert "\n" not in str(error)

    def test_missing_workspace(self, tmp_path):
        with pytest.raises(SnapshotError, match="not a directory"):
            GitSnapshotter().capture(str(tmp_path / "nowhere"))

    def test_check_workspace_names_the_branch_snapshots_go_to(self, repo):
        assert GitSnapshotter().check_workspace(str(repo)) == "commits on branch main"
        (repo / "a.txt").write_text("a\n")
        first = commit_all(repo)
        git(repo, "checkout", "-q", "--detach", first)
        assert GitSnapshotter().check_workspace(str(repo)) == "commits on a detached HEAD"

    def test_check_workspace_refuses_a_directory_outside_git(self, tmp_path):
        plain = tmp_path / "plain"
        plain.mkdir()
        with pytest.raises(SnapshotError, match="not inside a git work tree") as caught:
            GitSnapshotter().check_workspace(str(plain))
        assert "git init" in str(caught.value)
        assert "not a git repository" in str(caught.value)  # git's own words
        assert caught.value.returncode == 128
        with pytest.raises(SnapshotError, match="not a directory"):
            GitSnapshotter().check_workspace(str(tmp_path / "nowhere"))
        assert list(plain.iterdir()) == []

    def test_git_not_installed(self, repo, monkeypatch, tmp_path):
        empty = tmp_path / "empty-bin"
        empty.mkdir()
        monkeypatch.setenv("PATH", str(empty))
        with pytest.raises(SnapshotError, match="git is not installed"):
            GitSnapshotter().capture(str(repo))


class TestCommandVerifier:
    """Levels run in natural order, all checks of a level run, the first failed level stops."""

    def test_all_levels_pass(self, tmp_path):
        verifier = CommandVerifier({"L0": "echo zero", "L1": ["echo one", "echo two >&2; pwd -P"]})

        report = verifier.verify(str(tmp_path))

        assert report.passed
        assert report.levels_run == ("L0", "L1")
        assert [level.passed for level in report.levels] == [True, True]
        zero, one, two = (check for level in report.levels for check in level.checks)
        assert (zero.command, zero.exit_code, zero.output_tail) == ("echo zero", 0, "zero\n")
        assert one.output_tail == "one\n"
        assert two.output_tail == f"two\n{tmp_path.resolve()}\n"  # stderr merged, run in place
        assert not any(check.timed_out for check in (zero, one, two))

    def test_stale_bytecode_of_a_same_size_edit_is_never_run(self, tmp_path):
        """An agent's edit of the same size in the same second: Python would trust the old .pyc.

        Reproduced exactly: the file's mtime is set back to the first version's, so a .pyc
        keyed by mtime and size (Python's default) matches the new source. The CI failure this
        caught: the agent loop's third, correct attempt was verified as its second, wrong one.
        """
        source = tmp_path / "calc.py"
        check = f"{sys.executable} -c 'import calc; assert calc.add(2, 3) == 5, calc.add(2, 3)'"
        levels = {"L0": f"{sys.executable} -m compileall -q calc.py", "L1": check}
        source.write_text("def add(a, b):\n    return a - b\n")
        stamp = source.stat().st_mtime_ns
        # as a plain `python -m compileall` in the workspace would, outside any verification
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "calc.py"], cwd=tmp_path, check=True
        )
        assert not CommandVerifier(levels).verify(str(tmp_path)).passed  # a - b is wrong

        source.write_text("def add(a, b):\n    return a + b\n")  # same size
        os.utime(source, ns=(stamp, stamp))  # and the same mtime: the old .pyc looks valid
        stale = subprocess.run(
            [sys.executable, "-c", "import calc; print(calc.add(2, 3))"],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert stale.stdout.strip() == "-1"  # the trap is real: plain Python runs the old code

        report = CommandVerifier(levels).verify(str(tmp_path))
        assert report.passed, report.levels[-1].checks[0].output_tail

    def test_bytecode_outside_the_workspace_is_compiled_once(self, tmp_path):
        """The standard library's (and pytest's) bytecode outlives a verification; the workspace's
        is removed after each (and before: test_stale_bytecode_..., in the same prefix)."""
        (tmp_path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
        show = "import os, json, calc; print(os.environ['PYTHONPYCACHEPREFIX'])"
        verifier = CommandVerifier({"L1": f'{sys.executable} -c "{show}"'})

        def verified() -> tuple[Path, Path]:
            report = verifier.verify(str(tmp_path))
            assert report.passed, report.levels[-1].checks[0].output_tail
            prefix = Path(report.levels[-1].checks[0].output_tail.strip())
            (library,) = (prefix / Path(json.__file__).parent.relative_to("/")).glob("__init__.*")
            assert not (prefix / tmp_path.resolve().relative_to("/")).exists()  # calc's removed
            return prefix, library

        prefix, library = verified()
        os.utime(library, ns=(1, 1))
        assert verified() == (prefix, library)  # one cache
        assert library.stat().st_mtime_ns == 1  # json's .pyc kept, not written again
        assert not (tmp_path / "__pycache__").exists()

    def test_the_cache_is_the_users_own_or_a_temporary_one(self, tmp_path, monkeypatch):
        cache = tmp_path / "cache"
        monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
        assert agent_bytecode._Prefix().path() == str(cache / "fsm-runner" / "pycache")
        assert (cache / "fsm-runner" / "pycache").stat().st_mode & 0o777 == 0o700
        (cache / "fsm-runner" / "pycache").chmod(0o777)  # another user could plant bytecode
        fallback = agent_bytecode._Prefix()  # its folder is removed when it is collected
        elsewhere = fallback.path()
        assert Path(elsewhere).name.startswith("fsm-runner-pycache-")
        assert Path(elsewhere).stat().st_mode & 0o777 == 0o700
        (cache / "fsm-runner").chmod(0o700)
        (cache / "fsm-runner" / "pycache").rmdir()
        (cache / "fsm-runner" / "pycache").write_text("not a folder")
        assert agent_bytecode._Prefix().path() != str(cache / "fsm-runner" / "pycache")

    def test_a_failed_level_stops_the_later_ones(self, tmp_path):
        verifier = CommandVerifier(
            {"L0": "true", "L1": "echo broken; exit 3", "L2": "touch l2-ran"}
        )

        report = verifier.verify(str(tmp_path))

        assert not report.passed
        assert report.levels_run == ("L0", "L1")
        (failed,) = report.failed_levels
        assert failed.level == "L1"
        (check,) = failed.checks
        assert (check.passed, check.exit_code, check.output_tail) == (False, 3, "broken\n")
        assert not (tmp_path / "l2-ran").exists()

    def test_every_check_of_a_failing_level_runs(self, tmp_path):
        verifier = CommandVerifier({"L0": ["exit 1", "echo ran > second.txt", "true"]})

        report = verifier.verify(str(tmp_path))

        (level,) = report.levels
        assert not level.passed
        assert [check.passed for check in level.checks] == [False, True, True]
        assert (tmp_path / "second.txt").read_text() == "ran\n"

    def test_levels_run_in_natural_order(self, tmp_path):
        levels = {name: f"echo {name} >> order.txt" for name in ("L10", "L2", "L1", "L0")}

        report = CommandVerifier(levels).verify(str(tmp_path))

        assert report.levels_run == ("L0", "L1", "L2", "L10")
        assert (tmp_path / "order.txt").read_text().split() == ["L0", "L1", "L2", "L10"]

    def test_levels_given_to_verify_replace_the_verifiers_own(self, tmp_path):
        verifier = CommandVerifier({"L0": "touch own"})

        report = verifier.verify(str(tmp_path), levels={"L5": ["touch given"]})

        assert report.levels_run == ("L5",)
        assert (tmp_path / "given").exists()
        assert not (tmp_path / "own").exists()

    def test_no_levels_is_an_error(self, tmp_path):
        with pytest.raises(ValueError, match="no verification levels"):
            CommandVerifier().verify(str(tmp_path))

    @pytest.mark.parametrize("commands", [[], [""], ["true", 5]])
    def test_malformed_levels_are_refused(self, commands):
        with pytest.raises(ValueError, match="level 'L0'"):
            CommandVerifier({"L0": commands})

    def test_output_tail_keeps_the_end(self, tmp_path):
        command = f"{QPY} -c \"print('x' * 5000 + 'END')\""

        (level,) = CommandVerifier({"L0": command}, output_tail=100).verify(str(tmp_path)).levels
        (nothing,) = CommandVerifier({"L0": command}, output_tail=0).verify(str(tmp_path)).levels

        (check,) = level.checks
        assert len(check.output_tail) == 100
        assert check.output_tail.endswith("xEND\n")
        assert nothing.checks[0].output_tail == ""

    def test_undecodable_output_is_replaced(self, tmp_path):
        command = f"{QPY} -c \"import sys; sys.stdout.buffer.write(b'ok \\xff')\""

        (level,) = CommandVerifier({"L0": command}).verify(str(tmp_path)).levels

        assert level.checks[0].output_tail == "ok \ufffd"

    def test_timeout_kills_the_whole_process_group(self, tmp_path):
        pid_file = tmp_path / "child.pid"
        verifier = CommandVerifier(
            {"L0": f"sleep 30 & echo $! > {pid_file}; wait", "L1": "touch l1-ran"}, timeout=0.5
        )

        report = verifier.verify(str(tmp_path))

        (level,) = report.levels
        (check,) = level.checks
        assert (check.passed, check.timed_out, check.exit_code) == (False, True, None)
        assert not (tmp_path / "l1-ran").exists()
        assert exited(int(pid_file.read_text()))  # the shell's child went with it

    def test_the_overall_budget_bounds_each_check(self, tmp_path):
        verifier = CommandVerifier({"L0": ["sleep 30", "touch never"]}, timeout=600)

        report = verifier.verify(str(tmp_path), timeout=0.5)

        (level,) = report.levels
        first, second = level.checks
        assert first.timed_out
        assert second.timed_out  # the budget was spent: not started at all
        assert "not run" in second.output_tail
        assert not (tmp_path / "never").exists()

    def test_a_missing_workspace_fails_each_check(self, tmp_path):
        report = CommandVerifier({"L0": "true"}).verify(str(tmp_path / "nowhere"))

        (check,) = report.levels[0].checks
        assert (check.passed, check.exit_code) == (False, 127)
        assert "could not start" in check.output_tail


RECORDER = """
    import json, os, sys
    stdin = sys.stdin.read()
    env = {k: v for k, v in os.environ.items() if k.startswith("FSM_") or k == "EXTRA"}
    with open("seen.json", "w") as f:
        json.dump({"stdin": stdin, "env": env, "cwd": os.getcwd()}, f)
    print("working on it")
"""


def request(workspace: Path, **changes) -> AgentRequest:
    fields = {"task": "Fix the bug", "workspace": str(workspace), "iteration": 1, **changes}
    return AgentRequest(**fields)


class TestCommandAgentDriver:
    """The agent is a command: request in through env and stdin, result out through stdout."""

    def test_request_reaches_the_command_through_env_and_stdin(self, tmp_path, monkeypatch):
        for name in [name for name in os.environ if name.startswith("FSM_")]:
            monkeypatch.delenv(name)  # the test run's own (FSM_RUNNER_TEST_POSTGRES) pass through
        script = write_script(tmp_path, RECORDER)
        workspace = tmp_path / "ws"
        workspace.mkdir()
        driver = CommandAgentDriver([PY, str(script)], env={"EXTRA": "yes"})

        result = driver.run(
            request(
                workspace,
                task="Fix the bug\nin calc.py",
                feedback="L1 failed: test_add",
                session_id="s-1",
                iteration=2,
            )
        )

        assert (result.success, result.exit_code, result.timed_out) == (True, 0, False)
        assert result.stdout == "working on it\n"
        assert result.duration_ms is not None
        seen = json.loads((workspace / "seen.json").read_text())
        assert json.loads(seen["stdin"]) == {
            "task": "Fix the bug\nin calc.py",
            "feedback": "L1 failed: test_add",
            "session_id": "s-1",
            "iteration": 2,
            "workspace": str(workspace),
        }
        assert seen["env"] == {
            "FSM_TASK": "Fix the bug\nin calc.py",
            "FSM_FEEDBACK": "L1 failed: test_add",
            "FSM_SESSION_ID": "s-1",
            "FSM_ITERATION": "2",
            "FSM_WORKSPACE": str(workspace),
            "EXTRA": "yes",
        }
        assert Path(seen["cwd"]).resolve() == workspace.resolve()

    def test_no_feedback_or_session_yet(self, tmp_path):
        script = write_script(tmp_path, RECORDER)

        CommandAgentDriver([PY, str(script)]).run(request(tmp_path))

        seen = json.loads((tmp_path / "seen.json").read_text())
        assert (seen["env"]["FSM_FEEDBACK"], seen["env"]["FSM_SESSION_ID"]) == ("", "")
        payload = json.loads(seen["stdin"])
        assert (payload["feedback"], payload["session_id"]) == (None, None)

    def test_the_last_json_line_is_the_result(self, tmp_path):
        script = write_script(
            tmp_path,
            """
            import json
            print(json.dumps({"session_id": "earlier", "model": "old"}))
            print("some chatter")
            print(json.dumps({"session_id": "s-9", "model": "m-1", "tokens_input": 100,
                              "tokens_output": 20, "cost_usd": 0.25, "extra": [1]}))
            print("{not json")
            print("[1, 2]")
            """,
        )

        result = CommandAgentDriver(f"{QPY} {shlex.quote(str(script))}").run(request(tmp_path))

        assert result.success
        assert (result.session_id, result.model) == ("s-9", "m-1")
        assert (result.tokens_input, result.tokens_output, result.tokens_total) == (100, 20, 120)
        assert result.cost_usd == 0.25

    def test_values_of_the_wrong_type_are_ignored(self, tmp_path):
        line = {
            "session_id": 5,
            "model": None,
            "tokens_input": True,
            "tokens_output": "20",
            "tokens_total": 7,
            "cost_usd": "free",
            "success": "yes",
        }
        command = [PY, "-c", f"print({json.dumps(json.dumps(line))})"]

        result = CommandAgentDriver(command).run(request(tmp_path))

        assert result.success  # "yes" is no bool: the exit code decides
        assert (result.session_id, result.model, result.cost_usd) == (None, None, None)
        assert (result.tokens_input, result.tokens_output, result.tokens_total) == (None, None, 7)

    def test_reported_failure_beats_exit_code_zero(self, tmp_path):
        command = [PY, "-c", 'print(\'{"success": false, "session_id": "s"}\')']

        result = CommandAgentDriver(command).run(request(tmp_path))

        assert (result.success, result.exit_code, result.session_id) == (False, 0, "s")

    def test_non_zero_exit(self, tmp_path):
        command = [PY, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]

        result = CommandAgentDriver(command).run(request(tmp_path))

        assert (result.success, result.exit_code, result.timed_out) == (False, 3, False)
        assert result.stderr == "boom\n"

    def test_timeout_kills_the_group_and_reports_137(self, tmp_path):
        # A shell, not Python: it starts in a millisecond, so the child's pid is surely written.
        command = "sleep 30 & echo $! > child.pid; echo started; wait"
        driver = CommandAgentDriver(command, timeout=600)

        result = driver.run(request(tmp_path, timeout=0.5))  # the smaller limit applies

        assert (result.success, result.exit_code, result.timed_out) == (False, 137, True)
        assert result.stdout == "started\n"
        assert exited(int((tmp_path / "child.pid").read_text()))

    def test_a_command_that_cannot_start(self, tmp_path):
        result = CommandAgentDriver([str(tmp_path / "no-such-agent")]).run(request(tmp_path))

        assert (result.success, result.exit_code) == (False, 127)
        assert "FileNotFoundError" in result.stderr

    def test_a_shell_command_that_is_not_found(self, tmp_path):
        result = CommandAgentDriver("no-such-agent-command-xyz").run(request(tmp_path))

        assert (result.success, result.exit_code) == (False, 127)

    @pytest.mark.parametrize("as_list", [False, True])
    def test_the_command_may_come_from_the_request_options(self, tmp_path, as_list):
        script = write_script(tmp_path, RECORDER)
        command = [PY, str(script)] if as_list else f"{QPY} {shlex.quote(str(script))}"

        result = CommandAgentDriver().run(request(tmp_path, options={"command": command}))

        assert result.success
        assert (tmp_path / "seen.json").exists()

    def test_no_command_at_all(self, tmp_path):
        with pytest.raises(ValueError, match="no agent command"):
            CommandAgentDriver().run(request(tmp_path))

    def test_a_malformed_command_in_the_options(self, tmp_path):
        with pytest.raises(TypeError, match="string or a list of strings"):
            CommandAgentDriver().run(request(tmp_path, options={"command": 5}))

    def test_long_output_keeps_its_tail(self, tmp_path):
        command = [PY, "-c", "print('a' * 30000 + 'END')"]

        result = CommandAgentDriver(command).run(request(tmp_path))

        assert len(result.stdout) == 20_000
        assert result.stdout.endswith("aEND\n")


def report(*levels: LevelResult) -> VerificationReport:
    return VerificationReport(passed=all(level.passed for level in levels), levels=levels)


class TestTemplateFeedbackGenerator:
    """Feedback restates the task and quotes each failed check."""

    def test_failed_checks_are_described(self):
        failing = report(
            LevelResult("L0", passed=True, checks=(CheckResult("ruff check .", passed=True),)),
            LevelResult(
                "L1",
                passed=False,
                checks=(
                    CheckResult("python -m compileall -q .", passed=True, exit_code=0),
                    CheckResult(
                        "python -m pytest -q",
                        passed=False,
                        exit_code=1,
                        output_tail="collected 2 items\nFAILED test_calc.py::test_add\n",
                    ),
                    CheckResult("slow-check", passed=False, timed_out=True),
                ),
            ),
        )

        text = TemplateFeedbackGenerator().generate(
            failing, task="Make the tests pass:\n  add must add."
        )

        lines = text.splitlines()
        assert lines[0] == "Task: Make the tests pass: add must add."
        assert "Level L1 failed:" in lines
        assert "- `python -m pytest -q` exited with code 1" in lines
        assert "FAILED test_calc.py::test_add" in lines
        assert "- `slow-check` timed out" in lines
        assert "L0" not in text
        assert "ruff" not in text
        assert "compileall" not in text

    def test_output_is_cut_to_its_end(self):
        check = CheckResult("make", passed=False, exit_code=2, output_tail="x" * 100 + "END")
        failing = report(LevelResult("L2", passed=False, checks=(check,)))

        text = TemplateFeedbackGenerator(max_output=10).generate(failing, task="t")

        assert "xxxxxxxEND" in text
        assert "x" * 8 not in text

    def test_backticks_in_output_do_not_break_the_block(self):
        check = CheckResult("lint", passed=False, exit_code=1, output_tail="use ``` fences")
        failing = report(LevelResult("L0", passed=False, checks=(check,)))

        text = TemplateFeedbackGenerator().generate(failing, task="t")

        assert "````\nuse ``` fences\n````" in text

    def test_a_long_task_is_cut(self):
        text = TemplateFeedbackGenerator(max_task=20).generate(report(), task="word " * 100)

        assert len(text.splitlines()[0]) == len("Task: ") + 20

    def test_a_passed_report(self):
        passed = report(LevelResult("L0", passed=True))

        text = TemplateFeedbackGenerator().generate(passed, task="t")

        assert "nothing to fix" in text


class TestFileResultPersister:
    """Artifacts become JSON files, written atomically; a failed write is a failed artifact."""

    def test_writes_json_and_describes_it(self, tmp_path):
        data = {"b": 1, "a": [1, 2], "text": "héllo"}

        record = FileResultPersister(tmp_path / "artifacts").persist(
            "run-1", "agent-1", "agent_result", data
        )

        path = tmp_path / "artifacts" / "run-1" / "agent-1.json"
        body = path.read_bytes()
        assert body == (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
        assert (record.name, record.kind, record.content, record.status) == (
            "agent-1",
            "agent_result",
            data,
            "stored",
        )
        assert record.path == str(path)
        assert record.sha256 == hashlib.sha256(body).hexdigest()
        assert record.size == len(body)
        assert [p.name for p in path.parent.iterdir()] == ["agent-1.json"]

    def test_rewriting_replaces_the_file(self, tmp_path):
        persister = FileResultPersister(str(tmp_path))
        persister.persist("run-1", "report", "verification_report", {"passed": False})

        record = persister.persist("run-1", "report", "verification_report", {"passed": True})

        assert record.path is not None
        assert json.loads(Path(record.path).read_text()) == {"passed": True}
        assert [p.name for p in (tmp_path / "run-1").iterdir()] == ["report.json"]

    def test_a_directory_that_is_a_file_fails_the_artifact_not_the_caller(self, tmp_path, caplog):
        blocker = tmp_path / "blocker"
        blocker.write_text("a file, not a directory")

        with caplog.at_level(logging.WARNING, logger="fsm_runner.presets.agent_loop.services"):
            record = FileResultPersister(blocker).persist("run-1", "agent-1", "agent_result", {})

        assert record.status == "failed"
        assert record.error is not None
        assert record.error.startswith(("FileExistsError", "NotADirectoryError"))
        assert (record.path, record.sha256, record.size, record.content) == (None, None, None, {})
        (logged,) = caplog.records
        assert logged.levelno == logging.WARNING
        assert "agent-1" in logged.getMessage()
        assert blocker.read_text() == "a file, not a directory"

    def test_a_failed_rename_leaves_no_temporary_file(self, tmp_path):
        target = tmp_path / "run-1" / "agent-1.json"
        target.mkdir(parents=True)
        (target / "keep").write_text("x")

        record = FileResultPersister(tmp_path).persist("run-1", "agent-1", "agent_result", [1])

        assert record.status == "failed"
        assert record.error is not None
        assert record.error.startswith("IsADirectoryError")
        assert [p.name for p in (tmp_path / "run-1").iterdir()] == ["agent-1.json"]
        assert (target / "keep").read_text() == "x"

    @pytest.mark.parametrize(("run_id", "name"), [("run-1", "../escape"), ("..", "a"), ("r", "")])
    def test_names_that_would_leave_the_directory_are_refused(self, tmp_path, run_id, name):
        with pytest.raises(ValueError, match="cannot be used as a file name"):
            FileResultPersister(tmp_path).persist(run_id, name, "artifact", {})

    def test_data_that_is_not_json_is_an_error(self, tmp_path):
        with pytest.raises(TypeError):
            FileResultPersister(tmp_path).persist("run-1", "a", "artifact", {"when": object()})


class TestSnapshotSince:
    """`since` counts changes from the last snapshot, even when the agent committed them."""

    def test_agent_commits_are_still_seen(self, tmp_path):
        repo = tmp_path / "r"
        repo.mkdir()
        git = [
            "git",
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@localhost",
            "-c",
            "commit.gpgsign=false",
        ]
        subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
        (repo / "a.txt").write_text("one\n")
        first = GitSnapshotter().capture(str(repo))
        (repo / "b.txt").write_text("two\n")
        subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-q", "-m", "agent's own commit"], cwd=repo, check=True)
        assert GitSnapshotter().capture(str(repo)).changed_files == ()
        second = GitSnapshotter().capture(str(repo), since=first.snapshot_id)
        assert second.before == first.snapshot_id
        assert second.changed_files == ("b.txt",)
        bogus = GitSnapshotter().capture(str(repo), since="0" * 40)
        assert bogus.before == bogus.after


# -- commands that outlive their runner ----------------------------------------------------------

# A runner in a process of its own: runs one agent or verification command in a workspace.
RUNNER = """
import sys
from fsm_runner.presets.agent_loop import AgentRequest
from fsm_runner.presets.agent_loop.services import CommandAgentDriver, CommandVerifier
kind, workspace, command = sys.argv[1:]
if kind == "agent":
    CommandAgentDriver(command).run(AgentRequest(task="t", workspace=workspace, iteration=1))
else:
    CommandVerifier({"L0": command}).verify(workspace)
"""

# A command that writes its pid to the file it is given, then runs until released (60 s at most).
SLEEPER = """
import os, pathlib, sys, time
pid_file = pathlib.Path(sys.argv[1])
pid_file.write_text(str(os.getpid()))
end = time.monotonic() + 60
while time.monotonic() < end and not pid_file.with_suffix(".release").exists():
    time.sleep(0.05)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_for(path: Path, process: subprocess.Popen[bytes] | None = None) -> int:
    """The pid written to ``path``, once it is there."""
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        assert process is None or process.poll() is None, "the runner ended early"
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return int(path.read_text())


@pytest.fixture
def sleeper(tmp_path):
    """``(command for a pid file, cleanup list)``: every pid written is killed at the end."""
    script = write_script(tmp_path, SLEEPER, name="sleeper.py")
    pids: list[int] = []
    yield (lambda pid_file: f"{QPY} {shlex.quote(str(script))} {shlex.quote(str(pid_file))}"), pids
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def start_runner(kind: str, workspace: Path, command: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PY, "-c", RUNNER, kind, str(workspace), command])


class TestCommandsEndWithTheirRunner:
    """A killed runner's commands never keep running in the workspace."""

    def test_the_command_dies_with_its_runner(self, tmp_path, sleeper):
        command, pids = sleeper
        # `exec`: the command is the runner's own child, which the kernel kills with it.
        runner = start_runner("agent", tmp_path, "exec " + command(tmp_path / "agent.pid"))
        pids.append(child := wait_for(tmp_path / "agent.pid", runner))

        runner.kill()
        runner.wait()

        assert exited(child)

    def test_what_a_dead_runner_left_is_killed_before_the_next_command(
        self, tmp_path, sleeper, caplog
    ):
        command, pids = sleeper
        # `; true`: the shell forks the check, so it is the runner's grandchild, which outlives
        # both the runner and the shell unless something ends it.
        runner = start_runner("verify", tmp_path, command(tmp_path / "check.pid") + "; true")
        pids.append(left := wait_for(tmp_path / "check.pid", runner))
        runner.kill()
        runner.wait()
        assert running(left)  # the kernel ended the shell, not its child
        # The check fails while the left-behind process still runs (a zombie no longer does).
        probe = write_script(
            tmp_path,
            f"""
            import pathlib, sys
            try:
                stat = pathlib.Path("/proc/{left}/stat").read_text()
            except OSError:
                sys.exit(0)
            sys.exit(stat[stat.rindex(")") + 2] != "Z")
            """,
            name="probe.py",
        )

        with caplog.at_level(logging.WARNING, "fsm_runner.presets.agent_loop.services"):
            report = CommandVerifier({"L0": f"{QPY} {probe}"}).verify(str(tmp_path))

        assert report.passed, report
        assert "left running" in caplog.text
        assert not (tmp_path / ".fsm-runner" / "child.json").exists()

    @pytest.mark.parametrize(
        ("change", "killed"),
        [({}, True), ({"start_time": 1}, False), ({"boot_id": "another-boot"}, False)],
        ids=["recorded", "recycled-pid", "another-boot"],
    )
    def test_only_the_recorded_process_group_is_killed(self, tmp_path, change, killed):
        group = subprocess.Popen(["sleep", "60"], start_new_session=True)
        try:
            guard = tmp_path / ".fsm-runner"
            guard.mkdir()
            record = {
                "pgid": group.pid,
                "start_time": _children._process(group.pid).start_time,
                "boot_id": _children._boot_id(),
                "command": "sleep 60",
                "runner_pid": 1,
            }
            (guard / "child.json").write_text(json.dumps(record | change))

            report = CommandVerifier({"L0": "true"}).verify(str(tmp_path))

            assert report.passed
            assert running(group.pid) is not killed
            assert not (guard / "child.json").exists()
        finally:
            group.kill()
            group.wait()

    def test_a_live_runners_command_is_waited_for_never_killed(self, tmp_path, sleeper):
        command, pids = sleeper
        pid_file = tmp_path / "agent.pid"
        runner = start_runner("agent", tmp_path, command(pid_file))
        try:
            pids.append(live := wait_for(pid_file, runner))

            busy = CommandVerifier({"L0": "true"}, timeout=0.2).verify(str(tmp_path))

            (check,) = busy.levels[0].checks
            assert (check.passed, check.timed_out) == (False, True)
            assert "is busy" in check.output_tail
            assert f"runs `{command(pid_file)}`" in check.output_tail
            assert running(live)
            agent = CommandAgentDriver("true", timeout=0.2).run(request(tmp_path))
            assert (agent.success, agent.timed_out) == (False, True)
            assert "is busy" in agent.stderr
        finally:
            pid_file.with_suffix(".release").touch()
            runner.wait()
        assert runner.returncode == 0
        assert CommandVerifier({"L0": "true"}).verify(str(tmp_path)).passed

    def test_a_workspace_where_no_record_can_be_kept_still_runs_commands(self, tmp_path, caplog):
        (tmp_path / ".fsm-runner").write_text("a file where the directory would go")

        with caplog.at_level(logging.WARNING, "fsm_runner.presets.agent_loop.services"):
            result = CommandAgentDriver("echo ran").run(request(tmp_path))

        assert (result.success, result.stdout) == (True, "ran\n")
        assert "cannot keep a record of the commands run in" in caplog.text

    def test_the_guard_directory_is_ignored_by_git(self, repo):
        CommandAgentDriver("echo hi > a.txt").run(request(repo))

        snapshot = GitSnapshotter().capture(str(repo))

        assert snapshot.changed_files == ("a.txt",)
        assert (repo / ".fsm-runner" / "lock").exists()
        assert git(repo, "status", "--porcelain") == ""
