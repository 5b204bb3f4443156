"""The one cattrs converter, shared by the spec and the journal records.

UTC ISO-8601 datetimes, enums by value, and fields equal to their default left out of
unstructured dicts, so adding a field with a default never changes a spec's hash and records
written before a field existed load with its default.
"""

from __future__ import annotations

import datetime as dt
import enum

import cattrs

__all__ = ["by_value", "converter", "format_utc", "parse_utc"]

_UTC = dt.timezone.utc

converter = cattrs.Converter(omit_if_default=True, forbid_extra_keys=False)


#: The formatted seconds of recent timestamps: most share theirs with one before (a run's
#: times with each other, its lease expiries with each other). Cleared when full.
_seconds: dict[tuple[int, int, int, int, int, int], str] = {}
_SECONDS_KEPT = 64
#: ``"000"`` to ``"999"``: a microsecond's six digits are two of these.
_DIGITS = [f"{number:03d}" for number in range(1000)]


def format_utc(value: dt.datetime) -> str:
    """Format a datetime as UTC ISO-8601 with microseconds (naive datetimes are taken as UTC).

    ``2026-11-21T22:13:07.123456+00:00``: fixed width (the year too), so the text sorts as the
    time does.
    """
    if value.tzinfo is not _UTC:
        value = value.replace(tzinfo=_UTC) if value.tzinfo is None else value.astimezone(_UTC)
    key = (value.year, value.month, value.day, value.hour, value.minute, value.second)
    second = _seconds.get(key)
    if second is None:
        if len(_seconds) >= _SECONDS_KEPT:
            _seconds.clear()  # a race only costs a recomputation
        second = _seconds[key] = "{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}.".format(*key)
    # The microseconds by two table lookups: a format spec (``:06d``) costs ~2,000 instructions
    microsecond = value.microsecond
    return second + _DIGITS[microsecond // 1000] + _DIGITS[microsecond % 1000] + "+00:00"


def parse_utc(value: str | dt.datetime) -> dt.datetime:
    """Parse an ISO-8601 timestamp into an aware UTC datetime."""
    parsed = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.astimezone(dt.timezone.utc)


def _is_enum(cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, enum.Enum)


def by_value(*enums: type[enum.Enum]) -> None:
    """Unstructure these enums to their plain values.

    cattrs dispatches ``str``-mixin enums to its ``str`` passthrough (``str`` precedes ``Enum``
    in their MRO), so each one is registered by name.
    """
    for cls in enums:
        converter.register_unstructure_hook(cls, lambda member: member.value)


converter.register_unstructure_hook(dt.datetime, format_utc)
converter.register_unstructure_hook_func(_is_enum, lambda member: member.value)
converter.register_structure_hook(dt.datetime, lambda value, _: parse_utc(value))
