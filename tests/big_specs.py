"""Specs of any size and depth, for `test_big_specs.py` and `bench/bench_big_spec.py`."""

from __future__ import annotations

import itertools

from fsm_runner import RETURN, MachineSpec, State, Transition, Wait

NEXT = "NEXT"
PHASE_COMPLETED = "PHASE_COMPLETED"
FAILED = "FAILED"
CANCEL = "CANCEL"
LOST = "SERVER_LOST"
FOUND = "SERVER_FOUND"


def big_spec(states: int, *, name: str = "big") -> MachineSpec:
    """A machine of about ``states`` states, shaped like a long real one.

    Blocks of ten: most a chain of leaves that move on with ``NEXT`` and, on ``FAILED``,
    go back three states while the ``retries_left`` guard allows it (a back-edge) and to
    ``failed`` otherwise; every fifth block a composite of three sub-phases (handler ``sub``:
    they complete), the middle one itself a composite of two, whose ``SERVER_LOST`` goes to
    ``recovering`` (handler ``recover``), which RETURNs.
    A wildcard ``CANCEL`` from every non-terminal state; three terminal states.
    """
    top: list[State] = []
    transitions: list[Transition] = []
    chain: list[str] = []  # the top-level names, in the order a run goes through them
    count = 0
    block = 0
    while count < states - 4:
        if block % 5 == 4:
            prefix = f"c{block}"
            inner = State(
                f"{prefix}_mid",
                children=[
                    State(f"{prefix}_mid_a", handler="sub"),
                    State(f"{prefix}_mid_b", handler="sub"),
                ],
            )
            composite = State(
                prefix,
                children=[
                    State(f"{prefix}_a", handler="sub"),
                    inner,
                    State(f"{prefix}_z", handler="sub"),
                ],
            )
            top.append(composite)
            transitions.append(Transition(prefix, LOST, "recovering"))
            chain.append(prefix)
            count += 7
        else:
            for index in range(10):
                state = f"s{block}_{index}"
                top.append(State(state, handler="work"))
                chain.append(state)
                if len(chain) > 3:
                    transitions.append(Transition(state, FAILED, chain[-4], guards="retries_left"))
                transitions.append(Transition(state, FAILED, "failed"))
            count += 10
        block += 1
    for current, following in itertools.pairwise(chain):
        event = "PHASE_COMPLETED" if current.startswith("c") else NEXT
        transitions.append(Transition(current, event, following))
    last_event = "PHASE_COMPLETED" if chain[-1].startswith("c") else NEXT
    transitions.append(Transition(chain[-1], last_event, "succeeded"))
    transitions.append(Transition("recovering", FOUND, RETURN))
    transitions.append(Transition("*", CANCEL, "cancelled"))
    top += [
        State("recovering", handler="recover"),
        State("succeeded", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("cancelled", terminal=True, outcome="aborted"),
    ]
    return MachineSpec(name, states=top, transitions=transitions)


def big_handlers() -> dict[str, object]:
    """Handlers for :func:`big_spec`: a run goes down the chain, through every sub-phase."""
    return {
        "work": lambda _ctx: NEXT,
        "sub": lambda _ctx: PHASE_COMPLETED,
        "recover": lambda _ctx: FOUND,
    }


def deep_spec(depth: int, *, name: str = "deep") -> MachineSpec:
    """A machine whose one phase sits ``depth`` composites deep (``depth`` 0: no composite)."""
    state = State("work", handler="work")
    for level in range(depth, 0, -1):
        state = State(f"level{level}", children=[state])
    return MachineSpec(
        name,
        states=[state, State("done", terminal=True)],
        transitions=[Transition(state.name, "PHASE_COMPLETED", "done")],
    )


def faulty_specs() -> dict[str, tuple[MachineSpec, dict[str, object]]]:
    """Small specs with known problems, and the registrations to validate them with.

    `test_big_specs.py` holds the problems the quadratic validate() of before found in them,
    in its order: the linear one must find exactly those.
    """
    inner = State("inner", children=[State("i1", handler="work"), State("i2", handler="work")])
    composite = State("outer", children=[State("o1", handler="work"), inner])
    graph = MachineSpec(
        "graph",
        states=[
            State("a", handler="work"),
            State("b", handler="work"),
            State("island", handler="work"),
            State("stuck", handler="work"),
            State("done", terminal=True),
            State("lost", terminal=True),
        ],
        transitions=[
            Transition("a", NEXT, "b"),
            Transition("a", NEXT, "done"),
            Transition("b", NEXT, "stuck"),
            Transition("b", FAILED, "a", guards="retries_left"),
            Transition("island", NEXT, "done"),
            Transition("done", NEXT, "a"),
            Transition("ghost", NEXT, "nowhere"),
            Transition("*", CANCEL, "done"),
            Transition("b", "\udc80", "done", guards=7, reason="x\udc80"),  # type: ignore[arg-type]
            Transition("island", FAILED, "lost", unless="g\u00e9"),
        ],
    )
    nested = MachineSpec(
        "nested",
        states=[
            State("start", handler="work"),
            composite,
            State("free", handler="work", terminal=True),
            State("waits", wait=Wait(timeout=5)),
            State("end", terminal=True, outcome="failed"),
        ],
        transitions=[
            Transition("start", NEXT, "outer"),
            Transition("outer", "PHASE_COMPLETED", "end"),
            Transition("i2", LOST, RETURN),
            Transition("start", 5, "end"),  # type: ignore[arg-type]
        ],
        initial="start",
    )
    registered = big_spec(45, name="registered")
    return {
        "graph": (graph, {"handlers": {"work"}, "guards": set()}),
        "nested": (nested, {"handlers": {"other"}, "guards": {"g"}}),
        "registered": (registered, {"handlers": {"work", "sub"}, "guards": {"other"}}),
        "valid": (registered, {}),
    }
