"""How the commands print: aligned tables, wrapped text, times, JSON, colour on a terminal only.

Piped output is plain, stable text: colour only when stdout is a terminal and ``NO_COLOR`` is
not set.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from fsm_runner.records import RunRecord, TransitionRecord


def _colour() -> bool:
    """Colour only when stdout is a terminal (and NO_COLOR is not set)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


_STATUS_COLOURS = {
    "active": "cyan",
    "succeeded": "green",
    "failed": "red",
    "aborted": "yellow",
    "dead_letter": "magenta",
}


def styled_status(text: str, status: str) -> str:
    """``text`` in the colour of run status ``status``, on a terminal."""
    colour = _STATUS_COLOURS.get(status)
    return click.style(text, fg=colour) if colour and _colour() else text


def format_time(value: Any) -> str:
    """A timestamp to the second (``-`` for none)."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def format_time_ms(value: Any) -> str:
    """A timestamp to the millisecond, as timelines show it."""
    return str(value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3])


def plural(number: int, noun: str) -> str:
    """``1 run``, ``2 runs``, ``0 runs``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def json_dump(data: Any) -> None:
    """Print ``data`` as indented JSON with sorted keys."""
    click.echo(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))


def table(
    rows: Sequence[Sequence[str]],
    headers: Sequence[str],
    *,
    styles: Sequence[str] | None = None,
) -> None:
    """Print aligned columns; on a terminal, colour each row by its status in ``styles``."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for index, row in enumerate(rows):
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        click.echo(styled_status(line, styles[index]) if styles else line)


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken between words, never inside one.

    A word longer than ``width`` gets a line of its own; line breaks in ``text`` are kept.
    """
    import textwrap

    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        lines += textwrap.wrap(
            paragraph, width, break_long_words=False, break_on_hyphens=False
        ) or [""]
    return lines


def wrap_column(rows: Sequence[Sequence[str]], column: int, width: int) -> list[tuple[str, ...]]:
    """Rows whose cell in ``column`` is wrapped (:func:`wrap`) onto continuation rows."""
    wrapped: list[tuple[str, ...]] = []
    for row in rows:
        lines = wrap(row[column], width)
        wrapped.append((*row[:column], lines[0], *row[column + 1 :]))
        blank = [""] * len(row)
        wrapped += [(*blank[:column], line, *blank[column + 1 :]) for line in lines[1:]]
    return wrapped


def text_width() -> int:
    """Columns to fill: the terminal's, or 100 when stdout is not a terminal."""
    import shutil

    return max(60, shutil.get_terminal_size().columns) if sys.stdout.isatty() else 100


def echo_transition(transition: TransitionRecord, run: RunRecord) -> None:
    """Print one committed transition (an engine listener: ``resume``, ``watch``, ...)."""
    error = transition.error
    note = f"  ({error.get('type')}: {error.get('message')})" if error else ""
    click.echo(
        f"{transition.seq:>4}  {transition.from_state or '-'} --{transition.event}--> "
        f"{transition.to_state}{note}"
    )


def run_standing(run: RunRecord) -> str:
    """Where a run stands, e.g. ``run ID has ended (succeeded) in state 'STATE'``."""
    status = run.status.value
    if status == "active":
        standing = "is active"
    elif status == "dead_letter":
        standing = "is parked (dead_letter)"
    else:
        standing = f"has ended ({status})"
    from fsm_runner.run_ids import shown

    return f"run {shown(run.run_id)} {standing} in state {run.state!r}"
