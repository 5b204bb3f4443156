"""Small machines and handlers shared by the tests."""

from __future__ import annotations

import attrs

from fsm_runner import RETURN, MachineSpec, RunEvent, State, Transition

NEXT = "NEXT"
PHASE_COMPLETED = RunEvent.PHASE_COMPLETED.value
SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
LOST = "SERVER_LOST"
FOUND = "SERVER_FOUND"


def snapshot(journal, run_id: str):
    """The run row and every transition: what "nothing changed" compares.

    A refused step has still taken and given back the run's lease: the lease token (the
    bookkeeping of who may write) is left out, and the lease must be free again.
    """
    run = journal.load(run_id)
    assert run.lease_owner is None, f"run {run_id} is still leased to {run.lease_owner}"
    return attrs.evolve(run, lease_token=0, lease_expires_at=None), list(
        journal.transitions(run_id)
    )


def linear_spec(*phases: str, name: str = "linear") -> MachineSpec:
    """phase1 -NEXT-> phase2 ... -NEXT-> done; SYSTEM_ERROR from anywhere -> failed; USER_ABORTED -> canceled."""
    states = [State(phase, handler=phase) for phase in phases]
    states += [
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ]
    transitions = [
        Transition(phase, NEXT, nxt)
        for phase, nxt in zip(phases, [*phases[1:], "done"], strict=True)
    ]
    transitions += [
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ]
    return MachineSpec(name, states, transitions)


def loop_spec() -> MachineSpec:
    """The 4-state loop used by the benchmark: a -> b -> c -> d -> a ... (never ends)."""
    names = ["a", "b", "c", "d"]
    return MachineSpec(
        "loop",
        [State(n, handler="noop") for n in names],
        [Transition(n, NEXT, m) for n, m in zip(names, names[1:] + names[:1], strict=True)],
    )


# The trigger as schema versions 1-3 wrote it (before it kept visit_seq).
TRIGGER_BEFORE_V4 = """CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions
WHEN NEW.seq > 0
BEGIN
    UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                    updated_at = NEW.at
     WHERE run_id = NEW.run_id AND seq = NEW.seq - 1;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE changes() = 0;
END"""


# The trigger as schema version 5 wrote it (before run heads were read from transitions).
TRIGGER_V5 = """CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions
WHEN NEW.seq > 0
BEGIN
    UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                    updated_at = NEW.at,
                    visit_seq = CASE WHEN NEW.from_state IS NEW.to_state
                                       AND NEW.event IN ('RETRIED', 'INTERRUPTED')
                                     THEN visit_seq ELSE NEW.seq END
     WHERE run_id = NEW.run_id AND seq = NEW.seq - 1 AND lease_token = NEW.lease_token;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE changes() = 0;
END"""


# The trigger as schema version 4 wrote it (before it checked lease tokens).
TRIGGER_V4 = TRIGGER_V5.replace(" AND lease_token = NEW.lease_token", "")
assert TRIGGER_V4 != TRIGGER_V5


def undo_v6(conn) -> None:
    """Turn a journal's schema back from version 6 (run heads read from transitions) to 5."""
    heads = conn.execute(
        "SELECT run_id, state, seq, iteration, updated_at, visit_seq FROM runs"
    ).fetchall()
    conn.execute("DROP VIEW runs")
    conn.execute("DROP TRIGGER transitions_fence")
    conn.execute("ALTER TABLE run_rows RENAME TO runs")
    conn.executemany(
        "UPDATE runs SET state = ?, seq = ?, iteration = ?, updated_at = ?, visit_seq = ?"
        " WHERE run_id = ?",
        [(*head[1:], head[0]) for head in heads],
    )
    conn.execute(TRIGGER_V5)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0006_derived_heads'")
    conn.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")


def undo_v5(conn) -> None:
    """Turn a journal's schema back from version 6 to version 4 (no lease tokens, recoveries)."""
    undo_v6(conn)
    conn.execute("DROP TRIGGER transitions_advance_run")
    conn.execute("DROP INDEX IF EXISTS idx_runs_status_lease_expires_at")
    conn.execute("DROP INDEX IF EXISTS idx_runs_status_machine_created_at")
    conn.execute("ALTER TABLE transitions DROP COLUMN lease_token")
    conn.execute("ALTER TABLE runs DROP COLUMN recoveries")
    conn.execute(TRIGGER_V4)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0005_leases'")
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")


def undo_v4(conn) -> None:
    """Turn a journal's schema back from version 6 to version 3 (no effects, no visits)."""
    undo_v5(conn)
    conn.execute("DROP TRIGGER transitions_advance_run")
    for column in ("visit_seq", "return_visit"):
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.execute("DROP TABLE effects")
    conn.execute(TRIGGER_BEFORE_V4)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0004_effects'")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


def one_line_error(result, code: int = 1) -> str:
    """The one line a CLI error printed, checking its exit code and that nothing else came."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


def start_release(journal_path, tmp_path, stop_after: int | None, version: str = "9.9.9") -> str:
    """A run of the release example in ``journal_path``, driven for ``stop_after`` phases."""
    from fsm_runner.examples import release

    engine = release.make_engine(journal_path)
    run_id = engine.start({"version": version, "workspace": str(tmp_path / "ws")})
    engine.run(run_id, max_steps=stop_after)
    engine.journal.close()
    return run_id


def nested_spec(*, extra_transitions=(), initial="", status_events=None, inner=None, **outer):
    """prepare -> working[a, inner[b, c], d] -> done; LOST anywhere in working -> recovering.

    recovering -FOUND-> RETURN (back to the sub-phase that was lost); SYSTEM_ERROR -> failed.
    """
    return MachineSpec(
        "nested",
        [
            State("prepare", handler="prepare"),
            State(
                "working",
                children=[
                    State("a", handler="a"),
                    State(
                        "inner",
                        children=[State("b", handler="b"), State("c", handler="c")],
                        **(inner or {}),
                    ),
                    State("d", handler="d"),
                ],
                **outer,
            ),
            State("recovering", handler="recover"),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            *extra_transitions,
            Transition("prepare", PHASE_COMPLETED, "working"),
            Transition("working", PHASE_COMPLETED, "done"),
            Transition("working", LOST, "recovering"),
            Transition("recovering", FOUND, RETURN),
            Transition("*", SYSTEM_ERROR, "failed"),
        ],
        initial=initial,
        status_events=status_events or {},
    )


def iteration_loop_spec() -> MachineSpec:
    """building (starts an iteration) -> verifying -> feedback -> building ..., with a limit."""
    return MachineSpec(
        "loop",
        [
            State("building", handler="build", starts_iteration=True),
            State("verifying", handler="verify"),
            State("feedback", handler="feedback"),
            State("succeeded", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("building", "BUILT", "verifying"),
            Transition("verifying", RunEvent.VERIFY_PASSED, "succeeded"),
            Transition("verifying", RunEvent.VERIFY_FAILED_RETRYABLE, "feedback"),
            Transition(
                "feedback", "FEEDBACK_READY", "failed", unless=["iterations_left"],
                reason="iteration limit spent",
            ),
            Transition("feedback", "FEEDBACK_READY", "building"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )  # fmt: skip
