"""The sandbox preset as an app, for the effects crash tests: a real process to SIGKILL.

The run's mutation is a hit on the counter server at ``FSM_TEST_COUNTER_URL``
(:class:`tests.servers.counter_server.CounterClient`); the journal is the SQLite file
``FSM_TEST_JOURNAL``. Other settings, from the environment:

``FSM_TEST_IDEMPOTENT=1``
    declare the mutation idempotent.
``FSM_TEST_BLOCK_AFTER_MUTATION=MARKER``
    once the mutation has returned (and is recorded done), touch ``MARKER`` and sleep for a
    long time, before the transition out of ``mutating`` is journaled: the test kills here.

Usage (from the repository root)::

    python -m tests.apps.effects_app start KEY
    python -m tests.apps.effects_app resume RUN_ID

Both print the run id on the first line (flushed at once), then the final state, then the type
of the run's last error (``-`` when there is none).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fsm_runner import PhaseContext, PhaseResult, SqliteJournal
from fsm_runner.presets.sandbox import MemoryTopic, MutatePhase, sandbox_engine
from tests.servers.counter_server import CounterClient


class BlockingMutatePhase(MutatePhase):
    """The preset's mutation, then a long sleep before the phase returns."""

    def __init__(self, marker: Path, *, idempotent: bool) -> None:
        super().__init__(idempotent=idempotent)
        self.marker = marker

    def run(self, ctx: PhaseContext) -> PhaseResult:
        result = super().run(ctx)
        self.marker.touch()
        time.sleep(600)  # killed here by the test
        return result


def main(argv: list[str]) -> int:
    """``start KEY`` a run and run it, or ``resume RUN_ID``; print id, state, error type."""
    idempotent = os.environ.get("FSM_TEST_IDEMPOTENT") == "1"
    block = os.environ.get("FSM_TEST_BLOCK_AFTER_MUTATION")
    handlers = {"mutate": BlockingMutatePhase(Path(block), idempotent=idempotent)} if block else {}
    with SqliteJournal(os.environ["FSM_TEST_JOURNAL"]) as journal:
        engine = sandbox_engine(
            journal=journal,
            topic=MemoryTopic(),
            store=CounterClient(os.environ["FSM_TEST_COUNTER_URL"]),
            idempotent_mutation=idempotent,
            handlers=handlers,
        )
        if argv[:1] == ["start"] and len(argv) == 2:
            run_id = engine.start({"key": argv[1], "change": 1})
        elif argv[:1] == ["resume"] and len(argv) == 2:
            run_id = argv[1]
        else:
            print(
                "usage: python -m tests.apps.effects_app start KEY | resume RUN_ID", file=sys.stderr
            )
            return 2
        print(run_id, flush=True)
        run = engine.resume(run_id)
        print(run.state, flush=True)
        print((run.error or {}).get("type", "-"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
