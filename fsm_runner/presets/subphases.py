"""The sub-phases preset: a phase of ordered sub-phases beside a helper server the harness owns.

::

    analysis: 1a → 1b → codeql → 1c ──PHASE_COMPLETED──▶ done
         │  any sub-phase ──SERVER_UNREACHABLE──▶ recovering ──SERVER_RECOVERED──▶ (that sub-phase)
         │                                            └──RESTART_BUDGET_SPENT──▶ failed
         └  any sub-phase ──PHASE_FAILED──▶ failed

plus ``SYSTEM_ERROR → failed`` and ``USER_ABORTED → canceled`` from anywhere. Every sub-phase
calls the helper server (:mod:`fsm_runner.presets.helper_server`) through the one service it is
given, ``ctx.services["server"]``: a client that can do work and nothing else. When the server
dies, the sub-phase reports ``SERVER_UNREACHABLE``; the harness's ``recovering`` state restarts
the server within its budget and returns the run to the sub-phase that failed — as that visit's
next attempt — never to one already completed.

A :class:`Harness` puts it together: it owns the server (through a
:class:`fsm_runner.supervisor.Supervisor`), the engine, and turns SIGTERM into an interruption
that is journaled (``INTERRUPTED``) and leaves the run resumable. From a shell::

    python -m fsm_runner.presets.subphases --journal j.db --workdir w start --delay 1b=5
    python -m fsm_runner.presets.subphases --journal j.db --workdir w resume RUN_ID

This module uses only fsm_runner's public API (and the supervisor), as a host app would.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsm_runner import (
    RETURN,
    Engine,
    Journal,
    MachineSpec,
    Outcome,
    PhaseContext,
    PhaseResult,
    RetryPolicy,
    RunEvent,
    RunRecord,
    RunStatus,
    SqliteJournal,
    State,
    Transition,
    interrupt_on_sigterm,
)
from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.presets.helper_server import (
    HelperServer,
    HelperServerError,
    ServerUnreachableError,
)
from fsm_runner.supervisor import RecoveryPhase, Supervisor

__all__ = ["SUBPHASES", "SUBPHASE_NAMES", "Harness", "SubPhase", "main", "plain_spec"]

#: The sub-phases of ``analysis``, in order.
SUBPHASE_NAMES = ("1a", "1b", "codeql", "1c")

_BUDGET_SPENT_REASON = "helper server restart budget spent"
_DEFAULT_BACKOFF = RetryPolicy(wait_initial=0.05, wait_max=2.0)


def _shared_states() -> list[State]:
    return [
        State(
            "recovering",
            handler="recover",
            description="the harness restarts the helper server, then returns the run",
        ),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ]


def _shared_transitions() -> list[Transition]:
    return [
        Transition("recovering", RunEvent.SERVER_RECOVERED, RETURN),
        Transition(
            "recovering", RunEvent.RESTART_BUDGET_SPENT, "failed", reason=_BUDGET_SPENT_REASON
        ),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ]


#: The machine: ``analysis`` made of four sub-phases, and the harness's recovery state.
SUBPHASES = MachineSpec(
    "subphases",
    states=[
        State(
            "analysis",
            children=[
                State(name, handler="work", description=f"sub-phase {name}")
                for name in SUBPHASE_NAMES
            ],
            description="ordered sub-phases that call the helper server",
        ),
        *_shared_states(),
    ],
    transitions=[
        # Sub-phases advance on PHASE_COMPLETED implicitly; only the last one's leaves.
        Transition("analysis", RunEvent.PHASE_COMPLETED, "done"),
        Transition("analysis", RunEvent.SERVER_UNREACHABLE, "recovering"),
        Transition("analysis", RunEvent.PHASE_FAILED, "failed"),
        *_shared_transitions(),
    ],
)


def plain_spec() -> MachineSpec:
    """The same four phases as a flat machine, with the same failure edges.

    A run that never loses its server takes exactly the same transitions in both machines.
    """
    following = [*SUBPHASE_NAMES[1:], "done"]
    return MachineSpec(
        "subphases-plain",
        states=[
            *(State(name, handler="work", description=f"phase {name}") for name in SUBPHASE_NAMES),
            *_shared_states(),
        ],
        transitions=[
            *(
                Transition(name, RunEvent.PHASE_COMPLETED, dest)
                for name, dest in zip(SUBPHASE_NAMES, following, strict=True)
            ),
            Transition(SUBPHASE_NAMES, RunEvent.SERVER_UNREACHABLE, "recovering"),
            Transition(SUBPHASE_NAMES, RunEvent.PHASE_FAILED, "failed"),
            *_shared_transitions(),
        ],
    )


class SubPhase:
    """The handler of every sub-phase: do the sub-phase's work on the helper server.

    The work is named after the state (``ctx.state``). The run's input may slow a sub-phase
    down or make it fail, for demos and tests: ``{"delays": {"1b": 5}, "fail": {"1c": "why"}}``
    (the server applies a delay only the first time it does that work).

    It reports the :class:`fsm_runner.RunStatus` events — ``OK``, ``SERVER_UNREACHABLE`` when
    the server does not answer, ``ERROR`` when it answers an error — as a
    :class:`fsm_runner.PhaseResult` so that the server's answer, or the reason for the failure,
    is journaled with the transition. It never touches the server's lifecycle: it cannot.
    """

    def __repr__(self) -> str:
        return "SubPhase()"

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Call the server for ``ctx.state`` and say how it went.

        Args:
            ctx: the sub-phase's context; ``ctx.services["server"]`` is the server's client.

        Returns:
            ``PHASE_COMPLETED`` with the server's answer as output, or ``SERVER_UNREACHABLE``
            or ``PHASE_FAILED`` with the error.
        """
        options: Mapping[str, Any] = ctx.input if isinstance(ctx.input, Mapping) else {}
        delay = float((options.get("delays") or {}).get(ctx.state, 0.0))
        fail = (options.get("fail") or {}).get(ctx.state)
        try:
            answer = ctx.services["server"].work(ctx.state, delay=delay, fail=fail)
        except ServerUnreachableError as exc:
            ctx.logger.warning("helper server unreachable: %s", exc.detail)
            return PhaseResult(RunStatus.SERVER_UNREACHABLE.event, error=_error(exc))
        except HelperServerError as exc:
            return PhaseResult(RunStatus.ERROR.event, error=_error(exc))
        return PhaseResult(RunStatus.OK.event, output=answer)


