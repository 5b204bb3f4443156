"""The journals of ``bench_scale.py``: many ended runs of a four-phase machine, built fast.

One run is made by the engine, the others are cloned from it by SQL in the journal's own schema
(its columns read with ``PRAGMA table_info``; no index, trigger or schema version named), so the
same build works on every schema version the journal may have.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

from fsm_runner import Engine, MachineSpec, SqliteJournal, State, Transition
from fsm_runner.journal._sqlite_chain import fill_digests
from fsm_runner.records import utc_now
from tests.helpers import NEXT

__all__ = [
    "CHECK_SPEC",
    "PHASES",
    "UI_KINDS",
    "build_check_journal",
    "build_ui_journal",
    "build_ui_journal_postgres",
    "handlers",
    "run_id_of",
]

PHASES = "abcd"
#: four phases: seqs 0..4, five transitions a run
CHECK_SPEC = MachineSpec(
    "scaled",
    [State(p, handler="noop") for p in PHASES] + [State("done", terminal=True)],
    [Transition(p, NEXT, q) for p, q in zip(PHASES, [*PHASES[1:], "done"], strict=True)],
)
#: runs cloned by one INSERT ... SELECT (one transaction each: the WAL stays bounded)
_BATCH = 50_000
#: run ``i``'s time (``back`` seconds earlier) as ``format_utc`` writes it, to the millisecond
_TIME_OF = (
    "strftime('%Y-%m-%dT%H:%M:%f', :oldest + (run_key - :template) * :step - {back},"
    " 'unixepoch') || '000+00:00'"
)


def handlers() -> dict[str, object]:
    """CHECK_SPEC's one handler: every phase moves on at once."""
    return {"noop": lambda _ctx: NEXT}


def build_check_journal(path: Path, runs: int, *, spread: dt.timedelta | None = None) -> None:
    """``runs`` ended runs of CHECK_SPEC: one by the engine, the others cloned from it by SQL.

    Clone ``i`` (``1 <= i < runs``) has run key ``template + i`` and run id
    :func:`run_id_of` ``(i)``. With ``spread``, run ``i`` (the template is run 0) was last
    updated at ``now - spread + i * spread / runs`` (to the millisecond) and created a second
    before: oldest key first, all within ``spread`` of now, each at its own time (a cutoff
    selects the oldest runs, as many as wanted). Without it every run keeps the template's.
    """
    with SqliteJournal(path) as journal:
        engine = Engine(CHECK_SPEC, handlers=handlers(), journal=journal)
        engine.run(engine.start({"n": 0}))
        engine.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.create_function("run_id_of", 1, run_id_of, deterministic=True)
    oldest = (utc_now() - (spread or dt.timedelta())).timestamp()
    step = (spread or dt.timedelta()).total_seconds() / runs
    (template,) = conn.execute("SELECT run_key FROM run_rows").fetchone()
    columns = [row[1] for row in conn.execute("PRAGMA table_info(run_rows)")]
    copied = [c for c in columns if c not in ("run_key", "run_id")]
    tcolumns = [row[1] for row in conn.execute("PRAGMA table_info(transitions)")]
    tcopied = [c for c in tcolumns if c not in ("run_key", "run_id")]
    for start in range(0 if spread else 1, runs, _BATCH):
        end = min(start + _BATCH, runs) - 1
        first = max(start, 1)
        conn.execute("BEGIN IMMEDIATE")
        if first <= end:
            conn.execute(
                f"WITH RECURSIVE n(i) AS (SELECT ? UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
                f" INSERT INTO run_rows (run_key, run_id, {', '.join(copied)})"
                f" SELECT ? + i, run_id_of(i), {', '.join('t.' + c for c in copied)}"
                f" FROM n, run_rows AS t WHERE t.run_key = ?",
                (first, end, template, template),
            )
            conn.execute(
                f"INSERT INTO transitions (run_key, run_id, {', '.join(tcopied)})"
                f" SELECT r.run_key, r.run_id, {', '.join('t.' + c for c in tcopied)}"
                f" FROM run_rows AS r, transitions AS t"
                f" WHERE r.run_key BETWEEN ? AND ? AND t.run_key = ? ORDER BY r.run_key, t.seq",
                (template + first, template + end, template),
            )
        if spread:  # after the transitions: a trigger may have copied their times to the row
            conn.execute(
                f"UPDATE run_rows SET created_at = {_TIME_OF.format(back=1)},"
                f" updated_at = {_TIME_OF.format(back=0)} WHERE run_key BETWEEN :first AND :last",
                {"oldest": oldest, "step": step, "template": template}
                | {"first": template + start, "last": template + end},
            )
        conn.execute("COMMIT")
    # Each clone's digests, as its writer would have stored them (its run id is its own, so
    # the template's are not): the check verifies every run's chain (schema 11).
    conn.execute("BEGIN IMMEDIATE")
    fill_digests(conn)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def run_id_of(n: int) -> str:
    """A run id as random in key order as uuid4's, but the same in every build."""
    return hashlib.md5(f"run {n}".encode(), usedforsecurity=False).hexdigest()


