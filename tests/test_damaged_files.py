"""Byte-damaged journal files (issue 30): every damaged read is one error, never a traceback.

A journal made by real runs (handlers that write outputs, context, iterations, artifacts and
effects; a run parked with a signal pending; runs ended, active and aborted) is copied
:data:`COPIES` times, each copy damaged as a disk would damage it: one bit flipped anywhere in
the file, the file cut short, or a page zeroed (seeded: ``FSM_DAMAGE_SEED``). On each copy the
operator's commands run in this process (click's runner) — ``check``, ``runs``, ``show`` and
``export`` of every run — and a resume through the engine. Each must answer as the CLI answers
a user's mistake: a documented exit code and at most one ``Error:`` line; a library call raises
a :class:`~fsm_runner.exceptions.FsmRunnerError` (a ``JournalError`` for the file), never
``sqlite3.DatabaseError`` or anything else raw.

And every copy either reads back exactly as written or ``check`` reports it (exit 1): the hash
chain (schema 11) covers every byte of a run's rows, so no damage reads back wrong unseen (7 of
330 such copies did before it, 0-5 a seed here). Each kind of damage a seed found answering with
a traceback has a test of its own below, made by hand.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsm_runner import (
    ArtifactRecord,
    Engine,
    MachineSpec,
    PhaseResult,
    RunEvent,
    SqliteJournal,
    State,
    Transition,
    Wait,
)
from fsm_runner.cli import cli
from fsm_runner.exceptions import FsmRunnerError, JournalError
from tests.test_cli_fuzz import assert_well_behaved

#: Damaged copies a run makes (`FSM_DAMAGE_COPIES`; the seed chooses the damage).
COPIES = int(os.environ.get("FSM_DAMAGE_COPIES", "320"))
SEED = int(os.environ.get("FSM_DAMAGE_SEED", "30"))

SPEC = MachineSpec(
    "damage",
    [
        State("building", handler="build", starts_iteration=True),
        State("verifying", handler="verify"),
        State("approving", wait=Wait(timeout=86_400, prompt="ship it?")),
        State("shipped", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("cancelled", terminal=True, outcome="aborted"),
    ],
    [
        Transition("building", "BUILT", "verifying"),
        Transition("verifying", "VERIFY_FAILED", "building"),
        Transition("verifying", "VERIFY_PASSED", "approving"),
        Transition("approving", "APPROVE", "shipped"),
        Transition("approving", "TIMEOUT", "cancelled"),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "cancelled"),
    ],
)


def build(ctx):
    tries = ctx.context.get("tries", 0) + 1
    stamp = ctx.effect("stamp", lambda: {"version": f"1.{tries}.0"}, kind="read")
    return PhaseResult(
        "BUILT",
        output={"version": stamp["version"], "files": ["a.py", "b.py"], "ok": True},
        context={"tries": tries, "note": "ünïcode ✓"},
        iteration={"tokens_input": 1200 * tries, "cost_usd": 0.25 * tries, "model": "m-1"},
        artifacts=[ArtifactRecord(f"build-{tries}", "report", {"lines": tries * 10})],
    )


def verify(ctx):
    passed = ctx.context["tries"] >= 2
    return PhaseResult(
        "VERIFY_PASSED" if passed else "VERIFY_FAILED",
        output={"levels": {"L1": True, "L2": passed}, "score": 0.5 + 0.25 * passed},
    )


HANDLERS = {"build": build, "verify": verify}
APP_SOURCE = """
from fsm_runner import Engine
from tests.test_damaged_files import HANDLERS, SPEC


def make_engine(journal=None):
    return Engine(SPEC, handlers=HANDLERS, journal=journal)
