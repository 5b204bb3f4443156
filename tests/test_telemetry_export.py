"""OpenTelemetry across real processes (issue 35): a trace continued after kill -9, OTLP over HTTP.

A real OTLP/HTTP receiver (``tests/servers/otlp_sink.py``, a process of its own) decodes what
arrives with ``opentelemetry-proto``. One run's trace is continued across a SIGKILL and a
``fsm-runner --otel resume`` in another process; the README's worker command
(``fsm-runner --otel worker``, configured by the ``OTEL_*`` variables it exports) sends its
spans and metrics to the receiver, which decodes them. Real SQLite files, real subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from fsm_runner.journal import SqliteJournal
from tests.ui_helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


class Sink:
    """``tests/servers/otlp_sink.py`` on a free port; what it received, decoded."""

    def __init__(self, tmp_path: Path) -> None:
        self.out = tmp_path / "received.jsonl"
        self.out.touch()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.servers.otlp_sink", "--port", str(self.port),
             "--out", str(self.out)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "listening"

    def rows(self, kind: str) -> list[dict]:
        lines = self.out.read_text(encoding="utf-8").splitlines()
        return [row for row in map(json.loads, lines) if row["kind"] == kind]

    def spans(self, name: str) -> list[dict]:
        return [row for row in self.rows("span") if row["name"] == name]

    def totals(self, name: str, key: str | None = None, field: str = "value") -> dict:
        """A cumulative metric's last exported ``field`` by the attribute ``key`` (the SDK
        exports running totals: the command flushes them once, and again at exit)."""
        last: dict = {}
        for row in self.rows("metric"):
            if row["name"] == name:
                last[json.dumps(row["attributes"], sort_keys=True)] = row
        totals: Counter = Counter()
        for row in last.values():
            totals[row["attributes"].get(key) if key else None] += row[field]
        return dict(totals)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def sink(tmp_path):
    found = Sink(tmp_path)
    yield found
    found.stop()


def environment(sink: Sink, workdir: Path, service: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {
        **env,
        "PYTHONPATH": str(ROOT),
        "FSM_OTEL_DIR": str(workdir),
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
        "OTEL_SERVICE_NAME": service,
    }


#: The first process: the app configures the SDK itself (spans exported as each ends, so the
#: start's span is out before the kill), starts a run and drives it into the phase that kills it.
FIRST = textwrap.dedent(
    """
    import sys
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "starter"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)

    from fsm_runner.journal import SqliteJournal
    from tests.otel_app import make_engine

    engine = make_engine(SqliteJournal(sys.argv[1]))
    run_id = engine.start({"kill": True}, run_id="release-7")
    print(run_id, flush=True)
    engine.run(run_id)  # build kills this process
    """
)


def test_a_trace_continues_across_a_kill_and_a_resume_in_another_process(tmp_path, sink):
    journal = tmp_path / "journal.db"
    env = environment(sink, tmp_path, "starter")
    first = subprocess.run(
        [sys.executable, "-c", FIRST, str(journal)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert first.returncode == -9, first.stderr  # SIGKILL, in build
    assert first.stdout.strip() == "release-7"
    resumed = subprocess.run(
        [sys.executable, "-m", "fsm_runner", "--otel", "--journal", str(journal), "resume",
         "release-7", "--app", "tests.otel_app:make_engine"],
        cwd=tmp_path, env={**env, "OTEL_SERVICE_NAME": "resumer"}, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    with SqliteJournal(journal) as opened:
        assert opened.load("release-7").status.value == "succeeded"
    calls = (tmp_path / "calls").read_text().split()
    assert calls[0::2] == ["fetch", "build", "build", "publish"]  # fetch never ran again

    (start,) = sink.spans("fsm_runner.start")
    (drive,) = [
        d for d in sink.spans("fsm_runner.drive") if d["resource"]["service.name"] == "resumer"
    ]
    assert start["resource"]["service.name"] == "starter"
    assert start["attributes"]["fsm_runner.run.id"] == "release-7"
    # the resumer's drive continues the starter's trace, under the run's start
    assert drive["trace_id"] == start["trace_id"]
    assert drive["parent_span_id"] == start["span_id"]
    assert drive["attributes"]["fsm_runner.state"] == "build"  # where the kill left it
    assert drive["attributes"]["fsm_runner.run.status"] == "succeeded"
    phases = [p for p in sink.spans("fsm_runner.phase") if p["trace_id"] == start["trace_id"]]
    by_service = Counter(
        (p["resource"]["service.name"], p["attributes"]["fsm_runner.state"]) for p in phases
    )
    # the starter's fetch span was exported before the kill; its build span never ended
    assert by_service == {
        ("starter", "fetch"): 1,
        ("resumer", "build"): 1,
        ("resumer", "publish"): 1,
    }
    resumer_phases = [p for p in phases if p["resource"]["service.name"] == "resumer"]
    assert {p["parent_span_id"] for p in resumer_phases} == {drive["span_id"]}
    # the killed process's lease, taken over at once
    assert sink.totals("fsm_runner.lease.takeovers") == {None: 1}


def readme_commands() -> list[str]:
    """The README's worker exporting to a collector: the lines of its OpenTelemetry bash block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Tracing and metrics: OpenTelemetry", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    return block.group(1).strip().splitlines()


