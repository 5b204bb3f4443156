"""A seeded fuzzer of the whole ``fsm-runner`` CLI: hostile arguments, journals and apps.

Every command and subcommand is invoked (in-process through click's CliRunner, a few through a
real ``fsm-runner`` process) with wrong, partial, ambiguous, empty and odd run ids (unicode,
NUL, newlines, SQL ``LIKE`` and quote characters, very long), numbers out of range, missing and
extra arguments, unknown options, hostile journal locations (missing, a directory, a foreign or
newer or read-only or empty file, malformed and unreachable PostgreSQL URLs) and hostile
``--app`` values, against a real journal holding ended, active, aborted and leased runs.

For every invocation: no traceback, an exit code the CLI documents, an ``Error:`` as one line
(click's own ``Usage:``/``Try`` lines aside), and the journal unchanged when a command refused.
The cases are drawn from a fixed seed, so a failure reproduces.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_runner import SqliteJournal
from fsm_runner.cli import (
    EXIT_CONFLICT,
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    cli,
)
from tests.helpers import start_release

pytestmark = pytest.mark.usefixtures("in_tmp_path")

APP = "fsm_runner.examples.release:make_engine"
SPEC = "fsm_runner.examples.release:SPEC"
DOCUMENTED = {EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONFLICT}
SEED = 20261125

# Run ids no run has, or that several runs share, or that try to escape a query or a line.
HOSTILE_IDS = [
    "",
    " ",
    "g",
    "%",
    "_",
    "%%",
    "_" * 12,
    "'",
    "'; DROP TABLE runs; --",
    '"',
    ";",
    "\\",
    "*",
    "a\nb",
    "\x00",
    "a\x00b",
    "\r\n",
    "a\tb",
    "é",
    "\u202eabc",
    "🙂",
    "\ud800",
    "\udcff",  # the byte 0xff in argv, as Python decodes it (surrogateescape)
    "x" * 5000,
    "../../etc/passwd",
    "-",
    "--",
    "-x",
    "0x10",
]
# Numbers an option may be given: out of range, not a number, absurdly large.
HOSTILE_NUMBERS = [
    "-1",
    "0",
    "1",
    str(2**70),
    str(-(2**70)),
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e309",
    "1.5",
    "",
    " ",
    "x",
    "1_0",
    "٣",
]
HOSTILE_APPS = [
    "",
    ":",
    "no_colon",
    "no_such_module_xyz:make_engine",
    "fsm_runner.examples.release:NOPE",
    "fsm_runner.examples.release:SPEC",
    "fsm_runner.examples.release:HANDLERS",
    "os:getcwd",
    "os:sep",
    "fsm_runner.examples.release:",
    ":make_engine",
    "missing.py:make_engine",
    "/:x",
    "a:b:c",
    "fsm_runner.examples..release:SPEC",
    "bad_syntax:make_engine",
    "raises_on_import:make_engine",
    "bad_syntax.py:make_engine",
    "raises_on_import.py:make_engine",
    "not_engine:make_engine",
    "factory_raises:make_engine",
    "\x00:x",
]


@pytest.fixture
def world(tmp_path, journal_path):
    """A journal with ended, active, aborted and leased runs; hostile files and apps beside."""
    succeeded = start_release(journal_path, tmp_path, None)
    active = start_release(journal_path, tmp_path, 1)
    aborted = start_release(journal_path, tmp_path, 1)
    leased = start_release(journal_path, tmp_path, 1)
    journal = SqliteJournal(journal_path)
    journal.claim(leased, "someone-alive", ttl=3600)
    journal.close()
    CliRunner().invoke(cli, ["--journal", str(journal_path), "abort", aborted, "--reason", "x"])
    (tmp_path / "bad_syntax.py").write_text("def make_engine(:\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    (tmp_path / "not_engine.py").write_text("def make_engine():\n    return 42\n")
    (tmp_path / "factory_raises.py").write_text(
        "def make_engine():\n    raise ValueError('no engine today')\n"
    )
    pristine = tmp_path / "pristine.db"
    shutil.copyfile(journal_path, pristine)
    return {
        "succeeded": succeeded,
        "active": active,
        "aborted": aborted,
        "leased": leased,
        "pristine": pristine,
    }


def dump(path: Path) -> str:
    """The journal's whole content, as SQL."""
    if not path.exists():
        return "<missing>"
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return "\n".join(connection.iterdump())
    finally:
        connection.close()


