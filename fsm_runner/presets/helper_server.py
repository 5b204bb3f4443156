"""A small helper server for the sub-phases preset: a real HTTP server in a subprocess.

The server stands for the kind of helper a harness runs beside its phases (a language server,
an analysis daemon): the sub-phases of :mod:`fsm_runner.presets.subphases` call it, and it may
die at any moment. Run it as::

    python -m fsm_runner.presets.helper_server --port P --log FILE [--refuse-if-exists PATH]

It listens on 127.0.0.1 only and answers:

``GET /health``
    ``200 {"ok": true, "pid": ...}``.
``POST /work/<name>?delay=S&key=KEY&fail=MESSAGE``
    appends ``start <name> <pid>`` (``start <name> <pid> <KEY>`` with a key) to the log
    (flushed and fsynced, so a kill right after still leaves it), sleeps ``S`` seconds, appends
    ``done <name> <pid>`` and answers ``{"name", "done", "pid"}`` where ``done`` counts the
    ``done <name>`` lines in the log. The delay applies only to the first ``start`` of
    ``<name>`` (with that ``KEY``: the sub-phases pass their run's id) the log has seen: a
    sub-phase is slow the first time (so a test can kill something while it runs) and its
    re-run is fast. With ``fail``, it answers ``500 {"error": MESSAGE}`` instead of doing
    the work.

With ``--refuse-if-exists PATH``, the server exits with code 1 at once if ``PATH`` exists;
tests create that file to make a killed server "never come back".

This module is also the I/O edge of the preset: :class:`HelperServer` is the harness's
:class:`fsm_runner.supervisor.Resource` for the server process, and :class:`HelperClient` is all
a phase gets — it can do work, and nothing else. Foreign failures (``OSError``,
``http.client.HTTPException``, bad JSON) become :class:`ServerUnreachableError` or
:class:`HelperServerError` here.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.presets._local_server import HOST, LocalServer

__all__ = [
    "HelperClient",
    "HelperServer",
    "HelperServerError",
    "ServerUnreachableError",
    "free_port",
    "main",
]


class ServerUnreachableError(FsmRunnerError, ConnectionError):
    """The helper server did not answer: refused, reset, or timed out.

    Also a :class:`ConnectionError`, since that is what it is. A phase reports it as
    ``SERVER_UNREACHABLE`` and leaves recovery to the harness.

    Attributes:
        url: what was requested.
        detail: what went wrong, in one line.
    """

    def __init__(self, url: str, detail: str) -> None:
        self.url = url
        self.detail = detail
        super().__init__(f"helper server unreachable at {url}: {detail}")


class HelperServerError(FsmRunnerError):
    """The helper server answered, but with an error (the work itself failed).

    Attributes:
        url: what was requested.
        status: the HTTP status.
        detail: the server's error message.
    """

    def __init__(self, url: str, status: int, detail: str) -> None:
        self.url = url
        self.status = status
        self.detail = detail
        super().__init__(f"helper server answered {status} to {url}: {detail}")


# -- the client: all a phase gets -------------------------------------------------------------


class HelperClient:
    """Calls the helper server; has no handle on its process or lifecycle.

    It keeps only the server's address and its timeouts, so it goes on working after the
    harness restarts the server on the same port.

    Args:
        base_url: ``http://127.0.0.1:PORT``.
        connect_timeout: seconds to wait for the connection (short: a dead server refuses
            at once, a hung one should not stall the phase).
        read_timeout: seconds to wait for the answer (generous: work takes time).
    """

    __slots__ = ("_host", "_port", "base_url", "connect_timeout", "read_timeout")

    def __init__(
        self, base_url: str, *, connect_timeout: float = 2.0, read_timeout: float = 300.0
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"base_url must be http://HOST:PORT, not {base_url!r}")
        self.base_url = base_url
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._host = parts.hostname
        self._port = parts.port

    def __repr__(self) -> str:
        return f"HelperClient({self.base_url!r})"

    def work(
        self, name: str, *, delay: float = 0.0, fail: str | None = None, key: str | None = None
    ) -> dict[str, Any]:
        """Ask the server to do the work called ``name``.

        Args:
            name: the work's name (a sub-phase).
            delay: seconds the server takes, the first time it does ``name`` (for ``key``).
            fail: make the server answer this error instead (to exercise failures).
            key: whose work it is (a run id): the delay applies to each key's first time.

        Returns:
            The server's answer: ``{"name", "done", "pid"}``.

        Raises:
            ServerUnreachableError: no connection, or it broke before a full answer.
            HelperServerError: the server answered with an error.
        """
        query: dict[str, str] = {}
        if delay:
            query["delay"] = f"{delay:g}"
        if key is not None:
            query["key"] = key
        if fail is not None:
            query["fail"] = fail
        path = f"/work/{urllib.parse.quote(name, safe='')}"
        if query:
            path += "?" + urllib.parse.urlencode(query)
        return self._request("POST", path)

    def _request(self, method: str, path: str) -> dict[str, Any]:
        url = self.base_url + path
        # http.client rather than urllib: urllib has one timeout for connecting and reading.
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.connect_timeout)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.read_timeout)
            conn.request(method, path, headers={"Content-Length": "0"})
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise ServerUnreachableError(url, detail) from exc
        finally:
            conn.close()
        try:
            data = json.loads(body)
        except ValueError:
            raise HelperServerError(url, response.status, f"not JSON: {body[:80]!r}") from None
        if response.status != http.HTTPStatus.OK or not isinstance(data, dict):
            message = data.get("error") if isinstance(data, dict) else data
            raise HelperServerError(url, response.status, str(message))
        return data


# -- the resource: what the harness owns ------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


class HelperServer(LocalServer):
    """The helper server as a supervised :class:`fsm_runner.supervisor.Resource`.

    Each :meth:`start` spawns ``python -m fsm_runner.presets.helper_server`` in the caller's
    process group, so whatever kills the runner's group kills the server too. The port is
    chosen once and kept across restarts, so clients handed out earlier stay valid.

    Args:
        log: the server's work log (``start``/``done`` lines).
        port: the port to listen on; a free one, chosen once, when not given.
        refuse_if_exists: passed to the server: it exits at once while this path exists.
        health_timeout: seconds one health check may take.
    """

    name = "helper-server"

    def __init__(
        self,
        *,
        log: Path,
        port: int | None = None,
        refuse_if_exists: Path | None = None,
        health_timeout: float = 0.5,
    ) -> None:
        super().__init__(
            port=port if port is not None else free_port(), health_timeout=health_timeout
        )
        self.log = Path(log)
        self.refuse_if_exists = refuse_if_exists

    def __repr__(self) -> str:
        return f"HelperServer(port={self.port}, pid={self.pid})"

    @property
    def base_url(self) -> str:
        """Where the server listens: ``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        argv = [
            sys.executable,
            "-m",
            "fsm_runner.presets.helper_server",
            "--port",
            str(self.port),
            "--log",
            str(self.log),
        ]
        if self.refuse_if_exists is not None:
            argv += ["--refuse-if-exists", str(self.refuse_if_exists)]
        return argv

    def start(self) -> None:
        """Spawn the server (a running one is stopped first); returns before it is healthy.

        Raises:
            OSError: the interpreter could not be spawned.
        """
        with self._lock:
            self._stop_locked()
            self._process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )

    def _healthy(self, answer: dict[str, Any]) -> bool:
        return bool(answer.get("ok"))

    def client(self) -> HelperClient:
        """A client for the server: it can do work, and nothing else."""
        return HelperClient(self.base_url)


