"""Old public names kept working for a while: using one warns and gives the new object itself."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["deprecated"]


def deprecated(module: str, old: str, new: str, value: Any) -> Any:
    """Warn that ``module.old`` is deprecated in favour of ``new``, and return ``value``.

    Called from a module's ``__getattr__``, so the warning points at the caller's line.
    """
    warnings.warn(
        f"{module}.{old} is deprecated; use {new} (the same class)",
        DeprecationWarning,
        stacklevel=3,
    )
    return value
