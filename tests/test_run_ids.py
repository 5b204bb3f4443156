"""The rule of run ids (issue 30): checked at every entry point, ids from before it shown escaped.

A run id is a ``str`` of 1 to 200 characters, each printable and not whitespace, with no ``/``
or ``\\``; not ``.`` or ``..``; not starting with ``-``. ``Engine.start``, ``start_many``,
``fork`` and every journal's write of a new run refuse any other (``InvalidRunIdError``,
nothing written); an id already in a journal that breaks it (written here by raw SQL,
``rename_run``) stays readable and is printed escaped, on one line; the release example never
writes outside its workspace for it.
"""

from __future__ import annotations

import contextlib
import html
import json
import sqlite3
from urllib.parse import quote

import attrs
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

import fsm_runner.engine
from fsm_runner import (
    Engine,
    InvalidRunIdError,
    MemoryJournal,
    SignalRecord,
    SqliteJournal,
    check_run_id,
)
from fsm_runner.cli import cli
from fsm_runner.command_line import EXIT_USAGE
from fsm_runner.run_ids import MAX_LENGTH, _problem, shown
from tests.helpers import NEXT, linear_spec, one_line_error, rename_run, start_release
from tests.ui_helpers import Server

SPEC = linear_spec("a", "b")
APP = "fsm_runner.examples.release:make_engine"

#: One id breaking each part of the rule, and how the error says it.
BAD_IDS = {
    "empty": ("", "it is empty"),
    "too-long": ("x" * (MAX_LENGTH + 1), "201 characters, more than 200"),
    "newline": ("bad\nid", r"'\n' (U+000A, whitespace)"),
    "space": ("a b", "' ' (U+0020, whitespace)"),
    "line-separator": ("a\u2028b", r"'\u2028' (U+2028, whitespace)"),
    "control": ("a\x1bb", r"'\x1b' (U+001B, not printable)"),
    "nul": ("a\x00b", r"'\x00' (U+0000, not printable)"),
    "surrogate": ("a\ud800", r"'\ud800' (U+D800, not printable)"),
    "slash": ("../../escaped", "it holds '/'"),
    "backslash": ("a\\b", r"it holds '\\'"),
    "dot": (".", "it is '.'"),
    "dot-dot": ("..", "it is '..'"),
    "dash": ("-rf", "it starts with '-'"),
    "not-str": (42, "it is not a str but int"),
}
#: A few of them, for the entry points run on every journal.
SOME_BAD = ["", "bad\nid", "../../escaped", "..", "-x", "a" * (MAX_LENGTH + 1)]
GOOD_IDS = ["a", "x" * MAX_LENGTH, "0123456789abcdef" * 2, "...", ".a", "a-b_c.d@e:f", "é→ü", "%2f"]


def engine_on(journal) -> Engine:
    return Engine(SPEC, handlers={"a": lambda _ctx: NEXT, "b": lambda _ctx: NEXT}, journal=journal)


def new_run(run_id: str):
    """A new run's records (row, seq 0, iterations) and spec, made by a scratch journal."""
    scratch = MemoryJournal()
    engine_on(scratch).start({"n": 1}, run_id="scratch")
    run = scratch.load("scratch")
    first = scratch.transitions("scratch")[0]
    opened = [attrs.evolve(i, run_id=run_id) for i in scratch.iterations("scratch")]
    new = (attrs.evolve(run, run_id=run_id), attrs.evolve(first, run_id=run_id), opened)
    return new, scratch.spec_json(run.spec_hash)


class TestTheRule:
    """check_run_id accepts exactly the ids of the rule, and says what is wrong."""

    @pytest.mark.parametrize("run_id", GOOD_IDS)
    def test_good_ids_pass_unchanged(self, run_id):
        assert check_run_id(run_id) is run_id
        assert shown(run_id) == run_id

    @pytest.mark.parametrize(("run_id", "reason"), BAD_IDS.values(), ids=BAD_IDS.keys())
    def test_each_part_of_the_rule_refuses(self, run_id, reason):
        with pytest.raises(InvalidRunIdError) as info:
            check_run_id(run_id)
        assert info.value.run_id == run_id
        assert reason in info.value.reason
        assert isinstance(info.value, ValueError)
        message = str(info.value)
        assert message.startswith("invalid run id ")
        assert len(message.splitlines()) == 1
        assert len(message) < 300  # one Error: line of the CLI, uncut

    @given(st.text(max_size=12) | st.text(alphabet="./\\-ab \n", max_size=5))
    def test_the_fast_path_agrees_with_the_full_check(self, run_id):
        # the compiled regex is the whole check for ASCII ids; _problem is the rule as written
        valid = _problem(run_id) is None
        try:
            check_run_id(run_id)
        except InvalidRunIdError:
            assert not valid
        else:
            assert valid

    @given(st.text())
    def test_shown_is_one_line_and_is_the_id_when_it_is_valid(self, run_id):
        text = shown(run_id)
        assert len(text.splitlines()) <= 1
        assert text.isprintable()
        assert text == (run_id if _problem(run_id) is None else repr(run_id))


