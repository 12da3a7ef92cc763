"""An OTLP/HTTP traces receiver for tests (a thread, on 127.0.0.1 or the address a test names): it
decodes what the router's and the sim's exporters POST to `/v1/traces` (protobuf, as the OTLP
specification's HTTP binding says) and keeps every span, so a test can assert a request's span
tree. A test tool, not a collector: the kit deploys none of it."""

from __future__ import annotations

import gzip
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TRACES_PATH = "/v1/traces"
SERVER, CLIENT = 2, 3  # OTLP's SpanKind values (Span.kind)


def client_traceparent() -> tuple[str, str, str]:
    """A client's W3C traceparent (version 00, sampled): its trace id, its span id, the header."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


@dataclass(frozen=True)
class Span:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root
    name: str
    kind: int  # OTLP's SpanKind: SERVER, CLIENT, ...
    service: str  # the resource's service.name
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)  # the exporter's resource attributes
    error: str | None = None  # the status message of an ERROR status


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        """`host`: the address to listen on (a free port of it); loopback unless an exporter on
        another machine must reach it (the end-to-end tests' hub bridge address)."""
        self.spans: list[Span] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == TRACES_PATH and receiver._take(body)
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def url(self) -> str:
        """The traces URL to configure (an exporter's full endpoint)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{TRACES_PATH}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening: the port refuses connections (a collector that is down)."""
        self._server.shutdown()
        self._server.server_close()

    def reopen(self) -> None:
        """Listen again on the same address after close(), keeping what was received (the
        exporters keep the URL; a new receiver would bind another free port)."""
        closed = self._server
        self._server = ThreadingHTTPServer(closed.server_address, closed.RequestHandlerClass)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: list[str], timeout: float = 20) -> list[Span]:
        """The trace's spans once all of `names` (with repeats) are in; AssertionError, naming
        what came, after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.trace(trace_id)
            found = [s.name for s in got]
            if all(found.count(name) >= names.count(name) for name in set(names)):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"after {timeout}s, trace {trace_id} has {sorted(found)}, not all of {names}")
            time.sleep(0.05)

    def _take(self, body: bytes) -> bool:
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except DecodeError:
            return False
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = resource.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            service=service,
                            attributes=_attributes(s.attributes),
                            error=s.status.message if s.status.code == 2 else None,
                            resource=resource,
                        )
                    )
        with self._lock:
            self.spans += spans
            self.posts += 1
        return True


def _attributes(pairs: Any) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        value = pair.value
        kind = value.WhichOneof("value")
        out[pair.key] = getattr(value, kind) if kind else None
    return out