def test_the_readmes_worker_exports_over_otlp_to_a_receiver(tmp_path, sink):
    """The README's commands, the collector's address swapped for the receiver's: what a
    worker sends over OTLP/HTTP arrives and decodes to the runs it drove."""
    export, worker = readme_commands()
    assert export.startswith("export OTEL_EXPORTER_OTLP_ENDPOINT=")
    env = environment(sink, tmp_path, "unused")
    for assignment in shlex.split(export)[1:]:
        name, value = assignment.split("=", 1)
        env[name] = value
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.url  # the receiver, where the README's collector is
    release = [sys.executable, "-m", "fsm_runner.examples.release", "--stop-after", "2"]
    for version in ("1.0.0", "1.1.0"):
        subprocess.run(
            [*release, "--version", version],
            cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    argv = shlex.split(worker)
    assert argv[0] == "fsm-runner"
    done = subprocess.run(
        [sys.executable, "-m", "fsm_runner", *argv[1:]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with SqliteJournal(tmp_path / "fsm-runner.db") as journal:
        runs = journal.runs()
        transitions = {run.run_id: len(journal.transitions(run.run_id)) for run in runs}
    assert {run.status.value for run in runs} == {"succeeded"}

    drives = sink.spans("fsm_runner.drive")
    assert sorted(d["attributes"]["fsm_runner.run.id"] for d in drives) == sorted(transitions)
    assert {d["attributes"]["fsm_runner.drive"] for d in drives} == {"work"}
    assert {d["resource"]["service.name"] for d in drives} == {env["OTEL_SERVICE_NAME"]}
    phases = Counter(p["attributes"]["fsm_runner.state"] for p in sink.spans("fsm_runner.phase"))
    assert phases == {"testing": 2, "publishing": 2}
    committed = sink.totals("fsm_runner.transitions", "fsm_runner.event")
    assert committed == {"TESTS_PASSED": 2, "PUBLISHED": 2}  # what this worker committed
    assert sink.totals("fsm_runner.runs.ended", "fsm_runner.outcome") == {"succeeded": 2}
    assert sink.totals("fsm_runner.phase.duration", field="count") == {None: 4}
    units = {m["unit"] for m in sink.rows("metric") if m["name"] == "fsm_runner.phase.duration"}
    assert units == {"s"}
    # flushed before the worker's engine closed: its runs now, read from the journal
    now = sink.totals("fsm_runner.runs.current", "fsm_runner.run.status")
    assert now == {"active": 0, "waiting": 0, "dead_letter": 0}