"""


def make_journal(path: Path) -> dict[str, str]:
    """Runs of every kind, by real runs; the file alone holds them all (WAL checkpointed)."""
    journal = SqliteJournal(path)
    # Fixed ids and durations: the rows' sizes (so where a seed's damage lands) vary only with
    # the wall-clock times and the worker ids' host names.
    engine = Engine(SPEC, handlers=HANDLERS, journal=journal, clock=lambda: 0.0)
    shipped = engine.start({"repo": "git@example.com:x.git", "branch": "main"}, run_id="shipped")
    engine.run(shipped)
    engine.signal(shipped, "APPROVE", {"by": "ana"}, signal_id="hook-1")  # ends it
    waiting = engine.start({"repo": "r", "branch": "dev"}, run_id="waiting")
    engine.run(waiting)
    active = engine.start({"repo": "r", "branch": "feature"}, run_id="active")
    engine.run(active, max_steps=1)
    aborted = engine.start({"repo": "r"}, run_id="aborted")
    engine.abort(aborted, reason="operator")
    engine.close()
    journal.close()
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    return {"shipped": shipped, "waiting": waiting, "active": active, "aborted": aborted}


#: What the digests vouch for of a run row: who the run is, what its commits wrote, its head.
#: Not its lease, abort request or wake time, nor its signals' rows (a consumed signal's payload
#: is in the transition that consumed it): see "Integrity" in docs/reference.md.
VOUCHED = ("run_id", "machine", "created_at", "parent_run_id", "forked_from", "input", "context",
           "error", "state", "seq", "iteration", "status")  # fmt: skip


def read_back(path: Path, run_ids: list[str]) -> object:
    """What the journal API reads of the runs that the digests vouch for (or its error).

    The runs' signals are read too (a damaged one must be one error), not compared.
    """
    try:
        with SqliteJournal(path, create=False) as journal:
            found = []
            for run_id in run_ids:
                run = journal.load(run_id)
                journal.signals(run_id)
                found.append(
                    (
                        tuple(getattr(run, name) for name in VOUCHED),
                        list(journal.transitions(run_id)),
                        list(journal.iterations(run_id)),
                        list(journal.artifacts(run_id)),
                        list(journal.effects(run_id)),
                    )
                )
            return found
    except FsmRunnerError as exc:
        return exc


def damaged_copy(original: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One way a disk damages a file: a flipped bit, a file cut short, a zeroed page."""
    data = bytearray(original)
    how = rng.choices(["flip", "truncate", "zero-page"], weights=[8, 1, 1])[0]
    if how == "flip":
        offset = rng.randrange(len(data))
        data[offset] ^= 1 << rng.randrange(8)
        return f"flip@{offset}", bytes(data)
    if how == "truncate":
        length = rng.randrange(len(data))
        return f"truncate@{length}", bytes(data[:length])
    page_size = 4096
    page = rng.randrange(max(1, len(data) // page_size))
    data[page * page_size : (page + 1) * page_size] = bytes(page_size)
    return f"zero-page@{page}", bytes(data)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damage")
    path = folder / "journal.db"
    runs = make_journal(path)
    return path, runs


def test_every_damaged_copy_answers_in_one_line_and_reads_back_as_written_or_fails_check(
    original, tmp_path
):
    path, runs = original
    run_ids = sorted(runs.values())
    expected = read_back(path, run_ids)
    assert not isinstance(expected, Exception), expected
    data = path.read_bytes()
    (tmp_path / "damage_app.py").write_text(APP_SOURCE)
    rng = random.Random(SEED)
    runner = CliRunner()
    silent: list[str] = []
    copy = tmp_path / "copy.db"
    for number in range(COPIES):
        how, damaged = damaged_copy(data, rng)
        for side in (copy, Path(f"{copy}-wal"), Path(f"{copy}-shm")):
            side.unlink(missing_ok=True)
        copy.write_bytes(damaged)
        kept = tmp_path / f"copy-{number}.db"  # named in a failure's message, kept by pytest
        case = f"copy {number} ({how}, seed {SEED}; the copy: {kept})"
        shutil.copyfile(copy, kept)
        checked = runner.invoke(cli, ["--journal", str(copy), "check"])
        assert_well_behaved(checked, [case, "check"])
        for argv in (
            ["runs", "--limit", "50"],
            *(["show", run_id, "--json"] for run_id in run_ids),
            ["export", runs["shipped"], str(tmp_path / "export.json")],
        ):
            assert_well_behaved(runner.invoke(cli, ["--journal", str(copy), *argv]), [case, *argv])
        got = read_back(copy, run_ids)
        resume_through_the_engine(copy, runs["active"], case)
        if checked.exit_code == 0 and not isinstance(got, Exception) and got != expected:
            silent.append(case)
        else:
            kept.unlink()
    print(f"{COPIES} damaged copies; read back wrong while check said sound: {len(silent)}")
    assert silent == [], "\n".join(silent)  # each a copy that check called sound


def resume_through_the_engine(path: Path, run_id: str, case: str) -> None:
    """Resume a run on the damaged copy: it ends, or an FsmRunnerError says why not."""
    try:
        journal = SqliteJournal(path, create=False)
    except FsmRunnerError:
        return
    try:
        engine = Engine(SPEC, handlers=HANDLERS, journal=journal)
        try:
            engine.resume(run_id, max_steps=4)
        finally:
            engine.close()
    except FsmRunnerError:
        pass  # one error, for the file
    except Exception as exc:  # the point: nothing else may leave the library
        pytest.fail(f"{case}: resume raised {type(exc).__name__}: {exc}")
    finally:
        journal.close()
        shutil.rmtree(path.with_suffix(".exports"), ignore_errors=True)


class TestDamageFoundByTheFuzz:
    """Each kind of damage that once escaped as a traceback, made by hand."""

    @pytest.fixture
    def journal_path(self, tmp_path):
        path = tmp_path / "journal.db"
        make_journal(path)
        return path

    def damage(self, path: Path, *statements: str) -> None:
        connection = sqlite3.connect(path)
        connection.execute("PRAGMA writable_schema = ON")
        for statement in statements:
            connection.execute(statement)
        connection.commit()
        connection.close()

    def test_a_signal_time_that_is_no_time(self, journal_path):
        """(seed 3: ``hour must be in 0..23`` from ``show``)"""
        self.damage(journal_path, "UPDATE signals SET received_at = '2026-11-28T25:00:00.000000Z'")
        with SqliteJournal(journal_path) as journal, pytest.raises(JournalError) as caught:
            journal.signals("shipped")
        assert "signal 1 of run 'shipped' has an unreadable row" in str(caught.value)
        result = CliRunner().invoke(cli, ["--journal", str(journal_path), "show", "shipped"])
        assert_well_behaved(result, ["show"])
        assert result.exit_code != 0

    def test_a_json_column_that_holds_a_number(self, journal_path):
        """(seed 7: a damaged record header made an effect's JSON column an integer)

        SQL cannot store one there (the column's TEXT affinity makes it text), only damage
        can: the journal's reading of a JSON column is given one directly.
        """
        with SqliteJournal(journal_path) as journal:
            for value in (5, 2.5):
                with pytest.raises(JournalError) as caught:
                    journal._core._loads(value)
                assert "unreadable JSON" in str(caught.value)

    def test_a_schema_object_whose_name_is_bytes(self, journal_path):
        """(seed 13: ``check`` compared a name read as bytes with the others)"""
        self.damage(
            journal_path,
            "UPDATE sqlite_master SET name = CAST(name AS BLOB) WHERE name = 'idx_run_rows_due'",
        )
        result = CliRunner().invoke(cli, ["--journal", str(journal_path), "check"])
        assert_well_behaved(result, ["check"])
        assert result.exit_code == 1
        assert "idx_run_rows_due is missing" in result.output

    def test_a_run_whose_key_reads_as_null(self):
        """(seed 42: a damaged index gave ``show`` a run whose key read as NULL)

        The key is the table's rowid (never NULL in SQL): a table of the same shape stands in.
        """
        from fsm_runner.journal._sqlite_writes import SqliteWriter

        connection = sqlite3.connect(":memory:")
        connection.execute("CREATE TABLE run_rows (run_id TEXT, run_key)")
        connection.execute("INSERT INTO run_rows VALUES ('shipped', NULL)")
        with pytest.raises(JournalError, match="run 'shipped' has an unreadable key"):
            SqliteWriter.stored_key(connection, "shipped")
        connection.close()

    def test_a_column_the_schema_renamed(self, journal_path):
        """(seed 142: a flipped byte in the table's SQL renamed ``result``; check read on)"""
        self.damage(
            journal_path,
            "UPDATE sqlite_master SET sql = replace(sql, ' result TEXT', ' resudt TEXT')"
            " WHERE name = 'transitions'",
        )
        result = CliRunner().invoke(cli, ["--journal", str(journal_path), "check"])
        assert_well_behaved(result, ["check"])
        assert result.exit_code == 1
        assert "has no 'result' column in its transitions" in result.output
