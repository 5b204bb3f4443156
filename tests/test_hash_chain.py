"""Each run's hash chain of transitions, and every row's digest (issue 30, part 1).

A changed byte anywhere in a run's journaled content — a transition's event, time or result, the
run's input or context, an iteration, effect or artifact row — is reported by ``check`` and
``integrity_problems()``, naming the run and the first seq that no longer matches.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from fsm_runner import (
    MemoryJournal,
    RunEvent,
    RunLifecycle,
    RunRecord,
    SqliteJournal,
    TransitionRecord,
)
from fsm_runner.cli import cli
from fsm_runner.journal._digest import (
    TRANSITION_DIGEST_COLUMNS,
    digest,
    row_digest,
    step_digest,
    stored_row_digest,
)
from fsm_runner.journal._sqlite_check import SCHEMA_VERSION
from fsm_runner.records import ArtifactRecord, EffectRecord, IterationRecord
from fsm_runner.replay import check_journal
from tests.helpers import (
    NEXT,
    UNDO_TO_VERSION,
    linear_spec,
    one_line_error,
)

SPEC = linear_spec("building", "verifying")
T0 = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone.utc)


def chained_run(journal, run_id: str = "r1") -> RunRecord:
    """A run at seq 2 with an input, a context, a result, an iteration, an artifact, an effect."""
    run = RunRecord(
        run_id,
        SPEC.name,
        SPEC.spec_hash,
        "building",
        input={"ref": "abc", "n": 1},
        created_at=T0,
        updated_at=T0,
    )
    first = TransitionRecord(run_id, 0, None, RunEvent.STARTED.value, "building", at=T0)
    opened = IterationRecord(run_id, 1, state="building", started_at=T0)
    journal.create_run(run, first, spec_json=SPEC.to_json(), iterations=[opened])
    for seq, to_state in ((1, "verifying"), (2, "done")):
        when = T0 + dt.timedelta(seconds=seq)
        after = attrs.evolve(
            run,
            state=to_state,
            seq=seq,
            visit_seq=seq,
            updated_at=when,
            context={"version": f"1.2.{seq}"},
            status=RunLifecycle.SUCCEEDED if to_state == "done" else RunLifecycle.ACTIVE,
        )
        transition = TransitionRecord(
            run_id,
            seq,
            run.state,
            NEXT,
            to_state,
            at=when,
            duration_ms=1.5,
            result={"version": f"1.2.{seq}", "context": {"version": f"1.2.{seq}"}},
        )
        artifacts = [ArtifactRecord("report", content={"lines": 3}, run_id=run_id, seq=seq)]
        journal.commit(after, transition, artifacts=artifacts if seq == 1 else ())
        if seq == 1:
            effect = EffectRecord(run_id, 1, "charge", "verifying", "mutate", params={"n": 5})
            journal.put_effect(effect, run_seq=1)
        run = after
    return run


def fork_at_one(journal, run: RunRecord) -> RunRecord:
    """Fork ``run`` (``r1``, from :func:`chained_run`) at seq 1 as ``f1``; the fork's row."""
    forked = attrs.evolve(
        run,
        run_id="f1",
        state="verifying",
        status=RunLifecycle.ACTIVE,
        seq=1,
        visit_seq=1,
        context={"version": "1.2.1"},
        updated_at=T0 + dt.timedelta(seconds=1),
        forked_from="r1@1",
    )
    journal.fork_run(forked, source_run_id="r1", at_seq=1)
    return forked


