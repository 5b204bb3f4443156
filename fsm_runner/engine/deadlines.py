"""A phase's deadline applied to an awaitable handler (async runs; async handlers in sync runs).

Its own module, below both drivers, so that neither sibling imports the other: the sync driver
needs it for an async handler as much as the async driver does.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from fsm_runner._lazy import LazyModule
from fsm_runner.exceptions import PhaseTimeoutError
from fsm_runner.rules.decisions import PhaseStep

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["with_deadline"]


class _HandlerTimeoutError(Exception):
    """Carries a ``TimeoutError`` the handler raised itself past ``asyncio.wait_for``."""

    def __init__(self, error: TimeoutError) -> None:
        self.error = error


async def _own_timeouts(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except TimeoutError as exc:
        raise _HandlerTimeoutError(exc) from exc


async def with_deadline(awaitable: Awaitable[Any], step: PhaseStep) -> Any:
    """Await a handler's ``awaitable``, cancelled at ``step``'s deadline (if its state has one).

    Used by both drivers (the sync one for async handlers in sync runs), so it is neither's.

    Raises:
        PhaseTimeoutError: the deadline passed first.
    """
    remaining = step.ctx.remaining
    if remaining is None:
        return await awaitable
    try:
        return await asyncio.wait_for(_own_timeouts(awaitable), timeout=max(remaining, 0.0))
    except _HandlerTimeoutError as own:
        raise own.error from None  # the handler's own TimeoutError, not the deadline's
    except asyncio.TimeoutError:
        raise PhaseTimeoutError(state=step.state.name, timeout=step.state.timeout) from None
