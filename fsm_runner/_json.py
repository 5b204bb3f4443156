r"""Standard JSON as every journal stores it, and exception text that can always be stored.

One strict encoder serves every place that writes JSON to a journal (the engine's checks before
a write, the SQL journals' parameters, :class:`fsm_runner.MemoryJournal`'s checks, the effects
ledger), so what one journal refuses every journal refuses, with the same reason:

- NaN and ±Infinity: ``json.dumps`` writes them as ``NaN``/``Infinity``, which is not JSON
  (PostgreSQL's ``json`` type and most other readers refuse it);
- nesting deeper than :data:`MAX_JSON_DEPTH` levels: deep enough to fail to encode
  (``RecursionError``), or to encode here but fail to decode, compare or print later from a
  deeper stack, which would leave a journaled run unreadable;
- a lone surrogate (``"\ud800"``): a Python ``str`` can hold one, UTF-8 (SQLite, PostgreSQL)
  cannot.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

__all__ = [
    "MAX_JSON_DEPTH",
    "dumps_json",
    "error_info",
    "exception_message",
    "printable",
    "storable_text",
]

#: How many levels JSON payloads may nest (orjson's limit too, so what it encodes fits).
MAX_JSON_DEPTH = 255

_CONTAINERS = (dict, list, tuple)


def dumps_json(value: Any, *, sort_keys: bool = False) -> str:
    """Compact JSON text of ``value``: standard JSON that UTF-8 can hold, or a clear refusal.

    Costs one ``json.dumps`` for the common payload: NaN is refused by the encoder itself, the
    surrogate check is O(1) for ASCII text, and only text with more than
    :data:`MAX_JSON_DEPTH` brackets is walked to measure its nesting.

    Raises:
        ValueError: saying what is wrong with the value (``is not JSON-serialisable (...)``,
            ``contains NaN or Infinity, ...``, ``is nested more than 255 levels deep``,
            ``contains a lone surrogate ...``), to be read after the name of the payload.
    """
    try:
        text = json.dumps(
            value,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
            sort_keys=sort_keys,
        )
    except RecursionError:
        raise ValueError(f"is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        if str(exc).startswith("Out of range float values"):
            raise ValueError(
                "contains NaN or Infinity, which standard JSON has no value for"
            ) from None
        raise ValueError(f"is not JSON-serialisable ({exc})") from None
    except TypeError as exc:
        raise ValueError(f"is not JSON-serialisable ({exc})") from None
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"contains a lone surrogate ({text[exc.start]!r}), which UTF-8 cannot store"
            ) from None
    # Nesting needs at least as many brackets as levels (brackets inside strings only add).
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _deeper_than(value, MAX_JSON_DEPTH):
        raise ValueError(f"is nested more than {MAX_JSON_DEPTH} levels deep")
    return text


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels in ``value`` (without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return False


def storable_text(text: str) -> str:
    r"""``text`` with any lone surrogate written as a ``\udXXX`` escape, so UTF-8 can hold it."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable(value: object) -> str:
    """``str(value)``, storable; a fallback naming the failure if ``__str__`` raises or lies."""
    try:
        message = str(value)
    except Exception as err:  # noqa: BLE001 - any failure of a foreign __str__ is reported
        return f"<unprintable {type(value).__name__}: __str__ raised {type(err).__name__}>"
    return storable_text(message)


def exception_message(exc: BaseException) -> str:
    """An exception's message as the journal keeps it (see :func:`printable`)."""
    return printable(exc)


def error_info(exc: BaseException) -> dict[str, Any]:
    """What the journal keeps of an exception: its type, message and traceback, all storable.

    Never raises for the exception's sake: an unprintable message or a traceback that cannot
    be formatted is replaced by a note saying so.
    """
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception as err:  # noqa: BLE001 - the failure is still journaled, without it
        text = f"<traceback unavailable: formatting it raised {type(err).__name__}>"
    return {
        "type": storable_text(type(exc).__name__),
        "message": exception_message(exc),
        "traceback": storable_text(text),
    }
