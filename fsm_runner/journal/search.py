"""Searching runs by what they hold and when they started (:class:`RunSearch`).

A :class:`RunSearch` narrows :meth:`Journal.runs <fsm_runner.journal.Journal.runs>` and
:meth:`Journal.count_runs <fsm_runner.journal.Journal.count_runs>` beyond their equality
filters: runs started in a range of time, and runs whose input or context holds a value at a
path (:class:`JsonMatch`, ``input.order.id = 42``). Every journal answers them alike; the SQL
journals compare in the database (SQLite's ``json_extract``/``json_type``, PostgreSQL's
``jsonb``), with the value's JSON type: the number ``42`` is not the string ``"42"``.

No index serves a JSON match: it reads the runs the other filters leave, newest first, until
the page is full (a rare value in a big journal reads them all; narrow it by machine, status
or time where you can). A time range on SQLite is read from the listing's own order too.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any, Literal

import attrs

__all__ = ["JsonMatch", "RunSearch"]

#: ``input`` or ``context``, then keys (``.name``) and list indexes (``[0]``), ``=``, a value.
_MATCH = re.compile(
    r"(input|context)((?:\.[A-Za-z_][A-Za-z0-9_-]*|\[\d{1,9}\])+)\s*=\s*(.+)", re.DOTALL
)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(\d{1,9})\]")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

Scalar = str | int | float | bool | None


def _check_path(instance: JsonMatch, _attribute: object, path: tuple[str | int, ...]) -> None:
    if not path:
        raise ValueError("a JSON match needs a path: input.KEY = VALUE")
    for step in path:
        if isinstance(step, bool) or not isinstance(step, str | int):
            raise TypeError(f"a path's step is a key or an index, not {step!r}")
        if isinstance(step, int) and not 0 <= step < 10**9:
            raise ValueError(f"a list index is 0 to 999,999,999, not {step}")
        if isinstance(step, str) and not _KEY.fullmatch(step):
            raise ValueError(f"a key is a letter or _ then letters, digits, _ or -: {step!r}")


def _check_value(instance: JsonMatch, _attribute: object, value: Scalar) -> None:
    if value is not None and not isinstance(value, str | int | float | bool):
        raise ValueError("a JSON match compares a string, a number, true, false or null")
    if isinstance(value, float) and value != value:  # noqa: PLR0124 - NaN is no JSON
        raise ValueError("a JSON match compares a JSON value: NaN is none")


@attrs.frozen
class JsonMatch:
    """Runs whose ``input`` or ``context`` holds ``value`` at ``path``.

    A run whose JSON has no such path does not match.

    Attributes:
        field: ``input`` or ``context``.
        path: where in it: keys (``str``: a letter or ``_``, then letters, digits, ``_``,
            ``-``) and list indexes (``int``), from the top; one step at least.
        value: a JSON scalar: a string, a number, ``True``, ``False`` or ``None`` (null).
    """

    field: Literal["input", "context"] = attrs.field(
        validator=attrs.validators.in_(("input", "context"))
    )
    path: tuple[str | int, ...] = attrs.field(converter=tuple, validator=_check_path)
    value: Scalar = attrs.field(validator=_check_value)

    @classmethod
    def parse(cls, text: str) -> JsonMatch:
        """Read ``input.order.id = 42``, ``context.files[0] = "a.py"``, ``input.ok = true``.

        The value is read as JSON; a value that is not JSON is the string as written
        (``input.user = ada``).

        Raises:
            ValueError: not ``input`` or ``context``, a path, ``=`` and a scalar value.
        """
        found = _MATCH.fullmatch(text.strip())
        if found is None:
            raise ValueError(
                "search as input.KEY = VALUE or context.KEY[0].KEY = VALUE"
                " (VALUE: a JSON string, number, true, false or null, or plain text)"
            )
        field, steps, raw = found.groups()
        path = tuple(key if key else int(index) for key, index in _STEP.findall(steps))
        raw = raw.strip()
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw  # plain text: the string it spells
        return cls(field, path, value)  # type: ignore[arg-type]

    def matches(self, document: Any) -> bool:
        """Whether ``document`` (a run's input or context, decoded) holds the value there."""
        for step in self.path:
            if isinstance(document, list) and isinstance(step, int) and step < len(document):
                document = document[step]
                continue
            if isinstance(document, dict) and isinstance(step, str) and step in document:
                document = document[step]
                continue
            return False
        return json_kind(document) == json_kind(self.value) and document == self.value

    @property
    def json_path(self) -> str:
        """The path as SQLite's JSON functions take it: ``$."order"."id"``, ``$."files"[0]``."""
        return "$" + "".join(f"[{s}]" if isinstance(s, int) else f'."{s}"' for s in self.path)

    def __str__(self) -> str:
        steps = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in self.path)
        return f"{self.field}{steps} = {json.dumps(self.value)}"


def json_kind(value: Any) -> str:
    """A decoded JSON value's type as JSON tells them: ``true`` is no number, ``1.0`` is one."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


@attrs.frozen
class RunSearch:
    """What :meth:`Journal.runs <fsm_runner.journal.Journal.runs>` searches beyond its filters.

    Attributes:
        created_from: runs started at or after this time (timezone-aware).
        created_before: runs started before this time (timezone-aware).
        json: runs whose input or context holds a value at a path.
    """

    created_from: dt.datetime | None = None
    created_before: dt.datetime | None = None
    json: JsonMatch | None = None

    def __attrs_post_init__(self) -> None:
        for bound in (self.created_from, self.created_before):
            if bound is not None and bound.utcoffset() is None:
                raise ValueError("a search's times must be timezone-aware (UTC, say)")

    def admits(self, created_at: dt.datetime, input_: Any, context: Any) -> bool:
        """Whether a run with these facts is found (the memory journal's search)."""
        if self.created_from is not None and created_at < self.created_from:
            return False
        if self.created_before is not None and created_at >= self.created_before:
            return False
        if self.json is None:
            return True
        return self.json.matches(input_ if self.json.field == "input" else context)


#: SQLite's ``json_type`` of each kind of value a match compares.
_SQLITE_TYPES = {"null": "'null'", "true": "'true'", "false": "'false'", "string": "'text'"}


def sqlite_json_match(match: JsonMatch) -> tuple[str, list[Any]]:
    """The SQLite condition (and parameters) of ``match`` on the ``runs`` view's JSON text.

    ``json_type`` tells the kinds apart (``json_extract`` reads ``true`` as ``1``): a number
    is ``integer`` or ``real``, then compared by ``json_extract``.
    """
    column, path = match.field, match.json_path
    kind = json_kind(match.value)
    if kind == "number":
        return (
            f"json_type({column}, ?) IN ('integer', 'real') AND json_extract({column}, ?) = ?",
            [path, path, match.value],
        )
    condition = f"json_type({column}, ?) = {_SQLITE_TYPES[kind]}"
    if kind != "string":
        return condition, [path]
    return f"{condition} AND json_extract({column}, ?) = ?", [path, path, match.value]


def postgres_json_match(match: JsonMatch) -> tuple[str, list[Any]]:
    """The PostgreSQL condition (and parameters) of ``match``: ``jsonb`` equality at a path."""
    path = [str(step) for step in match.path]
    return f"({match.field}::jsonb #> %s::text[]) = %s::jsonb", [path, json.dumps(match.value)]
