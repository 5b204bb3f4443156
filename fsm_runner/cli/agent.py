"""``fsm-runner demo`` and ``fsm-runner agent-loop``: the agent-loop preset on the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fsm_runner.cli.apps import driving, interrupted_run
from fsm_runner.cli.errors import FiniteFloatRange, Int64Range, exit_if_failed
from fsm_runner.cli.journals import CliState
from fsm_runner.cli.output import echo_transition, run_standing
from fsm_runner.cli.report import print_iterations
from fsm_runner.command_line import suggested_command

if TYPE_CHECKING:
    from fsm_runner.records import RunRecord
    from fsm_runner.spec import MachineSpec


_ASK_HELP = (
    "Wait for your approval once verification passes: the run parks in state"
    " awaiting_approval (no process waits) until `fsm-runner signal RUN APPROVE` or `REJECT"
    ' --data \'{"comment": "..."}\'`; no answer in 24 h cancels it.'
)


def _how_to_answer(state: CliState, spec: MachineSpec, run: RunRecord) -> None:
    """Print what a run parked at the approval gate asks, and the commands that answer it."""
    from fsm_runner.presets.agent_loop import APPROVAL_TIMEOUT

    wait = spec.wait_of(run.state)
    short = run.run_id[:12]
    journal = state.journal_path
    comment = json.dumps({"comment": "what to change"})
    approve = suggested_command("fsm-runner", journal, "signal", short, "APPROVE")
    reject = suggested_command("fsm-runner", journal, "signal", short, "REJECT", "--data", comment)
    resume = suggested_command("fsm-runner", journal, "resume", short)
    timeout = wait.timeout if wait is not None and wait.timeout else APPROVAL_TIMEOUT
    click.echo(f"waiting for your answer: {wait.prompt if wait else 'approve the change?'}")
    click.echo(f"approve it with: {approve}")
    click.echo(f"reject it with:  {reject}")
    click.echo(f"  then the next build (your comment is its feedback): {resume}")
    click.echo(f"no answer in {timeout / 3600:g} h cancels the run.")


def _run_agent_loop(state: CliState, run_input: dict[str, Any], *, ask: bool = False) -> None:
    """Start an agent-loop run with ``run_input``, print it as it goes, then its iterations.

    With ``ask``, the run is one with the approval gate: once verification passes it parks
    waiting for a signal, and this prints how to send one, and exits 0.
    """
    from fsm_runner.presets.agent_loop.commands import make_engine
    from fsm_runner.presets.agent_loop.services import GitSnapshotter

    # Refused before anything starts: a workspace that cannot be snapshotted (not in a git
    # repository) would otherwise be found only after the agent had worked in it.
    snapshots = GitSnapshotter().check_workspace(run_input["workspace"])
    journal = state.journal(must_exist=False)
    state.telemetry()
    engine = make_engine(journal, approval=ask)
    engine.listeners.append(echo_transition)
    click.echo(f"agent loop in {run_input['workspace']}, journal {journal.location}")
    click.echo(f"snapshots: {snapshots} (each build's changes are committed there)")
    run_id = engine.start(run_input)
    with driving(engine, interrupted=interrupted_run(run_id)):
        run = engine.run(run_id)
    click.echo("")
    print_iterations(journal.iterations(run_id))
    click.echo("")
    click.echo(run_standing(run))
    if run.error and run.ended:
        click.echo(f"reason: {run.error.get('message')}")
    short = run_id[:12]
    show = suggested_command("fsm-runner", state.journal_path, "show", short)
    export = suggested_command(
        "fsm-runner", state.journal_path, "export", short, f"fsm-runner-export-{short}"
    )
    click.echo(f"see it with: {show}   export it with: {export}")
    if not run.ended and run.state in engine.spec.waiting_states:
        _how_to_answer(state, engine.spec, run)
    exit_if_failed(run)


@click.command()
@click.option("--ask", is_flag=True, help=_ASK_HELP)
@click.pass_obj
def demo(state: CliState, ask: bool) -> None:
    """Run the agent loop on a small demo project, journaled like any run.

    Creates a git project with a failing test in a temporary directory, and runs a scripted
    agent (a real subprocess that edits files: one wrong attempt, then the fix) with real
    verification: L0 compiles the code, L1 runs pytest. With --ask, the verified fix waits for
    your approval: the command prints how to approve or reject it, and exits with the run
    waiting.
    """
    from fsm_runner.presets.agent_loop.commands import create_demo_project, demo_input

    _run_agent_loop(state, demo_input(create_demo_project(), approval=ask), ask=ask)


@click.command("agent-loop")
@click.option(
    "--workspace",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The git repository the agent works in.",
)
@click.option(
    "--agent",
    "agent_command",
    required=True,
    metavar="CMD",
    help="The agent command, run by the shell in the workspace. It gets the task and feedback"
    " in $FSM_TASK and $FSM_FEEDBACK (also $FSM_SESSION_ID, $FSM_ITERATION, $FSM_WORKSPACE) and"
    " as one JSON object on stdin; a JSON line it prints may report session_id, model, tokens"
    " and cost_usd.",
)
@click.option("--task", required=True, metavar="PROMPT", help="The task prompt.")
@click.option(
    "--verify",
    "levels",
    multiple=True,
    required=True,
    metavar="LEVEL=CMD",
    help="A verification command, e.g. L1='pytest -q'; repeat for more checks and levels.",
)
@click.option("--max-iterations", type=Int64Range(min=1), default=3, show_default=True)
@click.option(
    "--timeout",
    type=FiniteFloatRange(min=0, min_open=True),
    metavar="S",
    help="Wall-clock limit of the whole run in seconds (each agent run gets at most this too).",
)
@click.option("--ask", is_flag=True, help=_ASK_HELP)
@click.pass_obj
def agent_loop(
    state: CliState,
    workspace: Path,
    agent_command: str,
    task: str,
    levels: tuple[str, ...],
    max_iterations: int,
    timeout: float | None,
    ask: bool,
) -> None:
    """Run the agent loop on your own repository with your own agent CLI.

    build (your agent) -> snapshot (git) -> verify (your levels) -> feedback -> build ...
    until verification passes or a limit is spent. Resume with `fsm-runner resume RUN`.
    With --ask, a change that passed verification waits for your APPROVE or REJECT (whose
    comment is the next build's feedback); --timeout then limits the time of the builds and
    checks, and the time the run waits for you too.
    """
    from fsm_runner.presets.agent_loop.commands import loop_input

    verify: dict[str, list[str]] = {}
    for item in levels:
        level, sep, command = item.partition("=")
        if not sep or not level.strip() or not command.strip():
            raise click.BadParameter(f"expected LEVEL=CMD, not {item!r}", param_hint="--verify")
        verify.setdefault(level.strip(), []).append(command)
    run_input = loop_input(
        task=task,
        workspace=workspace,
        agent=agent_command,
        verify=verify,
        max_iterations=max_iterations,
        timeout=timeout,
        approval=ask,
    )
    _run_agent_loop(state, run_input, ask=ask)
