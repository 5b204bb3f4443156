"""OpenTelemetry traces and metrics of runs (issue 35): each span and each metric, in process.

The SDK's in-memory span exporter and metric reader, over a real SQLite journal file; the
providers are passed to a :class:`~fsm_runner.telemetry.Telemetry` of the test's own (never set
globally: the other tests of this process make engines too). Whether an engine turns telemetry
on by itself (the host's global providers, ``OTEL_SDK_DISABLED``), and that nothing of
OpenTelemetry is imported when it is off, is checked in fresh interpreters. Processes, kill -9
and OTLP over HTTP: ``test_telemetry_processes.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from fsm_runner import Engine, JournalError, MachineSpec, RetryPolicy, State, Transition
from fsm_runner.engine import abort_run
from fsm_runner.events import RunEvent
from fsm_runner.journal import SqliteJournal
from fsm_runner.supervisor import RecoveryPhase, Supervisor
from fsm_runner.telemetry import METRICS, SPANS, Telemetry
from tests.helpers import NEXT, linear_spec
from tests.ui_journals import APPROVAL_HANDLERS, approval_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = linear_spec("a", "b", "c", name="otel")


class Otel:
    """A telemetry over in-memory exporters, and what they caught."""

    def __init__(self) -> None:
        self.spans_out = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans_out))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = Telemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def spans(self, name: str | None = None) -> list:
        return [s for s in self.spans_out.get_finished_spans() if name is None or s.name == name]

    def points(self, name: str) -> list:
        """The data points of metric ``name`` (empty if it was never recorded)."""
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def counts(self, name: str, *keys: str) -> dict[tuple, int]:
        """A counter's (or histogram's count of) values by the attributes ``keys``."""
        totals: Counter[tuple] = Counter()
        for point in self.points(name):
            value = getattr(point, "value", None)
            totals[tuple(point.attributes.get(k) for k in keys)] += (
                point.count if value is None else value
            )
        return dict(totals)

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def otel():
    found = Otel()
    yield found
    found.close()


@pytest.fixture
def journal(tmp_path):
    j = SqliteJournal(tmp_path / "journal.db")
    yield j
    j.close()


def engine_of(journal, otel, spec=SPEC, handlers=None, **options) -> Engine:
    handlers = handlers or {name: (lambda _ctx: NEXT) for name in "abc"}
    return Engine(spec, handlers=handlers, journal=journal, telemetry=otel.telemetry, **options)


def parent_of(span):
    return None if span.parent is None else span.parent.span_id


class TestTraces:
    def test_a_run_is_one_trace_its_drives_parented_on_its_start(self, journal, otel):
        with engine_of(journal, otel) as engine:
            run_id = engine.start({"n": 1})
            engine.run(run_id, max_steps=1)  # two drives of the run
            engine.run(run_id)
        (start,) = otel.spans("fsm_runner.start")
        drives = otel.spans("fsm_runner.drive")
        phases = otel.spans("fsm_runner.phase")
        assert len(drives) == 2
        assert [p.attributes["fsm_runner.state"] for p in phases] == ["a", "b", "c"]
        trace_id = start.context.trace_id
        assert {s.context.trace_id for s in otel.spans()} == {trace_id}
        assert start.parent is None
        assert [parent_of(d) for d in drives] == [start.context.span_id] * 2
        assert [parent_of(p) for p in phases] == [drives[0].context.span_id] + [
            drives[1].context.span_id
        ] * 2
        assert start.attributes["fsm_runner.run.id"] == run_id
        first = dict(drives[0].attributes)
        assert (first["fsm_runner.drive"], first["fsm_runner.state"]) == ("run", "a")
        assert (first["fsm_runner.drive.state"], first["fsm_runner.drive.seq"]) == ("b", 1)
        assert drives[1].attributes["fsm_runner.run.status"] == "succeeded"
        b = dict(phases[1].attributes)
        assert b == {
            "fsm_runner.run.id": run_id,
            "fsm_runner.machine": "otel",
            "fsm_runner.state": "b",
            "fsm_runner.attempt": 1,
            "fsm_runner.iteration": 0,
            "fsm_runner.visit_seq": 1,
            "fsm_runner.event": NEXT,
            "fsm_runner.seq": 2,
            "fsm_runner.to_state": "c",
            "fsm_runner.outcome": "committed",
        }

    def test_the_start_context_is_stored_with_the_run_and_chained(self, journal, otel):
        with engine_of(journal, otel) as engine:
            run_id = engine.start({"n": 1})
        (start,) = otel.spans("fsm_runner.start")
        stored = journal.transitions(run_id)[0].result["trace"]
        trace_id, span_id = f"{start.context.trace_id:032x}", f"{start.context.span_id:016x}"
        assert stored["traceparent"].startswith(f"00-{trace_id}-{span_id}-")  # then its flags
        from fsm_runner.replay import check_journal

        assert check_journal(journal) == []  # the run's hash chain covers it

    def test_a_host_span_parents_the_start_and_is_linked_from_a_drive(self, journal, otel):
        tracer = otel.tracer_provider.get_tracer("host")
        with engine_of(journal, otel) as engine:
            with tracer.start_as_current_span("POST /orders") as request:
                run_id = engine.start({"n": 1})
            with tracer.start_as_current_span("cron") as cron:
                engine.run(run_id)
        (start,) = otel.spans("fsm_runner.start")
        (drive,) = otel.spans("fsm_runner.drive")
        assert parent_of(start) == request.get_span_context().span_id
        assert parent_of(drive) == start.context.span_id  # the run's trace, not the cron's
        assert [link.context.span_id for link in drive.links] == [cron.get_span_context().span_id]

    def test_async_runs_and_group_commits(self, journal, otel):
        async def main(engine):
            run_ids = [await engine.astart({"n": n}) for n in range(4)]
            await asyncio.gather(*(engine.arun(run_id) for run_id in run_ids))
            return run_ids

        with engine_of(journal, otel) as engine:
            run_ids = asyncio.run(main(engine))
        drives = otel.spans("fsm_runner.drive")
        assert sorted(d.attributes["fsm_runner.run.id"] for d in drives) == sorted(run_ids)
        assert {d.attributes["fsm_runner.drive"] for d in drives} == {"arun"}
        by_drive = Counter(parent_of(p) for p in otel.spans("fsm_runner.phase"))
        assert sorted(by_drive.values()) == [3] * 4
        assert set(by_drive) == {d.context.span_id for d in drives}
        sizes = otel.points("fsm_runner.group_commit.size")
        assert sum(p.sum for p in sizes) == 12  # every phase's commit went in a group
        assert otel.counts("fsm_runner.commit.duration", "fsm_runner.grouped")[(True,)] >= 3

    def test_a_step_is_a_drive_too(self, journal, otel):
        with engine_of(journal, otel) as engine:
            run_id = engine.start()
            engine.step(run_id)
            asyncio.run(engine.astep(run_id))
        assert [d.attributes["fsm_runner.drive"] for d in otel.spans("fsm_runner.drive")] == [
            "step",
            "astep",
        ]

    def test_a_failing_phase_records_its_exception(self, journal, otel):
        def broken(_ctx):
            raise KeyError("no such key")

        handlers = {"a": broken, "b": lambda _ctx: NEXT, "c": lambda _ctx: NEXT}
        with engine_of(journal, otel, handlers=handlers) as engine:
            run_id = engine.start()
            assert engine.run(run_id).status.value == "failed"
        (phase,) = otel.spans("fsm_runner.phase")
        assert phase.attributes["fsm_runner.outcome"] == "failed"
        assert phase.attributes["fsm_runner.event"] == RunEvent.SYSTEM_ERROR.value
        assert phase.attributes["error.type"] == "KeyError"
        assert phase.status.status_code is StatusCode.ERROR
        (event,) = phase.events
        assert event.name == "exception"
        assert event.attributes["exception.type"] == "KeyError"
        assert "no such key" in event.attributes["exception.message"]
        assert otel.counts("fsm_runner.runs.ended", "fsm_runner.outcome") == {("failed",): 1}

    def test_retries_are_attempts(self, journal, otel):
        spec = MachineSpec(
            "retrying",
            [
                State("a", handler="a", retry=RetryPolicy(max_attempts=3, wait_initial=0)),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [Transition("a", NEXT, "done"), Transition("a", RunEvent.SYSTEM_ERROR, "failed")],
        )
        tries = []

        def flaky(ctx):
            tries.append(ctx.attempt)
            if ctx.attempt < 3:
                raise ConnectionError("later")
            return NEXT

        with engine_of(journal, otel, spec, {"a": flaky}) as engine:
            assert engine.run(engine.start()).status.value == "succeeded"
        phases = otel.spans("fsm_runner.phase")
        tried = [
            (p.attributes["fsm_runner.attempt"], p.attributes["fsm_runner.outcome"]) for p in phases
        ]
        assert tried == [(1, "retried"), (2, "retried"), (3, "committed")]
        assert [e.name for e in phases[0].events] == ["exception"]
        assert otel.counts("fsm_runner.phase.retries", "fsm_runner.state") == {("a",): 2}
        assert otel.counts("fsm_runner.phase.duration", "fsm_runner.outcome") == {
            ("retried",): 2,
            ("committed",): 1,
        }

    def test_effects_are_children_of_their_phase(self, journal, otel):
        sent = []

        def b(ctx):
            ctx.effect("send", sent.append, "mail", kind="mutate")
            if len(sent) == 1 and ctx.attempt == 1:
                ctx.effect("charge", lambda: 1 / 0, kind="mutate")
            return NEXT

        spec = MachineSpec(
            "effects",
            [
                State("b", handler="b", retry=RetryPolicy(max_attempts=2, wait_initial=0)),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [Transition("b", NEXT, "done"), Transition("b", RunEvent.SYSTEM_ERROR, "failed")],
        )
        with engine_of(journal, otel, spec, {"b": b}) as engine:
            assert engine.run(engine.start()).status.value == "succeeded"
        assert sent == ["mail"]  # exactly once: the retry found it done
        phases = otel.spans("fsm_runner.phase")
        effects = otel.spans("fsm_runner.effect")
        shown = [
            (
                e.attributes["fsm_runner.effect.name"],
                e.attributes["fsm_runner.effect.status"],
                e.attributes["fsm_runner.effect.recorded"],
                [event.name for event in e.events],
                parent_of(e),
            )
            for e in effects
        ]
        first, second = (p.context.span_id for p in phases)
        assert shown == [
            ("send", "done", False, ["fsm_runner.effect.in_flight"], first),
            ("charge", "failed", False, ["fsm_runner.effect.in_flight", "exception"], first),
            ("send", "done", True, [], second),
        ]
        assert effects[0].attributes["fsm_runner.effect.kind"] == "mutate"
        assert len(effects[0].attributes["fsm_runner.effect.idempotency_key"]) == 32

    def test_a_sub_phase_names_its_composites(self, journal, otel):
        spec = MachineSpec(
            "nested",
            [
                State("work", children=[State("inner", children=[State("x", handler="h")])]),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                Transition("work", RunEvent.PHASE_COMPLETED, "done"),
                Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
            ],
        )
        with engine_of(journal, otel, spec, {"h": lambda _ctx: RunEvent.PHASE_COMPLETED}) as e:
            assert e.run(e.start()).status.value == "succeeded"
        (phase,) = otel.spans("fsm_runner.phase")
        assert phase.attributes["fsm_runner.state"] == "x"
        assert list(phase.attributes["fsm_runner.phase.parents"]) == ["inner", "work"]

    def test_a_server_restart_is_a_span_of_its_recovery_phase(self, journal, otel):
        class Flaky:
            """A resource whose first start fails (a unit test of the span, not of restarts)."""

            name = "helper"

            def __init__(self) -> None:
                self.starts = 0

            def start(self) -> None:
                self.starts += 1
                if self.starts == 1:
                    raise OSError("port in use")

            def stop(self) -> None:
                pass

            def health(self) -> bool:
                return True

        supervisor = Supervisor(Flaky(), max_restarts=3, sleep=lambda _s: None)
        spec = MachineSpec(
            "harness",
            [
                State("recovering", handler="recover"),
                State("done", terminal=True),
                State("failed", terminal=True, outcome="failed"),
            ],
            [
                Transition("recovering", RunEvent.SERVER_RECOVERED, "done"),
                Transition("recovering", RunEvent.RESTART_BUDGET_SPENT, "failed"),
                Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
            ],
        )
        handlers = {"recover": RecoveryPhase(supervisor).run}
        with engine_of(journal, otel, spec, handlers) as engine:
            assert engine.run(engine.start()).status.value == "succeeded"
        (phase,) = otel.spans("fsm_runner.phase")
        (restart,) = otel.spans("fsm_runner.restart")
        assert parent_of(restart) == phase.context.span_id
        assert restart.attributes["fsm_runner.server"] == "helper"
        assert restart.attributes["fsm_runner.restart.ok"] is True
        assert restart.attributes["fsm_runner.restart.attempts"] == 2
        tries = [(e.name, e.attributes["fsm_runner.restart.ok"]) for e in restart.events]
        assert tries == [("fsm_runner.restart.try", False), ("fsm_runner.restart.try", True)]


class TestMetrics:
    def test_transitions_starts_ends_and_phase_durations(self, journal, otel):
        handlers = {"a": lambda _ctx: NEXT, "b": lambda _ctx: NEXT, "c": lambda _ctx: 1 / 0}
        with engine_of(journal, otel, handlers=handlers) as engine:
            for run_id in engine.start_many([{}, {}]):
                engine.run(run_id)
        assert otel.counts("fsm_runner.runs.started", "fsm_runner.machine") == {("otel",): 2}
        assert otel.counts("fsm_runner.transitions", "fsm_runner.event") == {
            ("STARTED",): 2,
            (NEXT,): 4,
            ("SYSTEM_ERROR",): 2,
        }
        assert otel.counts("fsm_runner.runs.ended", "fsm_runner.outcome") == {("failed",): 2}
        durations = otel.counts(
            "fsm_runner.phase.duration", "fsm_runner.state", "fsm_runner.outcome"
        )
        assert durations == {("a", "committed"): 2, ("b", "committed"): 2, ("c", "failed"): 2}
        assert otel.counts("fsm_runner.commit.duration", "fsm_runner.grouped") == {(False,): 6}
        assert {p.sum > 0 for p in otel.points("fsm_runner.commit.duration")} == {True}

    def test_runs_now_active_waiting_and_dead_lettered(self, journal, otel):
        engine = engine_of(journal, otel)
        waiting = Engine(
            approval_spec(), handlers=APPROVAL_HANDLERS, journal=journal, telemetry=otel.telemetry
        )
        poison = Engine(
            linear_spec("a", name="poison"),
            handlers={"a": lambda _ctx: "NO_SUCH_EVENT"},
            journal=journal,
            lease_ttl=1e-6,
            max_recoveries=0,
            telemetry=otel.telemetry,
        )
        with engine, waiting, poison:
            engine.start()  # active
            engine.run(engine.start())  # ended: not counted
            waiting.run(waiting.start())  # parked in its waiting state
            poison.start()
            for _ in range(2):  # lost at once, then parked as dead_letter
                poison.work(max_runs=1, exit_when_idle=True)
            counted = otel.counts(
                "fsm_runner.runs.current", "fsm_runner.machine", "fsm_runner.run.status"
            )
        assert counted == {
            ("otel", "active"): 1,
            ("otel", "waiting"): 0,
            ("otel", "dead_letter"): 0,
            ("approval", "active"): 0,
            ("approval", "waiting"): 1,
            ("approval", "dead_letter"): 0,
            ("poison", "active"): 0,
            ("poison", "waiting"): 0,
            ("poison", "dead_letter"): 1,
        }
        assert otel.counts("fsm_runner.runs.current", "fsm_runner.machine") == {}  # all closed

    def test_a_lease_taken_over(self, journal, otel):
        with engine_of(journal, otel) as engine:
            run_id = engine.start()
            journal.claim(run_id, "lost-worker", ttl=1e-6)  # its holder is gone: it expired
            assert engine.run(run_id).status.value == "succeeded"
        assert otel.counts("fsm_runner.lease.takeovers", "fsm_runner.machine") == {("otel",): 1}
        (drive,) = otel.spans("fsm_runner.drive")
        assert drive.attributes["fsm_runner.run.recoveries"] >= 1

    def test_a_fenced_commit(self, tmp_path, journal, otel):
        other = SqliteJournal(tmp_path / "journal.db")

        def b(ctx):
            abort_run(other, ctx.run.run_id, "stop it")  # from elsewhere, while b runs
            return NEXT

        handlers = {"a": lambda _ctx: NEXT, "b": b, "c": lambda _ctx: NEXT}
        try:
            with engine_of(journal, otel, handlers=handlers) as engine:
                assert engine.run(engine.start()).status.value == "aborted"
        finally:
            other.close()
        assert otel.counts("fsm_runner.commits.fenced", "fsm_runner.machine") == {("otel",): 1}

    def test_a_journal_error_ends_the_drive(self, journal, otel):
        def b(ctx):
            journal.close()  # the journal goes away under the run
            return NEXT

        handlers = {"a": lambda _ctx: NEXT, "b": b, "c": lambda _ctx: NEXT}
        engine = engine_of(journal, otel, handlers=handlers)
        run_id = engine.start()
        with pytest.raises(JournalError):
            engine.run(run_id)
        (drive,) = otel.spans("fsm_runner.drive")
        assert drive.status.status_code is StatusCode.ERROR
        assert [e.name for e in drive.events] == ["exception"]
        assert otel.counts("fsm_runner.journal.errors", "error.type") == {("JournalError",): 1}

    def test_every_instrument_and_span_is_documented(self):
        readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "operating.md").read_text()
        for name in [*METRICS, *SPANS]:
            assert f"`{name}`" in readme, name


def python(*code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (this tree importable); the JSON it printed last."""
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(textwrap.dedent(part) for part in code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


PREAMBLE = """
    import json, sys
    from fsm_runner import Engine
    from fsm_runner.journal import MemoryJournal
    from tests.helpers import NEXT, linear_spec
    def engine():
        spec = linear_spec("a", name="fresh")
        return Engine(spec, handlers={"a": lambda _ctx: NEXT}, journal=MemoryJournal())
"""


class TestOnOrOff:
    def test_off_by_default_and_nothing_of_opentelemetry_imported(self):
        found = python(
            PREAMBLE,
            """
            e = engine(); e.run(e.start())
            print(json.dumps({"on": e._core.telemetry is not None, "fast": bool(e._core.fast),
                              "imported": sorted(m for m in sys.modules if "opentelemetry" in m)}))
            """,
        )
        assert found == {"on": False, "fast": True, "imported": []}

    def test_on_when_the_host_set_a_provider(self):
        code = (
            """
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            trace.set_tracer_provider(TracerProvider())
            """,
            PREAMBLE,
            """
            e = engine()
            print(json.dumps({"on": e._core.telemetry is not None, "fast": bool(e._core.fast)}))
            """,
        )
        assert python(*code) == {"on": True, "fast": False}
        assert python(*code, OTEL_SDK_DISABLED="true") == {"on": False, "fast": True}

    def test_imported_but_not_configured_is_off(self):
        found = python(
            "from opentelemetry import metrics, trace",
            PREAMBLE,
            """
            e = engine()
            print(json.dumps({"on": e._core.telemetry is not None}))
            """,
        )
        assert found == {"on": False}

    def test_false_is_off_and_true_is_on(self, journal):
        handlers = {name: (lambda _ctx: NEXT) for name in "abc"}
        off = Engine(SPEC, handlers=handlers, journal=journal, telemetry=False)
        on = Engine(SPEC, handlers=handlers, journal=journal, telemetry=True)
        with off, on:
            assert off._core.telemetry is None
            assert off._core.fast
            assert isinstance(on._core.telemetry, Telemetry)
            assert not on._core.fast

    def test_the_cli_sets_the_sdk_up_only_for_a_command_that_drives_runs(self):
        found = python(
            """
            import json
            from click.testing import CliRunner
            from opentelemetry import trace
            from fsm_runner.cli import cli

            result = CliRunner().invoke(cli, ["--otel", "worker", "--help"])
            provider = type(trace.get_tracer_provider()).__name__
            print(json.dumps({"code": result.exit_code, "provider": provider}))
            """
        )
        assert found == {"code": 0, "provider": "ProxyTracerProvider"}

    def test_an_exporter_it_cannot_provide_is_one_line(self, tmp_path):
        SqliteJournal(tmp_path / "j.db").close()
        done = subprocess.run(
            [sys.executable, "-m", "fsm_runner", "--otel", "--journal", str(tmp_path / "j.db"),
             "worker", "--app", "tests.otel_app:make_engine", "--exit-when-idle"],
            capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
            env={**os.environ, "OTEL_TRACES_EXPORTER": "zipkin"},
        )  # fmt: skip
        assert done.returncode == 2
        assert done.stderr.strip().splitlines()[-1] == (
            "Error: OTEL_TRACES_EXPORTER=zipkin: --otel exports otlp, console or none"
        )
        assert "Traceback" not in done.stderr
