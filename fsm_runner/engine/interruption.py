"""Interruptions: SIGTERM as Ctrl-C, and how a journaled ``INTERRUPTED`` names its cause."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["interrupt_on_sigterm", "interruption_cause"]


def interruption_cause(exc: BaseException) -> str:
    """``by SIGTERM`` for :func:`interrupt_on_sigterm`'s interruption, else ``(ExceptionType)``."""
    text = str(exc) if isinstance(exc, KeyboardInterrupt) else ""
    if text.startswith(_SIGNAL_PREFIX):
        return f"by {text.removeprefix(_SIGNAL_PREFIX)}"
    return f"({type(exc).__name__})"


#: How :func:`interrupt_on_sigterm`'s ``KeyboardInterrupt`` names the signal: ``signal SIGTERM``.
_SIGNAL_PREFIX = "signal "


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM interrupts like Ctrl-C (``KeyboardInterrupt``).

    So a run that is stopped by its supervisor (systemd, Kubernetes, a shell's ``kill``)
    journals ``INTERRUPTED`` and stays resumable, exactly as after Ctrl-C. Only in the main
    thread (where Python delivers signals); elsewhere the block changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"{_SIGNAL_PREFIX}{signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
