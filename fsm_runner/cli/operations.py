"""Commands that move runs: ``resume``, ``recover``, ``worker``, ``abort``, ``signal``, ``fork``.

``resume``, ``recover`` and ``worker`` run the phases with the handlers of ``--app``;
``abort`` and ``signal`` need an app only for guards, ``fork`` none.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, NoReturn

import click

from fsm_runner.cli.apps import driving, interrupted_run, load_app
from fsm_runner.cli.errors import (
    EXIT_USAGE,
    FiniteFloatRange,
    Int64Range,
    exit_if_failed,
    fail,
)
from fsm_runner.cli.journals import CliState, resolve_run_id
from fsm_runner.cli.output import echo_transition, json_dump, run_standing, styled_status
from fsm_runner.exceptions import InvalidRunIdError
from fsm_runner.run_ids import shown

if TYPE_CHECKING:
    from fsm_runner.journal import Journal
    from fsm_runner.records import SignalRecord

#: ``--app`` of the commands that run phases for any run of the app.
_required_app = click.option(
    "--app", required=True, metavar="MODULE:ATTR", help="The host app: an Engine or a factory."
)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--app",
    metavar="MODULE:ATTR",
    help="The host app: an Engine, or a factory returning one (given the journal if it takes"
    " it), as MODULE:ATTR or FILE.py:ATTR. Optional for runs whose input names their app (as"
    " `demo` and `agent-loop` runs do).",
)
@click.option("--max-steps", type=Int64Range(min=1), help="Stop after this many steps.")
@click.option(
    "--from-state",
    metavar="STATE",
    help="Continue from this earlier state of the run instead (journaled as REWOUND).",
)
@click.pass_obj
def resume(
    state: CliState, run_id: str, app: str | None, max_steps: int | None, from_state: str | None
) -> None:
    """Resume a run from its last journaled state, with the handlers of --app.

    The run continues in the journal given to fsm-runner (--journal), whatever journal the
    app's engine was built with. Prints each transition as it is committed. With
    --from-state, the run first goes back to that state (one it has been in, not a terminal
    one) and its phase runs again; the move is journaled as a REWOUND transition.
    """
    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    if app is None:
        run_input = journal.load(run_id).input
        app = run_input.get("app") if isinstance(run_input, dict) else None
        if not isinstance(app, str):
            raise click.UsageError("this run's input names no app; pass --app MODULE:ATTR")
    from fsm_runner.exceptions import InvalidTransitionError

    engine = load_app(app, journal)
    engine.listeners.append(echo_transition)
    try:
        with driving(engine, interrupted=interrupted_run(run_id)):
            run = engine.resume(run_id, max_steps=max_steps, from_state=from_state)
    except InvalidTransitionError as exc:
        if from_state is None or exc.event != "REWOUND":
            raise
        fail(f"--from-state: {exc}", EXIT_USAGE)  # a state the run cannot go back to
    click.echo(run_standing(run))
    exit_if_failed(run)


@click.command()
@_required_app
@click.option("--limit", type=Int64Range(min=1), help="Recover at most this many runs.")
@click.pass_obj
def recover(state: CliState, app: str, limit: int | None) -> None:
    """Take over the app's runs whose worker is gone (lease expired) and run them.

    A run taken over more often than the engine's max_recoveries is parked as dead_letter
    with the reason instead. Prints one line per run recovered.
    """
    journal = state.journal()
    engine = load_app(app, journal)
    engine.listeners.append(echo_transition)
    with driving(engine, interrupted="interrupted; the runs not finished stay recoverable"):
        recovered = engine.recover(limit=limit)
    for run in recovered:
        click.echo(styled_status(run_standing(run), run.status.value))
    click.echo(f"recovered {len(recovered)} runs")


@click.command()
@_required_app
@click.option("--max-runs", type=Int64Range(min=1), help="Stop after this many runs.")
@click.option("--exit-when-idle", is_flag=True, help="Stop when no run is runnable.")
@click.option(
    "--idle-wait",
    type=FiniteFloatRange(min=0.01),
    default=0.5,
    show_default=True,
    metavar="S",
    help="Seconds between looks for work while idle.",
)
@click.option(
    "--takeover-dead/--no-takeover-dead",
    default=True,
    show_default=True,
    help="Take over at once the runs of a worker that died (else when their leases expire).",
)
@click.pass_obj
def worker(
    state: CliState,
    app: str,
    max_runs: int | None,
    exit_when_idle: bool,
    idle_wait: float,
    takeover_dead: bool,
) -> None:
    """Be a worker: claim the app's runnable runs one at a time and run them.

    Any number of workers may share one journal; each run is advanced by one worker at a time
    (leases with fencing). Runs whose worker died are taken over at once (a process of this
    host, or on PostgreSQL a worker whose session ended), else once their lease expires.
    Ctrl-C or SIGTERM stops it cleanly (exit 0): the run in progress is interrupted, its lease
    released, and the next worker takes it at once.
    """
    journal = state.journal()
    engine = load_app(app, journal)
    engine.listeners.append(
        lambda transition, run: click.echo(
            f"{shown(run.run_id)[:12]} {transition.seq:>4}  {transition.from_state or '-'} "
            f"--{transition.event}--> {transition.to_state}"
        )
    )
    try:
        with driving(engine, interrupted=None):
            taken = engine.work(
                max_runs=max_runs,
                exit_when_idle=exit_when_idle,
                idle_wait=idle_wait,
                takeover_dead=takeover_dead,
            )
    except KeyboardInterrupt as exc:
        from fsm_runner.engine.interruption import interruption_cause

        cause = interruption_cause(exc).removeprefix("by ")
        cause = "Ctrl-C" if cause.startswith("(") else cause
        click.echo(f"worker {engine.worker_id} stopped by {cause}; any run in progress released")
        return
    click.echo(f"worker {engine.worker_id} ran {taken} runs")


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--reason", required=True, help="Why the run is aborted (journaled).")
@click.option(
    "--app",
    metavar="MODULE:ATTR",
    help="The host app, needed only when the spec's USER_ABORTED transition has guards.",
)
@click.pass_obj
def abort(state: CliState, run_id: str, reason: str, app: str | None) -> None:
    """Abort a run: it follows its USER_ABORTED transition, or stops where it is."""
    from fsm_runner.engine import abort_run

    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    guards = None
    if app:
        engine = load_app(app, journal)
        guards = engine.guards
        engine.close()
    run = abort_run(journal, run_id, reason, guards=guards)
    if run.ended:
        click.echo(f"run {shown(run.run_id)} aborted: {run.status.value} in state {run.state!r}")
    else:  # a live worker holds it: the request is journaled, the worker carries it out
        click.echo(
            f"run {shown(run.run_id)}: abort requested; {run.lease_owner}, which holds the run, "
            "carries it out at its next step"
        )


def _not_a_number(constant: str) -> NoReturn:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e999: JSON, but no number a journal stores
        raise ValueError(f"{text} is too large")
    return number


def json_option(option: str, text: str | None) -> Any:
    """The value of a JSON option (``None`` when it is not given), or a one-line usage error."""
    if text is None:
        return None
    try:
        return json.loads(text, parse_constant=_not_a_number, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError too; [[[[...
        fail(f"{option}: not JSON: {exc}", EXIT_USAGE)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.argument("name")
@click.option(
    "--data",
    metavar="JSON",
    help="The signal's payload, as JSON (the transition it causes carries it as its output).",
)
@click.option(
    "--id",
    "signal_id",
    metavar="ID",
    help="The sender's key: a signal sent again with the same ID is journaled once, and the"
    " first one's outcome is printed.",
)
@click.option(
    "--app",
    metavar="MODULE:ATTR",
    help="The host app, needed only when the exit the signal takes has guards (without it, a"
    " worker of the app consumes the signal).",
)
@click.pass_obj
def signal(
    state: CliState,
    run_id: str,
    name: str,
    data: str | None,
    signal_id: str | None,
    app: str | None,
) -> None:
    """Send signal NAME (APPROVED, say) to a run that waits for an answer.

    The signal is journaled in the run's mailbox even when the run is not waiting for it yet;
    the run consumes it when it waits in a state that accepts it (one of that state's exits'
    events), in arrival order, exactly once. If the run waits in such a state now, the signal
    is consumed at once and the run moves on (a worker of its app runs what comes next).
    A NAME no waiting state of the run's machine accepts is refused (exit 2), as is a signal to
    an ended run (exit 4); nothing is written then. Prints one line: the signal's number, and
    the seq that consumed it or why it is pending.
    """
    from fsm_runner.engine.waits import signal_run
    from fsm_runner.exceptions import InvalidTransitionError

    payload = json_option("--data", data)
    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    repeated = signal_id is not None and any(
        stored.signal_id == signal_id for stored in journal.signals(run_id)
    )
    guards = None
    if app:
        engine = load_app(app, journal)
        guards = engine.guards
        engine.close()
    try:
        sent = signal_run(journal, run_id, name, payload, signal_id=signal_id, guards=guards)
    except InvalidTransitionError as exc:
        fail(f"NAME: {exc}", EXIT_USAGE)  # a signal the run's machine never takes
    click.echo(_signal_line(journal, sent, repeated=repeated))


def _signal_line(journal: Journal, sent: SignalRecord, *, repeated: bool) -> str:
    """What ``signal`` prints: the signal, and where it stands (consumed, pending, expired)."""
    from fsm_runner.records import SignalStatus

    run = journal.load(sent.run_id)
    head = f"signal #{sent.number} {sent.name} for run {shown(run.run_id)}"
    if repeated:
        head += f" (already sent with --id {sent.signal_id}; nothing written)"
    if sent.status is SignalStatus.CONSUMED:
        return f"{head}: consumed by seq {sent.consumed_seq} (now in state {run.state!r})"
    if sent.status is SignalStatus.EXPIRED or run.ended:
        return (
            f"{head}: expired (the run ended, {run.status.value} in state {run.state!r}, "
            "before it waited for it)"
        )
    from fsm_runner.engine.waits import parked_phase
    from fsm_runner.spec import MachineSpec

    parked = parked_phase(run)
    if parked is not None and parked[0] == sent.name:
        return (
            f"{head}: pending (the run's phase waits for it in state {run.state!r}; a worker of"
            " its app wakes the run, and the phase reads it)"
        )
    if sent.name in MachineSpec.from_json(journal.spec_json(run.spec_hash)).accepts(run.state):
        # Held by a worker, or its exit has guards only the app can ask.
        return (
            f"{head}: pending (the run waits in state {run.state!r}, which accepts it; a worker"
            " of its app consumes it)"
        )
    return (
        f"{head}: pending (the run is in state {run.state!r}; it is consumed when the run "
        "waits in a state that accepts it)"
    )


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--at",
    "at_seq",
    type=Int64Range(min=0),
    help="The last seq the fork keeps (default: the run's last; required for an ended run).",
)
@click.option("--run-id", "new_run_id", metavar="ID", help="The fork's id (default: random).")
@click.option("--json", "as_json", is_flag=True, help="Print the fork's run row as JSON.")
@click.pass_obj
def fork(
    state: CliState, run_id: str, at_seq: int | None, new_run_id: str | None, as_json: bool
) -> None:
    """Fork a run: a new run with RUN's history up to --at SEQ.

    The fork records where it came from (RUN@SEQ); the original is untouched. The fork stands
    in the state the original was in at SEQ, and that state's phase runs when it is resumed
    (fsm-runner resume FORK --app ...). Ended runs can be forked at any earlier seq.
    """
    from fsm_runner.engine import fork_run
    from fsm_runner.records import unstructure

    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    try:
        forked = fork_run(journal, run_id, at_seq=at_seq, new_run_id=new_run_id)
    except InvalidRunIdError as exc:
        fail(f"--run-id: {exc}", EXIT_USAGE)
    except ValueError as exc:
        fail(f"--at: {exc}", EXIT_USAGE)
    if as_json:
        json_dump(unstructure(forked))
        return
    click.echo(
        f"forked {shown(forked.forked_from or '')} as run {forked.run_id}: state {forked.state!r}, "
        f"seq {forked.seq}; continue it with: fsm-runner resume {forked.run_id[:12]} --app ..."
    )
