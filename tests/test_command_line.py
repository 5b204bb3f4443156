"""What every fsm_runner command line shares: ``fsm_runner.command_line``.

The one ``--journal`` option (with ``$FSM_RUNNER_JOURNAL`` and ``./fsm-runner.db`` as
``fsm_runner.journal.locate`` finds them), the one rule for suggested commands (they name the
journal unless the command would find it by itself), and the error mapping of the presets' own
command lines.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fsm_runner.command_line import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    ExitCodeCommand,
    journal_option,
    suggested_command,
)
from fsm_runner.exceptions import AmbiguousRunIdError, JournalNotFoundError
from fsm_runner.journal.locate import DEFAULT_JOURNAL, ENV_JOURNAL


@click.group()
@journal_option()
@click.pass_context
def group(ctx, journal_path):
    ctx.obj = journal_path


@group.command()
@journal_option(inherited=True)
def child(journal_path):
    click.echo(f"journal={journal_path}")


@click.command(cls=ExitCodeCommand)
@journal_option()
@click.argument("what")
def failing(journal_path, what):
    if what == "journal":
        raise JournalNotFoundError(path="/nowhere/j.db")
    raise AmbiguousRunIdError("ab", ["abc", "abd"])


class TestJournalOption:
    """One --journal: the option, else $FSM_RUNNER_JOURNAL, else ./fsm-runner.db."""

    @pytest.mark.parametrize(
        ("env", "args", "seen"),
        [
            (None, [], DEFAULT_JOURNAL),
            ("env.db", [], "env.db"),
            ("env.db", ["--journal", "given.db"], "given.db"),
            (None, ["--journal", "given.db"], "given.db"),
        ],
    )
    def test_where(self, monkeypatch, env, args, seen):
        monkeypatch.delenv(ENV_JOURNAL, raising=False)
        if env:
            monkeypatch.setenv(ENV_JOURNAL, env)
        result = CliRunner().invoke(group, [*args, "child"])
        assert result.output == f"journal={seen}\n"

    def test_an_inherited_option_wins_over_the_groups(self, monkeypatch):
        monkeypatch.setenv(ENV_JOURNAL, "env.db")
        result = CliRunner().invoke(group, ["--journal", "g.db", "child", "--journal", "c.db"])
        assert result.output == "journal=c.db\n"
        result = CliRunner().invoke(group, ["--journal", "g.db", "child"])
        assert result.output == "journal=g.db\n"

    def test_help_names_where_the_journal_is_found(self):
        text = CliRunner().invoke(group, ["--help"]).output
        assert f"${ENV_JOURNAL}" in text
        assert f"./{DEFAULT_JOURNAL}" in text
        text = CliRunner().invoke(group, ["child", "--help"]).output
        assert f"${ENV_JOURNAL}" in text

    def test_declared_once(self):
        # Every command line of the package takes --journal from journal_option.
        import fsm_runner

        root = Path(fsm_runner.__file__).parent
        declaring = sorted(
            str(path.relative_to(root))
            for path in root.rglob("*.py")
            if '"--journal",' in path.read_text()
        )
        assert declaring == ["command_line.py"]


class TestSuggestedCommand:
    """A suggested command names the journal unless the command would find it by itself."""

    def test_default_and_env(self, monkeypatch):
        monkeypatch.delenv(ENV_JOURNAL, raising=False)
        assert suggested_command("fsm-runner", "fsm-runner.db", "show", "abc") == (
            "fsm-runner show abc"
        )
        assert suggested_command("fsm-runner", "my journal.db", "show", "abc") == (
            "fsm-runner --journal 'my journal.db' show abc"
        )
        monkeypatch.setenv(ENV_JOURNAL, "my journal.db")
        assert suggested_command("fsm-runner", "my journal.db", "show", "abc") == (
            "fsm-runner show abc"
        )
        assert suggested_command("fsm-runner", "fsm-runner.db", "show", "abc") == (
            "fsm-runner --journal fsm-runner.db show abc"
        )

    def test_named_always_and_program_as_shell_text(self, monkeypatch):
        monkeypatch.delenv(ENV_JOURNAL, raising=False)
        assert (
            suggested_command("python -m app", "fsm-runner.db", "resume", "a;b", name_journal=True)
            == "python -m app --journal fsm-runner.db resume 'a;b'"
        )


class TestErrors:
    """The presets' command lines map the locating errors to fsm-runner's exit codes."""

    def test_no_journal(self):
        result = CliRunner().invoke(failing, ["journal"])
        assert result.exit_code == EXIT_NOT_FOUND
        assert result.output == (
            "Error: no journal at /nowhere/j.db (pass --journal PATH or set FSM_RUNNER_JOURNAL)\n"
        )

    def test_ambiguous(self):
        result = CliRunner().invoke(failing, ["ambiguous"])
        assert result.exit_code == EXIT_USAGE
        assert "is ambiguous: it matches abc, abd" in result.output

    def test_importing_it_loads_no_journal(self):
        code = (
            "import sys, fsm_runner.command_line, fsm_runner.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('fsm_runner.journal')))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert done.stdout == "[]\n"  # `fsm-runner --help` stays fast
