"""``fsm-runner diagram``: a machine, or a run's path on it, as Mermaid, DOT, SVG or PNG."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fsm_runner.cli.apps import load_spec
from fsm_runner.cli.errors import EXIT_USAGE, fail
from fsm_runner.cli.journals import CliState, resolve_run_id

if TYPE_CHECKING:
    from fsm_runner.records import TransitionRecord


@click.command()
@click.argument("spec_path", metavar="[SPEC_IMPORT_PATH]", required=False)
@click.option(
    "--run", "run_id", metavar="RUN", help="Draw this run's path on its machine (from the journal)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mermaid", "dot", "svg", "png"]),
    default="mermaid",
    show_default=True,
    help="Text (mermaid, dot), or an image rendered by Graphviz `dot` (svg, png).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write to this file instead of stdout.",
)
@click.pass_obj
def diagram(
    state: CliState, spec_path: str | None, run_id: str | None, fmt: str, output: Path | None
) -> None:
    """Draw a machine, or a run's path on it, as Mermaid, DOT, SVG or PNG.

    SPEC_IMPORT_PATH is MODULE:ATTR naming a MachineSpec, an Engine, or a zero-argument
    factory returning either. With --run, the machine is read from the journal (no import
    needed): visited states and taken edges are highlighted, edges show how often they were
    taken, the current state is marked, and a failed run's last state is marked as failed.
    """
    from fsm_runner.diagrams import render, render_image
    from fsm_runner.spec import MachineSpec

    if (spec_path is None) == (run_id is None):
        fail("give either SPEC_IMPORT_PATH or --run RUN (one of them)", EXIT_USAGE)
    run = None
    timeline: Sequence[TransitionRecord] = ()
    if run_id is not None:
        journal = state.journal()
        run = journal.load(resolve_run_id(journal, run_id))
        timeline = journal.transitions(run.run_id)
        spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
    else:
        assert spec_path is not None
        spec = load_spec(spec_path, "SPEC_IMPORT_PATH")
    if fmt in ("svg", "png"):
        text = render(spec, format="dot", run=run, timeline=timeline)
        data = render_image(text, format="svg" if fmt == "svg" else "png")
    else:
        text = render(spec, format="dot" if fmt == "dot" else "mermaid", run=run, timeline=timeline)
        data = text.encode()
    if output is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    try:
        output.write_bytes(data)
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    click.echo(f"wrote {output} ({fmt}, {len(data)} bytes)", err=True)
