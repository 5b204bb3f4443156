"""Signals carry digests too, and their consumption is the chain's (issue 30; SQLite 12, PostgreSQL 10).

A signal's digest covers what its sender wrote (run id, name, payload, signal id, time
received), written with it; the transition that consumes it names it in its result, which the
run's chain vouches for. ``check`` (``integrity_problems``) names a signal whose content changed,
one marked consumed at a seq whose transition does not name it, and one the chain says was
consumed but that was made pending again (it would be delivered twice). A fork's copied
transitions name its source's signals: not the fork's, not a problem. Real journals (a SQLite
file, a PostgreSQL schema), damaged by raw SQL.
"""

from __future__ import annotations

import sqlite3

import pytest
from psycopg import sql

from fsm_runner import (
    Engine,
    JournalError,
    MachineSpec,
    SignalRecord,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.journal._digest import row_digest
from fsm_runner.records import format_utc
from tests.helpers import NEXT, undo_v12

SPEC = MachineSpec(
    "signalled",
    [State("waiting"), State("working", handler="work"), State("done", terminal=True)],
    [Transition("waiting", "GO", "working"), Transition("working", NEXT, "done")],
)


@pytest.fixture(params=["sqlite", "postgres"])
def site(request, tmp_path):
    """(journal, raw SQL on its tables): a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        path = tmp_path / "journal.db"
        journal = SqliteJournal(path)

        def raw(statement: str) -> list[tuple]:
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                return conn.execute(statement).fetchall()
            finally:
                conn.close()

        yield journal, raw
        journal.close()
        return
    journal = request.getfixturevalue("postgres_journal")
    admin = request.getfixturevalue("postgres_server").admin

    def raw(statement: str) -> list[tuple]:
        with admin.cursor() as cursor:
            cursor.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(journal.schema)))
            cursor.execute(statement)
            rows = cursor.fetchall() if cursor.description else []
            cursor.execute("SET search_path TO DEFAULT")
        return rows

    yield journal, raw


def signalled(journal) -> tuple[str, str, int, int]:
    """Run ``a`` consumed a GO (seq 1) and was forked there; run ``b`` has a GO pending."""
    engine = Engine(SPEC, handlers={"work": lambda _ctx: NEXT}, journal=journal)
    a, b = engine.start({}, run_id="a"), engine.start({}, run_id="b")
    engine.signal(a, "GO", {"why": "ready"})  # consumed at once: it waits for it
    consumed = journal.signals(a)[0].number
    assert journal.load(a).seq == 1
    engine.fork(a, at_seq=1, new_run_id="a-fork")  # its seq 1 names a's signal: not its own
    pending = journal.put_signal(SignalRecord(b, 0, "GO", {"n": 1}, signal_id="once")).number
    return a, b, consumed, pending


def digest_lines(journal) -> list[str]:
    return [line for line in journal.integrity_problems() if line.startswith("digest:")]


def test_a_journal_with_signals_is_sound(site):
    journal, _ = site
    signalled(journal)
    assert digest_lines(journal) == []


def test_a_changed_payload_is_named(site):
    journal, raw = site
    _, _, _, pending = signalled(journal)
    raw(f"UPDATE signals SET payload = '{{\"n\": 2}}' WHERE number = {pending}")
    assert digest_lines(journal) == [
        f"digest: run b: its signal {pending} does not match its digest"
        " (changed since it was written)"
    ]


def test_a_consumed_signal_made_pending_again_is_named(site):
    journal, raw = site
    _, _, consumed, _ = signalled(journal)
    raw(f"UPDATE signals SET consumed_seq = NULL, consumed_at = NULL WHERE number = {consumed}")
    assert digest_lines(journal) == [
        f"digest: run a: its signal {consumed} is consumed at seq 1 by the chain, not marked so"
    ]


def test_a_signal_marked_consumed_elsewhere_is_named(site):
    journal, raw = site
    _, _, consumed, _ = signalled(journal)
    raw(f"UPDATE signals SET consumed_seq = 0 WHERE number = {consumed}")
    assert sorted(digest_lines(journal)) == [
        f"digest: run a: its signal {consumed} is consumed at seq 1 by the chain, not marked so",
        f"digest: run a: its signal {consumed} is marked consumed at seq 0, whose transition"
        " does not name it",
    ]


def test_a_signal_is_stored_with_the_digest_of_what_was_sent(site):
    journal, raw = site
    _, _, _, pending = signalled(journal)
    (signal,) = [s for s in journal.signals("b") if s.number == pending]
    expected = row_digest(("b", "GO", '{"n":1}', "once", format_utc(signal.received_at)))
    assert raw(f"SELECT digest FROM signals WHERE number = {pending}") == [(expected,)]


def test_a_version_11_journal_gets_its_signals_digests(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        signalled(journal)
    conn = sqlite3.connect(path, isolation_level=None)
    undo_v12(conn)
    conn.close()
    with SqliteJournal(path) as journal:
        assert journal.meta()["schema_version"] == "12"
        assert digest_lines(journal) == []
    conn = sqlite3.connect(path)  # (a `with` block would commit, not close it)
    try:
        assert conn.execute("SELECT count(*) FROM signals WHERE digest IS NULL").fetchone() == (0,)
    finally:
        conn.close()


# -- delivery: a signal whose row fails its digest is never delivered ---------------------------


def damage_pending(journal, raw) -> tuple[str, int]:
    _, b, _, pending = signalled(journal)
    raw(f"UPDATE signals SET payload = '{{\"n\": 2}}' WHERE number = {pending}")
    return b, pending


def refusal(run_id: str, number: int) -> str:
    return (
        f"signal {number} of run {run_id} fails its digest; 'fsm-runner check' says what is"
        " damaged; nothing was written"
    )


def test_a_changed_pending_signal_is_refused_not_delivered(site):
    journal, raw = site
    b, pending = damage_pending(journal, raw)
    before = journal.load(b)
    engine = Engine(SPEC, handlers={"work": lambda _ctx: NEXT}, journal=journal)
    with pytest.raises(JournalError) as caught:
        engine.run(b)
    assert caught.value.detail == refusal(b, pending)
    after = journal.load(b)
    assert (after.state, after.seq, after.lease_owner) == ("waiting", before.seq, None)
    assert raw(f"SELECT consumed_seq FROM signals WHERE number = {pending}") == [(None,)]
    with pytest.raises(JournalError, match="fails its digest"):
        journal.signals(b, pending=True)  # what delivers it refuses it
    assert [s.number for s in journal.signals(b)] == [pending]  # listing it still shows it


def test_a_worker_leaves_a_run_whose_signal_was_changed(site, caplog):
    journal, raw = site
    b, pending = damage_pending(journal, raw)
    engine = Engine(SPEC, handlers={"work": lambda _ctx: NEXT}, journal=journal)
    engine.work(exit_when_idle=True)  # runs a and its fork to their ends, refused at b
    assert journal.load(b).state == "waiting"
    assert raw(f"SELECT consumed_seq FROM signals WHERE number = {pending}") == [(None,)]
    assert f"run b failed in this worker: journal {journal.location}: {refusal(b, pending)}" in (
        caplog.text
    )


def test_the_cli_says_so_in_one_line(tmp_path):
    from click.testing import CliRunner

    from fsm_runner.cli import cli

    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal:
        b, pending = damage_pending(journal, lambda statement: sqlite_raw(path, statement))
    result = CliRunner().invoke(cli, ["--journal", str(path), "signal", b, "GO", "--id", "2nd"])
    assert result.exit_code == 1, result.output
    (line,) = result.output.splitlines()
    assert line.startswith("Error: journal ")
    assert line.endswith(refusal(b, pending))
    with SqliteJournal(path) as journal:  # the damaged mailbox refused before any write
        assert [s.number for s in journal.signals(b)] == [pending]
        assert journal.load(b).lease_owner is None


def sqlite_raw(path, statement: str) -> list[tuple]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return conn.execute(statement).fetchall()
    finally:
        conn.close()
