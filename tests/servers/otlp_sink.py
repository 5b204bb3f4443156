"""A real OTLP/HTTP receiver for the telemetry tests: it decodes what arrives and writes it down.

Run as a process of its own (``python -m tests.servers.otlp_sink --port P --out FILE``): it
answers ``POST /v1/traces`` and ``POST /v1/metrics`` (protobuf, gzip or not) as a collector
would, decodes each request with ``opentelemetry-proto`` and appends one JSON line per span and
per metric data point to FILE (hex ids, attributes as plain values, the resource's attributes).
It prints ``listening`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

_WRITE = threading.Lock()


def plain(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a plain value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: plain(pair.value) for pair in pairs}


def spans_of(body: bytes) -> list[dict[str, Any]]:
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    return [
        span_row(span, attributes(resource_spans.resource.attributes), scope_spans.scope.name)
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def span_row(span: Any, resource: dict[str, Any], scope: str) -> dict[str, Any]:
    return {
        "kind": "span",
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "attributes": attributes(span.attributes),
        "events": [{"name": e.name, "attributes": attributes(e.attributes)} for e in span.events],
        "links": [link.span_id.hex() for link in span.links],
        "status": span.status.code,
        "resource": resource,
        "scope": scope,
    }


def points_of(body: bytes) -> list[dict[str, Any]]:
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_metrics in request.resource_metrics:
        resource = attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                for point in getattr(metric, kind).data_points:
                    row: dict[str, Any] = {
                        "kind": "metric",
                        "name": metric.name,
                        "type": kind,
                        "unit": metric.unit,
                        "attributes": attributes(point.attributes),
                        "resource": resource,
                    }
                    if kind == "histogram":
                        row.update(count=point.count, sum=point.sum)
                    else:
                        row["value"] = point.WhichOneof("value") and getattr(
                            point, point.WhichOneof("value")
                        )
                    found.append(row)
    return found


class Handler(BaseHTTPRequestHandler):
    out: Path

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            rows = spans_of(body)
            answer = trace_service_pb2.ExportTraceServiceResponse()
        elif self.path == "/v1/metrics":
            rows = points_of(body)
            answer = metrics_service_pb2.ExportMetricsServiceResponse()
        else:
            self.send_error(404)
            return
        with _WRITE, self.out.open("a", encoding="utf-8") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
        data = answer.SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args()
    Handler.out = options.out
    with ThreadingHTTPServer(("127.0.0.1", options.port), Handler) as server:
        print("listening", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