def assert_well_behaved(result: Result, argv: list[str]) -> None:
    """No traceback, a documented exit code, and an ``Error:`` that is one line."""
    where = f"argv={argv!r}\nstdout={result.stdout!r}\nstderr={result.stderr!r}"
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), where + f"\n{result.exc_info!r}"
    assert "Traceback (most recent call last)" not in result.output, where
    assert result.exit_code in DOCUMENTED, where
    assert_one_error_line(result.stderr, result.exit_code, where)


def assert_one_error_line(stderr: str, exit_code: int, where: str) -> None:
    """An ``Error:`` is one line; click's usage errors add only its ``Usage:``/``Try`` lines."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    if exit_code in (EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONFLICT):
        assert len(errors) == 1, where
    if errors:
        others = [line for line in lines if not line.startswith("Error:")]
        assert len(errors) == 1, where
        assert all(line.startswith(("Usage:", "Try '")) for line in others), where


class Fuzzer:
    """Invokes the CLI on the world's journal, checking each result and the journal."""

    def __init__(self, journal_path: Path, world: dict) -> None:
        self.journal_path = journal_path
        self.world = world
        self.runner = CliRunner()
        self.count = 0

    def __call__(self, *args: str, journal: str | None = None) -> Result:
        argv = ["--journal", journal or str(self.journal_path), *args]
        before = dump(self.journal_path)
        result = self.runner.invoke(cli, argv)
        self.count += 1
        assert_well_behaved(result, argv)
        after = dump(self.journal_path)
        if result.exit_code not in (EXIT_OK, EXIT_FAILURE):
            assert after == before, f"refused {argv!r} changed the journal"
        if after != before:
            shutil.copyfile(self.world["pristine"], self.journal_path)
        return result


@pytest.fixture
def fuzz(journal_path, world):
    return Fuzzer(journal_path, world)


def run_ids(world: dict, rng: random.Random) -> str:
    """A run id: a real one, a prefix of one, or a hostile one."""
    real = world[rng.choice(["succeeded", "active", "aborted", "leased"])]
    return rng.choice(
        [real, real[: rng.randint(1, 8)], real.upper(), real + "0", rng.choice(HOSTILE_IDS)]
    )


def numbers(rng: random.Random) -> str:
    return rng.choice(HOSTILE_NUMBERS)


