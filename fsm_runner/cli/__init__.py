"""The ``fsm-runner`` command line: list, inspect, replay, resume, abort, signal, fork, draw runs.

The CLI is thin: every command opens the journal, calls the library and prints. It is the only
place where errors become exit codes: a user's mistake prints one line on stderr, never a
traceback. Heavy imports happen inside the commands, so ``fsm-runner --help`` stays fast.
Colour is used only on a terminal; piped output is plain, stable text.

This module holds the ``cli`` group and registers every command on it. The commands live by
topic: :mod:`~fsm_runner.cli.inspection` (``runs``, ``watch``, ``replay``),
:mod:`~fsm_runner.cli.report` (``show``), :mod:`~fsm_runner.cli.operations` (``resume``,
``recover``, ``worker``, ``abort``, ``signal``, ``fork``),
:mod:`~fsm_runner.cli.maintenance` (``check``, ``prune``, ``export``),
:mod:`~fsm_runner.cli.drawing` (``diagram``) and
:mod:`~fsm_runner.cli.agent` (``demo``, ``agent-loop``); what they share:
:mod:`~fsm_runner.cli.errors` (exit codes, one-line errors), :mod:`~fsm_runner.cli.journals`
(the journal a command works on), :mod:`~fsm_runner.cli.apps` (importing ``--app``) and
:mod:`~fsm_runner.cli.output` (tables, wrapping, colour). Below it: finding and opening the
journal (:mod:`fsm_runner.journal.locate`) and what every fsm_runner command line shares, the
``--journal`` option among them (:mod:`fsm_runner.command_line`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from fsm_runner.cli.agent import agent_loop as agent_loop
from fsm_runner.cli.agent import demo as demo
from fsm_runner.cli.drawing import diagram as diagram
from fsm_runner.cli.effects import effects as effects
from fsm_runner.cli.effects import settle as settle
from fsm_runner.cli.errors import (
    EXIT_CONFLICT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    ExitCodeCommand,
    ExitCodeGroup,
)
from fsm_runner.cli.errors import CliError as CliError
from fsm_runner.cli.indexes import index as index
from fsm_runner.cli.inspection import replay as replay
from fsm_runner.cli.inspection import runs as runs
from fsm_runner.cli.inspection import watch as watch
from fsm_runner.cli.journals import CliState, open_cli_journal, resolve_run_id
from fsm_runner.cli.maintenance import check as check
from fsm_runner.cli.maintenance import export as export
from fsm_runner.cli.maintenance import prune as prune
from fsm_runner.cli.operations import abort as abort
from fsm_runner.cli.operations import fork as fork
from fsm_runner.cli.operations import recover as recover
from fsm_runner.cli.operations import resume as resume
from fsm_runner.cli.operations import signal as signal
from fsm_runner.cli.operations import worker as worker
from fsm_runner.cli.report import show as show
from fsm_runner.command_line import journal_option
from fsm_runner.ui.command import ui

__all__ = [
    "EXIT_CONFLICT",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "ExitCodeCommand",
    "ExitCodeGroup",
    "cli",
    "main",
    "open_cli_journal",
    "resolve_run_id",
]


def __getattr__(name: str) -> Any:
    # Where the journal is found, kept here by name for the presets and examples that read it
    # from the CLI; loaded on first use, as the journal package is (`--help` stays fast).
    if name in ("DEFAULT_JOURNAL", "ENV_JOURNAL"):
        from fsm_runner.journal import locate

        return getattr(locate, name)
    raise AttributeError(f"module 'fsm_runner.cli' has no attribute {name!r}")


@click.group(cls=ExitCodeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@journal_option()
@click.option(
    "--otel",
    is_flag=True,
    help="Export OpenTelemetry traces and metrics of the runs this command drives, as the "
    "OTEL_* variables say (OTLP over HTTP by default; also on when OTEL_TRACES_EXPORTER or "
    "OTEL_METRICS_EXPORTER is set). Needs fsm-runner[otel].",
)
@click.version_option(package_name="fsm-runner", prog_name="fsm-runner")
@click.pass_context
def cli(ctx: click.Context, journal_path: str, otel: bool) -> None:
    """Run long, multi-phase jobs as durable state machines, and operate their journal.

    Run ids may be abbreviated to any unique prefix.

    Exit codes: 0 ok; 1 failure (also a run that ended failed or aborted); 2 usage error;
    3 run or journal not found; 4 conflict (the run has ended, its lease is held by another
    worker, or another writer moved it).
    """
    # Text another writer left in the journal that UTF-8 cannot carry (a lone surrogate) is
    # printed escaped (\ud800), as the run inspector shows it, not refused.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    state = CliState(journal_path, otel=otel)  # set up before a command makes an engine
    ctx.obj = state
    ctx.call_on_close(state.close)


cli.add_command(runs)
cli.add_command(show)
cli.add_command(resume)
cli.add_command(recover)
cli.add_command(worker)
cli.add_command(abort)
cli.add_command(signal)
cli.add_command(effects)
cli.add_command(settle)
cli.add_command(export)
cli.add_command(fork)
cli.add_command(diagram)
cli.add_command(watch)
cli.add_command(replay)
cli.add_command(check)
cli.add_command(prune)
cli.add_command(index)
cli.add_command(demo)
cli.add_command(agent_loop)
cli.add_command(ui)  # the run inspector


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``fsm-runner`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="fsm-runner")
