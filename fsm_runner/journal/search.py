"""Searching runs by what they hold and when they started (:class:`RunSearch`).

A :class:`RunSearch` narrows :meth:`Journal.runs <fsm_runner.journal.Journal.runs>` and
:meth:`Journal.count_runs <fsm_runner.journal.Journal.count_runs>` beyond their equality
filters: runs started in a range of time, and runs whose input or context holds a value at a
path (:class:`JsonMatch`, ``input.order.id = 42``). Every journal answers them alike; the SQL
journals compare in the database (SQLite's ``json_extract``/``json_type``, PostgreSQL's
``jsonb``), with the value's JSON type: the number ``42`` is not the string ``"42"``.

A search is served by an index when the journal has one for it (:class:`SearchKey`; its
journal's ``search_indexes``: ``add("input.order.id")``), as a console's search attributes are
declared first: every JSON path cannot be indexed, and each index costs a write to every run
that sets its value. Without one, a JSON match reads the runs the other filters leave, newest
first, until the page is full (a rare value in a big journal reads them all); so does a time
range on SQLite, whose start times are indexed only once ``created_at`` is added (PostgreSQL's
always are).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable
from typing import Any, Literal, Protocol

import attrs

__all__ = ["JsonMatch", "RunSearch", "SearchIndexes", "SearchKey"]

#: ``input`` or ``context``, then keys (``.name``) and list indexes (``[0]``), ``=``, a value.
_MATCH = re.compile(
    r"(input|context)((?:\.[A-Za-z_][A-Za-z0-9_-]*|\[\d{1,9}\])+)\s*=\s*(.+)", re.DOTALL
)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(\d{1,9})\]")
#: ``input`` or ``context``, then keys and list indexes: what a search index serves.
_FIELD = re.compile(r"(input|context)((?:\.[A-Za-z_][A-Za-z0-9_-]*|\[\d{1,9}\])+)")
#: The longest index name PostgreSQL keeps (``NAMEDATALEN - 1`` bytes).
_NAME_BYTES = 63
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

Scalar = str | int | float | bool | None


def _check_path(instance: object, _attribute: object, path: tuple[str | int, ...]) -> None:
    if not path:
        raise ValueError("a JSON match needs a path: input.KEY = VALUE")
    for step in path:
        if isinstance(step, bool) or not isinstance(step, str | int):
            raise TypeError(f"a path's step is a key or an index, not {step!r}")
        if isinstance(step, int) and not 0 <= step < 10**9:
            raise ValueError(f"a list index is 0 to 999,999,999, not {step}")
        if isinstance(step, str) and not _KEY.fullmatch(step):
            raise ValueError(f"a key is a letter or _ then letters, digits, _ or -: {step!r}")


def _steps(path: Iterable[str | int]) -> tuple[str | int, ...]:
    return tuple(path)


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
    def key(self) -> SearchKey:
        """What an index serving this match indexes: its field and path."""
        return SearchKey(self.field, self.path)

    @property
    def json_path(self) -> str:
        """The path as SQLite's JSON functions take it: ``$."order"."id"``, ``$."files"[0]``."""
        return self.key.json_path

    def __str__(self) -> str:
        return f"{self.key} = {json.dumps(self.value)}"


