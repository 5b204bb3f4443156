"""Runs driven from the inspector's pages: **Resume** and **Retry** (``fsm-runner ui --app``).

The server was given the host app (``--app MODULE:ATTR``, as ``fsm-runner resume`` takes it):
a run's page can then resume it, or retry a failed one (forked at the seq before its failure,
and the fork resumed). Each drive is a thread of the server with a journal and an engine of its
own, as ``fsm-runner resume`` would be a process: the page it was asked from follows it live
and says how it ended. A run is driven by one drive at a time; a run another worker holds is
refused by the journal as everywhere else, and the drive says so.

A drive still running when the server stops ends with the process, as a killed ``resume``
would: what it committed stays, its lease expires (or is taken over at once on this host) and
the run resumes from its last state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import attrs

from fsm_runner.journal import Journal

if TYPE_CHECKING:
    from fsm_runner.engine import Engine

__all__ = ["Drive", "Drives"]

DriveState = Literal["running", "ended", "failed"]


@attrs.define
class Drive:
    """One run driven from a page: how it stands, and what it came to."""

    run_id: str
    #: ``running``; ``ended`` (the engine returned: the run ended, or waits, or stopped);
    #: ``failed`` (the engine raised: a lease held elsewhere, a journal error).
    state: DriveState = "running"
    #: How it ended, in one line.
    message: str = ""
    _done: threading.Event = attrs.field(factory=threading.Event, alias="_done")

    def finish(self, state: DriveState, message: str) -> None:
        """Say how the drive ended (its thread does, once)."""
        self.state, self.message = state, message
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the drive to end; whether it has."""
        return self._done.wait(timeout)


class Drives:
    """The drives of one inspector: started by run id, at most one per run at a time."""

    def __init__(
        self, open_journal: Callable[[], tuple[Journal, bool]], app: Callable[[Journal], Engine]
    ) -> None:
        """``open_journal``: a journal for a drive, and whether the drive closes it after."""
        self._open = open_journal
        self._app = app
        self._lock = threading.Lock()
        self._drives: dict[str, Drive] = {}

    def of(self, run_id: str) -> Drive | None:
        """The run's latest drive from this server, if any."""
        return self._drives.get(run_id)

    def start(self, run_id: str) -> Drive:
        """Resume ``run_id`` in a thread of its own, unless a drive of it is running."""
        with self._lock:
            drive = self._drives.get(run_id)
            if drive is not None and drive.state == "running":
                return drive
            drive = self._drives[run_id] = Drive(run_id)
        threading.Thread(
            target=self._drive,
            args=(drive,),
            name=f"fsm-runner-ui-drive-{run_id[:12]}",
            daemon=True,
        ).start()
        return drive

    def _drive(self, drive: Drive) -> None:
        try:
            journal, owned = self._open()
            try:
                engine = self._app(journal)
                try:
                    run = engine.resume(drive.run_id)
                finally:
                    engine.close()
            finally:
                if owned:
                    journal.close()
        except BaseException as exc:  # noqa: BLE001 - whatever ended it, the page says it
            drive.finish("failed", f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        else:
            drive.finish("ended", f"{run.status.value} in state {run.state} at seq {run.seq}")
