"""The fsm-runner CLI through click's CliRunner, on real journals in tmp_path."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fsm_runner import SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.examples import release
from tests.helpers import one_line_error, start_release

APP = "fsm_runner.examples.release:make_engine"


pytestmark = pytest.mark.usefixtures("in_tmp_path")


class TestHelp:
    """Every command documents itself."""

    def test_every_command_has_help_text(self):
        runner = CliRunner()
        assert cli.help
        for name, command in cli.commands.items():
            assert command.help, f"{name} has no help text"
            result = runner.invoke(cli, [name, "--help"])
            assert result.exit_code == 0
            assert command.help.split("\n")[0] in result.output

    def test_group_help_documents_exit_codes(self):
        result = CliRunner().invoke(cli, ["-h"])
        assert result.exit_code == 0
        assert "Exit codes" in result.output


class TestRuns:
    """`fsm-runner runs`."""

    def test_lists_runs_newest_first(self, invoke, journal_path, tmp_path):
        first = start_release(journal_path, tmp_path, None)
        second = start_release(journal_path, tmp_path, 1)
        result = invoke("runs")
        assert result.exit_code == 0
        lines = result.output.splitlines()
        assert lines[0].split()[:4] == ["RUN", "MACHINE", "STATE", "STATUS"]
        assert lines[1].startswith(second[:12])
        assert lines[2].startswith(first[:12])

    def test_json_and_filters(self, invoke, journal_path, tmp_path):
        done = start_release(journal_path, tmp_path, None)
        active = start_release(journal_path, tmp_path, 1)
        data = json.loads(invoke("runs", "--json").output)
        assert [run["run_id"] for run in data] == [active, done]
        data = json.loads(invoke("runs", "--json", "--status", "succeeded").output)
        assert [run["run_id"] for run in data] == [done]
        assert json.loads(invoke("runs", "--json", "--machine", "other").output) == []
        assert len(json.loads(invoke("runs", "--json", "--limit", "1").output)) == 1

    def test_empty_journal(self, invoke, journal_path):
        SqliteJournal(journal_path).close()
        result = invoke("runs")
        assert result.exit_code == 0
        assert result.output.strip() == "no runs"

    def test_missing_journal_is_one_line(self, invoke, journal_path):
        line = one_line_error(invoke("runs"), code=3)
        assert "no journal at" in line
        assert not journal_path.exists()

    def test_corrupt_journal_is_one_line(self, invoke, journal_path):
        journal_path.write_bytes(b"\x00garbage" * 1000)
        line = one_line_error(invoke("runs"))  # damaged: not "no journal"
        assert "not a SQLite database" in line
        assert journal_path.read_bytes() == b"\x00garbage" * 1000

    def test_journal_from_environment(self, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        result = CliRunner().invoke(cli, ["runs"], env={"FSM_RUNNER_JOURNAL": str(journal_path)})
        assert run_id[:12] in result.output


class TestShow:
    """`fsm-runner show RUN`."""

    def test_summary_and_timeline(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        result = invoke("show", run_id[:6])
        assert result.exit_code == 0, result.output
        assert run_id in result.output
        assert "published (succeeded)" in result.output
        for event in ("STARTED", "FETCHED", "BUILT", "TESTS_PASSED", "PUBLISHED"):
            assert event in result.output

    def test_json(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        data = json.loads(invoke("show", run_id, "--json").output)
        assert data["run"]["state"] == "testing"
        assert [t["seq"] for t in data["transitions"]] == [0, 1, 2]
        assert data["transitions"][2]["result"]["output"]["archive"] == "release-9.9.9.tar.gz"

    def test_unknown_run(self, invoke, journal_path, tmp_path):
        start_release(journal_path, tmp_path, None)
        assert "no run 'nope'" in one_line_error(invoke("show", "nope"), code=3)

    def test_ambiguous_prefix(self, invoke, journal_path):
        engine = release.make_engine(journal_path)
        engine.start({"version": "1", "workspace": "x"}, run_id="abc1")
        engine.start({"version": "1", "workspace": "x"}, run_id="abc2")
        engine.journal.close()
        assert "ambiguous" in one_line_error(invoke("show", "abc"), code=2)
        assert invoke("show", "abc1").exit_code == 0

    def test_failed_run_shows_its_error(self, invoke, journal_path, tmp_path):
        engine = release.make_engine(journal_path)
        run_id = engine.start({"version": "1"})  # no workspace: the first phase raises
        engine.run(run_id)
        engine.journal.close()
        result = invoke("show", run_id)
        assert "failed (failed)" in result.output
        assert "KeyError" in result.output


class TestResume:
    """`fsm-runner resume RUN --app MODULE:ATTR`."""

    def test_finishes_an_interrupted_run(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        result = invoke("resume", run_id[:8], "--app", APP)
        assert result.exit_code == 0, result.output
        assert "testing --TESTS_PASSED--> publishing" in result.output
        assert "(succeeded) in state 'published'" in result.output
        with SqliteJournal(journal_path) as journal:
            events = [t.event for t in journal.transitions(run_id)]
        assert events == ["STARTED", "FETCHED", "BUILT", "TESTS_PASSED", "PUBLISHED"]

    def test_max_steps(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        result = invoke("resume", run_id, "--app", APP, "--max-steps", "1")
        assert result.exit_code == 0
        assert "active in state 'testing'" in result.output

    def test_ended_run_is_refused(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        assert "has ended" in one_line_error(invoke("resume", run_id, "--app", APP), code=4)

    @pytest.mark.parametrize(
        ("app", "message"),
        [
            ("no_such_module_xyz:engine", "cannot import 'no_such_module_xyz'"),
            ("fsm_runner.examples.release:nothing", "has no attribute"),
            ("fsm_runner.examples.release:SPEC", "is MachineSpec, not an Engine"),
            ("fsm_runner.examples.release:fetch", "takes arguments"),
            ("fsm_runner.examples.release:main", "returns None, not an Engine"),
            ("fsm_runner.examples.release:release", "is a command line, not an Engine"),
            ("./no/such/app.py:make_engine", "does not exist (expected MODULE:ATTR or FILE.py"),
        ],
    )
    def test_bad_app_is_a_usage_error(self, invoke, journal_path, tmp_path, app, message):
        run_id = start_release(journal_path, tmp_path, 1)
        assert message in one_line_error(invoke("resume", run_id, "--app", app), code=2)
        with SqliteJournal(journal_path) as journal:
            assert journal.load(run_id).seq == 1  # nothing ran

    def test_a_factory_that_returns_no_engine(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        (tmp_path / "not_an_app.py").write_text(
            "from fsm_runner import Engine, MemoryJournal\n"
            "from fsm_runner.examples import release\n"
            "def main():\n    return 42\n\ndef broken():\n    raise RuntimeError('no db')\n"
            "class Thing:\n    pass\n"
            "class ReleaseEngine(Engine):\n"
            "    def __init__(self):\n"
            "        super().__init__(release.SPEC, handlers=release.HANDLERS,"
            " journal=MemoryJournal())\n"
        )
        line = one_line_error(invoke("resume", run_id, "--app", "not_an_app:main"), code=2)
        assert line == "Error: not_an_app:main returned int, not an Engine"
        line = one_line_error(invoke("resume", run_id, "--app", "not_an_app:broken"), code=1)
        assert line == "Error: not_an_app:broken failed: RuntimeError: no db"
        line = one_line_error(invoke("resume", run_id, "--app", "not_an_app:Thing"), code=2)
        assert "is the class Thing, not an Engine" in line
        result = invoke("resume", run_id, "--app", "not_an_app:ReleaseEngine")  # a class factory
        assert result.exit_code == 0, result.output

    @pytest.mark.parametrize("form", ["relative", "absolute"])
    def test_app_from_a_file_path(self, invoke, journal_path, tmp_path, form):
        run_id = start_release(journal_path, tmp_path, 2)
        app_dir = tmp_path / "myapp"
        app_dir.mkdir()
        (app_dir / "helpers_xyz.py").write_text(
            "from fsm_runner.examples import release\nHANDLERS = release.HANDLERS\n"
        )
        (app_dir / "jobs.py").write_text(
            "import helpers_xyz\n"  # a module beside it imports, as under `python jobs.py`
            "from fsm_runner import Engine, MemoryJournal\n"
            "from fsm_runner.examples.release import SPEC\n"
            "def make_engine():\n"
            "    return Engine(SPEC, handlers=helpers_xyz.HANDLERS, journal=MemoryJournal())\n"
        )
        path = "./myapp/jobs.py" if form == "relative" else str(app_dir / "jobs.py")
        result = invoke("resume", run_id[:8], "--app", f"{path}:make_engine")
        assert result.exit_code == 0, result.output
        assert "(succeeded) in state 'published'" in result.output

    def test_app_without_colon_is_a_usage_error(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        result = invoke("resume", run_id, "--app", "fsm_runner")
        assert result.exit_code == 2
        assert "MODULE:ATTR" in result.output

    def test_failed_run_exits_1(self, invoke, journal_path, tmp_path):
        engine = release.make_engine(journal_path)
        run_id = engine.start({"version": "1"})  # no workspace: the first phase raises
        engine.journal.close()
        result = invoke("resume", run_id, "--app", APP)
        assert result.exit_code == 1
        assert "(failed) in state 'failed'" in result.output


class TestShowSubphases:
    """`show` lists each sub-phase's attempts, restarts and interruptions."""

    def test_subphase_table(self, invoke, journal_path):
        from fsm_runner import RETURN, Engine, MachineSpec, PhaseStatus, RunEvent, State, Transition

        spec = MachineSpec(
            "nested",
            [
                State("work", children=[State("a", handler="a"), State("b", handler="b")]),
                State("recovering", handler="recover"),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                Transition("work", RunEvent.PHASE_COMPLETED, "done"),
                Transition("work", RunEvent.SERVER_UNREACHABLE, "recovering"),
                Transition("recovering", RunEvent.SERVER_RECOVERED, RETURN),
                Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
            ],
        )
        calls = []

        def b(ctx):
            calls.append(ctx.attempt)
            return PhaseStatus.SERVER_UNREACHABLE if len(calls) == 1 else PhaseStatus.OK

        engine = Engine(
            spec,
            handlers={
                "a": lambda ctx: PhaseStatus.OK,
                "b": b,
                "recover": lambda ctx: "SERVER_RECOVERED",
            },
            journal=SqliteJournal(journal_path),
        )
        run = engine.run(engine.start())
        engine.journal.close()
        assert run.state == "done"
        assert calls == [1, 2]
        data = json.loads(invoke("show", run.run_id, "--json").output)
        visits = {v["subphase"]: v for v in data["subphases"]}
        assert (visits["a"]["attempts"], visits["a"]["restarts"]) == (1, 0)
        assert (visits["b"]["attempts"], visits["b"]["restarts"]) == (2, 1)
        text = invoke("show", run.run_id).output
        assert "SUB-PHASE" in text
        assert "RESTARTS" in text


