"""A run about to be driven is verified first: its head transition and its row, by their digests.

``check`` verifies every chain whole; a run loaded to be driven (claimed by ``resume``, a
step, a worker, an abort; a fork's source at the fork's seq) is verified only where a step
would build on it, at the cost of one indexed read: its head transition against the previous
transition's digest (the chain's last link), and its run row (input, context, error) against
its own digest. A run that fails is refused with one :class:`JournalError` naming the seq, and
nothing is written: it is never advanced past a row that no longer holds what was written.
A fork's source is verified up to the fork's seq (:func:`verify_history`): the fork copies those
rows, and its copies get digests of their own.

Each journal reads the rows its own way and hands them here: a head row is the head
transition's stored digest followed by its :data:`~._digest.TRANSITION_DIGEST_COLUMNS` as
stored; a run row the run row's stored digest followed by its
:data:`~._digest.RUN_DIGEST_COLUMNS` (SQLite reads the head's text columns as their bytes, as
``check`` does, and a claim takes the run row's from the row it loads). A ``None`` digest (a
journal, or a row, without digests) is not verified. PostgreSQL's journal can call the same
functions with its rows once it stores digests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import Any

from fsm_runner._shown import problem, shown, valid_ascii
from fsm_runner.exceptions import InvalidRunIdError, JournalError
from fsm_runner.journal._digest import text

__all__ = [
    "check_stored_id",
    "head_problem",
    "head_refusal",
    "is_head_refusal",
    "stored_digest",
    "verify_head",
    "verify_history",
]

_CHECK = "'fsm-runner check' says what is damaged"
_REFUSED = f" fails its digest; {_CHECK}; nothing was written"


def head_refusal(run_id: str, seq: int | None, *, path: str | None) -> JournalError:
    """The error refusing to drive ``run_id``: its transition ``seq`` (``None``: its row) fails."""
    what = f"the row (input, context, error) of run {shown(run_id)}"
    if seq is not None:
        what = f"seq {seq} of run {shown(run_id)}"
    return JournalError(f"{what}{_REFUSED}", path=path)


def signal_refusal(run_id: str, number: int, *, path: str | None) -> JournalError:
    """The error refusing to deliver signal ``number`` of ``run_id``: its row fails its digest.

    What its sender wrote (name, payload, id, arrival) no longer matches: delivered, the run
    would move on a payload nobody sent. The run is refused as a damaged head refuses it.
    """
    return JournalError(f"signal {number} of run {shown(run_id)}{_REFUSED}", path=path)


def is_head_refusal(error: BaseException) -> bool:
    """Whether ``error`` is a refusal to drive one run (:func:`head_refusal`'s, or its id's).

    Such a run is skipped by whoever goes through many (``Engine.recover``); any other
    ``JournalError`` (the journal closed, locked, unreadable) concerns them all.
    """
    if isinstance(error, InvalidRunIdError):
        return True
    return isinstance(error, JournalError) and error.detail.endswith(_REFUSED)


def head_problem(
    seq: int,
    head: Sequence[Any] | None,
    previous_digest: str | None,
    run_row: Sequence[Any] | None,
) -> tuple[bool, int | None]:
    """Whether the run fails, and what: the head's ``seq``, or ``None`` for the run row.

    ``head``: the head transition's digest and values (``None``: the journal has no such row);
    ``previous_digest``: the stored digest of the transition before it (``None`` at seq 0, or
    stored without one: a writer chains to it as ``None`` too); ``run_row``: the run row's
    digest and values (``None``: not read).
    """
    run_digest = None if run_row is None else run_row[0]
    if head is None:  # a run stored with digests whose head transition is missing: damaged
        return run_digest is not None, seq
    if head[0] is not None and stored_digest(previous_digest, head[1:]) != head[0]:
        return True, seq
    if run_digest is not None and stored_digest(None, run_row[1:]) != run_digest:  # type: ignore[index]
        return True, None
    return False, None


def stored_digest(previous: Any, values: Iterable[Any]) -> str:
    """:func:`~._digest.digest` of values as stored: its text, built as bytes.

    Text columns read as bytes (SQLite's ``CAST(... AS BLOB)``) are hashed as they are, with
    no round trip through ``str`` (the same bytes: ``digest`` decodes and encodes them with
    ``surrogateescape``). A row of bytes (and NULLs), or of text, is joined in one call: a
    claim's verification costs a few microseconds.
    """
    if previous is None:
        start = b""
    else:
        start = (previous if type(previous) is str else text(previous)).encode(
            "utf-8", "surrogateescape"
        )
    items: list[Any] = ["\x00" if value is None else value for value in values]
    if not items:
        return blake2b(start, digest_size=16).hexdigest()
    try:
        body = b"\x1f".join([b"\x00" if value == "\x00" else value for value in items])
    except TypeError:  # not all bytes
        try:
            body = "\x1f".join(items).encode("utf-8", "surrogateescape")
        except TypeError:  # numbers too: each as its text
            body = "\x1f".join(map(text, items)).encode("utf-8", "surrogateescape")
    return blake2b(start + b"\x1f" + body, digest_size=16).hexdigest()


def check_stored_id(run_id: str) -> None:
    """Refuse to drive a run whose id, stored before the rule of run ids, breaks it.

    Such a run stays readable (listed, shown, replayed, exported, forked from) but is never
    written again: not resumed, stepped, aborted, signalled or claimed by a worker.

    Raises:
        InvalidRunIdError: the id breaks the rule (:mod:`fsm_runner.run_ids`); nothing was
            written.
    """
    if type(run_id) is str and valid_ascii(run_id) is not None:
        return
    reason = problem(run_id)
    if reason is not None:
        raise InvalidRunIdError(
            run_id, f"{reason}; a run stored with such an id is read-only, never advanced"
        )


def verify_head(
    run_id: str,
    seq: int,
    head: Sequence[Any] | None,
    previous_digest: str | None,
    run_row: Sequence[Any] | None,
    *,
    path: str | None,
) -> None:
    """Refuse a run whose head transition or run row fails its digest (see the module).

    Or whose id breaks the rule of run ids (:func:`check_stored_id`): checked first.

    Raises:
        InvalidRunIdError: the run's id breaks the rule; nothing was written.
        JournalError: naming the seq (or the run's row); nothing was written.
    """
    check_stored_id(run_id)
    failed, at = head_problem(seq, head, previous_digest, run_row)
    if failed:
        raise head_refusal(run_id, at, path=path)


def verify_history(
    run_id: str,
    transitions: Iterable[tuple[int, str | None, Sequence[Any]]],
    run_row: Sequence[Any] | None,
    *,
    path: str | None,
) -> None:
    """Refuse a run whose chain up to a seq, or whose row, fails its digest (a fork's source).

    ``transitions``: each transition's seq, stored digest and values, from seq 0 in order, up
    to the seq a fork copies (the copies get digests of their own: a changed row must not
    become one that verifies); ``run_row``: as for :func:`verify_head`.

    Raises:
        JournalError: naming the first seq that fails (or the run's row); nothing was written.
    """
    previous: str | None = None
    for seq, stored, values in transitions:
        if stored is not None and stored_digest(previous, values) != stored:
            raise head_refusal(run_id, seq, path=path)
        previous = stored
    if (
        run_row is not None
        and run_row[0] is not None
        and stored_digest(None, run_row[1:]) != run_row[0]
    ):
        raise head_refusal(run_id, None, path=path)
