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

from collections.abc import Iterable

from fsm_runner._shown import MAX_LENGTH, shown, valid_ascii
from fsm_runner._shown import problem as _problem
from fsm_runner.exceptions import InvalidRunIdError

__all__ = ["MAX_LENGTH", "check_run_id", "check_run_ids", "shown"]


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it follows the rule of run ids (see :mod:`fsm_runner.run_ids`).

    Args:
        run_id: the id to check.

    Returns:
        ``run_id``, unchanged.

    Raises:
        InvalidRunIdError: ``run_id`` breaks the rule; ``reason`` says how.
    """
    if type(run_id) is str and valid_ascii(run_id) is not None:
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
    valid = valid_ascii
    for run_id in run_ids:
        if type(run_id) is not str or valid(run_id) is None:
            check_run_id(run_id)