class TestEntryPoints:
    """Engine.start, start_many, fork, Engine.fork and each journal's writes refuse a bad id."""

    def test_start(self, journal):
        engine = engine_on(journal)
        for run_id in SOME_BAD:
            with pytest.raises(InvalidRunIdError):
                engine.start(run_id=run_id)
        assert journal.runs() == []
        assert engine.start(run_id="good") == "good"

    def test_start_many(self, journal, monkeypatch):
        # start_many makes the ids itself: an id maker gone wrong is refused all the same
        monkeypatch.setattr(fsm_runner.engine.starts, "random_ids", lambda n: ["ok", "../x"][:n])
        with pytest.raises(InvalidRunIdError, match=r"'\.\./x'"):
            engine_on(journal).start_many([{}, {}])
        assert journal.runs() == []

    def test_fork_and_engine_fork(self, journal):
        engine = engine_on(journal)
        source = engine.start(run_id="source")
        engine.step(source)
        for run_id in SOME_BAD:
            with pytest.raises(InvalidRunIdError):
                fsm_runner.engine.fork_run(journal, source, at_seq=0, new_run_id=run_id)
            with pytest.raises(InvalidRunIdError):
                engine.fork(source, at_seq=0, new_run_id=run_id)
        assert [run.run_id for run in journal.runs()] == ["source"]
        assert engine.fork(source, at_seq=0, new_run_id="fork").forked_from == "source@0"

    def test_the_journals_writes(self, journal):
        for run_id in SOME_BAD:
            (run, first, opened), spec_json = new_run(run_id)
            with pytest.raises(InvalidRunIdError):
                journal.create_run(run, first, spec_json=spec_json, iterations=opened)
            good, _ = new_run("good")
            with pytest.raises(InvalidRunIdError):  # all or none: the good run is not stored
                journal.create_runs([good, (run, first, opened)], spec_json=spec_json)
        assert journal.runs() == []
        (run, first, opened), spec_json = new_run("source")
        journal.create_runs([(run, first, opened)], spec_json=spec_json)
        for run_id in SOME_BAD:
            with pytest.raises(InvalidRunIdError):
                journal.fork_run(attrs.evolve(run, run_id=run_id), source_run_id="source", at_seq=0)
        assert [r.run_id for r in journal.runs()] == ["source"]
        journal.fork_run(attrs.evolve(run, run_id="fork"), source_run_id="source", at_seq=0)
        assert journal.load("fork").seq == 0


@pytest.mark.usefixtures("in_tmp_path")
class TestCli:
    """fork --run-id BAD is one Error: line, a usage error; nothing is written."""

    @pytest.mark.parametrize("run_id", ["../../escaped", "..", "bad\nid", "-x", ""])
    def test_fork_to_a_bad_id(self, journal_path, run_id):
        with SqliteJournal(journal_path) as journal:
            source = engine_on(journal).start(run_id="source")
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_path), "fork", source, "--at", "0", "--run-id", run_id]
        )
        assert result.exit_code == EXIT_USAGE, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        lines = result.output.splitlines()
        assert len(lines) == 1, result.output
        assert lines[0].startswith("Error: --run-id: invalid run id ")
        with SqliteJournal(journal_path) as journal:
            assert [run.run_id for run in journal.runs()] == ["source"]


