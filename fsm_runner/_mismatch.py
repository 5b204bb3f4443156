"""How replay names a run-row field that differs from what the transitions derive: briefly.

Only what differs is shown (a mapping's keys that differ, up to a few), each value in a short
form (JSON cut to :data:`_SHOWN_CHARS` characters, a time as the journal writes it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fsm_runner._convert import format_utc
from fsm_runner.spec import RunLifecycle

__all__ = ["shown_fields"]

_SHOWN_CHARS = 160
_SHOWN_KEYS = 4
_ABSENT = object()


def shown_fields(name: str, expected: Any, found: Any) -> tuple[str, str]:
    """How a compared row field is named in a mismatch: only what differs, briefly."""
    if isinstance(expected, Mapping) and isinstance(found, Mapping):
        keys = sorted(
            (
                key
                for key in {*expected, *found}
                if expected.get(key, _ABSENT) != found.get(key, _ABSENT)
            ),
            key=str,
        )
        if keys and len(keys) <= _SHOWN_KEYS:
            return (
                ", ".join(_entry(name, key, expected) for key in keys),
                ", ".join(_entry(name, key, found) for key in keys),
            )
    return _show(name, expected), _show(name, found)


def _entry(name: str, key: Any, mapping: Mapping[Any, Any]) -> str:
    value = mapping.get(key, _ABSENT)
    return f"{name}[{key!r}] " + ("absent" if value is _ABSENT else _json(value))


def _json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


def _show(name: str, value: Any) -> str:
    if value is None:
        return f"{name} None"
    if name in ("context", "error"):
        return f"{name} {_json(value)}"
    if name == "updated_at":
        return f"{name} {format_utc(value)}"
    if isinstance(value, RunLifecycle):
        return f"{name} {value.value!r}"
    return f"{name} {value!r}"
