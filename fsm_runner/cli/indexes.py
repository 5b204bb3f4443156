"""``fsm-runner index``: the search indexes that serve the inspector's searches at scale.

A search index holds one key of every run: its start time (``created_at``) or the JSON value at
a path of its input or context (``input.order.id``); see
:class:`fsm_runner.journal.search.SearchKey`. Searches use them by themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from fsm_runner.cli.errors import EXIT_USAGE, ExitCodeCommand, ExitCodeGroup, fail
from fsm_runner.cli.journals import CliState
from fsm_runner.cli.output import json_dump

if TYPE_CHECKING:
    from fsm_runner.journal.search import SearchIndexes, SearchKey


@click.group(cls=ExitCodeGroup)
def index() -> None:
    """List, add and drop the journal's search indexes.

    KEY is created_at (a run's start time; PostgreSQL journals always index it) or a path in
    a run's input or context: input.order.id, context.files[0]. A search by the key reads its
    index instead of every run; each index costs a write to every run that sets its value.
    """


def _indexes(state: CliState) -> SearchIndexes:
    journal = state.journal()
    indexes: SearchIndexes | None = getattr(journal, "search_indexes", None)
    if indexes is None:
        fail(f"the journal {journal.location} has no search indexes to manage", EXIT_USAGE)
    return indexes


def _keys(texts: tuple[str, ...]) -> list[SearchKey]:
    from fsm_runner.journal.search import SearchKey

    try:
        return [SearchKey.parse(text) for text in texts]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None


@index.command("list", cls=ExitCodeCommand)
@click.option("--json", "as_json", is_flag=True, help="Print the keys as a JSON list.")
@click.pass_obj
def list_indexes(state: CliState, as_json: bool) -> None:
    """List the keys the journal's search indexes serve."""
    keys = [str(key) for key in _indexes(state).indexed()]
    if as_json:
        json_dump(keys)
    elif not keys:
        click.echo("no search indexes")
    else:
        for key in keys:
            click.echo(key)


@index.command("add", cls=ExitCodeCommand)
@click.argument("keys", metavar="KEY...", nargs=-1, required=True)
@click.pass_obj
def add(state: CliState, keys: tuple[str, ...]) -> None:
    """Index KEY of every run (SQLite: writers wait for the build; PostgreSQL: they go on)."""
    _each(state, keys, "add", ("indexed", "already indexed"))


@index.command("drop", cls=ExitCodeCommand)
@click.argument("keys", metavar="KEY...", nargs=-1, required=True)
@click.pass_obj
def drop(state: CliState, keys: tuple[str, ...]) -> None:
    """Drop the search index of KEY."""
    _each(state, keys, "drop", ("dropped", "no search index"))


def _each(state: CliState, keys: tuple[str, ...], action: str, said: tuple[str, str]) -> None:
    """``add`` or ``drop`` each key (all read first: a bad one changes nothing); say what it did."""
    wanted = _keys(keys)
    indexes = _indexes(state)
    for key in wanted:
        changed = getattr(indexes, action)(key)
        click.echo(f"{key}: {said[0] if changed else said[1]}")
