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
