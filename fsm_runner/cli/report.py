"""``fsm-runner show``: a run's report, as text or JSON.

The summary, the timeline, then each section the run has: signals, sub-phases, effects, child
runs, iterations and artifacts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from fsm_runner.cli.journals import CliState, resolve_run_id
from fsm_runner.cli.output import (
    format_time,
    format_time_ms,
    json_dump,
    styled_status,
    table,
    text_width,
    wrap,
    wrap_column,
)
from fsm_runner.run_ids import shown
from fsm_runner.visits import subphase_visits

if TYPE_CHECKING:
    from fsm_runner.cli.inspection import Waiting
    from fsm_runner.journal import Journal
    from fsm_runner.records import (
        ArtifactRecord,
        EffectRecord,
        IterationRecord,
        RunRecord,
        SignalRecord,
        TransitionRecord,
    )

_T = TypeVar("_T")


class _Shown:
    """Everything ``show`` prints about a run, read from the journal.

    A plain class: a ``NamedTuple`` would cost ``fsm-runner --help`` its creation.
    """

    def __init__(self, journal: Journal, run_id: str) -> None:
        from fsm_runner.cli.inspection import Waiting
        from fsm_runner.engine.waits import waits_now
        from fsm_runner.spec import MachineSpec

        self.run = run = journal.load(run_id)
        self.timeline = journal.transitions(run.run_id)
        self.iterations = journal.iterations(run.run_id)
        self.artifacts = journal.artifacts(run.run_id)
        spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
        self.visits = subphase_visits(spec, self.timeline)
        self.children = list(reversed(journal.runs(parent_run_id=run.run_id)))
        self.effects = journal.effects(run.run_id)
        self.signals = journal.signals(run.run_id)
        self.waiting: Waiting | None = None
        if not run.ended and waits_now(spec, run):
            self.waiting = Waiting(journal, spec, run)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_obj
def show(state: CliState, run_id: str, as_json: bool) -> None:
    """Show a run: its summary and its timeline of transitions."""
    journal = state.journal()
    shown = _Shown(journal, resolve_run_id(journal, run_id))
    if as_json:
        _print_json(shown)
        return
    print_summary(shown.run)
    if shown.waiting is not None:
        _print_pair("waits", shown.waiting.summary())
    click.echo("")
    _print_timeline(shown.timeline)
    _print_section(shown.signals, _print_signals)
    _print_section(shown.visits, _print_visits)
    _print_section(shown.effects, _print_effects)
    _print_section(shown.children, _print_children)
    _print_section(shown.iterations, print_iterations)
    _print_section(shown.artifacts, _print_artifacts)


def _print_section(records: Sequence[_T], print_records: Callable[[Sequence[_T]], None]) -> None:
    """A blank line and the section, for a run that has any of it."""
    if records:
        click.echo("")
        print_records(records)


def _print_json(shown: _Shown) -> None:
    from fsm_runner.records import unstructure

    json_dump(
        {
            "run": unstructure(shown.run),
            "transitions": [unstructure(t) for t in shown.timeline],
            "iterations": [unstructure(i) for i in shown.iterations],
            "artifacts": [artifact_summary(a) for a in shown.artifacts],
            "subphases": shown.visits,
            "effects": [unstructure(e) for e in shown.effects],
            "signals": [unstructure(s) for s in shown.signals],
            "wait": shown.waiting.wait_json() if shown.waiting is not None else None,
            "children": [
                {"run_id": c.run_id, "machine": c.machine, "state": c.state,
                 "status": c.status.value}
                for c in shown.children
            ],
        }
    )  # fmt: skip


def artifact_summary(artifact: ArtifactRecord) -> dict[str, Any]:
    """An artifact as JSON without its content (``export`` writes contents)."""
    from fsm_runner.records import unstructure

    data = unstructure(artifact)
    data.pop("content", None)  # `export` writes contents; listings stay short
    return data


def print_summary(run: RunRecord) -> None:
    """The run's summary: one ``key value`` line each, long values wrapped under their value."""
    pairs = [
        ("run", shown(run.run_id)),
        ("machine", f"{run.machine} (spec {run.spec_hash[:12]})"),
        ("state", styled_status(f"{run.state} ({run.status.value})", run.status.value)),
        ("seq", f"{run.seq}   iteration {run.iteration}   attempt {run.attempt}"),
        (
            "started",
            f"{format_time(run.created_at)} UTC   updated {format_time(run.updated_at)} UTC",
        ),
        ("input", json.dumps(run.input, ensure_ascii=False)),
        ("context", json.dumps(dict(run.context), ensure_ascii=False)),
    ]
    if run.parent_run_id:
        pairs.append(("parent", shown(run.parent_run_id)))
    if run.forked_from:
        pairs.append(("forked", shown(run.forked_from)))
    if run.abort_reason:
        pairs.append(("abort", f"requested: {run.abort_reason}"))
    if run.error:
        pairs.append(("error", f"{run.error.get('type')}: {run.error.get('message')}"))
    for key, value in pairs:
        _print_pair(key, value)


