"""``fsm-runner demo`` and ``fsm-runner agent-loop``: the agent-loop preset on the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from fsm_runner.cli.apps import driving, interrupted_run
from fsm_runner.cli.errors import FiniteFloatRange, Int64Range, exit_if_failed
from fsm_runner.cli.journals import CliState
from fsm_runner.cli.output import echo_transition, run_standing
from fsm_runner.cli.report import print_iterations
from fsm_runner.command_line import suggested_command


def _run_agent_loop(state: CliState, run_input: dict[str, Any]) -> None:
    """Start an agent-loop run with ``run_input``, print it as it goes, then its iterations."""
    from fsm_runner.presets.agent_loop.commands import make_engine
    from fsm_runner.presets.agent_loop.services import GitSnapshotter

    # Refused before anything starts: a workspace that cannot be snapshotted (not in a git
    # repository) would otherwise be found only after the agent had worked in it.
    snapshots = GitSnapshotter().check_workspace(run_input["workspace"])
    journal = state.journal(must_exist=False)
    engine = make_engine(journal)
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
    exit_if_failed(run)


@click.command()
@click.pass_obj
def demo(state: CliState) -> None:
    """Run the agent loop on a small demo project, journaled like any run.

    Creates a git project with a failing test in a temporary directory, and runs a scripted
    agent (a real subprocess that edits files: one wrong attempt, then the fix) with real
    verification: L0 compiles the code, L1 runs pytest.
    """
    from fsm_runner.presets.agent_loop.commands import create_demo_project, demo_input

    _run_agent_loop(state, demo_input(create_demo_project()))


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
@click.pass_obj
def agent_loop(
    state: CliState,
    workspace: Path,
    agent_command: str,
    task: str,
    levels: tuple[str, ...],
    max_iterations: int,
    timeout: float | None,
) -> None:
    """Run the agent loop on your own repository with your own agent CLI.

    build (your agent) -> snapshot (git) -> verify (your levels) -> feedback -> build ...
    until verification passes or a limit is spent. Resume with `fsm-runner resume RUN`.
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
    )
    _run_agent_loop(state, run_input)
