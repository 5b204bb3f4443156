"""OpenTelemetry traces and metrics of runs, phases, effects and restarts (the ``[otel]`` extra).

Off unless asked for, and then free: :func:`resolve` turns an engine's ``telemetry`` setting
into a :class:`Telemetry` or ``None``, and with ``None`` the engine makes no call here at all
(its drivers test one attribute per drive). ``opentelemetry`` is never imported by this module
unless it is on: the default (``telemetry=None``) is on only when the host app has already
imported ``opentelemetry`` and set a tracer or meter provider (its SDK), and
``OTEL_SDK_DISABLED`` is not ``true``. ``fsm-runner --otel`` (or ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER`` set) configures the SDK from the standard ``OTEL_*`` variables first
(:func:`configure_sdk`).

**Traces.** A run's start is a span (``fsm_runner.start``, a child of the caller's current
span); its W3C trace context is stored in the run's transition seq 0 (``result["trace"]``, so
it is covered by the run's hash chain and copied by forks). Every later drive of the run — in
another process, after a kill, on another host — is a span (``fsm_runner.drive``) *parented*
on that stored context, so one run is one trace; the caller's current span, if any, is added
as a *link* to the drive span. Inside a drive, each phase attempt is a span
(``fsm_runner.phase``), each effect (``fsm_runner.effect``) and each restart of a supervised
server (``fsm_runner.restart``) a child of its phase's span. A sub-phase's attempt is a phase
span with ``fsm_runner.phase.parents`` (its enclosing composites, innermost first).

**Metrics** (instrument names and attributes: :data:`METRICS`): transitions committed, phase
durations, retries, runs started and ended, runs active / waiting / dead-lettered (observed
from the journal's counts when the metrics are collected), lease takeovers, fenced commits,
commit latency and group-commit batch sizes, journal errors.

Attribute names live under ``fsm_runner.``; ``error.type`` and the ``exception.*`` event are
OpenTelemetry's semantic conventions.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fsm_runner.events import RETRIED, WAITING
from fsm_runner.records import RunRecord, TransitionRecord

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Span

__all__ = [
    "METRICS",
    "SPANS",
    "Telemetry",
    "configure_sdk",
    "current",
    "resolve",
]

#: The instrumentation scope's name (the tracer's and the meter's).
SCOPE = "fsm_runner"

#: Each span this module makes: name, and what it stands for.
SPANS: Mapping[str, str] = {
    "fsm_runner.start": "a run's start (its context is stored with the run)",
    "fsm_runner.drive": "one drive of a run: run, step, arun, astep, or a worker's",
    "fsm_runner.phase": "one attempt of a phase (a sub-phase's too)",
    "fsm_runner.effect": "one effect a phase performs through ctx.effect",
    "fsm_runner.restart": "a supervised server's restart (all its tries)",
}

#: Each instrument: name, kind, unit, attributes, and what it counts.
METRICS: Mapping[str, tuple[str, str, str, str]] = {
    "fsm_runner.transitions": (
        "counter", "{transition}", "machine, event", "transitions committed",
    ),
    "fsm_runner.phase.duration": (
        "histogram", "s", "machine, state, outcome", "how long each phase attempt took",
    ),
    "fsm_runner.phase.retries": ("counter", "{retry}", "machine, state", "phase retries"),
    "fsm_runner.runs.started": ("counter", "{run}", "machine", "runs started"),
    "fsm_runner.runs.ended": ("counter", "{run}", "machine, outcome", "runs ended, by outcome"),
    "fsm_runner.runs.current": (
        "gauge", "{run}", "machine, status",
        "runs now active, waiting (in a waiting state) and dead-lettered, from the journal",
    ),
    "fsm_runner.lease.takeovers": (
        "counter", "{takeover}", "machine", "leases taken over from a lost or expired holder",
    ),
    "fsm_runner.commits.fenced": (
        "counter", "{commit}", "machine", "commits the journal refused (lease or seq moved on)",
    ),
    "fsm_runner.commit.duration": (
        "histogram", "s", "machine, grouped", "a journal commit's latency",
    ),
    "fsm_runner.group_commit.size": (
        "histogram", "{commit}", "machine", "transitions written by one group commit",
    ),
    "fsm_runner.journal.errors": (
        "counter", "{error}", "machine, error.type", "journal errors met while driving runs",
    ),
}  # fmt: skip

#: The telemetry of the phase running in this context (effects and restarts find it here).
_CURRENT: contextvars.ContextVar[Telemetry | None] = contextvars.ContextVar(
    "fsm_runner_telemetry", default=None
)
#: Stored trace contexts remembered per run (a run driven again reads none).
_REMEMBERED = 4096


def _described(name: str) -> tuple[str, str, str]:
    """An instrument's name, unit and description, as :data:`METRICS` documents it."""
    _kind, unit, _attributes, description = METRICS[name]
    return name, unit, description


