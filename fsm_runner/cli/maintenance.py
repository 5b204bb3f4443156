"""Commands that look after the journal: ``check``, ``prune``, and ``export`` of a run to files."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import click

from fsm_runner._shown import problem, valid_ascii
from fsm_runner.cli.errors import EXIT_FAILURE, EXIT_USAGE, FiniteFloatRange, fail
from fsm_runner.cli.journals import CliState, resolve_run_id
from fsm_runner.cli.output import json_dump, plural
from fsm_runner.cli.report import artifact_summary
from fsm_runner.run_ids import shown

#: A ``--since`` duration: a number and a unit (seconds, minutes, hours, days, weeks).
_DURATION = re.compile(r"(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[smhdw])", re.IGNORECASE)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: As far back as ``prune --older-than`` reaches: a thousand years.
_MAX_DAYS = 365_000


def parse_since(value: str) -> dt.datetime:
    """The time ``--since`` names: an ISO date/time (UTC unless it says), ``7d``, or DAYS.

    A bare number is days, as ``prune --older-than`` takes them; ``30m``, ``12h``, ``7d``,
    ``2w`` are a duration back from now.

    Raises:
        ValueError: not one of those, NaN, infinite, or more than a thousand years back.
    """
    from fsm_runner.records import utc_now

    text = value.strip()
    match = _DURATION.fullmatch(text)
    try:
        days = float(text) if match is None else None
    except ValueError:
        days = None
    if match is not None or days is not None:
        if match is not None:
            days = float(match["n"]) * _UNIT_SECONDS[match["unit"].lower()] / 86400
        assert days is not None
        if not math.isfinite(days) or not 0 <= days <= _MAX_DAYS:
            raise ValueError(f"{value!r} is not a time back from now of 0 to {_MAX_DAYS} days")
        return utc_now() - dt.timedelta(days=days)
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is neither an ISO date/time (2026-11-20, 2026-11-20T08:00Z) nor a"
            " duration (30m, 12h, 7d, 2w, or DAYS)"
        ) from None
    return (
        when.replace(tzinfo=dt.timezone.utc)
        if when.tzinfo is None
        else when.astimezone(dt.timezone.utc)
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the problems as JSON.")
@click.option(
    "--run",
    "run_ids",
    multiple=True,
    metavar="RUN",
    help="Check only this run (an id or a unique prefix); repeatable.",
)
@click.option(
    "--since",
    metavar="WHEN",
    help="Check only the runs updated (their last transition) since WHEN: an ISO date/time"
    " (UTC unless it says) or a duration back from now (30m, 12h, 7d, 2w; a bare number is days).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1, max=1024),
    default=None,
    metavar="N",
    help="Processes to replay the runs in (default: the CPU count; 1: in this one).",
)
@click.pass_obj
def check(
    state: CliState, as_json: bool, run_ids: tuple[str, ...], since: str | None, jobs: int | None
) -> None:
    """Check the journal's integrity, and replay every run through its stored spec.

    SQLite's own integrity check, the schema and dangling rows, every run's hash chain and
    every row's digest (the first seq, or row, whose content changed since it was written;
    every journal), then for every run (or those --run and --since select):
    seqs gapless from 0 (invariant 2), the run row equal to its last transition (1) and to
    what replaying its transitions gives (8). The runs are
    replayed in --jobs processes, a range of runs each. Exits 1 with a list of problems, one
    per line; a progress bar on stderr when it is a terminal. A run whose id breaks the rule
    of run ids (stored before it) is a warning line, not a problem: it is read-only.
    """
    import os

    from fsm_runner.replay import check_runs

    when = None
    if since is not None:
        try:
            when = parse_since(since)
        except ValueError as exc:
            fail(f"--since: {exc}", EXIT_USAGE)
    journal = state.journal()
    selected = [resolve_run_id(journal, run_id) for run_id in run_ids] if run_ids else None
    with _progress_bar() as progress:
        report = check_runs(
            journal,
            run_ids=selected,
            since=when,
            jobs=jobs if jobs is not None else os.cpu_count() or 1,
            progress=progress,
        )
    problems, count = list(report.problems), report.runs
    warnings = _id_warnings(
        journal.run_ids("", limit=sys.maxsize) if selected is None else selected
    )
    if as_json:
        json_dump(
            {"journal": journal.location, "runs": count, "problems": problems, "warnings": warnings}
        )
    elif problems:
        click.echo(f"journal {journal.location}: {len(problems)} problems in {count} runs")
        for problem in problems:
            click.echo(f"  {problem}")
    else:
        click.echo(f"journal {journal.location}: {count} runs checked, no problems")
    for warning in [] if as_json else warnings:
        click.echo(f"  warning: {warning}")
    if problems:
        sys.exit(EXIT_FAILURE)


def _id_warnings(run_ids: Iterable[str]) -> list[str]:
    """One line per run whose id breaks the rule of run ids (stored before it): not a problem.

    Such a run is read as any other, but never advanced (``fsm_runner.run_ids``).
    """
    lines = []
    for run_id in run_ids:
        reason = None if valid_ascii(run_id) is not None else problem(run_id)
        if reason is not None:
            lines.append(
                f"run {shown(run_id)}: its id breaks the rule of run ids ({reason}); the run is"
                " read-only (shown, replayed, exported, forked from; never advanced)"
            )
    return lines


@contextlib.contextmanager
def _progress_bar() -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback drawing click's bar on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    bars: list[Any] = []

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(
                click.progressbar(length=total, label="checking runs", file=sys.stderr).__enter__()
            )
        bars[0].update(done)

    try:
        yield progress
    finally:
        if bars:
            bars[0].__exit__(None, None, None)


@click.command()
@click.option(
    "--older-than",
    "days",
    # At most a thousand years: further back is no date (and NaN and infinity are none).
    type=FiniteFloatRange(min=0, max=365_000),
    required=True,
    metavar="DAYS",
    help="Prune runs that ended (were last updated) more than this many days ago.",
)
@click.option("--dry-run", is_flag=True, help="Only list what would be pruned.")
@click.option(
    "--vacuum",
    is_flag=True,
    help="SQLite: then shrink the file (VACUUM; every writer waits for it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def prune(state: CliState, days: float, dry_run: bool, vacuum: bool, as_json: bool) -> None:
    """Delete old ended runs with all they own, in short batches.

    Runs that have not ended, and ended runs with a child run still active, are never touched.
    The space freed is reused by the journal; --vacuum gives it back to the file system.
    """
    import datetime as dt

    from fsm_runner.journal import SqliteJournal
    from fsm_runner.records import utc_now

    journal = state.journal()
    ended_before = utc_now() - dt.timedelta(days=days)
    if isinstance(journal, SqliteJournal):
        report = journal.prune(ended_before=ended_before, dry_run=dry_run, vacuum=vacuum)
    elif vacuum:
        fail("--vacuum is for a SQLite journal (PostgreSQL's VACUUM is its own)", EXIT_USAGE)
    else:
        report = journal.prune(ended_before=ended_before, dry_run=dry_run)
    if as_json:
        json_dump(
            {
                "run_ids": list(report.run_ids),
                "runs": len(report.run_ids),
                "transitions": report.transitions,
                "dry_run": report.dry_run,
                "bytes_before": report.bytes_before,
                "bytes_after": report.bytes_after,
            }
        )
        return
    verb = "would prune" if dry_run else "pruned"
    click.echo(
        f"{verb} {plural(len(report.run_ids), 'run')} ({plural(report.transitions, 'transition')})"
    )
    if dry_run:
        for pruned_id in report.run_ids:
            click.echo(f"  {shown(pruned_id)}")
    elif report.bytes_before is not None and report.bytes_after is not None:
        click.echo(f"journal size {report.bytes_before:,} -> {report.bytes_after:,} bytes")


@click.command()
@click.argument("run_id", metavar="RUN")
@click.argument(
    "directory", metavar="DIR", type=click.Path(file_okay=False, writable=True, path_type=Path)
)
@click.pass_obj
def export(state: CliState, run_id: str, directory: Path) -> None:
    """Write a run to DIR as JSON files.

    run.json (the run and its transitions; from a journal that keeps digests, each
    transition's and the head's, to verify the run's chain elsewhere), effects.json (its
    effects ledger), iteration-N.json for each iteration, and one file per artifact named after it
    (agent-N.json, verification-N.json for agent-loop runs).
    """
    from fsm_runner._json import dumps_json
    from fsm_runner.records import unstructure

    journal = state.journal()
    run = journal.load(resolve_run_id(journal, run_id))
    transitions = journal.transitions(run.run_id)
    files: dict[str, Any] = {
        "run.json": {
            "run": unstructure(run),
            "transitions": [unstructure(t) for t in transitions],
        },
        "effects.json": [unstructure(e) for e in journal.effects(run.run_id)],
    }
    if transitions and transitions[-1].digest is not None:  # a journal that keeps digests
        files["run.json"]["head_digest"] = transitions[-1].digest
        # What each digest covers: the result's JSON as stored (this file sorts its keys)
        for data, transition in zip(files["run.json"]["transitions"], transitions, strict=True):
            data["result_json"] = (
                None if transition.result is None else dumps_json(transition.result)
            )
    for record in journal.iterations(run.run_id):
        files[f"iteration-{record.iteration}.json"] = unstructure(record)
    for artifact in journal.artifacts(run.run_id):
        # artifact names come from handlers: keep them inside DIR whatever they hold
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", artifact.name).lstrip(".") or "artifact"
        files[f"{safe}.json"] = (
            artifact.content if artifact.status == "stored" else artifact_summary(artifact)
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (directory / name).write_text(
                json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            )
    except OSError as exc:
        fail(f"cannot write to {directory}: {exc.strerror or exc}")
    click.echo(f"wrote {len(files)} files to {directory}: {', '.join(sorted(files))}")
