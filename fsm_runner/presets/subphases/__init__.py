"""The sub-phases preset: a phase of ordered sub-phases beside a helper server the harness owns.

::

    analysis: 1a → 1b → codeql → 1c ──PHASE_COMPLETED──▶ done
         │  any sub-phase ──SERVER_UNREACHABLE──▶ recovering ──SERVER_RECOVERED──▶ (that sub-phase)
         │                                            └──RESTART_BUDGET_SPENT──▶ failed
         └  any sub-phase ──PHASE_FAILED──▶ failed

plus ``SYSTEM_ERROR → failed`` and ``USER_ABORTED → canceled`` from anywhere. Every sub-phase
calls the helper server (:mod:`fsm_runner.presets.subphases.helper_server`) through the one
service it is given, ``ctx.services["server"]``: a client that can do work and nothing else.
When the server dies, the sub-phase reports ``SERVER_UNREACHABLE``; the harness's
``recovering`` state restarts the server within its budget and returns the run to the sub-phase
that failed — as that visit's next attempt — never to one already completed.

A :class:`Harness` puts it together: it owns the server (through a
:class:`fsm_runner.supervisor.Supervisor`), the engine, and turns SIGTERM into an interruption
that is journaled (``INTERRUPTED``) and leaves the run resumable. From a shell::

    python -m fsm_runner.presets.subphases --journal j.db --workdir w start --delay 3
    python -m fsm_runner.presets.subphases --journal j.db --workdir w resume RUN

``--delay 3`` makes every sub-phase take 3 s the first time it runs (``--delay 1b=5`` only
``1b``), so there is time to interrupt it (Ctrl-C, SIGTERM, ``kill -9``); ``RUN`` may be any
unique prefix of the run's id. Exit codes are ``fsm-runner``'s, and 130 when interrupted.

This module uses fsm_runner's public API, the supervisor, and the CLI's journal option, run-id
prefixes and exit codes for its command line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from fsm_runner import (
    RETURN,
    Engine,
    Journal,
    MachineSpec,
    PhaseContext,
    PhaseResult,
    PhaseStatus,
    RetryPolicy,
    RunEvent,
    RunLifecycle,
    RunRecord,
    State,
    Transition,
    interrupt_on_sigterm,
)
from fsm_runner.command_line import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    ExitCodeCommand,
    ExitCodeGroup,
    journal_option,
    suggested_command,
)
from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.journal.locate import locate_journal, resolve_run_id
from fsm_runner.presets.subphases.helper_server import (
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
    (the server applies a delay only the first time it does that work for this run).

    It reports the :class:`fsm_runner.PhaseStatus` events — ``OK``, ``SERVER_UNREACHABLE`` when
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
            answer = ctx.services["server"].work(
                ctx.state, delay=delay, fail=fail, key=ctx.run_id if delay else None
            )
        except ServerUnreachableError as exc:
            ctx.logger.warning("helper server unreachable: %s", exc.detail)
            return PhaseResult(PhaseStatus.SERVER_UNREACHABLE.event, error=_error(exc))
        except HelperServerError as exc:
            return PhaseResult(PhaseStatus.ERROR.event, error=_error(exc))
        return PhaseResult(PhaseStatus.OK.event, output=answer)


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


PROG = "python -m fsm_runner.presets.subphases"


def _delays(values: Sequence[str]) -> dict[str, float]:
    """``--delay SECONDS`` (every sub-phase) and ``--delay SUBPHASE=SECONDS`` (one)."""
    delays: dict[str, float] = {}
    for text in values:
        name, sep, seconds = text.rpartition("=")
        problem = click.BadParameter(
            f"expected SECONDS or SUBPHASE=SECONDS with SUBPHASE one of "
            f"{', '.join(SUBPHASE_NAMES)}, not {text!r}",
            param_hint="--delay",
        )
        if sep and name not in SUBPHASE_NAMES:
            raise problem
        try:
            value = float(seconds)
        except ValueError:
            raise problem from None
        if not value >= 0 or value == float("inf"):
            raise problem
        delays.update({name: value} if sep else dict.fromkeys(SUBPHASE_NAMES, value))
    return delays


class _Options:
    """What the group hands its commands."""

    def __init__(self, **options: Any) -> None:
        self.journal_path: str = options.pop("journal_path")
        self.options = options

    def resume_hint(self, run_id: str) -> str:
        """The command that continues the run."""
        workdir = str(self.options["workdir"])
        return suggested_command(
            PROG, self.journal_path, "--workdir", workdir, "resume", run_id[:12]
        )


@click.group(cls=ExitCodeGroup, name=PROG, context_settings={"help_option_names": ["-h", "--help"]})
@journal_option()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default="fsm-runner-subphases",
    show_default=True,
    metavar="DIR",
    help="Where the helper server keeps its work log (helper-server.log).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    metavar="N",
    default=3,
    show_default=True,
    help="How often the harness may restart the helper server.",
)
@click.option(
    "--window",
    type=click.FloatRange(min=0, min_open=True),
    metavar="S",
    help="The restart budget's window in seconds (default: the whole run).",
)
@click.option(
    "--health-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    metavar="S",
    help="Seconds the helper server may take to become healthy after a start.",
)
@click.option(
    "--refuse-if-exists",
    type=click.Path(path_type=Path),
    metavar="PATH",
    help="The helper server refuses to start while PATH exists (to try a server that dies).",
)
@click.pass_context
def cli(ctx: click.Context, /, **options: Any) -> None:
    """Run the sub-phases machine (1a, 1b, codeql, 1c) beside a supervised helper server.

    `start` prints the run's id, then its final state and status. Interrupt it (Ctrl-C,
    SIGTERM) and `resume RUN` continues at the sub-phase it was in; RUN may be any unique
    prefix of the id. Exit codes: 0 the run succeeded; 1 it failed (or a failure); 2 usage;
    3 run or journal not found; 4 the run has ended or is held; 130 interrupted (the run
    stays resumable).
    """
    ctx.obj = _Options(**options)


@cli.command(cls=ExitCodeCommand)
@click.option(
    "--delay",
    "delays",
    multiple=True,
    metavar="[SUBPHASE=]SECONDS",
    help="Make every sub-phase (or SUBPHASE only) take SECONDS the first time it runs, so "
    "there is time to interrupt the run; repeatable.",
)
@click.pass_obj
def start(options: _Options, delays: tuple[str, ...]) -> None:
    """Start a run and run it to the end."""
    slow = _delays(delays)
    _drive(options, lambda harness: harness.start({"delays": slow} if slow else None), False)


@cli.command(cls=ExitCodeCommand)
@click.argument("run_id", metavar="RUN")
@click.pass_obj
def resume(options: _Options, run_id: str) -> None:
    """Resume a run from its journaled state (an interrupted sub-phase runs again)."""
    _drive(options, lambda harness: resolve_run_id(harness.engine.journal, run_id), True)


def _drive(options: _Options, pick: Callable[[Harness], str], must_exist: bool) -> None:
    """Open the journal, start the harness, pick the run and run it; print as documented."""
    run_id = None
    journal = locate_journal(options.journal_path, must_exist=must_exist)
    try:
        # The whole body, not only the run: a SIGTERM during start-up must still stop the
        # server on the way out rather than orphan it.
        with interrupt_on_sigterm(), Harness(journal, **options.options) as harness:
            run_id = pick(harness)
            click.echo(run_id)
            sys.stdout.flush()
            run = harness.resume(run_id)
    except KeyboardInterrupt as exc:
        cause = str(exc).removeprefix("signal ") or "Ctrl-C"
        if run_id is None:
            message = f"interrupted by {cause} while the helper server started"
        else:
            hint = options.resume_hint(run_id)
            message = f"run {run_id} interrupted by {cause}; it stays resumable: {hint}"
        click.echo(f"Error: {message}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        journal.close()
    click.echo(f"{run.state} {run.status.value}")
    if run.status is not RunLifecycle.SUCCEEDED:
        reason = (run.error or {}).get("message") or run.status.value
        click.echo(f"Error: run {run.run_id} {run.status.value}: {reason}", err=True)
        sys.exit(EXIT_FAILURE)


def main(argv: Sequence[str] | None = None) -> None:
    """Start or resume a run; print its id (first line, at once), then its final state.

    Exits 0 when the run succeeded, 1 when it failed or was canceled, 130 when interrupted
    (Ctrl-C, SIGINT, SIGTERM): the interruption is journaled and the run resumable. Errors
    (an unknown or ambiguous run, an ended one, a journal that is not there) print one
    ``Error:`` line and exit with ``fsm-runner``'s codes (2 usage, 3 not found, 4 conflict).
    """
    cli.main(args=list(argv) if argv is not None else None, prog_name=PROG)