def command_lines(world: dict, tmp_path: Path, rng: random.Random) -> list[list[str]]:
    """Command lines for every command, arguments drawn from the pools (ended runs for watch)."""

    def rid() -> str:
        return run_ids(world, rng)

    def ended() -> str:
        run = world[rng.choice(["succeeded", "aborted"])]
        return rng.choice([run, run[:6], rng.choice(HOSTILE_IDS)])

    def app() -> str:
        return rng.choice([APP, *HOSTILE_APPS])

    makers = [
        lambda: ["runs", "--limit", numbers(rng)],
        lambda: ["runs", "--parent", rid(), "--json"],
        lambda: ["runs", "--state", rng.choice(HOSTILE_IDS), "--machine", rng.choice(HOSTILE_IDS)],
        lambda: ["runs", "--status", rng.choice(["active", "ACTIVE", "", "%", "nope"])],
        lambda: ["show", rid()],
        lambda: ["show", rid(), "--json"],
        lambda: ["show"],
        lambda: ["show", rid(), rid()],
        lambda: ["resume", rid(), "--app", app()],
        lambda: ["resume", rid(), "--app", APP, "--max-steps", numbers(rng)],
        lambda: ["resume", rid(), "--app", APP, "--from-state", rng.choice(HOSTILE_IDS)],
        lambda: ["recover", "--app", app(), "--limit", numbers(rng)],
        lambda: ["worker", "--app", app(), "--exit-when-idle", "--max-runs", numbers(rng)],
        lambda: ["worker", "--app", APP, "--exit-when-idle", "--idle-wait", numbers(rng)],
        lambda: ["abort", rid(), "--reason", rng.choice(["x", "", "\x00", "é\n" * 50])],
        lambda: ["abort", rid()],
        lambda: ["abort", rid(), "--reason", "x", "--app", app()],
        lambda: ["export", rid(), str(tmp_path / "out")],
        lambda: ["export", rid(), rng.choice(["", "/proc/nope", str(tmp_path / "bad_syntax.py")])],
        lambda: ["export", rid()],
        lambda: ["fork", rid(), "--at", numbers(rng)],
        lambda: ["fork", rid(), "--run-id", rng.choice([*HOSTILE_IDS, world["active"]])],
        lambda: ["diagram", "--run", rid(), "--format", rng.choice(["mermaid", "dot", "gif"])],
        lambda: ["diagram", app()],
        lambda: ["diagram", SPEC, "-o", rng.choice(["", str(tmp_path), "/proc/nope/x.mmd"])],
        lambda: ["diagram"],
        lambda: ["watch", ended(), "--interval", numbers(rng)],
        lambda: ["replay", rid(), "--to", numbers(rng)],
        lambda: ["replay", rid(), "--spec", app()],
        lambda: ["check", "--json"],
        lambda: ["prune", "--older-than", numbers(rng), "--dry-run"],
        lambda: ["prune", "--older-than", numbers(rng)],
        lambda: ["prune"],
        lambda: ["agent-loop", "--task", "t", "--max-iterations", numbers(rng)],
        lambda: ["agent-loop", "--task", "t", "--timeout", numbers(rng), "--agent", "true"],
        lambda: ["agent-loop", "--workspace", str(tmp_path / "nope"), "--task", "t"],
        lambda: ["agent-loop", "--task", "t", "--verify", rng.choice(["", "=", "L9=x", "noeq"])],
        lambda: ["ui", "--port", rng.choice(["-1", "65536", str(2**70), "nan", "x"])],
        lambda: ["ui", "--host", rng.choice(["0.0.0.0", "::", "example.com"]), "--port", "0"],
        lambda: ["nope"],
        lambda: ["show", "--no-such-option", rid()],
        lambda: [
            "signal",
            rid(),
            rng.choice(["APPROVE", "", "\x00", "é\n" * 50, "STARTED", "BUILT"]),
            "--data",
            rng.choice(["{}", "{", "NaN", '"x"', "1e999", "-Infinity", "\ud800", "[" * 5000]),
        ],
        lambda: ["signal", rid(), "BUILT", "--id", rng.choice(HOSTILE_IDS)],
        lambda: ["signal", rid()],
        lambda: [
            "runs",
            "--waiting",
            "--machine",
            rng.choice(HOSTILE_IDS),
            "--limit",
            numbers(rng),
        ],
        lambda: ["runs", "--waiting", "--state", rng.choice(HOSTILE_IDS), "--json"],
    ]
    lines = []
    for make in makers:
        for _ in range(3):
            argv = make()
            if rng.random() < 0.1:
                argv.append(rng.choice(["extra", "--bogus", "-z"]))
            lines.append(argv)
    return lines


