"""Commands that read runs without changing them: ``runs``, ``watch`` and ``replay``.

``show`` has a module of its own, :mod:`fsm_runner.cli.report`.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from fsm_runner.cli.apps import load_spec
from fsm_runner.cli.errors import (
    EXIT_FAILURE,
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
    wrap_column,
)
from fsm_runner.run_ids import shown

if TYPE_CHECKING:
    from fsm_runner.journal import Journal
    from fsm_runner.records import RunRecord
    from fsm_runner.replay import Replay
    from fsm_runner.spec import MachineSpec


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
@click.option(
    "--waiting",
    is_flag=True,
    help="Only active runs waiting for a signal, with what each waits for, since when, its"
    " deadline, its pending signals and its prompt.",
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
    waiting: bool,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first (child runs show their parent).

    With --waiting, the active runs that wait, newest first: those in a waiting state of
    their machine (a state without a handler: it waits for a signal, see `fsm-runner
    signal`) and those their phase parked (ctx.wait_for, ctx.sleep_until; their state shown
    with "(phase)"): the signals each waits for, since when (its last transition), its
    deadline (when the wait times out; - for none), how many signals wait in its mailbox,
    and what the wait asks. --machine and --state narrow it.
    """
    from fsm_runner.records import unstructure

    journal = state.journal()
    if waiting:
        others = {
            "--status": status not in (None, "active"),
            "--parent": parent is not None,
            "--stale": stale,
            "--effect-in-flight": effect_in_flight,
        }
        clashing = [option for option, given in others.items() if given]
        if clashing:
            fail(f"--waiting cannot be combined with {', '.join(clashing)}", EXIT_USAGE)
        _print_waiting(journal, machine, run_state, limit, as_json=as_json)
        return
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
            shown(run.run_id)[:12],
            run.machine,
            run.state,
            run.status.value,
            str(run.seq),
            str(run.iteration),
            format_time(run.updated_at),
            shown(run.parent_run_id)[:12] if run.parent_run_id else "-",
        )
        for run in found
    ]
    table(
        rows,
        ("RUN", "MACHINE", "STATE", "STATUS", "SEQ", "ITER", "UPDATED (UTC)", "PARENT"),
        styles=[run.status.value for run in found],
    )


#: How many of the newest active runs name the machines ``runs --waiting`` looks at, when no
#: --machine is given (the journal has no list of its machines).
_MACHINES_SAMPLE = 1000