def _print_pair(key: str, value: str) -> None:
    """One ``key value`` line of the summary; a long value wraps between words under itself."""
    lines = wrap(value, text_width() - 9)
    click.echo(f"{key:<9}{lines[0]}")
    for line in lines[1:]:
        click.echo(f"{'':<9}{line}")


def _print_timeline(timeline: Sequence[TransitionRecord]) -> None:
    rows = []
    for t in timeline:
        error = t.error
        rows.append(
            (
                str(t.seq),
                format_time_ms(t.at),
                t.from_state or "-",
                t.event,
                t.to_state,
                f"{t.duration_ms:.1f}",
                f"{error.get('type')}: {error.get('message')}" if error else "",
            )
        )
    table(wrap_column(rows, 6, 80), ("SEQ", "AT (UTC)", "FROM", "EVENT", "TO", "MS", "ERROR"))


#: How much of a signal's payload the signals table shows.
_PAYLOAD_CHARS = 40


def _short(value: Any) -> str:
    """A payload as one line of JSON, cut to :data:`_PAYLOAD_CHARS` characters."""
    if value is None:
        return "-"
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= _PAYLOAD_CHARS else text[: _PAYLOAD_CHARS - 1] + "…"


def _print_signals(signals: Sequence[SignalRecord]) -> None:
    table(
        [
            (
                f"#{s.number}",
                s.name,
                s.status.value,
                format_time_ms(s.received_at),
                "-" if s.consumed_seq is None else f"seq {s.consumed_seq}",
                s.signal_id or "-",
                _short(s.payload),
            )
            for s in signals
        ],
        ("SIGNAL", "NAME", "STATUS", "RECEIVED (UTC)", "CONSUMED BY", "ID", "PAYLOAD"),
        styles=[_SIGNAL_STYLES[s.status.value] for s in signals],
    )


#: The colour of a signal's row: a run status' of the same mood.
_SIGNAL_STYLES = {"pending": "active", "consumed": "succeeded", "expired": "aborted"}


def _print_visits(visits: Sequence[dict[str, Any]]) -> None:
    table(
        [
            (
                v["subphase"],
                v["parent"],
                str(v["attempts"]),
                str(v["restarts"]),
                str(v["interruptions"]),
                v["last_event"] or "-",
            )
            for v in visits
        ],
        ("SUB-PHASE", "IN", "ATTEMPTS", "RESTARTS", "INTERRUPTED", "LAST EVENT"),
    )


def _print_effects(effects: Sequence[EffectRecord]) -> None:
    table(
        [
            (
                e.name,
                e.state,
                str(e.visit_seq),
                e.kind,
                e.status.value,
                e.idempotency_key[:12],
                f"{(e.error or {}).get('type')}: {(e.error or {}).get('message')}"[:50]
                if e.error
                else "",
            )
            for e in effects
        ],
        ("EFFECT", "STATE", "VISIT", "KIND", "STATUS", "KEY", "ERROR"),
    )


def _print_children(children: Sequence[RunRecord]) -> None:
    table(
        [(shown(c.run_id)[:12], c.machine, c.state, c.status.value, str(c.seq)) for c in children],
        ("CHILD RUN", "MACHINE", "STATE", "STATUS", "SEQ"),
    )


def print_iterations(iterations: Sequence[IterationRecord]) -> None:
    """The iteration records as a table (``show``, and ``agent-loop`` when its run ends)."""
    rows = []
    for record in iterations:
        tokens = "-" if record.tokens_total is None else str(record.tokens_total)
        cost = "-" if record.cost_usd is None else f"{record.cost_usd:.4f}"
        ok = {True: "yes", False: "no", None: "-"}
        error = "" if record.error_type.value == "none" else record.error_type.value
        if record.error_message:
            error = f"{error}: {record.error_message}"
        rows.append(
            (
                str(record.iteration),
                record.state,
                ok[record.success],
                ok[record.passed],
                ",".join(record.levels_run) or "-",
                tokens,
                cost,
                "-" if record.duration_ms is None else f"{record.duration_ms / 1000:.1f}s",
                "yes" if record.feedback else "-",
                record.model or "-",
                record.agent_session_id or "-",
                error,
            )
        )
    table(
        wrap_column(rows, 11, 50),
        ("ITER", "STATE", "AGENT OK", "PASSED", "LEVELS", "TOKENS", "COST $", "TIME", "FEEDBACK",
         "MODEL", "SESSION", "ERROR"),
    )  # fmt: skip


def _print_artifacts(artifacts: Sequence[ArtifactRecord]) -> None:
    table(
        [
            (a.name, a.kind, str(a.seq), a.status, a.path or "(in journal)", a.error or "")
            for a in artifacts
        ],
        ("ARTIFACT", "KIND", "SEQ", "STATUS", "WHERE", "ERROR"),
    )