class TestFoundByFuzzing:
    """Cases the fuzzer found giving a traceback; each a focused regression test."""

    @pytest.mark.parametrize("days", ["nan", "inf", "1e309", "1e7"])
    def test_prune_refuses_days_that_are_no_date(self, fuzz, days):
        result = fuzz("prune", "--older-than", days, "--dry-run")
        assert result.exit_code == EXIT_USAGE
        assert "--older-than" in result.stderr

    @pytest.mark.parametrize("interval", ["nan", "inf"])
    def test_watch_refuses_an_interval_that_is_not_finite(self, fuzz, world, interval):
        result = fuzz("watch", world["active"], "--interval", interval)
        assert result.exit_code == EXIT_USAGE
        assert "--interval" in result.stderr

    @pytest.mark.parametrize(
        "argv",
        [
            ["show", "\udcff"],
            ["runs", "--parent", "\udcff"],
            ["runs", "--state", "\udcff"],
            ["resume", "\udcff", "--app", APP],
            ["replay", "\udcff"],
        ],
    )
    def test_undecodable_bytes_in_an_argument_are_one_line(self, fuzz, argv):
        result = fuzz(*argv)
        assert result.exit_code == EXIT_USAGE
        assert "UTF-8" in result.stderr

    def test_a_lone_surrogate_another_writer_left_is_printed_escaped(self, journal_path, world):
        # Not the user's argument: text in the journal (a JSON escape \ud800) that UTF-8
        # cannot carry. Printed escaped, as the run inspector shows it: not refused as if the
        # user's argument were not UTF-8 (exit 2), nor a traceback.
        conn = sqlite3.connect(journal_path)
        conn.execute(
            "UPDATE run_rows SET input = ? WHERE run_id = ?",
            ('{"x": "\\ud800"}', world["succeeded"]),
        )
        conn.commit()
        conn.close()
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_path), "show", world["succeeded"]]
        )
        assert result.exit_code == 0, result.output
        assert '{"x": "\\ud800"}' in result.output
        assert "Traceback" not in result.output

    @pytest.mark.parametrize(
        "argv", [["export", "g", "\x00"], ["diagram", SPEC, "-o", "a\x00b"], ["show", "\x00"]]
    )
    def test_a_nul_in_an_argument_is_one_line(self, fuzz, argv):
        result = fuzz(*argv)
        assert result.exit_code == EXIT_USAGE
        assert "NUL" in result.stderr

    @pytest.mark.parametrize(
        "argv",
        [
            ["recover", "--app", APP, "--limit", "HUGE"],
            ["runs", "--limit", "HUGE"],
            ["fork", "SUCCEEDED", "--at", "HUGE"],
            ["replay", "SUCCEEDED", "--to", "HUGE"],
            ["resume", "ACTIVE", "--app", APP, "--max-steps", "HUGE"],
            ["worker", "--app", APP, "--exit-when-idle", "--max-runs", "HUGE"],
        ],
    )
    def test_an_integer_beyond_64_bits_is_one_line(self, fuzz, world, argv):
        names = {"HUGE": str(2**63), "SUCCEEDED": world["succeeded"], "ACTIVE": world["active"]}
        result = fuzz(*[names.get(arg, arg) for arg in argv])
        assert result.exit_code == EXIT_USAGE
        assert "too large" in result.stderr

    @pytest.mark.parametrize(
        "argv", [["show", "g", "a\nb"], ["runs", "x\ny"], ["no\nsuch-command"], ["show", "--a\nb"]]
    )
    def test_a_usage_error_echoing_a_newline_is_one_line(self, fuzz, argv):
        result = fuzz(*argv)
        assert result.exit_code == EXIT_USAGE


