"""Digests of a journal's rows: each run's hash chain of transitions, and per-row digests.

A transition's digest is BLAKE2b-128 (hex) over the previous transition's digest and the
transition's values as the journal stores them (the INSERT's parameters: the JSON text, the
formatted time); so a changed byte in any transition — or a changed digest — shows at the first
seq whose content no longer matches. A run row's digest covers what its commits write that
a check cannot derive from the transitions (its input, context and error, and who it is);
an iteration's, effect's or artifact's digest covers that row's own values.

The canonical text of a row: its values joined by the unit separator (0x1F), each as text —
a string as it is, ``None`` as the byte 0x00, an integer (a boolean as 0 or 1) in decimal, a float
in hexadecimal, Python's ``float.hex()`` (exact, and far cheaper to write than the shortest
decimal), or as the integer it is when it has no fractional part (SQLite stores an integer
given to a REAL column as REAL, and a float given to an INTEGER column as INTEGER) — then
UTF-8. The chain's text starts with the previous digest (empty at seq 0). A separator byte
inside a value (JSON text escapes it; ids and state names do not hold it) would make two rows'
texts alike only if two fields changed together.

Reading a row back to verify it, text columns come as bytes (SQL's
``CAST(... AS BLOB)``): a damaged byte that is not UTF-8 is still a byte of the text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from fsm_runner.journal import _rows
from fsm_runner.records import TransitionRecord, format_utc

__all__ = [
    "RUN_DIGEST_COLUMNS",
    "SIGNAL_DIGEST_COLUMNS",
    "TRANSITION_DIGEST_COLUMNS",
    "chain_break",
    "digest",
    "row_digest",
    "row_digest_from",
    "row_hasher",
    "step_digest",
    "stored_row_digest",
    "text",
    "transition_digest",
]

_blake2b = hashlib.blake2b
#: A BLAKE2b-128 state with nothing hashed yet: copied, not made again, by each step.
_EMPTY_STATE = _blake2b(digest_size=16)
_SEPARATOR = "\x1f"
_NULL = "\x00"
#: A transition's columns its digest covers, in order (the INSERT's, its run key aside).
TRANSITION_DIGEST_COLUMNS = (
    "run_id", "seq", "from_state", "event", "to_state", "iteration", "attempt", "at",
    "duration_ms", "result", "lease_token",
)  # fmt: skip
#: A run row's columns its digest covers: who the run is and what its commits write that the
#: transitions do not give (its head is its last transition's: the chain covers that).
RUN_DIGEST_COLUMNS = (
    "run_id", "machine", "created_at", "parent_run_id", "forked_from", "input", "context",
    "error",
)  # fmt: skip
#: A signal's columns its digest covers: what its sender wrote (SQLite schema 12, PostgreSQL
#: 10). Its consumption is the chain's: the transition that consumed it names it in its result.
SIGNAL_DIGEST_COLUMNS = ("run_id", "name", "payload", "signal_id", "received_at")


def text(value: Any) -> str:
    """One value's canonical text (see the module)."""
    kind = type(value)
    if kind is str:
        return value  # type: ignore[no-any-return]
    if value is None:
        return _NULL
    if kind is float:  # hex: exact, and ~15x cheaper than repr's shortest decimal
        return str(int(value)) if value.is_integer() else value.hex()
    if isinstance(value, int):  # bools too, as SQLite stores them
        return str(int(value))
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "surrogateescape")
    return str(value)