@pytest.fixture
def old_journal(journal_path):
    """A SQLite journal holding ``bad\\nid`` (renamed by raw SQL) and its child ``child``."""
    with SqliteJournal(journal_path) as journal:
        engine = engine_on(journal)
        engine.step(engine.start(run_id="plain"))
        engine.start(run_id="child", parent_run_id="plain")
    rename_run(journal_path, "plain", "bad\nid")
    with (
        contextlib.closing(sqlite3.connect(journal_path)) as db,
        db,
    ):  # raw SQL wrote it: no engine would
        assert db.execute("SELECT count(*) FROM run_rows WHERE run_id = 'bad' || char(10) || 'id'")
    return journal_path


@pytest.mark.usefixtures("in_tmp_path")
class TestIdsAlreadyInAJournal:
    """An id that breaks the rule stays readable, is printed escaped, and cannot be forked to."""

    def invoke(self, journal_path, *args):
        return CliRunner().invoke(cli, ["--journal", str(journal_path), *args])

    def test_runs_lists_it_escaped_on_one_line(self, old_journal):
        result = self.invoke(old_journal, "runs")
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert len(lines) == 3, result.output  # the header, the run and its child
        row = next(line for line in lines if line.startswith("'bad"))
        assert row.startswith(r"'bad\nid'")
        child = next(line for line in lines if line.startswith("child"))
        assert child.endswith(r"'bad\nid'")  # its parent

    def test_show_prints_it_escaped(self, old_journal):
        result = self.invoke(old_journal, "show", "bad\nid")
        assert result.exit_code == 0, result.output
        assert result.output.splitlines()[0] == r"run      'bad\nid'"
        assert "\nid" not in result.output

    @pytest.mark.parametrize(
        "command",
        [
            ["resume", "bad\nid", "--app", "tests.test_run_ids:engine_on"],
            ["abort", "bad\nid", "--reason", "x"],
        ],
        ids=["resume", "abort"],
    )
    def test_it_is_never_advanced(self, old_journal, command):
        """Read-only: resume and abort refuse it with the rule's message; nothing is written."""
        result = self.invoke(old_journal, *command)
        line = one_line_error(result, EXIT_USAGE)
        assert line.startswith(
            r"Error: invalid run id 'bad\nid': it holds '\n' (U+000A, whitespace); a run stored"
            " with such an id is read-only, never advanced (a run id is 1 to 200"
        ), line
        with SqliteJournal(old_journal) as journal:
            run = journal.load("bad\nid")
            assert (run.seq, run.lease_owner, run.lease_token, run.abort_reason) == (
                1,
                None,
                1,
                None,
            )

    def test_engine_calls_refuse_it(self, old_journal):
        with SqliteJournal(old_journal) as journal:
            engine = engine_on(journal)
            for call in (engine.step, engine.run, engine.resume):
                with pytest.raises(InvalidRunIdError, match="read-only, never advanced"):
                    call("bad\nid")
            assert journal.load("bad\nid").seq == 1

    def test_no_signal_is_stored_for_it(self, old_journal):
        with SqliteJournal(old_journal) as journal:
            with pytest.raises(InvalidRunIdError, match="read-only"):
                journal.put_signal(SignalRecord(run_id="bad\nid", number=0, name="GO", payload={}))
            assert journal.signals("bad\nid") == []

    def test_a_worker_drives_the_others(self, old_journal, caplog):
        """``claim_next`` looks past it (logged once, nothing written) and claims ``child``."""
        with SqliteJournal(old_journal) as journal:
            engine = engine_on(journal)
            assert engine.work(exit_when_idle=True) == 1
            assert journal.load("child").state == "done"
            assert journal.claim_next("w", ttl=5, machine=SPEC.name, states=["a", "b"]) is None
            run = journal.load("bad\nid")
            assert (run.seq, run.lease_owner, run.lease_token) == (1, None, 1)
        logged = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
        assert len(logged) == 1, logged  # once, though claim_next looked at it twice
        assert r"'bad\nid'" in logged[0]
        assert logged[0].endswith("the run is skipped (not claimed)")

    def test_check_warns_of_it_and_passes(self, old_journal):
        result = self.invoke(old_journal, "check")
        assert result.exit_code == 0, result.output
        assert result.output.splitlines()[1:] == [
            r"  warning: run 'bad\nid': its id breaks the rule of run ids (it holds '\n' (U+000A,"
            r" whitespace)); the run is read-only (shown, replayed, exported, forked from; never"
            " advanced)"
        ]
        as_json = json.loads(self.invoke(old_journal, "check", "--json").output)
        assert (as_json["problems"], len(as_json["warnings"])) == ([], 1)
        assert self.invoke(old_journal, "check", "--run", "child").output.count("warning") == 0

    def test_replay_prints_it_escaped(self, old_journal):
        result = self.invoke(old_journal, "replay", "bad\nid")
        assert result.exit_code == 0, result.output
        assert r"replay of run 'bad\nid' matches the journal" in result.output
        assert "bad\nid" not in result.output

    def test_export_writes_it(self, old_journal, tmp_path):
        result = self.invoke(old_journal, "export", "bad\nid", str(tmp_path / "out"))
        assert result.exit_code == 0, result.output
        exported = json.loads((tmp_path / "out" / "run.json").read_text())
        assert exported["run"]["run_id"] == "bad\nid"

    def test_it_reads_and_forks_from_but_not_to(self, old_journal):
        with SqliteJournal(old_journal) as journal:
            assert journal.load("bad\nid").seq == 1
            fork = fsm_runner.engine.fork_run(journal, "bad\nid", at_seq=0, new_run_id="fork")
            assert fork.forked_from == "bad\nid@0"
            with pytest.raises(InvalidRunIdError):
                fsm_runner.engine.fork_run(journal, "fork", at_seq=0, new_run_id="bad\nid2")
        result = self.invoke(old_journal, "show", "fork")
        assert r"forked   'bad\nid@0'" in result.output.splitlines()

    def test_the_inspector_links_it_and_its_page_answers(self, old_journal):
        server = Server(str(old_journal))
        try:
            listing = server.get("/runs").body
            link = "/runs/" + quote("bad\nid", safe="")
            assert f'href="{link}"' in listing
            answer = server.get(link)
            assert answer.status == 200, answer.body[:300]
            assert """<h1>Run <span class="id">'bad\\nid'</span></h1>""" in html.unescape(
                answer.body
            )
        finally:
            server.stop()