def current() -> Telemetry | None:
    """The telemetry of the phase running in this context, if it is on."""
    return _CURRENT.get()


def _disabled_by_env() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _host_configured() -> bool:
    """Whether the host set a tracer or meter provider (never imports opentelemetry)."""
    trace_module = sys.modules.get("opentelemetry.trace")
    metrics_module = sys.modules.get("opentelemetry.metrics")
    if trace_module is None and metrics_module is None:
        return False
    from opentelemetry import metrics, trace  # noqa: PLC0415 - imported by the host already

    # The API's own providers (its proxies until one is set, its no-ops) live in its modules;
    # a provider set by the host (the SDK's, or another implementation) does not.
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        if not type(provider).__module__.startswith(_API_MODULES):
            return True
    return False


_API_MODULES = ("opentelemetry.trace", "opentelemetry.metrics")


def resolve(setting: Telemetry | bool | None) -> Telemetry | None:
    """An engine's ``telemetry`` setting as the telemetry it uses, or ``None`` (off).

    ``None``: on if the host configured OpenTelemetry (a tracer or meter provider set) and
    ``OTEL_SDK_DISABLED`` is not ``true``; ``True``: on (the API's global providers);
    ``False``: off; a :class:`Telemetry`: that one.

    Raises:
        ImportError: ``True`` without ``opentelemetry-api`` installed (``pip install
            'fsm-runner[otel]'``).
    """
    if setting is None:
        return _default() if not _disabled_by_env() and _host_configured() else None
    if setting is False:
        return None
    if setting is True:
        return _default()
    return setting


_default_lock = threading.Lock()
_configured = False  # configure_sdk has set the global providers
_default_telemetry: Telemetry | None = None


def _default() -> Telemetry:
    """The telemetry over the global providers, made once (its instruments are shared)."""
    global _default_telemetry  # noqa: PLW0603 - one per process, as the providers are
    with _default_lock:
        if _default_telemetry is None:
            _default_telemetry = Telemetry()
        return _default_telemetry