class TestFuzz:
    """Seeded hostile command lines against a journal with runs of every kind."""

    def test_every_command_on_hostile_arguments(self, fuzz, world, tmp_path):
        rng = random.Random(SEED)
        for argv in command_lines(world, tmp_path, rng):
            fuzz(*argv)
        assert fuzz.count > 100

    def test_every_run_command_on_every_hostile_id(self, fuzz, world):
        for run_id in HOSTILE_IDS:
            for argv in (
                ["show", run_id],
                ["resume", run_id, "--app", APP],
                ["abort", run_id, "--reason", "x"],
                ["fork", run_id],
                ["replay", run_id],
                *([["watch", run_id]] if not live(world, run_id) else []),
                ["diagram", "--run", run_id],
                ["export", run_id, "out"],
                ["runs", "--parent", run_id],
                ["signal", run_id, "BUILT"],
            ):
                result = fuzz(*argv)
                assert result.exit_code != EXIT_OK, argv

    def test_every_hostile_app(self, fuzz, world):
        for app in HOSTILE_APPS:
            for argv in (
                ["resume", world["active"], "--app", app],
                ["recover", "--app", app],
                ["worker", "--app", app, "--exit-when-idle"],
                *([["abort", world["active"], "--reason", "x", "--app", app]] if app else []),
                ["replay", world["succeeded"], "--spec", app],
                ["diagram", app],
            ):
                result = fuzz(*argv)
                valid = app == SPEC and argv[0] in ("replay", "diagram")
                assert result.exit_code != EXIT_OK or valid, argv

    def test_refusals_of_runs_that_cannot_move(self, fuzz, world):
        for kind in ("succeeded", "aborted"):
            for argv in (
                ["resume", world[kind], "--app", APP],
                ["abort", world[kind], "--reason", "x"],
            ):
                assert fuzz(*argv).exit_code == EXIT_CONFLICT, argv
        result = fuzz("resume", world["leased"], "--app", APP)
        assert result.exit_code == EXIT_CONFLICT


def live(world: dict, run_id: str) -> bool:
    """Whether ``run_id`` names an active run (``watch`` would follow it until it ends)."""
    return any(world[kind].startswith(run_id) for kind in ("active", "leased")) and bool(run_id)


def hostile_journals(tmp_path: Path, world: dict) -> list[str]:
    """Journal locations that are not a usable journal of this version."""
    (tmp_path / "empty.db").write_bytes(b"")
    (tmp_path / "text.db").write_text("hello\n")
    (tmp_path / "adir").mkdir()
    foreign = sqlite3.connect(tmp_path / "foreign.db")
    foreign.execute("create table runs (x)")
    foreign.commit()
    foreign.close()
    newer = tmp_path / "newer.db"
    shutil.copyfile(world["pristine"], newer)
    connection = sqlite3.connect(newer)
    connection.execute("update meta set value = '999' where key = 'schema_version'")
    connection.commit()
    connection.close()
    readonly = tmp_path / "readonly.db"
    shutil.copyfile(world["pristine"], readonly)
    readonly.chmod(0o444)
    return [
        "",
        str(tmp_path / "missing.db"),
        str(tmp_path / "missing-dir" / "j.db"),
        str(tmp_path / "empty.db"),
        str(tmp_path / "text.db"),
        str(tmp_path / "adir"),
        str(tmp_path / "foreign.db"),
        str(newer),
        str(readonly),
        str(tmp_path / "a\nb.db"),
        "\x00",
        "postgresql://",
        "postgresql://user@127.0.0.1:1/db",
        "postgresql://user@127.0.0.1:1/db?schema=x'y",
        "postgresql://user@[::1/db",
        "postgresql://user@127.0.0.1:99999/db",
        "postgres://%zz@host/db",
        "mysql://x@y/z",
    ]


# Command lines with one slot: TEXT is any text, NUMBER any number (or text) as an argument.
SLOTTED = [
    ["show", "TEXT"],
    ["replay", "TEXT", "--to", "NUMBER"],
    ["fork", "TEXT", "--at", "NUMBER"],
    ["abort", "TEXT", "--reason", "TEXT"],
    ["resume", "TEXT", "--app", APP, "--max-steps", "NUMBER"],
    ["watch", "TEXT", "--interval", "NUMBER"],
    ["diagram", "--run", "TEXT"],
    ["export", "TEXT", "TEXT"],
    ["runs", "--parent", "TEXT", "--state", "TEXT", "--limit", "NUMBER"],
    ["prune", "--older-than", "NUMBER", "--dry-run"],
    ["recover", "--app", APP, "--limit", "NUMBER"],
    ["worker", "--app", APP, "--exit-when-idle", "--idle-wait", "NUMBER"],
    ["signal", "TEXT", "TEXT", "--data", "TEXT", "--id", "TEXT"],
    ["runs", "--waiting", "--machine", "TEXT", "--state", "TEXT", "--limit", "NUMBER"],
]
any_number = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.floats().map(str),
    st.text(max_size=8),
)