@pytest.mark.usefixtures("in_tmp_path")
class TestReleaseExample:
    """The release example, resumed under a hostile id, writes nothing outside its workspace."""

    @pytest.mark.parametrize("hostile", ["../../escaped", ".."])
    def test_a_hostile_id_already_in_the_journal_is_refused(self, journal_path, tmp_path, hostile):
        base = tmp_path / "deep" / "er"
        base.mkdir(parents=True)
        run_id = start_release(journal_path, base, 1)  # fetched; building is next
        rename_run(journal_path, run_id, hostile)
        outside = {p for p in tmp_path.rglob("*") if not p.is_relative_to(base / "ws")}
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_path), "resume", hostile, "--app", APP]
        )
        # Read-only: refused before any phase runs; the example's own check of the id, where it
        # becomes a directory, stays as a second line of defence.
        line = one_line_error(result, EXIT_USAGE)
        assert line.startswith(f"Error: invalid run id {hostile!r}: "), line
        assert {p for p in tmp_path.rglob("*") if not p.is_relative_to(base / "ws")} == outside
        assert not list(tmp_path.rglob("release-*.tar.gz"))
        with SqliteJournal(journal_path) as journal:
            assert journal.load(hostile).seq == 1

    def test_a_run_directory_linked_outside_is_refused(self, journal_path, tmp_path):
        run_id = start_release(journal_path, tmp_path, 1)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (tmp_path / "ws" / run_id).rename(tmp_path / "moved")
        (tmp_path / "ws" / run_id).symlink_to(elsewhere)
        result = CliRunner().invoke(
            cli, ["--journal", str(journal_path), "resume", run_id, "--app", APP]
        )
        assert result.exit_code == 1, result.output
        assert list(elsewhere.iterdir()) == []
        with SqliteJournal(journal_path) as journal:
            assert "outside the workspace" in journal.load(run_id).error["message"]


class TestPresets:
    """A preset that makes run ids from names refuses names that would break the rule."""

    def test_a_task_id_a_run_id_cannot_hold_is_a_graph_problem(self):
        from fsm_runner.presets.coordinator import Task, TaskGraph, TaskGraphError

        with pytest.raises(TaskGraphError) as info:
            TaskGraph([Task("write tests"), Task("../up"), Task("ok")])
        assert info.value.problems == (
            "task 'write tests' cannot be part of its runs' ids: it holds ' ' (U+0020, whitespace)",
            "task '../up' cannot be part of its runs' ids: it holds '/'",
        )
