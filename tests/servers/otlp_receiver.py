"""A tiny real OTLP/HTTP receiver, in a subprocess: what an exporter sends, decoded to JSON lines.

It stands for the collector a process configured with ``fsm-runner --otel`` exports to: it takes
the requests an OTLP/HTTP exporter sends, decodes them with ``opentelemetry-proto`` as a
collector would, and writes down what arrived, so a test can read the spans and metrics other
processes exported. Only the tests use it; it is built on the HTTP half the package's own helper
server is built on (:mod:`fsm_runner.presets._local_server`). Run it as::

    python -m tests.servers.otlp_receiver --out FILE [--port P]

It listens on 127.0.0.1 only (port 0, the default, picks a free one), prints the port it
listens on as its first line of output, and answers:

``GET /health``
    ``{"ok": true, "pid": ...}``.
``POST /v1/traces``
    an ``ExportTraceServiceRequest`` (protobuf; ``Content-Encoding: gzip`` or ``deflate``
    honoured): one JSON line per span is appended to FILE, then the answer is 200 with an empty
    ``ExportTraceServiceResponse``.
``POST /v1/metrics``
    an ``ExportMetricsServiceRequest``: one JSON line per metric (its data points in it), then
    200 with an empty ``ExportMetricsServiceResponse``.

A body that does not decode is answered 400, an unknown encoding 415, another path 404. The
lines of one request are written (and the file closed) before it is answered, so whatever an
exporter was told it delivered is in FILE by then. A span's line::

    {"signal": "span", "request": N, "name", "trace_id", "span_id", "parent_span_id" (hex, ""
     for a root), "kind", "start", "end" (ns), "attributes": {...}, "events": [{"name",
     "attributes"}], "links": [{"trace_id", "span_id"}], "status": {"code": "UNSET" | "OK" |
     "ERROR", "message"}, "scope", "resource": {...}}

A metric's line::

    {"signal": "metric", "request": N, "name", "unit", "type": "sum" | "gauge" | "histogram" |
     "exponential_histogram" | "summary", "temporality" and "monotonic" (sums), "scope",
     "resource": {...}, "points": [{"attributes", "start", "time", and "value" (sums, gauges)
     or "count", "sum", "bucket_counts", "bounds" (histograms)}]}

``request`` numbers the requests the receiver decoded, from 1, in the order they arrived.

:class:`OtlpReceiver` starts and stops the receiver process (a
:class:`fsm_runner.supervisor.Resource` too) and reads what it wrote.
"""

from __future__ import annotations

import argparse
import gzip
import http
import json
import subprocess
import sys
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from fsm_runner.exceptions import SupervisorError
from fsm_runner.presets._local_server import HOST, JsonHandler, JsonServer, LocalServer, serve

__all__ = ["OtlpReceiver", "decode_metrics", "decode_spans", "main"]


# -- decoding ----------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a plain JSON value (bytes as hex)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [plain(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    """OTLP ``KeyValue`` pairs as a dict."""
    return {pair.key: plain(pair.value) for pair in pairs}


def decode_spans(body: bytes) -> list[dict[str, Any]]:
    """The spans of an ``ExportTraceServiceRequest``, one dict each (the line, less ``request``).

    Raises:
        google.protobuf.message.DecodeError: the body is not such a request.
    """
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "signal": "span",
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "kind": trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                        "attributes": attributes(span.attributes),
                        "events": [
                            {"name": event.name, "attributes": attributes(event.attributes)}
                            for event in span.events
                        ],
                        "links": [
                            {"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()}
                            for link in span.links
                        ],
                        "status": {
                            "code": trace_pb2.Status.StatusCode.Name(span.status.code).removeprefix(
                                "STATUS_CODE_"
                            ),
                            "message": span.status.message,
                        },
                        "scope": scope_spans.scope.name,
                        "resource": resource,
                    }
                )
    return spans


def _point(point: Any, kind: str) -> dict[str, Any]:
    found: dict[str, Any] = {
        "attributes": attributes(point.attributes),
        "start": point.start_time_unix_nano,
        "time": point.time_unix_nano,
    }
    if kind in ("sum", "gauge"):
        which = point.WhichOneof("value")
        found["value"] = None if which is None else getattr(point, which)
    else:  # histograms and summaries: a count and a sum
        found["count"] = point.count
        found["sum"] = point.sum
        if kind == "histogram":
            found["bucket_counts"] = list(point.bucket_counts)
            found["bounds"] = list(point.explicit_bounds)
    return found


def decode_metrics(body: bytes) -> list[dict[str, Any]]:
    """The metrics of an ``ExportMetricsServiceRequest``, one dict each, with their points.

    Raises:
        google.protobuf.message.DecodeError: the body is not such a request.
    """
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    request.ParseFromString(body)
    metrics = []
    for resource_metrics in request.resource_metrics:
        resource = attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind is None:
                    continue
                data = getattr(metric, kind)
                found: dict[str, Any] = {
                    "signal": "metric",
                    "name": metric.name,
                    "unit": metric.unit,
                    "type": kind,
                    "scope": scope_metrics.scope.name,
                    "resource": resource,
                    "points": [_point(point, kind) for point in data.data_points],
                }
                if kind == "sum":
                    found["monotonic"] = data.is_monotonic
                if kind in ("sum", "histogram", "exponential_histogram"):
                    found["temporality"] = metrics_pb2.AggregationTemporality.Name(
                        data.aggregation_temporality
                    ).removeprefix("AGGREGATION_TEMPORALITY_")
                metrics.append(found)
    return metrics


