"""What a state may say about its phase's failures: :class:`RetryPolicy` (part of a spec).

Plain frozen data, as the rest of :mod:`fsm_runner.spec` (which exports it too); a field of the
wrong type is kept as given and named by ``MachineSpec.validate()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

import attrs

__all__ = ["RetryPolicy"]


def _int_field(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return cast(int, value)  # validate() names it


def _float_field(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return cast(float, value)  # validate() names it


@attrs.frozen
class RetryPolicy:
    """Retry a phase whose handler raised, with exponential backoff, before giving up.

    Every failed attempt is journaled as a ``RETRIED`` self transition, so it stays visible;
    once ``max_attempts`` attempts have failed the spec's ``SYSTEM_ERROR`` transition is followed.

    Args:
        max_attempts: attempts in all, the first one included (>= 1).
        wait_initial: seconds to wait after the first failure.
        wait_max: the longest wait between two attempts.
        wait_exp_base: how much each wait grows over the one before.
    """

    max_attempts: int = attrs.field(default=3, converter=_int_field)
    wait_initial: float = attrs.field(default=0.1, converter=_float_field)
    wait_max: float = attrs.field(default=5.0, converter=_float_field)
    wait_exp_base: float = attrs.field(default=2.0, converter=_float_field)

    def wait(self, failed_attempt: int) -> float:
        """Seconds to wait after attempt number ``failed_attempt`` (1-based) failed."""
        exponent = max(failed_attempt - 1, 0)
        return float(min(self.wait_initial * self.wait_exp_base**exponent, self.wait_max))

    def problems(self) -> Iterator[str]:
        """Yield what is wrong with this policy."""
        attempts: Any = self.max_attempts  # as given: the converter keeps what it cannot read
        if not isinstance(attempts, int):
            yield f"max_attempts must be an integer, not {attempts!r}"
        elif attempts < 1:
            yield f"max_attempts must be >= 1, not {attempts}"
        waits: tuple[Any, ...] = (self.wait_initial, self.wait_max, self.wait_exp_base)
        if not all(isinstance(wait, float) and math.isfinite(wait) for wait in waits):
            yield f"waits must be finite numbers, not {waits!r}"
        elif self.wait_initial < 0 or self.wait_max < 0 or self.wait_exp_base < 1:
            yield "waits must be >= 0 and wait_exp_base >= 1"