@attrs.frozen
class SearchKey:
    """What a search index serves: runs' start times, or a path in their input or context.

    Written ``created_at``, ``input.order.id`` or ``context.files[0]`` (:meth:`parse`). Its
    index's name is ``search:`` and the key (:attr:`index_name`); the SQL of a search by it
    names the index's expression exactly (:meth:`sqlite_expression`,
    :meth:`postgres_expression`), so the database's planner finds the index by itself.

    Attributes:
        field: ``created_at``, ``input`` or ``context``.
        path: a JSON field's path (keys and list indexes, as :class:`JsonMatch`'s); empty for
            ``created_at``.
    """

    field: Literal["input", "context", "created_at"] = attrs.field(
        validator=attrs.validators.in_(("input", "context", "created_at"))
    )
    path: tuple[str | int, ...] = attrs.field(default=(), converter=_steps)

    def __attrs_post_init__(self) -> None:
        if self.field == "created_at":
            if self.path:
                raise ValueError("created_at has no path")
        else:
            _check_path(self, None, self.path)
        if len(self.index_name.encode()) > _NAME_BYTES:
            raise ValueError(f"a search index's key is at most {_NAME_BYTES - 7} characters")

    @classmethod
    def parse(cls, text: str) -> SearchKey:
        """Read ``created_at``, ``input.order.id``, ``context.files[0]``.

        Raises:
            ValueError: none of those, or a key too long for an index's name.
        """
        text = text.strip()
        if text == "created_at":
            return cls("created_at")
        found = _FIELD.fullmatch(text)
        if found is None:
            raise ValueError(
                f"cannot index {text!r}: a search index is created_at, input.KEY or"
                " context.KEY, with .KEY and [INDEX] steps (input.order.id, context.files[0])"
            )
        field, steps = found.groups()
        path = tuple(key if key else int(index) for key, index in _STEP.findall(steps))
        return cls(field, path)  # type: ignore[arg-type]

    def __str__(self) -> str:
        steps = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in self.path)
        return f"{self.field}{steps}"

    @property
    def index_name(self) -> str:
        """The name of the index that serves it (``search:input.order.id``)."""
        return f"search:{self}"

    @property
    def json_path(self) -> str:
        """The path as SQLite's JSON functions take it: ``$."order"."id"``, ``$."files"[0]``."""
        return "$" + "".join(f"[{s}]" if isinstance(s, int) else f'."{s}"' for s in self.path)

    def sqlite_expression(self) -> str:
        """What a SQLite index holds and a search compares: ``json_extract(input, '$."id"')``.

        The path is written into the SQL (a bound one would not name the index's expression):
        its keys hold letters, digits, ``_`` and ``-`` only, so it needs no escaping.
        """
        if self.field == "created_at":
            return "created_at"
        return f"json_extract({self.field}, '{self.json_path}')"

    def postgres_expression(self, decode: str) -> str:
        """What a PostgreSQL index holds: the ``jsonb`` at the path of ``decode(field)``."""
        if self.field == "created_at":
            return "created_at"
        steps = ",".join(f'"{step}"' for step in self.path)  # quoted: a key "null" is no NULL
        return f"({decode}({self.field}) #> '{{{steps}}}'::text[])"


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

    @property
    def ranged(self) -> bool:
        """Whether it searches a range of start times (either bound)."""
        return self.created_from is not None or self.created_before is not None

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


def search_index_sql(key: SearchKey) -> str:
    """The SQL of a SQLite journal's search index of ``key`` (as ``sqlite_master`` keeps it)."""
    return f'CREATE INDEX "{key.index_name}" ON run_rows ({key.sqlite_expression()})'


def sqlite_json_match(match: JsonMatch) -> tuple[str, list[Any]]:
    """The SQLite condition (and parameters) of ``match`` on the ``runs`` view's JSON text.

    ``json_extract`` at the path, compared first (what a search index on the path holds:
    ``true`` is ``1`` there, ``null`` SQL's NULL), then ``json_type`` tells the kinds apart (a
    number is ``integer`` or ``real``).
    """
    key = match.key
    value, kind = match.value, json_kind(match.value)
    found = key.sqlite_expression()
    type_of = f"json_type({key.field}, '{key.json_path}')"
    if kind == "null":
        return f"{found} IS NULL AND {type_of} = 'null'", []
    if kind == "number":
        return f"{found} = ? AND {type_of} IN ('integer', 'real')", [value]
    if kind == "string":
        return f"{found} = ? AND {type_of} = 'text'", [value]
    return f"{found} = {int(bool(value))} AND {type_of} = {_SQLITE_TYPES[kind]}", []


#: The function a PostgreSQL journal's search indexes decode JSON text with (NULL for text
#: ``jsonb`` refuses, as a ``\u0000`` escape: a cast there would refuse the run's write).
POSTGRES_DECODE = "fsm_runner_search_json"


def postgres_json_match(match: JsonMatch, *, decode: str | None = None) -> tuple[str, list[Any]]:
    """The PostgreSQL condition (and parameters) of ``match``: ``jsonb`` equality at a path.

    ``decode``: :data:`POSTGRES_DECODE` when a search index serves the match's key (the
    expression the index holds); else the column cast to ``jsonb``.
    """
    found = match.key.postgres_expression(decode or "jsonb")
    return f"{found} = %s::jsonb", [json.dumps(match.value)]


class SearchIndexes(Protocol):
    """A journal's search indexes (``journal.search_indexes``; see :class:`SearchKey`).

    The built-in journals have one; a journal of the host's own may (the CLI's ``index``
    commands say so when it has none). A key is a :class:`SearchKey` or its text.
    """

    def indexed(self) -> list[SearchKey]:
        """The keys the journal's search indexes serve, by name."""

    def serves(self, key: SearchKey | str) -> bool:
        """Whether an index serves ``key``."""

    def add(self, key: SearchKey | str) -> bool:
        """Index ``key`` of every run; ``False`` if an index already serves it."""

    def drop(self, key: SearchKey | str) -> bool:
        """Drop the index of ``key``; ``False`` if there was none."""
