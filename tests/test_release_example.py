"""The release example (`python -m fsm_runner.examples.release`): forks resume, its CLI errors.

Real processes, real SQLite files in tmp_path; the fork is resumed through `fsm-runner`.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fsm_runner import SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.examples import release
from tests.helpers import start_release

APP = "fsm_runner.examples.release:make_engine"
PROG = [sys.executable, "-m", "fsm_runner.examples.release"]

pytestmark = pytest.mark.usefixtures("in_tmp_path")


def fsm_runner(journal_path, *args: str):
    return CliRunner().invoke(cli, ["--journal", str(journal_path), *args])


class TestForks:
    """A fork runs the phases after its seq again, from what the journal holds."""

    @pytest.mark.parametrize("at", [0, 1, 2, 3])
    def test_a_fork_of_a_published_run_resumes(self, journal_path, tmp_path, at):
        original = start_release(journal_path, tmp_path, None)
        published = tmp_path / "ws" / "dist" / "release-9.9.9.tar.gz"
        digest = hashlib.sha256(published.read_bytes()).hexdigest()
        forked = fsm_runner(journal_path, "fork", original[:8], "--at", str(at), "--run-id", "f1")
        assert forked.exit_code == 0, forked.output
        result = fsm_runner(journal_path, "resume", "f1", "--app", APP)
        assert result.exit_code == 0, result.output
        assert "run f1 has ended (succeeded) in state 'published'" in result.output
        with SqliteJournal(journal_path) as journal:
            outputs = {t.from_state: t.output for t in journal.transitions("f1")}
        assert outputs["publishing"]["sha256"] == digest  # the same archive, rebuilt
        assert hashlib.sha256(published.read_bytes()).hexdigest() == digest

    def test_a_run_whose_workspace_was_cleaned_resumes(self, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)  # built; testing is next
        shutil.rmtree(tmp_path / "ws")
        result = fsm_runner(journal_path, "resume", run_id, "--app", APP)
        assert result.exit_code == 0, result.output
        assert (tmp_path / "ws" / "dist" / "release-9.9.9.tar.gz").exists()

    def test_a_tampered_archive_fails_the_tests(self, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        (tmp_path / "ws" / run_id / "release-9.9.9.tar.gz").write_bytes(b"not the archive")
        result = fsm_runner(journal_path, "resume", run_id, "--app", APP)
        assert result.exit_code == 1
        assert "TESTS_FAILED" in result.output


class TestCommandLine:
    """Its own CLI: help on every option, fsm-runner's journal errors and exit codes."""

    def test_every_option_has_help(self):
        for param in release.release.params:
            assert getattr(param, "help", None), f"{param.name} has no help text"
        result = subprocess.run([*PROG, "--help"], capture_output=True, text=True, check=True)
        for option in ("--journal", "--workspace", "--version", "--stop-after"):
            assert option in result.stdout

    def test_runs_and_tells_how_to_finish(self, tmp_path):
        journal = tmp_path / "j.db"
        result = subprocess.run(
            [*PROG, "--journal", str(journal), "--stop-after", "2"],
            capture_output=True, text=True, check=False, cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        last = result.stdout.splitlines()[-1]
        assert last.startswith(f"finish it with: fsm-runner --journal {journal} resume ")
        assert last.endswith(f"--app {APP}")
        with SqliteJournal(journal) as opened:
            (run,) = opened.runs()
        assert run.state == "testing"

    @pytest.mark.parametrize("kind", ["missing directory", "directory", "text file", "postgres"])
    def test_a_journal_it_cannot_use_is_one_error_line(self, tmp_path, kind):
        notes = tmp_path / "notes.txt"
        notes.write_text("notes\n")
        location = {
            "missing directory": str(tmp_path / "nowhere" / "j.db"),
            "directory": str(tmp_path),
            "text file": str(notes),
        }.get(kind)
        code = 3
        if location is None:  # a server nobody listens on: cannot connect, a failure
            location, code = "postgresql://root@127.0.0.1:1/test?connect_timeout=2", 1
        result = subprocess.run(
            PROG, capture_output=True, text=True, check=False, cwd=tmp_path,
            env={"FSM_RUNNER_JOURNAL": location, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert result.returncode == code, result.stderr
        assert "Traceback" not in result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith("Error: journal ")
        assert result.stdout == ""
        assert notes.read_text() == "notes\n"

    def test_a_postgres_journal_from_the_environment(self, postgres_server, postgres_schema):
        location = f"{postgres_server.url}?schema={postgres_schema}"
        result = subprocess.run(
            [*PROG, "--stop-after", "1"], capture_output=True, text=True, check=False,
            env={"FSM_RUNNER_JOURNAL": location, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "finish it with: fsm-runner resume " in result.stdout  # the env names the journal
        shown = CliRunner().invoke(cli, ["--journal", location, "runs", "--json"])
        assert '"state": "building"' in shown.output