class _Specs:
    """The specs a journal keeps, read once per hash."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._specs: dict[str, MachineSpec] = {}

    def __call__(self, spec_hash: str) -> MachineSpec:
        spec = self._specs.get(spec_hash)
        if spec is None:
            from fsm_runner.spec import MachineSpec

            spec = MachineSpec.from_json(self._journal.spec_json(spec_hash))
            self._specs[spec_hash] = spec
        return spec


def _waiting_runs(
    journal: Journal, specs: _Specs, machine: str | None, only_state: str | None, limit: int
) -> list[RunRecord]:
    """The active runs that wait, newest first: in a waiting state, or parked by their phase.

    Index reads only: per machine, the states its active runs stand in (``run_counts``),
    then the newest ``limit`` active runs of each state (``runs(machine=, status="active",
    state=)``), of which those that wait are kept. Every run of a waiting state waits; a
    run its phase parked (``ctx.wait_for``, ``ctx.sleep_until``) is found among the newest
    ``limit`` of its state.
    """
    from fsm_runner.engine.waits import waits_now

    if machine is not None:
        machines = [machine]
    else:
        sample = journal.runs(status="active", limit=_MACHINES_SAMPLE)
        machines = sorted({run.machine for run in sample})
    found: list[RunRecord] = []
    for name in machines:
        counts = journal.run_counts(machine=name)
        states = sorted(
            {s for (s, status), count in counts.items() if status == "active" and count}
        )
        for run_state in states if only_state is None else [s for s in states if s == only_state]:
            candidates = journal.runs(machine=name, status="active", state=run_state, limit=limit)
            found += [run for run in candidates if waits_now(specs(run.spec_hash), run)]
    found.sort(key=lambda run: (run.updated_at, run.run_id), reverse=True)
    return found[:limit]


class Waiting:
    """How one run waits: for which signals, since when, until when, what it asks.

    What ``runs --waiting`` lists and ``show`` says of a waiting run.

    A plain class: a ``NamedTuple`` would cost ``fsm-runner --help`` its creation.
    """

    def __init__(self, journal: Journal, spec: MachineSpec, run: RunRecord) -> None:
        from fsm_runner.engine.waits import deadline, parked_phase

        self.run = run
        self.since = run.updated_at
        self.pending = len(journal.signals(run.run_id, pending=True))
        parked = parked_phase(run)
        wait = spec.wait_of(run.state)
        if parked is not None:  # its phase waits (ctx.wait_for, ctx.sleep_until)
            signal, until = parked
            self.by = "phase"
            self.accepts = [signal] if signal is not None else []
            self.deadline = until
            self.on_timeout: str | None = None
            self.prompt = ""
        else:
            self.by = "state"
            self.accepts = sorted(spec.accepts(run.state))
            self.deadline = deadline(journal, spec, run)
            self.on_timeout = wait.on_timeout if wait is not None else None
            self.prompt = wait.prompt if wait is not None else ""

    def wait_json(self) -> dict[str, Any]:
        """The wait, as JSON."""
        from fsm_runner._convert import format_utc

        return {
            "state": self.run.state,
            "by": self.by,
            "accepts": self.accepts,
            "since": format_utc(self.since),
            "deadline": format_utc(self.deadline) if self.deadline is not None else None,
            "on_timeout": self.on_timeout,
            "pending_signals": self.pending,
            "prompt": self.prompt,
        }

    def as_json(self) -> dict[str, Any]:
        """The run's row, and its ``wait``."""
        from fsm_runner.records import unstructure

        return {**unstructure(self.run), "wait": self.wait_json()}

    def summary(self) -> str:
        """One line: what the run waits for, until when, what it asks."""
        what = ", ".join(self.accepts) or ("a time" if self.by == "phase" else "nothing")
        text = f"for {what}" if self.by == "state" else f"in its phase, for {what}"
        if self.deadline is not None:
            text += f" until {format_time(self.deadline)} UTC"
            if self.on_timeout:
                text += f" (then {self.on_timeout})"
        if self.pending:
            text += f"; {self.pending} signal{'s' if self.pending != 1 else ''} pending"
        return f"{text}: {self.prompt}" if self.prompt else text

    def row(self) -> tuple[str, ...]:
        """The run's row of the table."""
        run = self.run
        waits_for = ",".join(self.accepts) or ("-" if self.by == "state" else "(a time)")
        return (
            shown(run.run_id)[:12],
            run.machine,
            run.state if self.by == "state" else f"{run.state} (phase)",
            waits_for,
            format_time(self.since),
            format_time(self.deadline),
            str(self.pending),
            self.prompt or "-",
        )


def _print_waiting(
    journal: Journal, machine: str | None, only_state: str | None, limit: int, *, as_json: bool
) -> None:
    """``runs --waiting``: the waiting runs, what each waits for, since when, until when."""
    specs = _Specs(journal)
    found = [
        Waiting(journal, specs(run.spec_hash), run)
        for run in _waiting_runs(journal, specs, machine, only_state, limit)
    ]
    if as_json:
        json_dump([waiting.as_json() for waiting in found])
        return
    if not found:
        click.echo("no waiting runs")
        return
    table(
        wrap_column([waiting.row() for waiting in found], 7, 50),
        ("RUN", "MACHINE", "STATE", "WAITS FOR", "SINCE (UTC)", "DEADLINE (UTC)", "PENDING",
         "PROMPT"),
    )  # fmt: skip


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
    from fsm_runner.journal._digest import chain_break
    from fsm_runner.replay import journal_specs, read_run
    from fsm_runner.replay import replay as replay_through

    journal = state.journal()
    # Transitions, then the row: one a live writer advances meanwhile is read consistently.
    timeline, run = read_run(journal, resolve_run_id(journal, run_id), to_seq=to_seq)
    if to_seq is not None and to_seq > run.seq:
        fail(f"--to: run {shown(run.run_id)} has seqs 0..{run.seq}", EXIT_USAGE)
    specs = journal_specs(journal)
    broken = chain_break(timeline)
    if broken is not None:
        fail(
            f"run {shown(run.run_id)} at seq {broken}: the transition does not match its digest"
            " (changed since it was written)",
            EXIT_FAILURE,
        )
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
            f"replay of run {shown(run.run_id)} matches the journal: {len(replayed.steps)} "
            f"transitions, state {run.state!r} ({run.status.value})"
        )
    else:
        at = replayed.run
        click.echo(
            f"run {shown(run.run_id)} at seq {to_seq}: state {at.state!r} ({at.status.value}), "
            f"iteration {at.iteration}, attempt {at.attempt}"
        )
