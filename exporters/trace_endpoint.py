"""The trace endpoint: the node's rings and stall dumps, read-only, for the alert bot's drill-down.

It listens on its own address (``trace_listen``), apart from ``/metrics``, so a NetworkPolicy can let
only the bot reach it, and answers GET requests carrying ``Authorization: Bearer <token>`` (the token
is read from ``trace_token_file``, re-read when the file changes, as a mounted Secret does):

- ``/v1/jobs``: the jobs with files on this node;
- ``/v1/jobs/<job>``: the node, and each rank of the job here: identity, liveness, GPU (index, UUID)
  and the pod, namespace and container holding that GPU (kubelet PodResources), its ring and dumps;
- ``/v1/jobs/<job>/ranks/<rank>``: the rank's ring header and counters;
- ``/v1/jobs/<job>/ranks/<rank>/ring?last=&after_serial=&since_ns=&until_ns=``: a window of the ring
  as a ring file of its own (`megatrace.exporters.trace_window`);
- ``/v1/jobs/<job>/dumps/<name>?last=``: one stall dump as written, or with its newest `last` records
  only (``last=0``: its header, which says when the rank was seen stalled, and its thread stacks);
- ``/v1/jobs/<job>/stacks/<name>``: one stacks file as written (every thread's stack, written by
  faulthandler when the rank's watchdog could not run, `megatrace.tracer.stack_fallback`).

Refusals carry a JSON ``{"error": ...}``: 401 without the right token, 400 for a malformed path or
query (percent-encoded characters are refused outright), 403 for a path that leads out of the trace
root, 404 for an unknown job, rank or dump, 413 past the response bounds, 503 while
``trace_max_concurrent`` requests are being served. A client has ``read_timeout_s`` to send its
request, and at most ``max_connections`` are open (`megatrace.exporters.http_limits`). Bodies are
gzip-compressed for clients that accept it. Windows are cut and compressed in a lower-priority
process (`megatrace.exporters.trace_workers`), so serving a drill-down barely slows the agent's
scrapes. Its own series:
``megatrace_trace_endpoint_requests_total{code}`` and ``megatrace_trace_endpoint_sent_bytes_total``.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from prometheus_client.core import Metric

from megatrace.exporters.collector_settings import setting
from megatrace.exporters.families import FamilySet
from megatrace.exporters.http_limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    BoundedHandler,
    BoundedHTTPServer,
)
from megatrace.exporters.podresources import PodLookup, configured_lookup, socket_setting
from megatrace.exporters.trace_store import Refused, TraceStore, header_or_none
from megatrace.exporters.trace_window import Window, WindowTooLarge
from megatrace.exporters.trace_workers import (
    GZIP_MIN_BYTES,
    Workers,
    dump_reply,
    gzip_bytes,
    ring_reply,
    stacks_reply,
)
from megatrace.exporters.tracer_files import trace_dir_setting, writer_alive
from megatrace.listen import parse_host_port
from megatrace.logsetup import register_secret
from megatrace.tracer.ringfile import RECORD_SIZE, RingFormatError

if TYPE_CHECKING:
    from megatrace.exporters.settings import ExporterConfig

log = logging.getLogger(__name__)

WINDOW_KEYS = {field.name for field in dataclasses.fields(Window)}
MAX_QUERY_FIELDS = 8
DEFAULT_TRACE_PORT = 9452
INTEGER = re.compile(r"-?[0-9]{1,19}")  # ASCII digits only: str.isdigit() also admits "²"


@dataclasses.dataclass(frozen=True)
class Reply:
    """An answer: status, body, its content type, and whether the body is gzip-compressed already."""

    status: int
    body: bytes
    content_type: str = "application/json"
    gzipped: bool = False


class TokenFile:
    """The bearer token in a file, re-read when the file changes (a rotated Kubernetes Secret)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._token = b""
        self._lock = threading.Lock()
        self.current()

    def current(self) -> bytes:
        """The token now; OSError when the file cannot be read, ValueError when it is empty."""
        stat = os.stat(self.path)
        with self._lock:
            if self._stamp != (stat.st_mtime_ns, stat.st_ino):
                token = self.path.read_bytes().strip()
                if not token:
                    raise ValueError(f"token file {self.path} is empty")
                register_secret(token.decode(errors="replace"))
                self._token, self._stamp = token, (stat.st_mtime_ns, stat.st_ino)
            return self._token

    def admits(self, authorization: str) -> bool:
        scheme, _, presented = authorization.partition(" ")
        try:
            token = self.current()
        except (OSError, ValueError) as exc:
            log.error("trace endpoint token: %s; refusing every request", exc)
            return False
        return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token)


