"""Commands on a run's effects ledger: ``effects`` (list) and ``settle`` (an operator's answer).

A non-idempotent effect caught in flight (its process died while it ran) stops its run: only
someone who can look at the outside system knows whether it happened. ``settle`` records that
answer in the effect's own row (see :func:`fsm_runner.effects.settled`): a resumed run then
returns the result given (``--done``) or raises the failure (``--failed``), and
``runs --effect-in-flight`` no longer lists the run.
"""

from __future__ import annotations

import getpass
import socket
from typing import TYPE_CHECKING, Any

import click

from fsm_runner.cli.errors import EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_USAGE, fail
from fsm_runner.cli.journals import CliState, resolve_run_id
from fsm_runner.run_ids import shown

if TYPE_CHECKING:
    from fsm_runner.records import EffectRecord


def _text(value: Any) -> str:
    """A value on one line, escaped: JSON for data, ``repr`` escapes for text."""
    from fsm_runner._json import dumps_json

    text = value if isinstance(value, str) else dumps_json(value)
    return repr(text)[1:-1] if isinstance(value, str) else text.encode("unicode_escape").decode()


def _line(effect: EffectRecord) -> str:
    from fsm_runner.records import format_utc

    started = format_utc(effect.started_at) if effect.started_at else "-"
    parts = [
        f"{effect.visit_seq:>4}",
        _text(effect.name),
        _text(effect.kind),
        effect.status.value,
        "idempotent" if effect.idempotent else "once",
        f"key={_text(effect.idempotency_key)}",
        f"started={started}",
    ]
    error = dict(effect.error or {})
    if "settled_by" in error:
        parts.append(f"settled_by={_text(error['settled_by'])} reason={_text(error['reason'])}")
    elif effect.error:
        parts.append(f"error={_text(error.get('type'))}: {_text(error.get('message'))}")
    return "  ".join(parts)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.pass_obj
def effects(state: CliState, run_id: str) -> None:
    """List a run's effects, one line each: visit, name, kind, status, key, start.

    An effect an operator settled shows who and why. Text is printed escaped.
    """
    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    found = journal.effects(run_id)
    for effect in found:
        click.echo(_line(effect))
    if not found:
        click.echo(f"run {shown(run_id)} has no effects")


@click.command()
@click.argument("run_id", metavar="RUN")
@click.argument("name", metavar="EFFECT")
@click.option("--done", "done", flag_value=True, default=None, help="It happened.")
@click.option("--failed", "done", flag_value=False, help="It did not happen (or failed).")
@click.option("--result", metavar="JSON", help="With --done: its result, as JSON (null).")
@click.option("--reason", help="Why (journaled; required with --failed).")
@click.option("--by", metavar="WHO", help="Who settles it (default: user@host).")
@click.option("--visit", type=int, metavar="SEQ", help="The visit, if several have EFFECT.")
@click.pass_obj
def settle(
    state: CliState,
    run_id: str,
    name: str,
    done: bool | None,
    result: str | None,
    reason: str | None,
    by: str | None,
    visit: int | None,
) -> None:
    """Record what became of an effect caught in flight: it was done, or it failed.

    A resumed run then takes the effect as done (its result returned, never called again) or
    as failed (raised as EffectFailedError); who settled it and why are journaled with it.
    """
    from fsm_runner._json import storable_text
    from fsm_runner.cli.operations import json_option
    from fsm_runner.effects import SettleRefusedError, settle_effect

    if done is None:
        fail("settle: give --done or --failed", EXIT_USAGE)
    if not done and (result is not None or not reason):
        fail("settle --failed: give --reason (and no --result)", EXIT_USAGE)
    value = json_option("--result", result)
    journal = state.journal()
    run_id = resolve_run_id(journal, run_id)
    who = storable_text(by or f"{getpass.getuser()}@{socket.gethostname()}")
    try:
        record = settle_effect(
            journal,
            run_id,
            name,
            done=done,
            result=value,
            reason=storable_text(reason or ""),
            by=who,
            visit_seq=visit,
        )
    except SettleRefusedError as exc:
        codes = {"not_found": EXIT_NOT_FOUND, "conflict": EXIT_CONFLICT}
        fail(str(exc).replace(": name one", ": give --visit"), codes.get(exc.reason, EXIT_USAGE))
    click.echo(f"effect {name!r} of run {shown(run_id)} settled {record.status.value} by {who}")
