"""The app of the telemetry process tests (``tests/test_telemetry_export.py``).

One machine, ``fetch`` → ``build`` → ``publish`` → ``done``. Each phase appends
``<phase> <pid>`` to ``$FSM_OTEL_DIR/calls``. ``build`` kills its own process with SIGKILL the
first time a run whose input says ``{"kill": true}`` reaches it (the file ``killed`` in that
directory remembers it did), and raises (``SYSTEM_ERROR``: the run fails) for ``{"fail": true}``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from fsm_runner import Engine, MachineSpec, RunEvent, State, Transition
from fsm_runner.journal import Journal

__all__ = ["SPEC", "make_engine"]

SPEC = MachineSpec(
    "otel-app",
    [
        State("fetch", handler="fetch"),
        State("build", handler="build"),
        State("publish", handler="publish"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [
        Transition("fetch", "FETCHED", "build"),
        Transition("build", "BUILT", "publish"),
        Transition("publish", "PUBLISHED", "done"),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)


def _here() -> Path:
    return Path(os.environ["FSM_OTEL_DIR"])


def _called(phase: str) -> None:
    with (_here() / "calls").open("a", encoding="utf-8") as calls:
        calls.write(f"{phase} {os.getpid()}\n")


def _fetch(ctx) -> str:
    _called("fetch")
    return "FETCHED"


def _build(ctx) -> str:
    _called("build")
    wanted = ctx.input or {}
    if wanted.get("kill") and not (_here() / "killed").exists():
        (_here() / "killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    if wanted.get("fail"):
        raise RuntimeError("the build broke")
    return "BUILT"


def _publish(ctx) -> str:
    _called("publish")
    return "PUBLISHED"


def make_engine(journal: Journal) -> Engine:
    """The app's engine on the command's journal (telemetry as the process configured it)."""
    return Engine(
        SPEC, handlers={"fetch": _fetch, "build": _build, "publish": _publish}, journal=journal
    )