#: What the inspector's journal holds, run ``i`` by ``i % 6``: a third done, a sixth failed, half
#: active (waiting in its first or second phase, unleased: what a worker would claim next).
UI_KINDS = ("done", "a", "b", "done", "a", "failed")


def _ui_spec() -> MachineSpec:
    """bench_ui's machine: three phases, then done; failed from anywhere."""
    return MachineSpec(
        "bench",
        [State(p, handler=p) for p in "abc"]
        + [State("done", terminal=True), State("failed", terminal=True, outcome="failed")],
        [Transition(p, NEXT, q) for p, q in zip("abc", ["b", "c", "done"], strict=True)]
        + [Transition("*", "SYSTEM_ERROR", "failed")],
    )


def _ui_templates(journal: Any) -> dict[str, str]:
    """One run of each kind of :data:`UI_KINDS`, made by the engine: their ids, by kind."""

    def failing(_ctx: object) -> str:
        raise RuntimeError("the bench's failed run")

    spec = _ui_spec()
    ok = Engine(spec, handlers=dict.fromkeys("abc", lambda _ctx: NEXT), journal=journal)
    bad = Engine(spec, handlers={"a": failing, "b": failing, "c": failing}, journal=journal)
    made = {"done": ok.start({}), "a": ok.start({}), "b": ok.start({}), "failed": bad.start({})}
    ok.run(made["done"])
    ok.step(made["b"])
    bad.run(made["failed"])
    ok.close()
    bad.close()
    return made


