"""Resources the harness owns (a helper server): start, health check, restart within a budget.

A phase that talks to a helper server must not manage that server: when the server dies, the
phase only reports ``SERVER_UNREACHABLE``. The machine then leaves the phase for a recovery
state whose handler belongs to the harness — a :class:`RecoveryPhase` — which restarts the
server through a :class:`Supervisor` and sends the run back to the phase that failed (a
:data:`fsm_runner.RETURN` transition), or fails it once the restart budget is spent::

    analysis.1b --SERVER_UNREACHABLE--> recovering --SERVER_RECOVERED--> analysis.1b (attempt 2)
                                                    --RESTART_BUDGET_SPENT--> failed

The seam is :class:`Resource`: start it, ask whether it is healthy, stop it, and hand out a
client. Phases only ever get the client (through ``ctx.services``), so their code has no way to
start, stop or restart what it talks to.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs

from fsm_runner.events import RunEvent
from fsm_runner.exceptions import SupervisorError
from fsm_runner.phases import PhaseContext, PhaseResult
from fsm_runner.spec import RetryPolicy
from fsm_runner.telemetry import current as current_telemetry

__all__ = ["RecoveryPhase", "Resource", "RestartOutcome", "RestartRecord", "Supervisor"]

_DEFAULT_BACKOFF = RetryPolicy(wait_initial=0.05, wait_max=2.0)


@runtime_checkable
class Resource(Protocol):
    """Something the harness runs on the phases' behalf, such as a helper server.

    Implementations own their process (or connection, or container); the supervisor decides
    when to start, check, stop and restart it.

    Attributes:
        name: a short name for messages and the supervisor's history (``helper-server``).
    """

    name: str

    def start(self) -> None:
        """Launch the resource; may return before it is healthy.

        Raises:
            OSError: the resource could not even be launched (the supervisor counts that as a
                failed start).
        """

    def health(self) -> bool:
        """Whether the resource answers now; quick (well under a second).

        Raises:
            SupervisorError: the resource can never become healthy without a new start (its
                process has exited); the supervisor stops waiting for it at once.
        """

    def stop(self) -> None:
        """Stop the resource and release what it holds.

        Idempotent: stopping a resource that is stopped or already dead does nothing and
        never raises.
        """

    def client(self) -> Any:
        """The handle phases use to talk to the resource.

        It must expose no lifecycle: nothing reachable from it can start, stop or restart
        the resource. The same client keeps working after a restart.
        """


@attrs.frozen
class RestartRecord:
    """One restart try, as the supervisor's :attr:`Supervisor.history` keeps it.

    Attributes:
        at: the supervisor's clock when the try began.
        reason: why the resource was restarted (what the failed phase reported).
        ok: whether the resource came back healthy.
        error: why it did not, if it did not.
    """

    at: float
    reason: str
    ok: bool
    error: str | None = None


@attrs.frozen
class RestartOutcome:
    """What one recovery (:meth:`Supervisor.restart`) came to.

    Attributes:
        ok: whether the resource is healthy again.
        restarts: restart tries so far, over the supervisor's whole life.
        attempts: restart tries in this recovery.
        error: one line saying why the recovery gave up, when ``ok`` is false.
    """

    ok: bool
    restarts: int
    attempts: int
    error: str | None = None


class Supervisor:
    """Starts a resource, checks its health, and restarts it within a budget.

    Every restart try counts against the budget, successful or not: at most ``max_restarts``
    tries within any ``window`` seconds (a sliding window), or over the supervisor's whole life
    when ``window`` is ``None``. Between stopping the resource and starting it again the
    supervisor waits ``backoff.wait(n)`` seconds for the ``n``-th try of a recovery
    (``backoff.max_attempts`` is not used: the budget decides when to give up).

    A context manager: the resource is started on entry and stopped on exit.

    Args:
        resource: what to supervise.
        max_restarts: restart tries allowed (within ``window``, or in all).
        window: the sliding window in seconds, or ``None`` to count every try ever.
        backoff: the waits between tries.
        health_timeout: how long a start may take to become healthy.
        health_interval: how long to wait between two health checks.
        clock: a monotonic clock in seconds (``FakeClock`` in tests).
        sleep: how to wait (``FakeClock.sleep`` in tests).
    """

    def __init__(
        self,
        resource: Resource,
        /,
        *,
        max_restarts: int = 3,
        window: float | None = None,
        backoff: RetryPolicy = _DEFAULT_BACKOFF,
        health_timeout: float = 10.0,
        health_interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {max_restarts}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be > 0 seconds or None, not {window}")
        self.resource = resource
        self.max_restarts = max_restarts
        self.window = window
        self.backoff = backoff
        self.health_timeout = health_timeout
        self.health_interval = health_interval
        self.clock = clock
        self.sleep = sleep
        self.history: list[RestartRecord] = []
        self._tries: deque[float] = deque()  # clock times of the tries that still count
        self._restarts = 0
        # One engine may call restart() from its run thread while the host stops the
        # supervisor from another; a lifecycle step must not interleave with another.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return (
            f"Supervisor({self.resource.name!r}, restarts={self._restarts}, "
            f"max_restarts={self.max_restarts}, window={self.window})"
        )

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def restarts(self) -> int:
        """Restart tries so far, successful or not."""
        return self._restarts

    def start(self) -> None:
        """Start the resource and wait until it is healthy.

        Raises:
            SupervisorError: it was not healthy within ``health_timeout`` (or could not be
                launched); it has been stopped again.
        """
        with self._lock:
            self._start_healthy()

    def stop(self) -> None:
        """Stop the resource (does nothing if it is not running)."""
        with self._lock:
            self.resource.stop()

    def restart(self, reason: str) -> RestartOutcome:
        """Bring the resource back: stop, wait, start, wait healthy; try again within budget.

        Args:
            reason: why, in one line (kept in :attr:`history` and in the final error).

        Returns:
            ``ok=True`` once the resource is healthy again; ``ok=False`` with a one-line
            ``error`` naming the budget and the last failure once the budget is spent.
        """
        telemetry = current_telemetry()
        if telemetry is None:
            return self._restart(reason)
        with telemetry.restart(self.resource.name, reason) as span:
            outcome = self._restart(reason)
            span.set_attribute("fsm_runner.restart.ok", outcome.ok)
            span.set_attribute("fsm_runner.restart.attempts", outcome.attempts)
            span.set_attribute("fsm_runner.restart.restarts", outcome.restarts)
            for tried in self.history[len(self.history) - outcome.attempts :]:
                span.add_event(
                    "fsm_runner.restart.try",
                    {
                        "fsm_runner.restart.ok": tried.ok,
                        "fsm_runner.restart.error": tried.error or "",
                    },
                )
            if not outcome.ok:
                from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 - on

                span.set_status(Status(StatusCode.ERROR, outcome.error or "restart failed"))
            return outcome

    def _restart(self, reason: str) -> RestartOutcome:
        with self._lock:
            attempts = 0
            last = reason
            while self._budget_left():
                attempts += 1
                now = self.clock()
                self._tries.append(now)
                self._restarts += 1
                self.resource.stop()
                self.sleep(self.backoff.wait(attempts))
                try:
                    self._start_healthy()
                except SupervisorError as exc:
                    last = exc.detail
                    self.history.append(RestartRecord(now, reason, ok=False, error=last))
                    continue
                self.history.append(RestartRecord(now, reason, ok=True))
                return RestartOutcome(ok=True, restarts=self._restarts, attempts=attempts)
            return RestartOutcome(
                ok=False, restarts=self._restarts, attempts=attempts, error=self._spent(last)
            )

    def _budget_left(self) -> bool:
        if self.window is not None:
            oldest = self.clock() - self.window
            while self._tries and self._tries[0] <= oldest:
                self._tries.popleft()
        return len(self._tries) < self.max_restarts

    def _spent(self, last: str) -> str:
        within = "" if self.window is None else f" within {self.window:g}s"
        plural = "" if self.max_restarts == 1 else "s"
        return f"restart budget spent: {self.max_restarts} restart{plural}{within}; last: {last}"

    def _start_healthy(self) -> None:
        name = self.resource.name
        try:
            self.resource.start()
        except OSError as exc:
            self.resource.stop()
            raise SupervisorError(name, f"could not start: {exc}") from exc
        deadline = self.clock() + self.health_timeout
        while True:
            try:
                if self.resource.health():
                    return
            except SupervisorError:
                self.resource.stop()
                raise
            remaining = deadline - self.clock()
            if remaining <= 0:
                self.resource.stop()
                raise SupervisorError(name, f"not healthy within {self.health_timeout:g}s")
            self.sleep(min(self.health_interval, remaining))


class RecoveryPhase:
    """The handler of the harness-owned recovery state: restart the resource, then go back.

    It reports ``SERVER_RECOVERED`` when the resource is healthy again (the spec sends the run
    back to the sub-phase that failed with a :data:`fsm_runner.RETURN` transition), or
    ``RESTART_BUDGET_SPENT`` with the supervisor's one-line error when it is not. Either way
    the output journals the restart counts and where the run is to return.

    Args:
        supervisor: the supervisor of the resource the phases reported unreachable.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def __repr__(self) -> str:
        return f"RecoveryPhase({self.supervisor!r})"

    def run(self, ctx: PhaseContext) -> PhaseResult:
        """Restart the resource and say whether it is back.

        Args:
            ctx: the recovery state's context; ``ctx.run.error`` (what the failed phase
                reported) becomes the restart's reason.

        Returns:
            ``SERVER_RECOVERED`` or ``RESTART_BUDGET_SPENT`` (with ``error``), each with
            ``{"restarts", "attempts", "return_to"}`` as output.
        """
        error = ctx.run.error or {}
        reason = str(error.get("message") or "server unreachable")
        outcome = self.supervisor.restart(reason)
        output = {
            "restarts": outcome.restarts,
            "attempts": outcome.attempts,
            "return_to": ctx.run.return_to,
        }
        if outcome.ok:
            return PhaseResult(RunEvent.SERVER_RECOVERED, output=output)
        return PhaseResult(RunEvent.RESTART_BUDGET_SPENT, output=output, error=outcome.error)