# -- the server process -----------------------------------------------------------------------


class _WorkLog:
    """The server's append-only log; every line is on disk before the server goes on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def _lines(self) -> list[str]:
        try:
            return self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []

    def _append(self, line: str) -> None:
        with self.path.open("a", encoding="utf-8") as log:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())

    def start(self, name: str, key: str | None = None) -> bool:
        """Log the start of ``name``; return whether it is the first (for ``key``) in the log."""
        with self._lock:
            first = not any(
                fields[:2] == ["start", name] and (key is None or fields[3:] == [key])
                for fields in (line.split() for line in self._lines())
            )
            self._append(f"start {name} {os.getpid()}" + ("" if key is None else f" {key}"))
            return first

    def done(self, name: str) -> int:
        """Log the end of ``name``; return how many times ``name`` is done in the log."""
        with self._lock:
            self._append(f"done {name} {os.getpid()}")
            return sum(line.split()[:2] == ["done", name] for line in self._lines())


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Keep the request log quiet; the work log is what matters."""

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        """``/health``."""
        if urllib.parse.urlsplit(self.path).path == "/health":
            self._answer(http.HTTPStatus.OK, {"ok": True, "pid": os.getpid()})
        else:
            self._answer(http.HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

    def do_POST(self) -> None:
        """``/work/<name>?delay=S&fail=MESSAGE``."""
        parts = urllib.parse.urlsplit(self.path)
        prefix = "/work/"
        name = urllib.parse.unquote(parts.path[len(prefix) :])
        if not parts.path.startswith(prefix) or not name or " " in name:
            self._answer(http.HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
            return
        query = urllib.parse.parse_qs(parts.query)
        if "fail" in query:
            self._answer(http.HTTPStatus.INTERNAL_SERVER_ERROR, {"error": query["fail"][0]})
            return
        try:
            delay = float(query.get("delay", ["0"])[0])
        except ValueError:
            self._answer(http.HTTPStatus.BAD_REQUEST, {"error": "delay must be a number"})
            return
        key = query.get("key", [None])[0]
        if key is not None and (not key or any(c.isspace() for c in key)):
            self._answer(http.HTTPStatus.BAD_REQUEST, {"error": "key must be one word"})
            return
        log = self.server.work_log
        if log.start(name, key) and delay > 0:
            time.sleep(delay)
        done = log.done(name)
        self._answer(http.HTTPStatus.OK, {"name": name, "done": done, "pid": os.getpid()})


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, work_log: _WorkLog) -> None:
        self.work_log = work_log
        super().__init__((HOST, port), _Handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the helper server until it is killed.

    Returns:
        1 at once when ``--refuse-if-exists`` names an existing path; otherwise it never
        returns on its own (0 after Ctrl-C).
    """
    parser = argparse.ArgumentParser(
        prog="python -m fsm_runner.presets.helper_server",
        description="The sub-phases preset's helper server (127.0.0.1 only).",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument("--log", type=Path, required=True, help="the work log file")
    parser.add_argument(
        "--refuse-if-exists", type=Path, help="exit with code 1 at once if this path exists"
    )
    args = parser.parse_args(argv)
    if args.refuse_if_exists is not None and args.refuse_if_exists.exists():
        print(f"helper server: {args.refuse_if_exists} exists; refusing", file=sys.stderr)
        return 1
    with _Server(args.port, _WorkLog(args.log)) as server:
        try:
            server.serve_forever(poll_interval=0.1)
        except KeyboardInterrupt:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