def sqlite_rows(path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def flip(text: str, old: str, new: str) -> str:
    """``text`` with one character of it changed (the first ``old`` after ``"``)."""
    assert old in text, (old, text)
    changed = text.replace(old, new, 1)
    assert len(changed.encode()) == len(text.encode())
    return changed


#: One changed byte each: (table, column, the row, the old and new text, what names the row).
DAMAGES = {
    "event": ("transitions", "event", "seq = 1", "NEXT", "NEXU", "at seq 1"),
    "timestamp": ("transitions", "at", "seq = 2", ":07.", ":08.", "at seq 2"),
    "result-value": ("transitions", "result", "seq = 1", "1.2.1", "1.2.7", "at seq 1"),
    "result-key": ("transitions", "result", "seq = 2", "version", "v%rsion", "at seq 2"),
    "input": ("run_rows", "input", "1", "abc", "abd", "its row"),
    "context": ("run_rows", "context", "1", "1.2.2", "1.2.3", "its row"),
    "iteration": ("iterations", "state", "1", "building", "bui1ding", "its iteration 1"),
    "effect": ("effects", "params", "1", '"n":5', '"n":6', "its effect 'charge' of visit 1"),
    "artifact": ("artifacts", "content", "1", '"lines":3', '"lines":4', "its artifact 'report'"),
}


def damage_sqlite(path, table: str, column: str, where: str, old: str, new: str) -> None:
    """Change one byte of a stored value, by SQL, as a bit flip on disk would."""
    conn = sqlite3.connect(path)
    try:
        (value,) = conn.execute(
            f"SELECT {column} FROM {table} WHERE run_id = 'r1' AND {where}"
        ).fetchone()
        conn.execute(
            f"UPDATE {table} SET {column} = ? WHERE run_id = 'r1' AND {where}",
            (flip(value, old, new),),
        )
        conn.commit()
    finally:
        conn.close()


def _evolve(table: dict, key: Any, **changes: Any) -> None:
    table[key] = attrs.evolve(table[key], **changes)


def _poke_transition(journal, seq: int, **changes: Any) -> None:
    _evolve(journal._transitions["r1"], seq, **changes)


#: The same damages, poked into a memory journal's stored records.
POKES = {
    "event": lambda j: _poke_transition(j, 1, event="NEXU"),
    "timestamp": lambda j: _poke_transition(
        j, 2, at=j._transitions["r1"][2].at + dt.timedelta(seconds=1)
    ),
    "result-value": lambda j: _poke_transition(
        j, 1, result={"version": "1.2.7", "context": {"version": "1.2.1"}}
    ),
    "result-key": lambda j: _poke_transition(
        j, 2, result={"v%rsion": "1.2.2", "context": {"version": "1.2.2"}}
    ),
    "input": lambda j: _evolve(j._runs, "r1", input={"ref": "abd", "n": 1}),
    "context": lambda j: _evolve(j._runs, "r1", context={"version": "1.2.3"}),
    "iteration": lambda j: _evolve(j._iterations["r1"], 1, state="bui1ding"),
    "effect": lambda j: _evolve(j._effects["r1"], (1, "charge"), params={"n": 6}),
    "artifact": lambda j: _evolve(j._artifacts["r1"], "report", content={"lines": 4}),
}


class TestMemoryChain:
    """The memory journal keeps the same digests, and finds a record poked in place."""

    def test_the_same_digests_as_sqlite(self, tmp_path):
        memory = MemoryJournal()
        chained_run(memory)
        assert memory.integrity_problems() == []
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
        stored = [
            row[0] for row in sqlite_rows(path, "SELECT digest FROM transitions ORDER BY seq")
        ]
        assert memory._digests.chains["r1"] == stored
        (row,) = sqlite_rows(path, "SELECT digest FROM run_rows")
        assert memory._digests.runs["r1"] == row[0]

    @pytest.mark.parametrize("damage", sorted(DAMAGES))
    def test_a_poked_record_is_found(self, damage):
        journal = MemoryJournal()
        chained_run(journal)
        chained_run(journal, "r2")
        POKES[damage](journal)
        problems = [p for p in journal.integrity_problems() if p.startswith("digest:")]
        assert len(problems) == 1, problems
        assert "run r1" in problems[0]
        assert DAMAGES[damage][-1] in problems[0]
        assert [p for p in check_journal(journal) if p.startswith("digest:")] == problems


class TestSqliteChain:
    """SQLite: the digests written are those recomputed from the rows; a changed byte shows."""

    def test_a_runs_digests_chain(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
            assert journal.integrity_problems() == []
        rows = sqlite_rows(
            path,
            f"SELECT digest, {', '.join(TRANSITION_DIGEST_COLUMNS)} FROM transitions"
            " WHERE run_id = 'r1' ORDER BY seq",
        )
        assert len(rows) == 3
        previous = None
        for stored, *values in rows:
            previous = digest(previous, values)
            assert stored == previous
            assert len(stored) == 32  # BLAKE2b-128, hex
        for table in ("run_rows", "iterations", "effects", "artifacts"):
            assert sqlite_rows(path, f"SELECT count(*) FROM {table} WHERE digest IS NULL") == [(0,)]

    @pytest.mark.parametrize("damage", sorted(DAMAGES))
    def test_a_changed_byte_is_found(self, tmp_path, damage):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
            chained_run(journal, "r2")  # untouched: never named
        table, column, where, old, new, names = DAMAGES[damage]
        damage_sqlite(path, table, column, where, old, new)
        with SqliteJournal(path) as journal:
            problems = [p for p in journal.integrity_problems() if p.startswith("digest:")]
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"digest: run r1 {names}" if "seq" in names else "digest:")
        assert "r1" in problems[0]
        assert names in problems[0]
        result = CliRunner().invoke(cli, ["--journal", str(path), "check", "--jobs", "1"])
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if "digest" in line]
        assert len(lines) == 1, result.output
        assert "run r1" in lines[0]
        assert names in lines[0]
        assert "r2" not in result.output

    def test_the_check_verifies_the_chains_as_it_reads_the_runs(self, tmp_path):
        """One read of the transitions: the ranges verify the chains, the same lines in place."""
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            for run_id in ("r1", "r2", "r3", "r4"):
                chained_run(journal, run_id)
        damage_sqlite(path, "transitions", "event", "seq = 1", "NEXT", "NEXU")  # r1 at seq 1
        damage_sqlite(path, "run_rows", "input", "1", "abc", "abd")  # r1's row
        conn = sqlite3.connect(path)
        with conn:  # r3: a digest changed, and a later one (the first break is named)
            conn.execute("UPDATE transitions SET digest = 'x' WHERE run_id = 'r3' AND seq >= 1")
            conn.execute("CREATE INDEX by_hand ON run_rows (error)")  # a medium's problem
        conn.close()
        with SqliteJournal(path) as journal:
            medium = journal.integrity_problems()
            chains = [line for line in medium if " at seq " in line]
            assert [line.split(":")[1] for line in chains] == [
                " run r1 at seq 1",
                " run r3 at seq 1",
            ]
            assert medium[-2:] == chains  # the chains come last
            assert journal.integrity_problems(chains=False) == medium[:-2]
            for jobs, chunk in ((1, 10**6), (2, 1), (2, 3)):
                lines = check_journal(journal, jobs=jobs, chunk=chunk)
                assert lines[: len(medium)] == medium, (jobs, chunk)  # in the medium's place
            assert check_journal(journal, run_ids=["r2"]) == medium  # the medium's own
            assert check_journal(journal, since=T0)[: len(medium)] == medium

    def test_an_untouched_journal_reports_nothing(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
            fork_at_one(journal, journal.load("r1"))
        result = CliRunner().invoke(cli, ["--journal", str(path), "check", "--jobs", "1"])
        assert result.exit_code == 0, result.output
        assert result.output.endswith("2 runs checked, no problems\n")


#: Each older schema version, made from a journal of this one (see tests/helpers.py).
UNDO = UNDO_TO_VERSION


class TestSqliteMigration:
    """Every older SQLite version: the migration computes the digests and says so."""

    @pytest.mark.parametrize("version", sorted(v for v in UNDO if v < 11))  # 11 had them
    def test_every_older_version_gets_digests(self, tmp_path, version):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            UNDO[version](conn)
        finally:
            conn.close()
        with SqliteJournal(path) as journal:
            assert journal.meta()["schema_version"] == str(SCHEMA_VERSION) == "12"
            assert journal.integrity_problems() == []
            meta = journal.meta()
            assert meta["digests_computed"].startswith("computed at migration to version 11 on ")
            assert meta["digests_computed_to_run_key"] == "1"
            chained_run(journal, "r2")  # a new run: its own digests, written as it goes
            assert journal.integrity_problems() == []
        damage_sqlite(path, "transitions", "at", "seq = 2", ":07.", ":08.")
        with SqliteJournal(path) as journal:
            (line,) = [p for p in journal.integrity_problems() if p.startswith("digest:")]
        assert line.startswith("digest: run r1 at seq 2:")
        assert "computed at migration to version 11" in line
        assert "vouch only for what the migration read" in line

    def test_a_new_journal_says_nothing_of_a_migration(self, tmp_path):
        with SqliteJournal(tmp_path / "journal.db") as journal:
            chained_run(journal)
            assert "digests_computed" not in journal.meta()


def documented_verify_chain():
    """``verify_chain`` as docs/reference.md documents it, run as written there."""
    text = (Path(__file__).parent.parent / "docs" / "reference.md").read_text()
    start = text.index("```python\n", text.index("To verify an exported run elsewhere"))
    block = text[start + len("```python\n") : text.index("```\n", start + 10)]
    namespace: dict[str, Any] = {}
    exec(block, namespace)
    return namespace["verify_chain"]


class TestExportAndReplay:
    """`export` carries the digests, and the documented verification recomputes them."""

    def test_an_exported_run_verifies_elsewhere(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
        out = tmp_path / "out"
        result = CliRunner().invoke(cli, ["--journal", str(path), "export", "r1", str(out)])
        assert result.exit_code == 0, result.output
        exported = json.loads((out / "run.json").read_text())
        stored = sqlite_rows(path, "SELECT digest FROM transitions ORDER BY seq")
        assert exported["head_digest"] == stored[-1][0]
        assert [t["digest"] for t in exported["transitions"]] == [row[0] for row in stored]
        verify_chain = documented_verify_chain()
        assert verify_chain(exported) is None
        changed = json.loads(json.dumps(exported))
        changed["transitions"][1]["result"]["version"] = "1.2.7"
        assert verify_chain(changed) == 1
        changed = json.loads(json.dumps(exported))
        changed["head_digest"] = "0" * 32
        assert verify_chain(changed) == "head"

    def test_replay_names_the_first_seq_that_changed(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            chained_run(journal)
        base = ["--journal", str(path), "replay", "r1"]
        assert CliRunner().invoke(cli, base).exit_code == 0
        damage_sqlite(path, *DAMAGES["result-value"][:5])
        line = one_line_error(CliRunner().invoke(cli, base))
        assert line == (
            "Error: run r1 at seq 1: the transition does not match its digest (changed since it"
            " was written)"
        )


_TEXTS = st.one_of(st.none(), st.text(), st.sampled_from(["a", "\udc80x", "\x1f"]))
_NUMBERS = st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), st.none())


class TestStoredRowDigest:
    """A row read as stored (text as bytes, NULL) gives exactly :func:`row_digest` of it."""

    @given(
        values=st.lists(
            st.one_of(
                st.none(),
                st.binary(),
                st.text().map(lambda text: text.encode("utf-8", "surrogateescape")),
                st.sampled_from([b"\xed\xb2\x80", b"\x1f", b"\x00", b"\xff"]),
            ),
            max_size=9,
        ),
        other=st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text()),
    )
    def test_same_as_row_digest(self, values, other) -> None:
        assert stored_row_digest(values) == row_digest(values)
        mixed = [*values, other]  # a value that is not bytes: row_digest's own way
        assert stored_row_digest(mixed) == row_digest(mixed)