class TestChildRuns:
    """Runs started by a run are listed under their parent."""

    def test_runs_parent_filter_and_show_children(self, invoke, journal_path, tmp_path):
        parent = start_release(journal_path, tmp_path, 1)
        engine = release.make_engine(journal_path)
        ws = str(tmp_path / "ws")
        kids = [
            engine.start({"version": f"0.{n}", "workspace": ws}, parent_run_id=parent)
            for n in range(2)
        ]
        engine.start({"version": "9", "workspace": ws})  # not a child
        engine.journal.close()
        data = json.loads(invoke("runs", "--json", "--parent", parent[:8]).output)
        assert sorted(r["run_id"] for r in data) == sorted(kids)
        table = invoke("runs").output
        assert table.splitlines()[0].split()[-1] == "PARENT"
        assert sum(parent[:12] in line for line in table.splitlines()) == 3  # itself + 2 kids
        shown = json.loads(invoke("show", parent, "--json").output)
        assert [c["run_id"] for c in shown["children"]] == kids
        assert "CHILD RUN" in invoke("show", parent).output
        assert "no run" in invoke("runs", "--parent", "zzz").output


class TestEffects:
    """`show` lists a run's effects; `runs --effect-in-flight` finds runs with one in flight."""

    def test_effects_listed_and_in_flight_filter(self, invoke, journal_path):
        from fsm_runner import Engine, MachineSpec, State, Transition
        from fsm_runner.records import EffectRecord

        spec = MachineSpec(
            "fx",
            [State("a", handler="a"), State("done", terminal=True)],
            [Transition("a", "NEXT", "done")],
        )

        def a(ctx):
            ctx.effect("fetch", lambda: {"rows": 3}, kind="read")
            return "NEXT"

        journal = SqliteJournal(journal_path)
        engine = Engine(spec, handlers={"a": a}, journal=journal)
        finished = engine.run(engine.start()).run_id
        stuck = engine.start()
        journal.put_effect(
            EffectRecord(stuck, 0, "push", "a", "mutate", params={"args": [], "kwargs": {}}),
            run_seq=0,
        )
        journal.close()
        shown = invoke("show", finished).output
        assert "EFFECT" in shown
        assert "fetch" in shown
        data = json.loads(invoke("show", finished, "--json").output)
        assert [(e["name"], e["status"], e["result"]) for e in data["effects"]] == [
            ("fetch", "done", {"rows": 3})
        ]
        found = json.loads(invoke("runs", "--json", "--effect-in-flight").output)
        assert [r["run_id"] for r in found] == [stuck]
