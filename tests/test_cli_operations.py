"""The operator commands (fork, resume --from-state, watch, prune, diagram, replay, check) and
the CLI's exit codes, through click's CliRunner on real SQLite journals."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import threading

import pytest

from fsm_runner import Engine, MachineSpec, PhaseResult, SqliteJournal, State, Transition
from fsm_runner.cli import EXIT_CONFLICT, EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_USAGE
from fsm_runner.examples import release
from tests.helpers import one_line_error, start_release

APP = "fsm_runner.examples.release:make_engine"
SPEC_PATH = "fsm_runner.examples.release:SPEC"

# Every command that reads a run, with the arguments it needs besides the run id.
RUN_COMMANDS = [
    ("show",),
    ("resume", "--app", APP),
    ("abort", "--reason", "x"),
    ("fork", "--at", "1"),
    ("replay",),
    ("watch",),
    ("diagram", "--run"),
]


pytestmark = pytest.mark.usefixtures("in_tmp_path")


def run_args(command: tuple[str, ...], run_id: str) -> list[str]:
    if command[0] in ("runs", "check"):
        return [command[0]]
    if command[0] == "diagram":
        return ["diagram", "--run", run_id]
    return [command[0], run_id, *command[1:]]


class TestExitCodes:
    """0 ok, 1 failure, 2 usage, 3 not found, 4 conflict — for every command that takes a run."""

    @pytest.mark.parametrize("command", RUN_COMMANDS, ids=lambda c: c[0])
    def test_unknown_run_is_not_found(self, invoke, journal_path, tmp_path, command):
        start_release(journal_path, tmp_path, 1)
        line = one_line_error(invoke(*run_args(command, "nope")), EXIT_NOT_FOUND)
        assert "no run 'nope'" in line

    @pytest.mark.parametrize("command", RUN_COMMANDS, ids=lambda c: c[0])
    def test_missing_journal_is_not_found(self, invoke, journal_path, command):
        line = one_line_error(invoke(*run_args(command, "r1")), EXIT_NOT_FOUND)
        assert "no journal at" in line
        assert not journal_path.exists()

    @pytest.mark.parametrize("command", [*RUN_COMMANDS, ("runs",), ("check",)], ids=lambda c: c[0])
    def test_corrupt_journal_is_one_line(self, invoke, journal_path, command):
        journal_path.write_bytes(b"\x00garbage" * 1000)
        line = one_line_error(invoke(*run_args(command, "r1")), EXIT_FAILURE)
        assert "not a SQLite database" in line
        assert journal_path.read_bytes() == b"\x00garbage" * 1000

    def test_terminal_run_resumed_is_a_conflict(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        line = one_line_error(invoke("resume", run_id, "--app", APP), EXIT_CONFLICT)
        assert "has ended" in line

    def test_run_moved_by_another_writer_is_a_conflict(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        line = one_line_error(
            invoke("fork", run_id, "--at", "0", "--run-id", run_id), EXIT_CONFLICT
        )
        assert "already exists" in line

    def test_bad_import_paths_are_usage_or_failure(self, invoke, journal_path, tmp_path):
        # The path given is wrong: a usage error (2), whatever is wrong with it.
        assert "MODULE:ATTR" in one_line_error(invoke("diagram", "no_colon"), EXIT_USAGE)
        line = one_line_error(invoke("diagram", "no_such_module_xyz:SPEC"), EXIT_USAGE)
        assert "cannot import 'no_such_module_xyz'" in line
        line = one_line_error(invoke("diagram", "fsm_runner.examples.release:NOPE"), EXIT_USAGE)
        assert "has no attribute 'NOPE'" in line
        line = one_line_error(invoke("diagram", "fsm_runner.examples.release:HANDLERS"), EXIT_USAGE)
        assert "not a MachineSpec" in line
        # The module named is there but fails: a failure (1).
        broken = tmp_path / "broken_app_xyz.py"
        broken.write_text("import no_such_dependency_xyz\n")
        line = one_line_error(invoke("diagram", f"{broken}:SPEC"), EXIT_FAILURE)
        assert "importing" in line
        assert "No module named 'no_such_dependency_xyz'" in line

    @pytest.mark.parametrize("kind", ["directory", "text file"])
    @pytest.mark.parametrize("command", [*RUN_COMMANDS, ("runs",), ("check",)], ids=lambda c: c[0])
    def test_a_journal_that_is_no_journal_is_not_found(self, invoke, journal_path, command, kind):
        if kind == "directory":
            journal_path.mkdir()
        else:
            journal_path.write_text("these are my notes\n")
        line = one_line_error(invoke(*run_args(command, "r1")), EXIT_NOT_FOUND)
        assert str(journal_path) in line
        assert ("is a directory" if kind == "directory" else "is a text file") in line
        if kind == "text file":
            assert journal_path.read_text() == "these are my notes\n"

    @pytest.mark.parametrize("command", [*RUN_COMMANDS, ("runs",), ("check",)], ids=lambda c: c[0])
    def test_a_postgres_database_without_a_journal_is_not_found(
        self, postgres_server, postgres_schema, command
    ):
        from click.testing import CliRunner

        from fsm_runner.cli import cli

        url = f"{postgres_server.url}?schema={postgres_schema}"
        for _ in range(2):  # no such schema; then a schema without tables
            result = CliRunner().invoke(cli, ["--journal", url, *run_args(command, "r1")])
            line = one_line_error(result, EXIT_NOT_FOUND)
            assert "holds no fsm_runner journal" in line
            postgres_server.admin.execute(f'CREATE SCHEMA IF NOT EXISTS "{postgres_schema}"')
        tables = postgres_server.admin.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (postgres_schema,)
        ).fetchone()
        assert tables == (0,)  # a read command created nothing

    def test_an_ambiguous_prefix_names_its_matches(self, invoke, journal_path):
        engine = release.make_engine(journal_path)
        for n in range(7):
            engine.start({"version": "1", "workspace": "x"}, run_id=f"abc{n}")
        engine.start({"version": "1", "workspace": "x"}, run_id="abd0")
        engine.journal.close()
        for command in RUN_COMMANDS:
            line = one_line_error(invoke(*run_args(command, "abc")), EXIT_USAGE)
            assert "ambiguous" in line
            assert "abc0, abc1, abc2, abc3, abc4, …" in line
            assert "abc5" not in line
            assert "abd0" not in line
        line = one_line_error(invoke("show", "ab"), EXIT_USAGE)
        assert "it matches abc0, abc1, abc2, abc3, abc4, …;" in line

    def test_no_colour_when_piped(self, invoke, journal_path, tmp_path):
        start_release(journal_path, tmp_path, None)
        for args in (("runs",), ("show", start_release(journal_path, tmp_path, 1))):
            assert "\x1b[" not in invoke(*args).output


class TestRuns:
    """runs --state and --stale."""

    def test_state_filter(self, invoke, journal_path, tmp_path):
        done = start_release(journal_path, tmp_path, None)
        building = start_release(journal_path, tmp_path, 1)
        result = invoke("runs", "--state", "building", "--json")
        assert [r["run_id"] for r in json.loads(result.output)] == [building]
        result = invoke("runs", "--state", "published", "--json")
        assert [r["run_id"] for r in json.loads(result.output)] == [done]

    def test_stale_filter(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        start_release(journal_path, tmp_path, 1)
        conn = sqlite3.connect(journal_path)
        conn.execute(
            "UPDATE run_rows SET lease_owner = 'worker-9', "
            "lease_expires_at = '2020-01-01T00:00:00.000000+00:00' WHERE run_id = ?",
            (run_id,),
        )
        conn.commit()
        conn.close()
        result = invoke("runs", "--stale", "--json")
        assert [r["run_id"] for r in json.loads(result.output)] == [run_id]


class TestFork:
    """fork RUN --at SEQ."""

    def test_fork_then_resume(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        result = invoke("fork", run_id[:8], "--at", "2", "--run-id", "forked")
        assert result.exit_code == 0, result.output
        assert f"forked {run_id}@2 as run forked: state 'testing'" in result.output
        shown = json.loads(invoke("show", "forked", "--json").output)
        assert shown["run"]["forked_from"] == f"{run_id}@2"
        assert [t["seq"] for t in shown["transitions"]] == [0, 1, 2]
        # the release example's phases work in a directory per run: fork at the start to rerun
        assert invoke("fork", run_id, "--at", "0", "--run-id", "again").exit_code == 0
        result = invoke("resume", "again", "--app", APP)
        assert result.exit_code == 0, result.output
        assert "run again has ended (succeeded) in state 'published'" in result.output
        original = json.loads(invoke("show", run_id, "--json").output)
        assert len(original["transitions"]) == 5

    def test_fork_json(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        data = json.loads(invoke("fork", run_id, "--json").output)
        assert data["forked_from"] == f"{run_id}@2"
        assert data["state"] == "testing"

    def test_fork_past_the_end_is_a_usage_error(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        assert "had ended at seq 4" in one_line_error(invoke("fork", run_id), EXIT_USAGE)
        assert "no seq 7" in one_line_error(invoke("fork", run_id, "--at", "7"), EXIT_USAGE)


class TestResumeFromState:
    """resume RUN --from-state STATE."""

    def test_reruns_from_the_earlier_state(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 3)  # in publishing
        result = invoke("resume", run_id, "--app", APP, "--from-state", "building")
        assert result.exit_code == 0, result.output
        assert "publishing --REWOUND--> building" in result.output
        assert "(succeeded) in state 'published'" in result.output

    def test_a_state_never_visited_is_refused(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        line = one_line_error(
            invoke("resume", run_id, "--app", APP, "--from-state", "publishing"), EXIT_USAGE
        )
        assert "never been in 'publishing'" in line

    def test_an_unknown_state_is_a_usage_error(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        line = one_line_error(
            invoke("resume", run_id, "--app", APP, "--from-state", "nosuch"), EXIT_USAGE
        )
        assert line.startswith("Error: --from-state: ")
        assert "no state 'nosuch'" in line
        with SqliteJournal(journal_path) as journal:
            assert journal.load(run_id).seq == 1  # nothing written


class TestWatch:
    """watch RUN."""

    def test_an_ended_run_prints_its_timeline_and_stops(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        result = invoke("watch", run_id)
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert "- --STARTED--> fetching" in lines[0]
        assert "publishing --PUBLISHED--> published" in lines[4]
        assert lines[-1] == f"run {run_id} has ended (succeeded) in state 'published'"

    def test_follows_a_live_run_until_it_ends(self, journal_path):
        """A real `fsm-runner watch` process follows a run another thread is advancing."""
        gate = threading.Event()
        spec = MachineSpec(
            "gated",
            [State("waiting", handler="wait"), State("done", terminal=True)],
            [Transition("waiting", "OPENED", "done")],
        )

        def wait(ctx):
            gate.wait(60)
            return PhaseResult("OPENED", output={"opened": True})

        journal = SqliteJournal(journal_path)
        engine = Engine(spec, handlers={"wait": wait}, journal=journal)
        run_id = engine.start(None)
        worker = threading.Thread(target=engine.run, args=(run_id,))
        worker.start()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "fsm_runner.cli", "--journal", str(journal_path), "watch",
             run_id, "--interval", "0.02", "--json"],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            first = json.loads(watcher.stdout.readline())
            assert first["event"] == "STARTED"
            gate.set()  # only now does the run move on
            rest, _ = watcher.communicate(timeout=60)
        finally:
            gate.set()
            worker.join(60)
            journal.close()
            if watcher.poll() is None:
                watcher.kill()
        assert watcher.returncode == 0
        assert [json.loads(line)["event"] for line in rest.splitlines()] == ["OPENED"]

    def test_a_failed_run_exits_1(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        invoke("abort", run_id, "--reason", "stop")
        result = invoke("watch", run_id)
        assert result.exit_code == EXIT_FAILURE
        assert "USER_ABORTED" in result.output


class TestPrune:
    """prune --older-than DAYS [--dry-run]."""

    def test_dry_run_then_prune(self, invoke, journal_path, tmp_path):
        done = start_release(journal_path, tmp_path, None)
        active = start_release(journal_path, tmp_path, 1)
        result = invoke("prune", "--older-than", "0", "--dry-run")
        assert result.exit_code == 0, result.output
        assert "would prune 1 run (5 transitions)" in result.output
        assert done in result.output
        assert invoke("show", done).exit_code == 0
        result = invoke("prune", "--older-than", "0")
        assert result.output == "pruned 1 run (5 transitions)\n"  # the file is not shrunk
        assert invoke("show", done).exit_code == EXIT_NOT_FOUND
        assert invoke("show", active).exit_code == 0

    def test_vacuum_shrinks_the_file(self, invoke, journal_path, tmp_path):
        for _ in range(20):
            start_release(journal_path, tmp_path, None)
        result = invoke("prune", "--older-than", "0", "--vacuum")
        assert result.exit_code == 0, result.output
        assert "pruned 20 runs (100 transitions)" in result.output
        before, after = (
            int(size.replace(",", ""))
            for size in result.output.split("journal size ")[1].split(" bytes")[0].split(" -> ")
        )
        assert after < before

    def test_vacuum_is_refused_for_a_journal_that_is_not_sqlite(
        self, postgres_server, postgres_journal
    ):
        from click.testing import CliRunner

        from fsm_runner.cli import cli

        url = f"{postgres_server.url}?schema={postgres_journal.schema}"
        args = ["--journal", url, "prune", "--older-than", "0", "--vacuum"]
        line = one_line_error(CliRunner().invoke(cli, args), EXIT_USAGE)
        assert "--vacuum is for a SQLite journal" in line

    def test_nothing_old_enough(self, invoke, journal_path, tmp_path):
        start_release(journal_path, tmp_path, None)
        data = json.loads(invoke("prune", "--older-than", "30", "--json").output)
        assert data["runs"] == 0
        assert data["run_ids"] == []


class TestDiagram:
    """diagram (SPEC | --run RUN) [--format] [-o]."""

    def test_spec_as_mermaid_on_stdout(self, invoke):
        result = invoke("diagram", SPEC_PATH)
        assert result.exit_code == 0, result.output
        assert "stateDiagram-v2" in result.output
        assert "title: release" in result.output

    def test_engine_factory_as_dot_to_file(self, invoke, tmp_path):
        out = tmp_path / "release.dot"
        result = invoke("diagram", APP, "--format", "dot", "-o", str(out))
        assert result.exit_code == 0, result.output
        assert out.read_text().startswith("digraph")

    def test_run_path_needs_no_import(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        result = invoke("diagram", "--run", run_id)
        assert result.exit_code == 0, result.output
        assert "classDef current" in result.output

    def test_spec_and_run_are_exclusive(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 2)
        assert "either" in one_line_error(invoke("diagram"), EXIT_USAGE)
        assert "either" in one_line_error(invoke("diagram", SPEC_PATH, "--run", run_id), EXIT_USAGE)

    @pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
    @pytest.mark.parametrize(("fmt", "magic"), [("svg", b"<svg"), ("png", b"\x89PNG")])
    def test_images_through_graphviz(self, invoke, tmp_path, fmt, magic):
        out = tmp_path / f"release.{fmt}"
        result = invoke("diagram", SPEC_PATH, "--format", fmt, "-o", str(out))
        assert result.exit_code == 0, result.output
        assert magic in out.read_bytes()[:400]

    def test_images_without_graphviz_say_how_to_install_it(self, invoke, tmp_path, monkeypatch):
        monkeypatch.setenv("PATH", str(tmp_path))
        line = one_line_error(invoke("diagram", SPEC_PATH, "--format", "svg"), EXIT_FAILURE)
        assert "install" in line
        assert "graphviz" in line.lower()


class TestExport:
    """export writes the effects ledger too."""

    def test_effects_json(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        out = tmp_path / "out"
        assert invoke("export", run_id, str(out)).exit_code == 0
        assert json.loads((out / "effects.json").read_text()) == []
        assert len(json.loads((out / "run.json").read_text())["transitions"]) == 5


def tamper(journal_path, sql: str, *params) -> None:
    conn = sqlite3.connect(journal_path)
    (fence,) = conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'transitions_fence'"
    ).fetchone()
    conn.execute("DROP TRIGGER transitions_fence")  # write what the test likes
    conn.execute(sql, params)
    conn.execute(fence)  # and put it back: check reports a schema that differs
    conn.commit()
    conn.close()


# The release machine with its testing phase renamed: old runs no longer replay through it.
RENAMED = MachineSpec(
    "release",
    [
        State(s.name if s.name != "testing" else "checking", handler=s.handler,
              terminal=s.terminal, outcome=s.outcome)
        for s in release.SPEC.states
    ],
    [
        Transition(
            tuple("checking" if x == "testing" else x for x in t.source), t.event,
            "checking" if t.dest == "testing" else t.dest,
        )
        for t in release.SPEC.transitions
    ],
)  # fmt: skip


class TestReplay:
    """replay RUN [--to SEQ] [--spec MODULE:ATTR]."""

    def test_a_sound_run_matches(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        result = invoke("replay", run_id)
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0].split()[:3] == ["SEQ", "AT", "(UTC)"]
        assert "PUBLISHED" in lines[5]
        assert "succeeded" in lines[5]
        assert f"replay of run {run_id} matches the journal: 5 transitions" in lines[-1]

    def test_to_seq(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        result = invoke("replay", run_id, "--to", "2")
        assert result.exit_code == 0, result.output
        assert f"run {run_id} at seq 2: state 'testing' (active)" in result.output
        data = json.loads(invoke("replay", run_id, "--to", "1", "--json").output)
        assert [s["seq"] for s in data["steps"]] == [0, 1]
        assert data["run"]["state"] == "building"
        assert "seqs 0..4" in one_line_error(invoke("replay", run_id, "--to", "9"), EXIT_USAGE)

    def test_a_run_a_writer_advances_meanwhile_still_matches(
        self, invoke, journal_path, monkeypatch
    ):
        # Found under load (tests/test_prune_attacks.py): replay read the row, then the
        # transitions; a step committed between the two was in the timeline, not in the row,
        # and a sound live run was reported as a mismatch.
        spec = MachineSpec(
            "live",
            [State(n, handler="next") for n in "abc"] + [State("done", terminal=True)],
            [Transition(a, "NEXT", b) for a, b in zip("abc", ["b", "c", "done"], strict=True)],
        )
        writer = SqliteJournal(journal_path)
        engine = Engine(spec, handlers={"next": lambda ctx: "NEXT"}, journal=writer)
        run_id = engine.run(engine.start(), max_steps=1).run_id
        read = SqliteJournal.transitions
        steps = []

        def transitions_after_a_step(journal, *args, **kwargs):
            if not steps and journal is not writer:  # the CLI's first read: a step lands first
                steps.append(engine.run(run_id, max_steps=1).seq)
            return read(journal, *args, **kwargs)

        monkeypatch.setattr(SqliteJournal, "transitions", transitions_after_a_step)
        result = invoke("replay", run_id)
        assert steps == [2]
        assert result.exit_code == 0, result.output
        assert f"replay of run {run_id} matches the journal: 3 transitions" in result.output
        engine.close()
        writer.close()

    def test_a_tampered_run_names_the_first_mismatch(self, invoke, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, None)
        tamper(
            journal_path,
            "UPDATE transitions SET to_state = 'publishing' WHERE run_id = ? AND seq = 2",
            run_id,
        )
        line = one_line_error(invoke("replay", run_id), EXIT_FAILURE)
        assert f"run {run_id} at seq 2" in line

    def test_a_changed_spec_names_where_it_stops_fitting(
        self, invoke, journal_path, tmp_path, monkeypatch
    ):
        run_id = start_release(journal_path, tmp_path, None)
        monkeypatch.syspath_prepend(str(tmp_path))
        (tmp_path / "renamed_release.py").write_text(
            "from tests.test_cli_operations import RENAMED as SPEC\n"
        )
        line = one_line_error(
            invoke("replay", run_id, "--spec", "renamed_release:SPEC"), EXIT_FAILURE
        )
        assert "at seq 2" in line
        assert "testing" in line
        assert invoke("replay", run_id, "--spec", SPEC_PATH).exit_code == 0


class TestCheck:
    """check: the medium and every run."""

    def test_a_sound_journal(self, invoke, journal_path, tmp_path):
        start_release(journal_path, tmp_path, None)
        start_release(journal_path, tmp_path, 2)
        result = invoke("check")
        assert result.exit_code == 0, result.output
        assert "2 runs checked, no problems" in result.output

    def test_problems_are_listed_one_per_line(self, invoke, journal_path, tmp_path):
        good = start_release(journal_path, tmp_path, None)
        gap = start_release(journal_path, tmp_path, None)
        moved = start_release(journal_path, tmp_path, 2)
        tamper(journal_path, "DELETE FROM transitions WHERE run_id = ? AND seq = 2", gap)
        tamper(journal_path, "UPDATE run_rows SET attempt = 7 WHERE run_id = ?", moved)
        result = invoke("check")
        assert result.exit_code == EXIT_FAILURE
        lines = result.output.splitlines()
        assert lines[0].endswith("3 problems in 3 runs")  # the gap breaks its run's chain too
        problems = "\n".join(lines[1:])
        assert gap in problems
        assert moved in problems
        assert good not in problems
        data = json.loads(invoke("check", "--json").output)
        assert len(data["problems"]) == 3
        assert data["runs"] == 3


class TestDemo:
    """`demo` ends with commands that work as printed."""

    @pytest.mark.parametrize("journal_option", [[], ["--journal", "my journal.db"]])
    def test_last_line_is_a_complete_export_command(self, tmp_path, monkeypatch, journal_option):
        import shlex
        import tempfile

        from click.testing import CliRunner

        from fsm_runner.cli import cli

        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the demo project goes here
        monkeypatch.setenv("GIT_TERMINAL_PROMPT", "0")
        monkeypatch.delenv("FSM_RUNNER_JOURNAL", raising=False)
        runner = CliRunner()
        result = runner.invoke(cli, [*journal_option, "demo"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        last = result.output.splitlines()[-1]
        show, export = (part.strip() for part in last.split("export it with:"))
        assert show.startswith("see it with: fsm-runner ")
        for command in (show.removeprefix("see it with: "), export):
            argv = shlex.split(command)
            assert argv[0] == "fsm-runner"
            done = runner.invoke(cli, argv[1:], catch_exceptions=False)
            assert done.exit_code == 0, (command, done.output)
        directory = tmp_path / shlex.split(export)[-1]
        assert (directory / "run.json").exists()
        assert (directory / "agent-2.json").exists()