class TestStepDigest:
    """The writers' hot path gives exactly :func:`digest` of the same values, whatever they are."""

    @given(
        previous=st.one_of(st.none(), st.text(max_size=32)),
        run_id=st.one_of(st.text(), st.integers()),
        seq=_NUMBERS,
        states=st.tuples(_TEXTS, _TEXTS, _TEXTS),
        numbers=st.tuples(_NUMBERS, _NUMBERS, _NUMBERS, _NUMBERS),
        at=st.one_of(st.text(), st.none()),
        result=_TEXTS,
    )
    def test_same_as_digest(self, previous, run_id, seq, states, numbers, at, result) -> None:
        from_state, event, to_state = states
        iteration, attempt, ms, token = numbers
        values = (
            run_id,
            seq,
            from_state,
            event,
            to_state,
            iteration,
            attempt,
            at,
            ms,
            result,
            token,
        )
        assert step_digest(previous, *values) == digest(previous, values)

    def test_a_step_as_the_engine_writes_it(self) -> None:
        values = (
            "r1",
            3,
            "a",
            "NEXT",
            "b",
            0,
            1,
            "2026-11-28T04:59:01.123456+00:00",
            0.0123,
            None,
            7,
        )
        assert step_digest("ab" * 16, *values) == digest("ab" * 16, values)
        assert step_digest(None, *values[:8], 2.0, '{"x": 1}', 7) == digest(
            None, (*values[:8], 2.0, '{"x": 1}', 7)
        )
