"""Small machines and handlers shared by the tests."""

from __future__ import annotations

from fsm_runner import MachineSpec, RunEvent, State, Transition

NEXT = "NEXT"


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


def undo_v4(conn) -> None:
    """Turn a journal's schema back from version 4 (effects, visits) to version 3."""
    conn.execute("DROP TRIGGER transitions_advance_run")
    for column in ("visit_seq", "return_visit"):
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.execute("DROP TABLE effects")
    conn.execute(TRIGGER_BEFORE_V4)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0004_effects'")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