def digest(previous: str | None, values: Iterable[Any]) -> str:
    """The digest of a row's ``values`` chained to ``previous`` (``None``: none before)."""
    joined = _SEPARATOR.join([previous or "", *map(text, values)])
    return _blake2b(joined.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


def row_digest(values: Iterable[Any]) -> str:
    """The digest of one row's own ``values`` (an iteration, effect, artifact, run row)."""
    return digest(None, values)


def stored_row_digest(values: Sequence[Any]) -> str:
    """:func:`row_digest` of a row's values as a check reads them stored: text as its bytes.

    Values that are all bytes or ``None`` (SQL's ``CAST(... AS BLOB)`` of text columns, and
    NULL) are joined as they are, not decoded and encoded again: the same bytes, so the same
    digest (``surrogateescape`` gives back any byte it took); anything else goes through
    :func:`row_digest`.
    """
    parts = [b""]
    for value in values:
        if value is None:
            parts.append(b"\x00")
        elif type(value) is bytes:
            parts.append(value)
        else:
            return row_digest(values)
    state = _EMPTY_STATE.copy()
    state.update(b"\x1f".join(parts))
    return state.hexdigest()


def row_hasher(values: Iterable[Any]) -> Any:
    """A BLAKE2b-128 state over the canonical text of a row's first ``values``.

    For a row whose first values repeat from write to write (a run row's input, say):
    ``row_digest_from(row_hasher(first), rest)`` is ``row_digest((*first, *rest))``, the first
    values' text built and hashed once.
    """
    joined = _SEPARATOR.join(["", *map(text, values)])
    return _blake2b(joined.encode("utf-8", "surrogateescape"), digest_size=16)


def row_digest_from(hasher: Any, rest: Iterable[Any]) -> str:
    """:func:`row_digest` of a row whose first values ``hasher`` (:func:`row_hasher`) holds."""
    more = hasher.copy()
    joined = "".join([_SEPARATOR + text(value) for value in rest])
    more.update(joined.encode("utf-8", "surrogateescape"))
    return more.hexdigest()  # type: ignore[no-any-return]


def chain_break(transitions: Sequence[TransitionRecord]) -> int | None:
    """The first seq of a run's ``transitions`` (from seq 0, in order) whose digest is wrong.

    Computed from the records as read (their JSON written again, their times formatted), so a
    run's chain is verified wherever its transitions go (``fsm-runner replay``, an export);
    ``check`` verifies the stored text itself. ``None``: the chain holds, or the transitions
    carry no digests (a journal without them).
    """
    previous: str | None = None
    for transition in transitions:
        if transition.digest is None:
            return None
        values = _rows.transition_params(transition, format_utc)
        if transition_digest(previous, values) != transition.digest:
            return transition.seq
        previous = transition.digest
    return None


def transition_digest(previous: str | None, values: tuple[Any, ...]) -> str:
    """:func:`digest` of a transition's INSERT values (:data:`TRANSITION_DIGEST_COLUMNS`)."""
    return step_digest(previous, *values)


def step_digest(  # noqa: PLR0917 - positional on purpose: the hot path
    previous: str | None,
    run_id: Any,
    seq: Any,
    from_state: Any,
    event: Any,
    to_state: Any,
    iteration: Any,
    attempt: Any,
    at: Any,
    ms: Any,
    result: Any,
    token: Any,
) -> str:
    """:func:`transition_digest` of the values given one by one: a writer's hot path.

    One f-string where the values have the types a step writes (ints, text, a float or
    ``None``), else :func:`digest` itself, whose text this is; the hash from a copy of a
    BLAKE2b-128 state made once (its parameters not parsed again: ~1,200 instructions).
    """
    if (
        type(seq) is type(iteration) is type(attempt) is type(token) is int
        and type(run_id) is type(event) is type(to_state) is type(at) is str
    ):
        joined = (
            f"{previous or ''}\x1f{run_id}\x1f{seq}"
            f"\x1f{_NULL if from_state is None else from_state}\x1f{event}\x1f{to_state}"
            f"\x1f{iteration}\x1f{attempt}\x1f{at}"
            f"\x1f{ms.hex() if type(ms) is float and not ms.is_integer() else text(ms)}"
            f"\x1f{_NULL if result is None else result}\x1f{token}"
        )
        state = _EMPTY_STATE.copy()
        try:
            state.update(joined.encode())
        except UnicodeEncodeError:  # a lone surrogate: its bytes as the other rows keep them
            state.update(joined.encode("utf-8", "surrogateescape"))
        return state.hexdigest()
    return digest(
        previous,
        (run_id, seq, from_state, event, to_state, iteration, attempt, at, ms, result, token),
    )
