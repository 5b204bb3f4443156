"""The rule of run ids as a test of text, and the form an id is printed in; no imports.

:mod:`fsm_runner.run_ids` is the public face of the rule (``check_run_id`` raises
``InvalidRunIdError``); this module is what both it and :mod:`fsm_runner.exceptions` (whose
messages print run ids) use, so neither imports the other.
"""

from __future__ import annotations

import re

__all__ = ["MAX_LENGTH", "problem", "shown", "valid_ascii"]

#: The most characters a run id may have.
MAX_LENGTH = 200

# The rule for ASCII ids, the ones apps use (random ids are 32 hex digits): one regex match is
# the whole check on the journals' hot path (create_runs of thousands). Visible ASCII is 0x21-0x7E;
# '/' (0x2F) and '\' (0x5C) are left out. Anything else goes to the full check, character by
# character, which also says what is wrong.
_ASCII_VALID = re.compile(r"(?!-)(?!\.\.?\Z)[!-.0-\[\]-~]{1,%d}\Z" % MAX_LENGTH)  # noqa: UP031
#: ``valid_ascii(run_id)`` is a match (not ``None``) for an ASCII id that follows the rule.
valid_ascii = _ASCII_VALID.match


def shown(run_id: str) -> str:
    """The form in which ``run_id`` is printed: itself if it follows the rule, else its ``repr``.

    A ``repr`` is one line whatever the id holds (a newline, a control character, a line
    separator are escaped), and its quotes tell such an id from one that follows the rule.
    """
    if (type(run_id) is str and valid_ascii(run_id) is not None) or problem(run_id) is None:
        return run_id
    return repr(run_id)


def problem(run_id: object) -> str | None:
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