def _error(exc: FsmRunnerError) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


class Harness:
    """Owns the helper server and the engine that runs the sub-phases beside it.

    A context manager: the server is started (and healthy) on entry and stopped on exit. The
    engine's only service is the server's client; the recovery state's handler, which holds
    the supervisor, belongs to the harness.

    Args:
        journal: where runs are journaled (the caller's: the harness does not close it).
        workdir: where the server's work log (``helper-server.log``) lives.
        spec: the machine to run (:data:`SUBPHASES`, or :func:`plain_spec`).
        max_restarts: server restarts allowed (within ``window``, or in all).
        window: the restart budget's sliding window in seconds, or ``None``.
        backoff: the waits between restarts.
        health_timeout: how long the server may take to become healthy after a start.
        refuse_if_exists: the server refuses to start while this path exists (tests).
        port: the server's port; a free one when not given.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        workdir: Path,
        spec: MachineSpec = SUBPHASES,
        max_restarts: int = 3,
        window: float | None = None,
        backoff: RetryPolicy = _DEFAULT_BACKOFF,
        health_timeout: float = 10.0,
        refuse_if_exists: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server = HelperServer(
            log=self.workdir / "helper-server.log", port=port, refuse_if_exists=refuse_if_exists
        )
        self.supervisor = Supervisor(
            self.server,
            max_restarts=max_restarts,
            window=window,
            backoff=backoff,
            health_timeout=health_timeout,
        )
        self.engine = Engine(
            spec,
            handlers={"work": SubPhase(), "recover": RecoveryPhase(self.supervisor)},
            journal=journal,
            services={"server": self.server.client()},
        )

    def __repr__(self) -> str:
        return f"Harness({self.engine!r}, {self.supervisor!r})"

    def __enter__(self) -> Harness:
        self.supervisor.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.supervisor.stop()
        finally:
            self.engine.close()

    @property
    def log_path(self) -> Path:
        """The helper server's work log."""
        return self.server.log

    def start(self, input: Any = None) -> str:  # noqa: A002 - the engine's name for it
        """Start a run (``{"delays": {...}}`` slows sub-phases down); return its id."""
        return self.engine.start(input)

    def run(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """Run until the run ends; SIGTERM (main thread) and Ctrl-C journal ``INTERRUPTED``.

        Raises:
            KeyboardInterrupt: after the interruption is journaled; resume the run later.
        """
        with interrupt_on_sigterm():
            return self.engine.run(run_id, max_steps=max_steps)

    def resume(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """Continue a run from its journaled state (an interrupted sub-phase runs again).

        Raises:
            KeyboardInterrupt: after the interruption is journaled.
            RunTerminalError: the run has ended.
        """
        with interrupt_on_sigterm():
            return self.engine.resume(run_id, max_steps=max_steps)


def _delay(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    problem = argparse.ArgumentTypeError(
        f"expected SUBPHASE=SECONDS with SUBPHASE one of {', '.join(SUBPHASE_NAMES)}"
    )
    if not sep or name not in SUBPHASE_NAMES:
        raise problem
    try:
        return name, float(seconds)
    except ValueError:
        raise problem from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsm_runner.presets.subphases",
        description="Run the sub-phases machine beside a supervised helper server.",
    )
    parser.add_argument("--journal", type=Path, required=True, help="the SQLite journal")
    parser.add_argument("--workdir", type=Path, required=True, help="the server's work dir")
    parser.add_argument("--max-restarts", type=int, default=3, help="server restart budget")
    parser.add_argument("--window", type=float, help="budget window in seconds (default: all)")
    parser.add_argument("--health-timeout", type=float, default=10.0, help="seconds to start")
    parser.add_argument("--refuse-if-exists", type=Path, help="the server refuses while it exists")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a run and run it to the end")
    start.add_argument(
        "--delay",
        type=_delay,
        action="append",
        default=[],
        metavar="SUBPHASE=SECONDS",
        help="slow a sub-phase down the first time it runs",
    )
    resume = commands.add_parser("resume", help="resume a run from its journaled state")
    resume.add_argument("run_id", help="the run to resume")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Start or resume a run; print its id (first line, at once), then its final state.

    Returns:
        0 when the run succeeded, 1 when it failed or was canceled, 130 when interrupted
        (Ctrl-C, SIGINT, SIGTERM): the interruption is journaled and the run resumable.
    """
    args = _parser().parse_args(argv)
    try:
        # The whole body, not only the run: a SIGTERM during start-up must still stop the
        # server on the way out rather than orphan it.
        with (
            interrupt_on_sigterm(),
            SqliteJournal(args.journal) as journal,
            Harness(
                journal,
                workdir=args.workdir,
                max_restarts=args.max_restarts,
                window=args.window,
                health_timeout=args.health_timeout,
                refuse_if_exists=args.refuse_if_exists,
            ) as harness,
        ):
            if args.command == "start":
                run_id = harness.start({"delays": dict(args.delay)} if args.delay else None)
            else:
                run_id = args.run_id
            print(run_id, flush=True)
            run = harness.resume(run_id)
    except KeyboardInterrupt:
        print("interrupted; the run can be resumed", file=sys.stderr)
        return 130
    except FsmRunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(run.state, run.status.value, flush=True)
    if run.error and run.status is not Outcome.SUCCEEDED:
        print(f"error: {run.error.get('message')}", file=sys.stderr)
    return 0 if run.status is Outcome.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