def build_ui_journal(path: Path, runs: int, *, days: float = 30.0) -> None:
    """``runs`` runs of bench_ui's 3-phase machine ``bench``, built fast for the inspector's bench.

    One run of each kind (:data:`UI_KINDS`) is made by the engine; run ``i`` (``0 <= i < runs``)
    is a copy of its kind's, with id :func:`run_id_of` ``(i)``, input ``{"n": i}`` and its own
    times: created in key order over the last ``days`` days, updated a second later. (The copies'
    digests are their templates': the inspector's pages do not verify them, ``check`` would.)
    """
    with SqliteJournal(path) as journal:
        made = _ui_templates(journal)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.create_function("run_id_of", 1, run_id_of, deterministic=True)
    keys = {kind: conn.execute("SELECT run_key FROM run_rows WHERE run_id = ?", (run_id,)).fetchone()[0]
            for kind, run_id in made.items()}  # fmt: skip
    (base,) = conn.execute("SELECT max(run_key) + 1 FROM run_rows").fetchone()
    conn.execute("CREATE TEMP TABLE kinds (mod INTEGER PRIMARY KEY, template INTEGER)")
    conn.executemany(
        "INSERT INTO kinds VALUES (?, ?)", [(i, keys[k]) for i, k in enumerate(UI_KINDS)]
    )
    columns = [row[1] for row in conn.execute("PRAGMA table_info(run_rows)")]
    copied = [
        c for c in columns if c not in ("run_key", "run_id", "input", "created_at", "updated_at")
    ]
    tcolumns = [row[1] for row in conn.execute("PRAGMA table_info(transitions)")]
    tcopied = [c for c in tcolumns if c not in ("run_key", "run_id")]
    oldest = (utc_now() - dt.timedelta(days=days)).timestamp()
    step = days * 86400 / max(runs, 1)
    stamp = (
        "strftime('%Y-%m-%dT%H:%M:%f', :oldest + n.i * :step + {back}, 'unixepoch') || '000+00:00'"
    )
    for start in range(0, runs, _BATCH):
        end = min(start + _BATCH, runs) - 1
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT :first UNION ALL SELECT i + 1 FROM n WHERE i < :last)"
            f" INSERT INTO run_rows (run_key, run_id, input, created_at, updated_at, {', '.join(copied)})"
            f" SELECT :base + n.i, run_id_of(n.i), json_object('n', n.i), {stamp.format(back=0)},"
            f" {stamp.format(back=1)}, {', '.join('t.' + c for c in copied)}"
            f" FROM n JOIN kinds AS k ON k.mod = n.i % {len(UI_KINDS)}"
            " JOIN run_rows AS t ON t.run_key = k.template ORDER BY n.i",
            {"first": start, "last": end, "base": base, "oldest": oldest, "step": step},
        )
        conn.execute(
            f"INSERT INTO transitions (run_key, run_id, {', '.join(tcopied)})"
            f" SELECT r.run_key, r.run_id, {', '.join('t.' + c for c in tcopied)}"
            f" FROM run_rows AS r JOIN kinds AS k ON k.mod = (r.run_key - :base) % {len(UI_KINDS)}"
            " JOIN transitions AS t ON t.run_key = k.template"
            " WHERE r.run_key BETWEEN :base + :first AND :base + :last ORDER BY r.run_key, t.seq",
            {"first": start, "last": end, "base": base},
        )
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def build_ui_journal_postgres(url: str, schema: str, runs: int, *, days: float = 30.0) -> None:
    """:func:`build_ui_journal` on PostgreSQL: the same runs in ``schema`` (made here).

    The templates by the engine, the copies by one ``INSERT ... SELECT FROM generate_series``
    a batch (runs and their transitions in one statement), then ``VACUUM (ANALYZE)`` as
    autovacuum would leave the tables.
    """
    import psycopg

    from fsm_runner import PostgresJournal

    with PostgresJournal(url, schema=schema) as journal:
        made = _ui_templates(journal)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')

        def columns(table: str, skipped: tuple[str, ...]) -> list[str]:
            rows = conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
                " AND table_name = %s AND is_generated = 'NEVER' AND is_identity = 'NO'"
                " ORDER BY ordinal_position",
                (schema, table),
            )
            return [row[0] for row in rows if row[0] not in skipped]

        copied = columns("runs", ("run_id", "input", "created_at", "updated_at"))
        tcopied = columns("transitions", ("run_id",))
        conn.execute("CREATE TEMP TABLE kinds (mod int PRIMARY KEY, template text)")
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO kinds VALUES (%s, %s)", [(i, made[k]) for i, k in enumerate(UI_KINDS)]
            )
        oldest = utc_now() - dt.timedelta(days=days)
        step = dt.timedelta(seconds=days * 86400 / max(runs, 1))
        for start in range(0, runs, _BATCH):
            end = min(start + _BATCH, runs) - 1
            conn.execute(
                "WITH n AS (SELECT i, md5('run ' || i) AS run_id, k.template"
                f" FROM generate_series(%(first)s::int, %(last)s::int) AS i"
                f" JOIN kinds AS k ON k.mod = i %% {len(UI_KINDS)}),"
                f" copies AS (INSERT INTO runs (run_id, input, created_at, updated_at,"
                f" {', '.join(copied)}) SELECT n.run_id, json_build_object('n', n.i)::text,"
                " %(oldest)s + n.i * %(step)s, %(oldest)s + n.i * %(step)s + interval '1 second',"
                f" {', '.join('t.' + c for c in copied)} FROM n JOIN runs AS t"
                " ON t.run_id = n.template ORDER BY n.i RETURNING run_id)"
                f" INSERT INTO transitions (run_id, {', '.join(tcopied)})"
                f" SELECT n.run_id, {', '.join('t.' + c for c in tcopied)}"
                " FROM n JOIN transitions AS t ON t.run_id = n.template ORDER BY n.i, t.seq",
                {"first": start, "last": end, "oldest": oldest, "step": step},
            )
        conn.execute("VACUUM (ANALYZE) runs")
        conn.execute("VACUUM (ANALYZE) transitions")
