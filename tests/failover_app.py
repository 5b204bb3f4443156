"""The worker app of the failover tests and bench (``tests/test_failover.py``,
``tests/bench/bench_failover.py``).

One machine, ``slow`` → ``done``: the phase appends ``call <pid> <run_id> <time>`` to
``$FSM_FAILOVER_DIR/calls`` when it starts, then blocks until the file ``release`` exists in
that directory (so a test can kill its worker mid-phase). Building the engine appends
``ready <pid>``. ``FSM_FAILOVER_HOST`` names the host in the worker id (two "hosts" on one
machine: the pid of another host's worker tells nothing here); ``FSM_FAILOVER_LEASE_TTL`` sets
the lease (seconds, default 30).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from fsm_runner import Engine, MachineSpec, MemoryJournal, State, Transition

__all__ = ["SPEC", "make_engine"]

SPEC = MachineSpec(
    "failover",
    [State("slow", handler="slow"), State("done", terminal=True)],
    [Transition("slow", "DONE", "done")],
)


def _log(line: str) -> None:
    with (Path(os.environ["FSM_FAILOVER_DIR"]) / "calls").open("a", encoding="utf-8") as file:
        file.write(line + "\n")


def slow(ctx):
    _log(f"call {os.getpid()} {ctx.run.run_id} {time.time():.6f}")
    release = Path(os.environ["FSM_FAILOVER_DIR"]) / "release"
    while not release.exists():
        time.sleep(0.01)
    return "DONE"


def make_engine() -> Engine:
    """The app's engine (``--app tests.failover_app:make_engine``); the CLI gives the journal."""
    host = os.environ.get("FSM_FAILOVER_HOST")
    worker_id = None if host is None else f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    engine = Engine(
        SPEC,
        handlers={"slow": slow},
        journal=MemoryJournal(),
        worker_id=worker_id,
        lease_ttl=float(os.environ.get("FSM_FAILOVER_LEASE_TTL", "30")),
    )
    _log(f"ready {os.getpid()}")
    return engine