@dataclasses.dataclass
class Served:
    """Counts for the endpoint's own series."""

    by_code: dict[int, int] = dataclasses.field(default_factory=dict)
    sent_bytes: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, code: int, nbytes: int) -> None:
        with self.lock:
            self.by_code[code] = self.by_code.get(code, 0) + 1
            self.sent_bytes += nbytes


class TraceServer(BoundedHTTPServer):
    """The endpoint's HTTP server: one thread per connection within the bounds of `http_limits`, at
    most `max_concurrent` doing work."""

    def __init__(
        self, address: tuple[str, int], endpoint: TraceEndpoint, read_timeout_s: float, max_connections: int
    ) -> None:
        self.endpoint = endpoint
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, TraceHandler, read_timeout_s, max_connections)


class TraceHandler(BoundedHandler):
    server: TraceServer
    server_version = "megatrace-trace-endpoint"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        endpoint = self.server.endpoint
        if not endpoint.token.admits(self.headers.get("Authorization", "")):
            self._json(401, {"error": "a valid bearer token is required"}, {"WWW-Authenticate": "Bearer"})
            return
        if not endpoint.slots.acquire(blocking=False):
            self._json(503, {"error": "busy; try again"}, {})
            return
        gzip_ok = "gzip" in self.headers.get("Accept-Encoding", "")
        try:
            reply = endpoint.answer(self.path, gzip_ok)
        except Refused as exc:
            reply = Reply(exc.status, _error(str(exc)))
        except Exception:
            log.exception("trace endpoint: %s failed", self.path[:200])
            reply = Reply(500, _error("internal error; the agent's log has details"))
        finally:
            endpoint.slots.release()
        self._send(reply)

    def _json(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
        self._send(Reply(status, json.dumps(payload).encode()), headers)

    def _send(self, reply: Reply, headers: dict[str, str] | None = None) -> None:
        body, gzipped = reply.body, reply.gzipped
        if not gzipped and len(body) > GZIP_MIN_BYTES and "gzip" in self.headers.get("Accept-Encoding", ""):
            body, gzipped = gzip_bytes(body), True  # small JSON answers: not worth a trip to the workers
        if gzipped:
            headers = {**(headers or {}), "Content-Encoding": "gzip"}
        if reply.status == 503:  # busy slots, or a serving process being started again
            headers = {**(headers or {}), "Retry-After": "1"}
        # counted before it is sent: a client that reads the agent's metrics next finds it there
        self.server.endpoint.served.add(reply.status, len(body))
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Vary", "Accept-Encoding")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def parse_window(query: str) -> Window:
    """A `Window` from a query string; Refused (400) for unknown keys or values that are not integers."""
    values: dict[str, int] = {}
    try:
        fields = parse_qsl(query, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)
    except ValueError:
        raise Refused(400, f"at most {MAX_QUERY_FIELDS} query fields are accepted") from None
    for key, value in fields:
        if key not in WINDOW_KEYS:
            raise Refused(400, f"unknown query key {key[:40]!r} (known: {', '.join(sorted(WINDOW_KEYS))})")
        if not INTEGER.fullmatch(value) or not -(2**63) <= int(value) < 2**63:
            raise Refused(400, f"{key}= must be an integer of at most 64 bits, got {value[:40]!r}")
        values[key] = int(value)
    return Window(**values)


class TraceEndpoint:
    """The endpoint as a collector of the agent: serves in a thread, exports its request counts."""

    def __init__(
        self,
        trace_dir: str | Path,
        address: tuple[str, int],
        token_file: Path,
        max_records: int,
        max_response_bytes: int,
        max_concurrent: int,
        node_name: str = "",
        pods: PodLookup | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.store = TraceStore(trace_dir)
        self.token = TokenFile(token_file)
        self.max_records = max_records
        self.max_response_bytes = max_response_bytes
        self.slots = threading.BoundedSemaphore(max_concurrent)
        self.node_name = node_name or os.uname().nodename
        self.pods = pods
        self.served = Served()
        self.workers = Workers()
        self.server = TraceServer(address, self, read_timeout_s, max_connections)
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="trace-endpoint", daemon=True)
        self._thread.start()
        log.info("serving trace data on %s:%d", *self.address[:2])

    def answer(self, raw_path: str, gzip_ok: bool = False) -> Reply:
        """The reply to a request path (a large body compressed when `gzip_ok`); Refused for what is
        not served."""
        path, _, query = raw_path.partition("?")
        if "%" in path or "\\" in path:
            raise Refused(400, "percent-encoded or backslash characters are not accepted in paths")
        parts = path.split("/")[1:]
        if any(part in ("", ".", "..") for part in parts):
            raise Refused(400, "empty, '.' or '..' path segments are not accepted")
        if parts[:1] != ["v1"] or len(parts) < 2 or parts[1] != "jobs":
            raise Refused(404, "not found; the endpoint serves /v1/jobs")
        match parts[2:]:
            case []:
                return Reply(200, _json({"node": self.node_name, "jobs": self.store.jobs()}))
            case [job]:
                return Reply(200, _json(self.job(job)))
            case [job, "ranks", rank]:
                header = header_or_none(self.store.ring(job, rank))
                if header is None:
                    raise Refused(404, f"rank {rank} of job {job!r} has no readable ring file here")
                return Reply(200, _json(dataclasses.asdict(header)))
            case [job, "ranks", rank, "ring"]:
                body, gzipped = self.ring(job, rank, parse_window(query), gzip_ok)
                return Reply(200, body, "application/octet-stream", gzipped)
            case [job, "dumps", name]:
                window = parse_window(query)
                if window != Window(last=window.last):
                    raise Refused(400, "a dump is cut by last= only")
                path = self.store.dump(job, name)
                args = (path, window.last, self.max_response_bytes, gzip_ok)
                body, gzipped = self.workers.run(dump_reply, *args)
                return Reply(200, body, "text/plain; charset=utf-8", gzipped)
            case [job, "stacks", name]:
                if query:
                    raise Refused(400, "a stacks file is served whole (no query)")
                path = self.store.stacks(job, name)
                body, gzipped = self.workers.run(stacks_reply, path, self.max_response_bytes, gzip_ok)
                return Reply(200, body, "text/plain; charset=utf-8", gzipped)
        raise Refused(404, "not found; see /v1/jobs")

    def job(self, job: str) -> dict[str, Any]:
        owners = self.pods() if self.pods is not None else {}
        ranks = []
        for rank, entry in self.store.ranks(job).items():
            ring = entry.ring
            header = header_or_none(ring)
            item: dict[str, Any] = {"rank": rank, "ring": ring is not None}
            item["dumps"] = [path.name for path in entry.dumps]
            item["stacks"] = [path.name for path in entry.stacks]
            if ring is not None and header is not None:
                namespace, pod, container = owners.get(header.device_uuid, ("", "", ""))
                item |= {
                    "local_rank": header.local_rank,
                    "world_size": header.world_size,
                    "host": header.host,
                    "alive": not header.finished and writer_alive(ring, header),
                    "finished": header.finished,
                    "records_written": header.records_written,
                    "gpu": header.cuda_device,
                    "gpu_uuid": header.device_uuid,
                    "namespace": namespace,
                    "pod": pod,
                    "container": container,
                }
            ranks.append(item)
        return {"job": job, "node": self.node_name, "ranks": ranks}

    def ring(self, job: str, rank: str, window: Window, gzip_ok: bool) -> tuple[bytes, bool]:
        path = self.store.ring(job, rank)
        header = header_or_none(path)
        if path is None or header is None:
            raise Refused(404, f"rank {rank} of job {job!r} has no readable ring file here")
        alive = not header.finished and writer_alive(path, header)
        limit = min(self.max_records, self.max_response_bytes // RECORD_SIZE)
        try:
            return self.workers.run(ring_reply, path, window, limit, alive, gzip_ok)
        except WindowTooLarge as exc:
            raise Refused(413, str(exc)) from None
        except (RingFormatError, OSError) as exc:
            reason = (
                str(exc).replace(str(path), path.name) if isinstance(exc, RingFormatError) else exc.strerror
            )
            raise Refused(404, f"rank {rank} of job {job!r}: unreadable ring ({reason})") from None

    def collect(self) -> Iterator[Metric]:
        families = FamilySet("trace_endpoint")
        with self.served.lock:
            by_code, sent = dict(self.served.by_code), self.served.sent_bytes
        for code, count in sorted(by_code.items()):
            families.counter(
                "requests_total",
                "Trace endpoint requests answered, by HTTP status.",
                {"code": str(code)},
                count,
            )
        families.counter("sent_bytes_total", "Bytes of trace data sent (after compression).", {}, sent)
        return iter(families.families())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.workers.close()


def _json(payload: object) -> bytes:
    return json.dumps(payload).encode()


@dataclasses.dataclass(frozen=True)
class TracesSettings:
    """The trace endpoint's keys: its own address (so that a NetworkPolicy can let only the alert bot
    reach it), the file holding the bearer token every request must carry, and its limits."""

    trace_dir: str = trace_dir_setting()
    podresources_socket: str = socket_setting()
    trace_listen: str = setting(
        f"0.0.0.0:{DEFAULT_TRACE_PORT}", "address of the trace endpoint", metavar="HOST:PORT"
    )
    trace_token_file: str = setting("", "file holding the trace endpoint's bearer token", metavar="PATH")
    trace_max_records: int = setting(200_000, "most records one ring window may hold", metavar="N")
    trace_max_response_bytes: int = setting(64 << 20, "most bytes one served dump or window may have")
    trace_max_concurrent: int = setting(4, "trace requests served at once", metavar="N")

    def problems(self, enabled: bool) -> list[str]:
        found = []
        try:
            parse_host_port(self.trace_listen)
        except ValueError as exc:
            found.append(f"key 'trace_listen': {exc}")
        if enabled and not self.trace_token_file:
            found.append("key 'trace_token_file': the trace endpoint (collector traces) needs a token file")
        for key in ("trace_max_records", "trace_max_response_bytes", "trace_max_concurrent"):
            if getattr(self, key) < 1:
                found.append(f"key '{key}': must be at least 1")
        return found


SETTINGS = TracesSettings


def build(settings: TracesSettings, agent: ExporterConfig, nvml: object = None) -> TraceEndpoint:
    """The agent's trace endpoint (`collectors` table entry "traces"), serving."""
    return TraceEndpoint(
        settings.trace_dir,
        parse_host_port(settings.trace_listen),
        Path(settings.trace_token_file),
        settings.trace_max_records,
        settings.trace_max_response_bytes,
        settings.trace_max_concurrent,
        agent.node_name,
        configured_lookup(settings.podresources_socket),
        agent.read_timeout_s,
        agent.max_connections,
    )