#: Each path the receiver answers: how its body decodes, and the (empty) answer.
ROUTES = {
    "/v1/traces": (decode_spans, trace_service_pb2.ExportTraceServiceResponse),
    "/v1/metrics": (decode_metrics, metrics_service_pb2.ExportMetricsServiceResponse),
}


# -- the resource ------------------------------------------------------------------------------


class OtlpReceiver(LocalServer):
    """The receiver process: a :class:`fsm_runner.supervisor.Resource` and a context manager.

    :meth:`start` spawns ``python -m tests.servers.otlp_receiver`` and returns once it listens.

    Args:
        out: the file the receiver appends what it decoded to (created empty if missing).
        port: the port to listen on; a free one, picked by the receiver, when not given.
        health_timeout: seconds one health check may take.
    """

    name = "otlp-receiver"

    def __init__(self, *, out: Path, port: int | None = None, health_timeout: float = 0.5) -> None:
        super().__init__(port=port, health_timeout=health_timeout)
        self.out = Path(out)

    def __repr__(self) -> str:
        return f"OtlpReceiver(port={self.port}, pid={self.pid})"

    def __enter__(self) -> OtlpReceiver:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT``: ``http://127.0.0.1:PORT``.

        Raises:
            SupervisorError: the receiver has not been started yet (its port is not known).
        """
        if self.port is None:
            raise SupervisorError(self.name, "not started yet; its port is not known")
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the receiver (from the repository's root)."""
        return [
            sys.executable, "-m", "tests.servers.otlp_receiver",
            "--out", str(self.out), "--port", str(self.port or 0),
        ]  # fmt: skip

    def start(self) -> None:
        """Spawn the receiver (a running one is stopped first) and wait until it listens.

        Raises:
            SupervisorError: the receiver exited before it listened.
            OSError: the interpreter could not be spawned.
        """
        root = Path(__file__).resolve().parents[2]  # where `tests` is a package
        with self._lock:
            self._stop_locked()
            self.out.touch()
            process = subprocess.Popen(
                self.command(), cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            self._process = process
            assert process.stdout is not None
            line = process.stdout.readline()  # the receiver prints its port once it listens
            if not line.strip().isdigit():
                self._stop_locked()
                raise SupervisorError(self.name, f"exited before it listened ({line.strip()!r})")
            self.port = int(line)

    def received(self) -> list[dict[str, Any]]:
        """Every line the receiver wrote, in order (spans and metrics)."""
        with self.out.open(encoding="utf-8") as lines:
            return [json.loads(line) for line in lines]

    def spans(self, name: str | None = None) -> list[dict[str, Any]]:
        """The spans received (those named ``name``, if given), in the order they arrived."""
        return [
            line
            for line in self.received()
            if line["signal"] == "span" and (name is None or line["name"] == name)
        ]

    def metrics(self, name: str | None = None) -> list[dict[str, Any]]:
        """The metrics received (those named ``name``, if given), one per metric and request."""
        return [
            line
            for line in self.received()
            if line["signal"] == "metric" and (name is None or line["name"] == name)
        ]


# -- the receiver process ----------------------------------------------------------------------


class _Handler(JsonHandler):
    server: _Server

    def do_GET(self) -> None:
        """``/health``."""
        if self.path == "/health":
            self._answer_health()
        else:
            self._answer_not_found()

    def do_POST(self) -> None:
        """``/v1/traces``, ``/v1/metrics``: decode, write down, answer."""
        route = ROUTES.get(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if route is None:
            self._answer_not_found()
            return
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding != "identity":
                self._answer(http.HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": encoding})
                return
            decode, response = route
            lines = decode(body)
        except (OSError, EOFError, zlib.error, DecodeError) as exc:
            self._answer(http.HTTPStatus.BAD_REQUEST, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self.server.write_down(lines)
        answer = response().SerializeToString()
        self.send_response(http.HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


class _Server(JsonServer):
    def __init__(self, port: int, out: Path) -> None:
        self.out = out
        self.requests = 0
        self.lock = threading.Lock()
        super().__init__(port, _Handler)  # type: ignore[arg-type]

    def write_down(self, lines: list[dict[str, Any]]) -> None:
        """Append one request's lines to the file, numbered, before the request is answered."""
        with self.lock:
            self.requests += 1
            with self.out.open("a", encoding="utf-8") as out:
                out.writelines(
                    json.dumps({**line, "request": self.requests}) + "\n" for line in lines
                )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the receiver until it is killed (0 after Ctrl-C)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.servers.otlp_receiver",
        description="A tiny OTLP/HTTP receiver writing what it decodes as JSON lines.",
    )
    parser.add_argument("--out", type=Path, required=True, help="the JSON lines file")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: a free one)")
    args = parser.parse_args(argv)
    server = _Server(args.port, args.out)
    print(server.server_address[1], flush=True)  # the port: OtlpReceiver.start waits for it
    return serve(server)


if __name__ == "__main__":
    sys.exit(main())
