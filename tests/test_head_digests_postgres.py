"""On PostgreSQL too, a run is never driven past a row that fails its digest (issue 30, point 2).

Every claim (``resume``, ``step``, ``run``, an abort, ``claim_unchanged``, a worker's
``claim_next``, ``claim_many``) reads the run's head transition, the digest of the one before
and the run's row in the claim's own transaction and verifies them (:mod:`~fsm_runner.journal.
_postgres_heads`); a run that fails is refused with one ``JournalError`` naming the seq, the
claim rolled back: no lease, no transition. ``claim_next`` logs such a run once and takes the
next one. Real runs in a schema of their own, damaged by raw SQL from another connection.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
from psycopg import sql

from fsm_runner import Engine, JournalError, RunTerminalError
from tests.helpers import NEXT, linear_spec

SPEC = linear_spec("a", "b", "c", name="heads")
CHECK = "'fsm-runner check' says what is damaged; nothing was written"

#: Raw SQL damage to run ``r1``, stopped at seq 2 (phase c next), and what the refusal names.
DAMAGES = {
    "head-result": (
        "UPDATE transitions SET result = '{\"forged\": 1}' WHERE run_id = 'r1' AND seq = 2",
        "seq 2",
    ),
    "head-time": (
        "UPDATE transitions SET at = at + interval '1 microsecond' WHERE run_id = 'r1' AND seq = 2",
        "seq 2",
    ),
    "head-event": (
        "UPDATE transitions SET event = 'FORGED' WHERE run_id = 'r1' AND seq = 2",
        "seq 2",
    ),
    "previous-digest": (
        "UPDATE transitions SET digest = 'x' || substr(digest, 2) WHERE run_id = 'r1' AND seq = 1",
        "seq 2",
    ),
    "context": (
        "UPDATE runs SET context = '{\"forged\": 1}' WHERE run_id = 'r1'",
        "the row (input, context, error)",
    ),
    "input": (
        "UPDATE runs SET input = '{\"n\": 2}' WHERE run_id = 'r1'",
        "the row (input, context, error)",
    ),
}


def engine_for(journal) -> Engine:
    return Engine(SPEC, handlers=dict.fromkeys("abc", lambda _ctx: NEXT), journal=journal)


def damage(admin, schema: str, statement: str) -> None:
    with admin.cursor() as cursor:
        cursor.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        cursor.execute(statement)
        cursor.execute("SET search_path TO DEFAULT")


def stored(journal, run_id: str) -> tuple:
    run = journal.load(run_id)
    return run.seq, run.lease_owner, run.lease_token, len(journal.transitions(run_id))


def at_seq_two(journal, run_id: str = "r1", n: int = 1) -> str:
    engine = engine_for(journal)
    engine.start({"n": n}, run_id=run_id)
    engine.run(run_id, max_steps=2)
    return run_id


@pytest.fixture
def admin(postgres_server):
    return postgres_server.admin


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, postgres_journal, admin):
    """``r1`` at seq 2, damaged one way; (journal, what the refusal names)."""
    at_seq_two(postgres_journal)
    statement, what = DAMAGES[request.param]
    damage(admin, postgres_journal.schema, statement)
    return postgres_journal, f"{what} of run r1"


def refusal(journal, what: str) -> str:
    return f"journal {journal.location}: {what} fails its digest; {CHECK}"


def test_every_drive_refuses_it_and_writes_nothing(damaged):
    journal, what = damaged
    before = stored(journal, "r1")
    engine = engine_for(journal)
    for drive in (engine.resume, engine.step, engine.run):
        with pytest.raises(JournalError) as refused:
            drive("r1")
        assert refused.value.message == refusal(journal, what)
    with pytest.raises(JournalError, match="fails its digest"):
        engine.abort("r1", "stop")
    run = journal.load("r1")
    with pytest.raises(JournalError, match="fails its digest"):
        journal.claim_unchanged(run, "w1", ttl=30)
    (refused,) = journal.claim_many(["r1"], "w1", ttl=30)
    assert isinstance(refused, JournalError)
    assert journal.claim_unchanged_many([run], "w1", ttl=30) == [None]  # left to claim_many
    assert stored(journal, "r1") == before  # no lease taken, no transition


def test_a_group_claim_of_runs_as_written_leaves_a_damaged_one_to_claim_many(
    postgres_journal, admin
):
    """``claim_unchanged_many`` (an engine's ``arun`` of runs it started) verifies the heads it
    claimed; one failing rolls the group back, every run ``None``: ``claim_many`` then claims
    each the usual way and refuses the damaged one alone."""
    sound = at_seq_two(postgres_journal, "r2", n=2)
    at_seq_two(postgres_journal)
    runs = [postgres_journal.load(r) for r in ("r1", sound)]
    before = {r.run_id: stored(postgres_journal, r.run_id) for r in runs}
    damage(admin, postgres_journal.schema, DAMAGES["head-result"][0])
    assert postgres_journal.claim_unchanged_many(runs, "w1", ttl=30) == [None, None]
    assert {r.run_id: stored(postgres_journal, r.run_id) for r in runs} == before
    refused, claimed = postgres_journal.claim_many(["r1", sound], "w1", ttl=30)
    assert isinstance(refused, JournalError)
    assert (claimed.lease_owner, stored(postgres_journal, "r1")) == ("w1", before["r1"])


def test_an_undamaged_run_goes_on(postgres_journal):
    at_seq_two(postgres_journal)
    assert engine_for(postgres_journal).run("r1").status.value == "succeeded"


def test_claim_next_logs_it_once_and_takes_the_next(postgres_journal, admin, caplog):
    at_seq_two(postgres_journal, "r1")  # the older: claimed first, were it sound
    at_seq_two(postgres_journal, "r2", n=2)
    damage(admin, postgres_journal.schema, DAMAGES["head-result"][0])
    before = stored(postgres_journal, "r1")
    with caplog.at_level(logging.ERROR, "fsm_runner"):
        taken = postgres_journal.claim_next("w1", ttl=30, machine=SPEC.name, states=["c"])
        assert taken is not None
        assert taken.run_id == "r2"
        for _ in range(2):  # polls: the damaged run is passed by, not logged again
            assert (
                postgres_journal.claim_next("w1", ttl=30, machine=SPEC.name, states=["c"]) is None
            )
    assert [r.getMessage() for r in caplog.records] == [
        f"{refusal(postgres_journal, 'seq 2 of run r1')}; the run is skipped (not claimed)"
    ]
    assert stored(postgres_journal, "r1") == before


def test_a_worker_drives_the_others(postgres_journal, admin):
    at_seq_two(postgres_journal, "r1")
    at_seq_two(postgres_journal, "r2", n=2)
    damage(admin, postgres_journal.schema, DAMAGES["context"][0])
    engine = engine_for(postgres_journal)
    engine.work(exit_when_idle=True, idle_wait=0.05)
    assert postgres_journal.load("r2").status.value == "succeeded"
    assert postgres_journal.load("r1").seq == 2


@pytest.fixture
def r1_at_seq_two(postgres_journal) -> str:
    return at_seq_two(postgres_journal)


@pytest.fixture
def slow_ends(admin, postgres_journal, r1_at_seq_two):
    """Once ``r1`` is at seq 2 (its first two commits not held up), each commit that moves a run
    of the journal holds its row a second before it commits, holding an advisory lock of its
    own meanwhile (:func:`in_sleep` looks for it: other tests sleep in the same database).
    Dropped after (the schema goes back to the pool)."""
    key = random.randrange(1, 2**31)
    damage(
        admin,
        postgres_journal.schema,
        "CREATE FUNCTION hold() RETURNS trigger LANGUAGE plpgsql AS"
        f" $$ BEGIN PERFORM pg_advisory_xact_lock({key}); PERFORM pg_sleep(1); RETURN NEW; END $$;"
        " CREATE TRIGGER hold AFTER UPDATE ON runs FOR EACH ROW"
        " WHEN (NEW.seq <> OLD.seq) EXECUTE FUNCTION hold()",
    )
    yield key
    damage(admin, postgres_journal.schema, "DROP FUNCTION hold() CASCADE")


def in_sleep(admin, key: int) -> bool:
    """Whether a commit of the journal's holds its row (the trigger's advisory lock)."""
    found = admin.execute(
        "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = %s"
        " AND objsubid = 1 AND granted",
        (key,),
    )
    return found.fetchone() is not None


@pytest.mark.parametrize("claim", ["claim", "claim_many"])
def test_a_claim_that_waited_for_a_commit_reads_the_head_it_committed(
    postgres_journal, postgres_server, admin, slow_ends, claim
):
    """A claim locks the run's row; when a commit held it, PostgreSQL hands the read the row's
    new version joined to the head rows of the read's older snapshot (none at the new seq).
    The claim reads the head again, now that the row is its own: the run is sound and ended,
    not refused as damaged (an inspector's answer to a waiting run failed so in CI)."""
    other = type(postgres_journal)(postgres_server.url, schema=postgres_journal.schema)
    ending = threading.Thread(target=lambda: engine_for(other).run("r1"))
    ending.start()
    try:
        deadline = time.monotonic() + 30
        while not in_sleep(admin, slow_ends):  # the last commit holds the row
            assert time.monotonic() < deadline, "the run's last commit never began"
            time.sleep(0.01)
        if claim == "claim":
            with pytest.raises(RunTerminalError):
                postgres_journal.claim("r1", "w2", ttl=30)
        else:
            (answer,) = postgres_journal.claim_many(["r1"], "w2", ttl=30)
            assert isinstance(answer, RunTerminalError), answer
    finally:
        ending.join()
        other.close()
    assert postgres_journal.load("r1").status.value == "succeeded"
