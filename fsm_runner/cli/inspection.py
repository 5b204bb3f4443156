"""Commands that read runs without changing them: ``runs``, ``watch`` and ``replay``.

``show`` has a module of its own, :mod:`fsm_runner.cli.report`.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from fsm_runner.cli.apps import load_spec
from fsm_runner.cli.errors import (
    EXIT_USAGE,
    FiniteFloatRange,
    Int64Range,
    exit_if_failed,
    fail,
)
from fsm_runner.cli.journals import CliState, resolve_run_id
from fsm_runner.cli.output import (
    echo_transition,
    format_time,
    format_time_ms,
    json_dump,
    run_standing,
    styled_status,
    table,
)

if TYPE_CHECKING:
    from fsm_runner.records import RunRecord
    from fsm_runner.replay import Replay


@click.command()
@click.option("--machine", help="Only runs of this machine.")
@click.option(
    "--status",
    type=click.Choice(["active", "succeeded", "failed", "aborted", "dead_letter"]),
    help="Only runs with this status.",
)
@click.option("--state", "run_state", metavar="STATE", help="Only runs in this state.")
@click.option("--parent", metavar="RUN", help="Only the child runs of this run.")
@click.option(
    "--stale",
    is_flag=True,
    help="Only active runs whose lease has expired (their worker is gone).",
)
@click.option(
    "--effect-in-flight",
    is_flag=True,
    help="Only runs with an effect caught in flight (its outcome unknown).",
)
@click.option("--limit", type=Int64Range(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def runs(
    state: CliState,
    machine: str | None,
    status: str | None,
    run_state: str | None,
    parent: str | None,
    stale: bool,
    effect_in_flight: bool,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first (child runs show their parent)."""
    from fsm_runner.records import unstructure

    journal = state.journal()
    if parent is not None:
        parent = resolve_run_id(journal, parent)
    found = journal.runs(
        machine=machine,
        status=status,
        parent_run_id=parent,
        limit=limit,
        effect_in_flight=effect_in_flight,
        state=run_state,
        stale=stale,
    )
    if as_json:
        json_dump([unstructure(run) for run in found])
        return
    if not found:
        click.echo("no runs")
        return
    rows = [
        (
            run.run_id[:12],
            run.machine,
            run.state,
            run.status.value,
            str(run.seq),
            str(run.iteration),
            format_time(run.updated_at),
            (run.parent_run_id or "-")[:12],
        )
        for run in found
    ]
    table(
        rows,
        ("RUN", "MACHINE", "STATE", "STATUS", "SEQ", "ITER", "UPDATED (UTC)", "PARENT"),
        styles=[run.status.value for run in found],
    )


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--interval",
    type=FiniteFloatRange(min=0.01),
    default=0.5,
    show_default=True,
    metavar="S",
    help="How often to look at the journal, in seconds.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per transition.")
@click.pass_obj
def watch(state: CliState, run_id: str, interval: float, as_json: bool) -> None:
    """Follow a run, printing each transition as it is journaled.

    Follows until the run ends, or Ctrl-C.

    Transitions journaled before the command started are printed first. Exits 1 if the run
    ends failed or aborted.
    """
    import time

    from fsm_runner.records import unstructure

    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    next_seq = 0
    try:
        while True:
            run = journal.load(run_id)
            if run.seq >= next_seq:
                for transition in journal.transitions(run_id, from_seq=next_seq):
                    if as_json:
                        click.echo(json.dumps(unstructure(transition), sort_keys=True))
                    else:
                        echo_transition(transition, run)
                    next_seq = transition.seq + 1
            if run.ended and next_seq > run.seq:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        sys.exit(130)
    if not as_json:
        click.echo(styled_status(run_standing(run), run.status.value))
    exit_if_failed(run)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--to", "to_seq", type=Int64Range(min=0), metavar="SEQ", help="Stop after this seq.")
@click.option(
    "--spec",
    "spec_path",
    metavar="MODULE:ATTR",
    help="Replay through this spec (e.g. the changed one) instead of the run's own.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the replayed steps as JSON.")
@click.pass_obj
def replay(
    state: CliState, run_id: str, to_seq: int | None, spec_path: str | None, as_json: bool
) -> None:
    """Replay a run's journal through its spec; check that it reproduces the run.

    Checks that seqs start at 0 without gaps, that every transition is one the spec (or the
    engine) allows from the state before it, and that the run row is exactly what the
    transitions lead to. Prints the reconstructed timeline; on a mismatch, exits 1 naming
    the first one (seq, expected, found).
    """
    from fsm_runner.replay import journal_specs, read_run
    from fsm_runner.replay import replay as replay_through

    journal = state.journal()
    # Transitions, then the row: one a live writer advances meanwhile is read consistently.
    timeline, run = read_run(journal, resolve_run_id(journal, run_id), to_seq=to_seq)
    if to_seq is not None and to_seq > run.seq:
        fail(f"--to: run {run.run_id} has seqs 0..{run.seq}", EXIT_USAGE)
    specs = journal_specs(journal)
    spec = load_spec(spec_path, "--spec") if spec_path is not None else specs(run.spec_hash)
    replayed = replay_through(
        spec,
        run,
        timeline,
        to_seq=to_seq,
        path=journal.location,
        specs=None if spec_path is not None else specs,
    )
    if as_json:
        _print_replay_json(replayed)
    else:
        _print_replay(run, replayed, to_seq)


def _print_replay_json(replayed: Replay) -> None:
    from fsm_runner.records import unstructure

    json_dump(
        {
            "run": unstructure(replayed.run),
            "steps": [
                {**unstructure(step.transition), "kind": step.kind,
                 "run": unstructure(step.run)}
                for step in replayed.steps
            ],
            "matches": True,
        }
    )  # fmt: skip


def _print_replay(run: RunRecord, replayed: Replay, to_seq: int | None) -> None:
    """The replayed steps as a table, then whether they match the run (or where it stood)."""
    rows = [
        (
            str(step.seq),
            format_time_ms(step.transition.at),
            step.from_state or "-",
            step.event,
            step.to_state,
            str(step.run.iteration),
            str(step.run.attempt),
            step.run.status.value,
            step.kind,
        )
        for step in replayed.steps
    ]
    table(
        rows,
        ("SEQ", "AT (UTC)", "FROM", "EVENT", "TO", "ITER", "ATTEMPT", "STATUS", "AS"),
        styles=[step.run.status.value for step in replayed.steps],
    )
    click.echo("")
    if to_seq is None:
        click.echo(
            f"replay of run {run.run_id} matches the journal: {len(replayed.steps)} "
            f"transitions, state {run.state!r} ({run.status.value})"
        )
    else:
        at = replayed.run
        click.echo(
            f"run {run.run_id} at seq {to_seq}: state {at.state!r} ({at.status.value}), "
            f"iteration {at.iteration}, attempt {at.attempt}"
        )
