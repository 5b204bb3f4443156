"""``--app`` factories: given the command's journal, or built on their own and closed; no stray file.

``fsm-runner --journal other.db resume RUN --app mod:make`` used to build the app's own engine
(opening, and creating, its default ``./fsm-runner.db``) and never close it. A factory may now
take the journal (``make(journal) -> Engine``); an app that opens a journal of its own is used
on the command's journal, its engine and journal closed, and a journal file it created in the
current directory for nothing removed. Each test runs in a temporary directory as the cwd.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsm_runner import SqliteJournal
from fsm_runner.cli import cli

APP = textwrap.dedent(
    """
    from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition

    SPEC = MachineSpec(
        "two",
        [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
        [Transition("a", "NEXT", "b"), Transition("b", "NEXT", "done")],
    )
    HANDLERS = {"a": lambda ctx: "NEXT", "b": lambda ctx: "NEXT"}


    def make_default():
        # No journal given: the engine opens its own ./fsm-runner.db.
        return Engine(SPEC, handlers=HANDLERS)


    def make_path() -> Engine:
        return Engine(SPEC, handlers=HANDLERS, journal=SqliteJournal("fsm-runner.db"))


    def make(journal) -> Engine:
        return Engine(SPEC, handlers=HANDLERS, journal=journal)


    def make_optional(journal=None) -> Engine:
        return Engine(SPEC, handlers=HANDLERS, journal=journal)
    """
)
#: An app whose module builds its engine when imported (on ./fsm-runner.db).
MODULE_ENGINE = APP + "\nengine = make_default()\n"

FACTORIES = ["make_default", "make_path", "make", "make_optional"]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty working directory; the app and the journal live elsewhere."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def app_file(tmp_path):
    """The app as a file outside the working directory (a fresh module name per test)."""
    path = tmp_path / "app" / "two_app.py"
    path.parent.mkdir()
    path.write_text(APP)
    return path


@pytest.fixture
def journal_file(tmp_path):
    """The command's journal, outside the working directory, holding one run at ``a``."""
    path = tmp_path / "data" / "other.db"
    path.parent.mkdir()
    return path


def start_run(journal_file: Path) -> str:
    from fsm_runner import Engine, MachineSpec, State, Transition

    spec = MachineSpec(
        "two",
        [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
        [Transition("a", "NEXT", "b"), Transition("b", "NEXT", "done")],
    )
    with SqliteJournal(journal_file) as journal:
        engine = Engine(
            spec, handlers={"a": lambda c: "NEXT", "b": lambda c: "NEXT"}, journal=journal
        )
        return engine.start()


def run_state(journal_file: Path, run_id: str) -> str:
    with SqliteJournal(journal_file, create=False) as journal:
        return journal.load(run_id).state


class TestInProcess:
    """Through CliRunner, every form of app leaves the working directory as it was."""

    @pytest.mark.parametrize("factory", FACTORIES)
    def test_resume_creates_no_stray_journal(self, cwd, app_file, journal_file, factory):
        run_id = start_run(journal_file)
        result = CliRunner().invoke(
            cli,
            ["--journal", str(journal_file), "resume", run_id, "--app", f"{app_file}:{factory}"],
        )
        assert result.exit_code == 0, result.output
        assert run_state(journal_file, run_id) == "done"
        assert sorted(p.name for p in cwd.iterdir()) == []

    def test_an_engine_built_at_import_leaves_no_stray_journal(self, cwd, tmp_path, journal_file):
        app = tmp_path / "module_engine_app.py"
        app.write_text(MODULE_ENGINE)
        run_id = start_run(journal_file)
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_file), "resume", run_id, "--app", f"{app}:engine"]
        )
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in cwd.iterdir()) == []

    @pytest.mark.parametrize("factory", FACTORIES)
    def test_worker_recover_abort_and_diagram(self, cwd, app_file, journal_file, factory):
        run_id = start_run(journal_file)
        app = f"{app_file}:{factory}"
        runner = CliRunner()
        for args in (
            ["abort", run_id, "--reason", "enough", "--app", app],
            ["recover", "--app", app],
            ["worker", "--app", app, "--exit-when-idle"],
            ["diagram", app],
        ):
            result = runner.invoke(cli, ["--journal", str(journal_file), *args])
            assert result.exit_code == 0, (args, result.output)
            assert sorted(p.name for p in cwd.iterdir()) == [], args

    def test_a_factory_taking_the_journal_gets_the_commands(self, cwd, tmp_path, journal_file):
        app = tmp_path / "seen_app.py"
        app.write_text(
            APP
            + textwrap.dedent(
                """
                SEEN = []

                def make_seen(journal) -> Engine:
                    SEEN.append(journal)
                    return make(journal)
                """
            )
        )
        run_id = start_run(journal_file)
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_file), "resume", run_id, "--app", f"{app}:make_seen"]
        )
        assert result.exit_code == 0, result.output
        module = next(m for name, m in sys.modules.items() if name.endswith("seen_app_py"))
        (journal,) = module.SEEN
        assert journal.location == str(journal_file)

    def test_a_journal_that_was_there_is_kept(self, cwd, app_file, journal_file):
        # An empty journal the user made, and one with runs: neither is the app's to remove.
        SqliteJournal(cwd / "fsm-runner.db").close()
        run_id = start_run(journal_file)
        result = CliRunner().invoke(
            cli,
            ["--journal", str(journal_file), "resume", run_id, "--app", f"{app_file}:make_default"],
        )
        assert result.exit_code == 0, result.output
        assert (cwd / "fsm-runner.db").exists()

    def test_the_default_journal_is_the_apps_own(self, cwd, app_file):
        # No --journal: the command's journal is ./fsm-runner.db, the one the app opens too.
        run_id = start_run(cwd / "fsm-runner.db")
        for factory in FACTORIES:
            result = CliRunner().invoke(cli, ["resume", run_id, "--app", f"{app_file}:{factory}"])
            assert result.exit_code in (0, 4), result.output  # 4: ended by the first
            assert run_state(cwd / "fsm-runner.db", run_id) == "done"

    def test_a_phase_handler_is_no_factory(self, cwd, app_file, journal_file):
        (app_file.parent / "handler_app.py").write_text("def handle(ctx):\n    return 'NEXT'\n")
        run_id = start_run(journal_file)
        result = CliRunner().invoke(
            cli,
            ["--journal", str(journal_file), "resume", run_id, "--app",
             f"{app_file.parent / 'handler_app.py'}:handle"],
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "takes arguments" in result.output
        assert sorted(p.name for p in cwd.iterdir()) == []


def console_script() -> str:
    beside = Path(sys.executable).with_name("fsm-runner")
    found = str(beside) if beside.exists() else shutil.which("fsm-runner")
    if found is None:
        pytest.skip("the fsm-runner console script is not installed")
    return found


@pytest.mark.slow
class TestConsoleScript:
    """Through a real ``fsm-runner`` process, old and new factories leave no stray journal."""

    @pytest.mark.parametrize("factory", ["make_default", "make"])
    def test_resume(self, cwd, app_file, journal_file, factory):
        run_id = start_run(journal_file)
        done = subprocess.run(
            [console_script(), "--journal", str(journal_file), "resume", run_id[:8],
             "--app", f"{app_file}:{factory}"],
            cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert run_state(journal_file, run_id) == "done"
        assert sorted(p.name for p in cwd.iterdir()) == []

    def test_a_module_on_the_path(self, cwd, app_file, journal_file):
        # MODULE:ATTR from the working directory, whose module builds nothing at import.
        shutil.copy(app_file, cwd / "cwd_app.py")
        run_id = start_run(journal_file)
        done = subprocess.run(
            [console_script(), "--journal", str(journal_file), "resume", run_id,
             "--app", "cwd_app:make_path"],
            cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in cwd.iterdir() if p.name != "__pycache__") == ["cwd_app.py"]
