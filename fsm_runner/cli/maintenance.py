"""Commands that look after the journal: ``check``, ``prune``, and ``export`` of a run to files."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import click

from fsm_runner.cli.errors import EXIT_FAILURE, FiniteFloatRange, fail
from fsm_runner.cli.journals import CliState, resolve_run_id
from fsm_runner.cli.output import json_dump, plural
from fsm_runner.cli.report import artifact_summary


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the problems as JSON.")
@click.pass_obj
def check(state: CliState, as_json: bool) -> None:
    """Check the journal's integrity, and replay every run through its spec.

    SQLite's own integrity check and dangling rows, then for every run: seqs gapless from 0
    (invariant 2), the run row equal to its last transition (1) and to what replaying its
    transitions gives (8). Exits 1 with a list of problems, one per line.
    """
    from fsm_runner.replay import check_journal

    journal = state.journal()
    problems = check_journal(journal)
    count = len(journal.run_ids("", limit=sys.maxsize))
    if as_json:
        json_dump({"journal": journal.location, "runs": count, "problems": problems})
    elif problems:
        click.echo(f"journal {journal.location}: {len(problems)} problems in {count} runs")
        for problem in problems:
            click.echo(f"  {problem}")
    else:
        click.echo(f"journal {journal.location}: {count} runs checked, no problems")
    if problems:
        sys.exit(EXIT_FAILURE)


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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def prune(state: CliState, days: float, dry_run: bool, as_json: bool) -> None:
    """Delete old ended runs with all they own, then reclaim space.

    Runs that have not ended, and ended runs with a child run still active, are never touched.
    """
    import datetime as dt

    from fsm_runner.records import utc_now

    journal = state.journal()
    report = journal.prune(ended_before=utc_now() - dt.timedelta(days=days), dry_run=dry_run)
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
            click.echo(f"  {pruned_id}")
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

    run.json (the run and its transitions), effects.json (its effects ledger),
    iteration-N.json for each iteration, and one file per artifact named after it
    (agent-N.json, verification-N.json for agent-loop runs).
    """
    from fsm_runner.records import unstructure

    journal = state.journal()
    run = journal.load(resolve_run_id(journal, run_id))
    files: dict[str, Any] = {
        "run.json": {
            "run": unstructure(run),
            "transitions": [unstructure(t) for t in journal.transitions(run.run_id)],
        },
        "effects.json": [unstructure(e) for e in journal.effects(run.run_id)],
    }
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