class Telemetry:
    """The spans and instruments of fsm_runner over OpenTelemetry providers.

    Args:
        tracer_provider: where spans go (default: the global one, ``trace.set_tracer_provider``).
        meter_provider: where measurements go (default: the global one).

    Raises:
        ImportError: ``opentelemetry-api`` is not installed.
    """

    def __init__(self, *, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        try:
            from opentelemetry import context, metrics, propagate, trace  # noqa: PLC0415 - optional
        except ImportError as exc:  # pragma: no cover - the [otel] extra is in the test extras
            raise ImportError(
                "telemetry needs opentelemetry-api: pip install 'fsm-runner[otel]'"
            ) from exc
        import importlib.metadata  # noqa: PLC0415 - 30 ms a process: only when it is on

        try:
            version: str | None = importlib.metadata.version("fsm-runner")
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a tree
            version = None
        self._trace = trace
        self._context = context
        self._propagate = propagate
        #: the providers (the global ones unless given): :meth:`flush` flushes them
        self._providers = (
            tracer_provider or trace.get_tracer_provider(),
            meter_provider or metrics.get_meter_provider(),
        )
        self.tracer = trace.get_tracer(SCOPE, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, version or "", meter_provider=meter_provider)
        self.meter = meter
        counter, histogram = meter.create_counter, meter.create_histogram
        self._transitions = counter(*_described("fsm_runner.transitions"))
        self._phase_duration = histogram(*_described("fsm_runner.phase.duration"))
        self._retries = counter(*_described("fsm_runner.phase.retries"))
        self._started = counter(*_described("fsm_runner.runs.started"))
        self._ended = counter(*_described("fsm_runner.runs.ended"))
        self._takeovers = counter(*_described("fsm_runner.lease.takeovers"))
        self._fenced = counter(*_described("fsm_runner.commits.fenced"))
        self._commit_duration = histogram(*_described("fsm_runner.commit.duration"))
        self._batch = histogram(*_described("fsm_runner.group_commit.size"))
        self._journal_errors = counter(*_described("fsm_runner.journal.errors"))
        #: the engines' cores (a journal and a spec each) whose runs the gauge counts
        self._observed: weakref.WeakSet[Any] = weakref.WeakSet()
        self._observed_lock = threading.Lock()
        meter.create_observable_gauge(
            "fsm_runner.runs.current",
            [self._observe_runs],
            "{run}",
            METRICS["fsm_runner.runs.current"][3],
        )
        self._contexts: dict[str, Context | None] = {}
        self._contexts_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Telemetry(tracer={self.tracer!r})"

    def flush(self, timeout: float = 10.0) -> None:
        """Export what the providers hold now (metrics collected, gauges read).

        Before a command's engine closes: a process about to exit sends its runs' counts too.
        """
        for provider in self._providers:
            force_flush = getattr(provider, "force_flush", None)
            if force_flush is not None:
                force_flush(int(timeout * 1000))

    # -- traces ------------------------------------------------------------------------------

    def start_carrier(self, run_id: str, machine: str) -> dict[str, str]:
        """Open and end a run's ``fsm_runner.start`` span; its context as a W3C carrier.

        The carrier is stored with the run (its transition seq 0); every drive of the run is
        parented on it (:meth:`drive`).
        """
        attributes = {"fsm_runner.run.id": run_id, "fsm_runner.machine": machine}
        with self.tracer.start_as_current_span("fsm_runner.start", attributes=attributes):
            carrier: dict[str, str] = {}
            self._propagate.inject(carrier)
        return carrier

    def _run_context(self, journal: Any, run_id: str) -> Context | None:
        """The trace context stored with the run at its start (``None``: none stored)."""
        with self._contexts_lock:
            if run_id in self._contexts:
                return self._contexts[run_id]
        stored = journal.transitions(run_id, from_seq=0, to_seq=0)
        result = stored[0].result if stored else None
        carrier = result.get("trace") if isinstance(result, Mapping) else None
        context = None
        if isinstance(carrier, Mapping) and carrier:
            found = self._propagate.extract({str(k): str(v) for k, v in carrier.items()})
            if self._trace.get_current_span(found).get_span_context().is_valid:
                context = found
        with self._contexts_lock:
            if len(self._contexts) >= _REMEMBERED:
                self._contexts.clear()
            self._contexts[run_id] = context
        return context

    @contextmanager
    def drive(self, journal: Any, run: RunRecord, how: str, worker_id: str) -> Iterator[Span]:
        """A drive of ``run``'s span, parented on the run's stored trace context.

        The caller's current span (a host's request, say) is linked. A journal error that ends
        the drive is counted (``fsm_runner.journal.errors``) and recorded on the span.
        """
        trace = self._trace
        try:
            parent = self._run_context(journal, run.run_id)
        except Exception:  # noqa: BLE001 - a trace context is never worth a drive
            parent = None
        caller = trace.get_current_span().get_span_context()
        links = [trace.Link(caller)] if parent is not None and caller.is_valid else None
        attributes: dict[str, Any] = {
            "fsm_runner.run.id": run.run_id,
            "fsm_runner.machine": run.machine,
            "fsm_runner.drive": how,
            "fsm_runner.worker.id": worker_id,
            "fsm_runner.state": run.state,
            "fsm_runner.seq": run.seq,
            "fsm_runner.run.recoveries": run.recoveries,
        }
        from fsm_runner.exceptions import JournalError  # noqa: PLC0415 - the one use

        with self.tracer.start_as_current_span(
            "fsm_runner.drive",
            context=parent,
            links=links,
            attributes=attributes,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            try:
                yield span
            except JournalError as exc:
                self.journal_error(run.machine, exc)
                raise

    def drove(self, span: Span, run: RunRecord) -> None:
        """Say where a drive left its run."""
        span.set_attribute("fsm_runner.drive.state", run.state)
        span.set_attribute("fsm_runner.drive.seq", run.seq)
        span.set_attribute("fsm_runner.run.status", run.status.value)

    def phase(self, run: RunRecord, attempt: int, parents: Sequence[str]) -> PhaseSpan:
        """Begin a phase attempt's span, current until :meth:`PhaseSpan.end` (effects find it).

        Not a context manager: a phase's span is begun and ended once a step, and a generator's
        frames cost more than the rest of it when the SDK is not configured.
        """
        attributes: dict[str, Any] = {
            "fsm_runner.run.id": run.run_id,
            "fsm_runner.machine": run.machine,
            "fsm_runner.state": run.state,
            "fsm_runner.attempt": attempt,
            "fsm_runner.iteration": run.iteration,
            "fsm_runner.visit_seq": run.visit_seq,
        }
        if parents:
            attributes["fsm_runner.phase.parents"] = list(parents)
        span = self.tracer.start_span("fsm_runner.phase", attributes=attributes)
        attached = self._context.attach(self._trace.set_span_in_context(span))
        return PhaseSpan(self, span, run, (attached, _CURRENT.set(self)), time.monotonic())

    def phase_ended(self, run: RunRecord, outcome: str, seconds: float) -> None:
        """Record a phase attempt's duration (``fsm_runner.phase.duration``)."""
        self._phase_duration.record(
            seconds,
            {
                "fsm_runner.machine": run.machine,
                "fsm_runner.state": run.state,
                "fsm_runner.outcome": outcome,
            },
        )

    @contextmanager
    def effect(self, run: RunRecord, name: str, kind: str, key: str, state: str) -> Iterator[Span]:
        """An effect's span (a child of its phase's); its status is set by the ledger."""
        attributes = {
            "fsm_runner.run.id": run.run_id,
            "fsm_runner.state": state,
            "fsm_runner.effect.name": name,
            "fsm_runner.effect.kind": kind,
            "fsm_runner.effect.idempotency_key": key,
        }
        with self.tracer.start_as_current_span(
            "fsm_runner.effect",
            attributes=attributes,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield span

    @contextmanager
    def restart(self, resource: str, reason: str) -> Iterator[Span]:
        """A supervised server's restart span (its tries are events on it)."""
        attributes = {"fsm_runner.server": resource, "fsm_runner.restart.reason": reason}
        with self.tracer.start_as_current_span(
            "fsm_runner.restart", attributes=attributes, record_exception=True
        ) as span:
            yield span

    # -- metrics -----------------------------------------------------------------------------

    def committed(self, transition: TransitionRecord, run: RunRecord) -> None:
        """Count a committed transition (and a run's start or end, a retry)."""
        machine = run.machine
        self._transitions.add(
            1, {"fsm_runner.machine": machine, "fsm_runner.event": transition.event}
        )
        if transition.seq == 0:  # stored: a start that failed is not counted
            self._started.add(1, {"fsm_runner.machine": machine})
        if transition.event == RETRIED:
            state = transition.from_state or transition.to_state
            self._retries.add(1, {"fsm_runner.machine": machine, "fsm_runner.state": state})
        if run.ended and transition.seq > 0:
            self._ended.add(
                1, {"fsm_runner.machine": machine, "fsm_runner.outcome": run.status.value}
            )

    def commit_took(self, machine: str, seconds: float, *, grouped: bool, size: int = 1) -> None:
        """A commit's latency (and, grouped, how many transitions it wrote)."""
        self._commit_duration.record(
            seconds, {"fsm_runner.machine": machine, "fsm_runner.grouped": grouped}
        )
        if grouped:
            self._batch.record(size, {"fsm_runner.machine": machine})

    def fenced(self, machine: str) -> None:
        """A commit the journal refused (the run's lease or seq had moved on)."""
        self._fenced.add(1, {"fsm_runner.machine": machine})

    def took_over(self, machine: str) -> None:
        """A lease taken over from a holder that is gone or whose lease expired."""
        self._takeovers.add(1, {"fsm_runner.machine": machine})

    def journal_error(self, machine: str, error: BaseException) -> None:
        """A journal error met while driving a run."""
        self._journal_errors.add(
            1, {"fsm_runner.machine": machine, "error.type": type(error).__name__}
        )

    def observe(self, core: Any) -> None:
        """Count ``core``'s runs (an engine's: its machine, its journal) while it lives.

        In the gauge ``fsm_runner.runs.current``, read when the metrics are collected.
        """
        with self._observed_lock:
            self._observed.add(core)

    def forget(self, core: Any) -> None:
        """Stop counting the runs of ``core``'s machine (its engine closed)."""
        with self._observed_lock:
            self._observed.discard(core)

    def _observe_runs(self, _options: CallbackOptions) -> Iterable[Observation]:
        from opentelemetry.metrics import Observation  # noqa: PLC0415 - on, and imported

        with self._observed_lock:
            cores = list(self._observed)
        seen: set[tuple[int, str]] = set()
        for core in cores:
            try:
                journal, spec = core.journal, core.spec
                if (id(journal), spec.name) in seen:
                    continue
                seen.add((id(journal), spec.name))
                counts = journal.run_counts(machine=spec.name)
            except Exception:  # noqa: BLE001, S112 - a closed journal: nothing to count
                continue
            waiting = set(spec.waiting_states)
            totals = {"active": 0, "waiting": 0, "dead_letter": 0}
            for (state, status), count in counts.items():
                if status == "active":
                    totals["waiting" if state in waiting else "active"] += count
                elif status == "dead_letter":
                    totals["dead_letter"] += count
            for status, count in totals.items():
                yield Observation(
                    count, {"fsm_runner.machine": spec.name, "fsm_runner.run.status": status}
                )


class PhaseSpan:
    """A phase attempt's span, current from :meth:`Telemetry.phase` until :meth:`end`."""

    __slots__ = ("_began", "_run", "_telemetry", "_tokens", "span")

    def __init__(
        self,
        telemetry: Telemetry,
        span: Span,
        run: RunRecord,
        tokens: tuple[object, contextvars.Token[Telemetry | None]],
        began: float,
    ) -> None:
        self._telemetry = telemetry
        self.span = span
        self._run = run
        self._tokens = tokens
        self._began = began

    def end(
        self,
        transition: TransitionRecord | None,
        error: BaseException | None,
        *,
        raised: BaseException | None = None,
    ) -> None:
        """End the span with the attempt's outcome; record its duration.

        ``transition``: what the attempt committed; ``error``: what its handler raised;
        ``raised``: what stopped the step itself (the outcome is then ``interrupted``).
        """
        span = self.span
        failure = raised if raised is not None else error
        if raised is not None:
            outcome = "interrupted"
        elif transition is None or transition.event == WAITING:
            outcome = "waiting"
        elif transition.event == RETRIED:
            outcome = "retried"
        elif error is not None:
            outcome = "failed"
        else:
            outcome = "committed"
        attributes: dict[str, Any] = {"fsm_runner.outcome": outcome}
        if transition is not None:
            attributes["fsm_runner.event"] = transition.event
            attributes["fsm_runner.seq"] = transition.seq
            attributes["fsm_runner.to_state"] = transition.to_state
        if failure is not None:
            from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 - on

            attributes["error.type"] = type(failure).__name__
            span.record_exception(failure)
            span.set_status(Status(StatusCode.ERROR, f"{type(failure).__name__}: {failure}"[:200]))
        span.set_attributes(attributes)
        span.end()
        attached, current = self._tokens
        _CURRENT.reset(current)
        self._telemetry._context.detach(attached)
        self._telemetry.phase_ended(self._run, outcome, time.monotonic() - self._began)


def configure_sdk(*, force: bool = False) -> bool:
    """Set the global tracer and meter providers from the standard ``OTEL_*`` variables.

    For the command line (``fsm-runner --otel``, or ``OTEL_TRACES_EXPORTER`` /
    ``OTEL_METRICS_EXPORTER`` set): exporters by ``OTEL_TRACES_EXPORTER`` and
    ``OTEL_METRICS_EXPORTER`` (``otlp``, the default; ``console``; ``none``), OTLP over HTTP
    (``OTEL_EXPORTER_OTLP_ENDPOINT`` and the rest, read by the exporters), the resource from
    ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``. The providers flush and shut down
    when the process exits.

    Returns:
        Whether it configured them (not when neither ``force`` nor an exporter variable asks,
        or ``OTEL_SDK_DISABLED`` is ``true``).

    Raises:
        ImportError: the SDK or the OTLP exporter is not installed (``fsm-runner[otel]``).
        ValueError: an exporter or protocol it does not provide is asked for.
    """
    global _configured  # noqa: PLW0603 - the global providers are set once a process
    traces = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    metrics_to = os.environ.get("OTEL_METRICS_EXPORTER", "").strip().lower()
    if _configured or _disabled_by_env() or not (force or traces or metrics_to):
        return False
    _configured = True
    try:
        from opentelemetry import metrics, trace  # noqa: PLC0415 - optional
        from opentelemetry.sdk.metrics import MeterProvider  # noqa: PLC0415
        from opentelemetry.sdk.metrics.export import (  # noqa: PLC0415
            ConsoleMetricExporter,
            MetricExporter,
            PeriodicExportingMetricReader,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError as exc:
        raise ImportError(
            f"--otel needs the OpenTelemetry SDK ({exc}): pip install 'fsm-runner[otel]'"
        ) from exc
    for variable, value in (
        ("OTEL_TRACES_EXPORTER", traces),
        ("OTEL_METRICS_EXPORTER", metrics_to),
    ):
        if value not in ("", "otlp", "console", "none"):
            raise ValueError(f"{variable}={value}: --otel exports otlp, console or none")
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip().lower()
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: --otel sends http/protobuf")
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource.create({"service.name": "fsm-runner"}))
    span_exporter: SpanExporter | None = None
    if traces in ("", "otlp"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )

        span_exporter = OTLPSpanExporter()
    elif traces == "console":
        span_exporter = ConsoleSpanExporter()
    tracer_provider = TracerProvider(resource=resource)
    if span_exporter is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    metric_exporter: MetricExporter | None = None
    if metrics_to in ("", "otlp"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # noqa: PLC0415
            OTLPMetricExporter,
        )

        metric_exporter = OTLPMetricExporter()
    elif metrics_to == "console":
        metric_exporter = ConsoleMetricExporter()
    readers = [] if metric_exporter is None else [PeriodicExportingMetricReader(metric_exporter)]
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    return True