class TestHypothesis:
    """Any text and any number in every slot, drawn by Hypothesis (derandomized: a fixed seed)."""

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data(), line=st.sampled_from(SLOTTED))
    def test_any_text_and_number_in_every_slot(self, fuzz, world, data, line):
        argv = [
            data.draw(st.text(st.characters(exclude_categories=()), max_size=40))
            if arg == "TEXT"
            else data.draw(any_number)
            if arg == "NUMBER"
            else arg
            for arg in line
        ]
        if argv[0] == "watch" and (live(world, argv[1]) or argv[1].startswith("-")):
            argv[0] = "show"  # watch follows a live run until it ends
            del argv[2:]
        fuzz(*argv)


class TestHostileJournals:
    """Every command, pointed at something that is not a usable journal."""

    def test_every_command_on_every_hostile_journal(self, fuzz, world, tmp_path):
        run = world["active"][:8]
        for journal in hostile_journals(tmp_path, world):
            for argv in (
                ["runs"],
                ["runs", "--waiting"],
                ["signal", run, "BUILT"],
                ["show", run],
                ["resume", run, "--app", APP],
                ["abort", run, "--reason", "x"],
                ["fork", run],
                ["replay", run],
                ["watch", world["succeeded"][:8]],
                ["export", run, str(tmp_path / "out")],
                ["check"],
                ["prune", "--older-than", "0"],
                ["recover", "--app", APP],
                ["worker", "--app", APP, "--exit-when-idle"],
                ["diagram", "--run", run],
                ["demo", "extra"],
                *(
                    [["demo"]]
                    if journal.endswith(("adir", "text.db", "foreign.db", "newer.db"))
                    else []
                ),
            ):
                result = fuzz(*argv, journal=journal)
                if journal and not journal.endswith("readonly.db"):  # "" is ./fsm-runner.db
                    assert result.exit_code != EXIT_OK or argv[0] in ("runs", "check"), (
                        journal,
                        argv,
                    )
            assert not (tmp_path / "missing.db").exists()


class TestRealProcess:
    """A few cases through the installed ``fsm-runner``: real stderr, real exit codes."""

    def test_hostile_cases_in_a_real_process(self, world, journal_path, tmp_path):
        exe = shutil.which("fsm-runner", path=str(Path(sys.executable).parent))
        assert exe
        cases = [
            ["show", "%"],
            ["show", "\u202e🙂" * 100],
            ["fork", world["succeeded"], "--at", str(2**70)],
            ["prune", "--older-than", "nan"],
            ["resume", world["active"], "--app", "raises_on_import:make_engine"],
            ["resume", world["leased"], "--app", APP],
            ["--journal", "postgresql://user@127.0.0.1:1/db", "runs"],
            ["--journal", str(tmp_path / "text.db"), "runs"],
            [b"show", b"\xff\xfe"],  # bytes that are not UTF-8, as a shell passes them
            [b"runs", b"--parent", b"ab\xff"],
        ]
        (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom')\n")
        (tmp_path / "text.db").write_text("hello\n")
        before = dump(journal_path)
        env = {**os.environ, "FSM_RUNNER_JOURNAL": str(journal_path), "NO_COLOR": "1"}
        for argv in cases:
            done = subprocess.run(
                [exe.encode() if isinstance(argv[0], bytes) else exe, *argv],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp_path,
                check=False,
            )
            where = f"argv={argv!r}\nstderr={done.stderr!r}"
            assert "Traceback" not in done.stderr, where
            assert done.returncode in DOCUMENTED - {EXIT_OK}, where
            assert_one_error_line(done.stderr, done.returncode, where)
            assert done.stderr.strip(), where
        assert dump(journal_path) == before
