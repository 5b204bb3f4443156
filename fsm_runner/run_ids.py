r"""What a run id may be: one rule, checked wherever a run is created, and the id's display form.

A run id names a run in every journal, on the command line (``fsm-runner show RUN``), in the
inspector's URLs (``/runs/RUN``) and, in apps and examples, in paths (``WORKSPACE/RUN``). So a
run id is a ``str`` of 1 to :data:`MAX_LENGTH` characters, each printable
(:meth:`str.isprintable`) and not whitespace, with no ``/`` or ``\``; it is not ``.`` or
``..``, and it does not start with ``-`` (so a command line never reads it as an option).

:func:`check_run_id` enforces the rule: :meth:`Engine.start <fsm_runner.Engine.start>`,
``start_many``, ``fork`` and every journal's write of a new run call it, and nothing is written
when it refuses. Ids already in a journal that break the rule (written before the rule, or by
raw SQL) stay readable; :func:`shown` is the form in which they are printed, on one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fsm_runner.exceptions import InvalidRunIdError

__all__ = ["MAX_LENGTH", "check_run_id", "check_run_ids", "shown"]

#: The most characters a run id may have.
MAX_LENGTH = 200

# The rule for ASCII ids, the ones apps use (random ids are 32 hex digits): one regex match is
# the whole check on the journals' hot path (create_runs of thousands). Visible ASCII is 0x21-0x7E;
# '/' (0x2F) and '\' (0x5C) are left out. Anything else goes to the full check, character by
# character, which also says what is wrong.
_ASCII_VALID = re.compile(r"(?!-)(?!\.\.?\Z)[!-.0-\[\]-~]{1,%d}\Z" % MAX_LENGTH)  # noqa: UP031
_valid_ascii = _ASCII_VALID.match


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it follows the rule of run ids (see :mod:`fsm_runner.run_ids`).

    Args:
        run_id: the id to check.

    Returns:
        ``run_id``, unchanged.

    Raises:
        InvalidRunIdError: ``run_id`` breaks the rule; ``reason`` says how.
    """
    if type(run_id) is str and _valid_ascii(run_id) is not None:
        return run_id
    reason = _problem(run_id)
    if reason is not None:
        raise InvalidRunIdError(run_id, reason)
    return run_id  # type: ignore[return-value]  # _problem found none: it is a str


def check_run_ids(run_ids: Iterable[object]) -> None:
    """Check every id of ``run_ids`` (:func:`check_run_id`); refuse at the first bad one.

    Raises:
        InvalidRunIdError: one of the ids breaks the rule.
    """
    valid = _valid_ascii
    for run_id in run_ids:
        if type(run_id) is not str or valid(run_id) is None:
            check_run_id(run_id)


def shown(run_id: str) -> str:
    """The form in which ``run_id`` is printed: itself if it follows the rule, else its ``repr``.

    A ``repr`` is one line whatever the id holds (a newline, a control character, a line
    separator are escaped), and its quotes tell such an id from one that follows the rule.
    """
    if _valid_ascii(run_id) is not None or _problem(run_id) is None:
        return run_id
    return repr(run_id)


def _problem(run_id: object) -> str | None:
    """How ``run_id`` breaks the rule, or ``None`` when it follows it."""
    if not isinstance(run_id, str):
        return f"it is not a str but {type(run_id).__name__}"
    if not 1 <= len(run_id) <= MAX_LENGTH:
        return (
            f"it has {len(run_id)} characters, more than {MAX_LENGTH}" if run_id else "it is empty"
        )
    bad = next((c for c in run_id if c in "/\\" or not c.isprintable() or c.isspace()), None)
    if bad is not None:
        if bad in "/\\":
            return f"it holds {bad!r}"
        what = "whitespace" if bad.isspace() else "not printable"
        return f"it holds {bad!r} (U+{ord(bad):04X}, {what})"
    if run_id in (".", ".."):
        return f"it is {run_id!r}"
    return "it starts with '-'" if run_id.startswith("-") else None
