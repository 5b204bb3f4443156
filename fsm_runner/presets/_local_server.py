"""The HTTP half of a small JSON server of ours on 127.0.0.1: its process, client and server.

The helper server (:mod:`fsm_runner.presets.subphases.helper_server`) is built from these, and
so is any other such server (the test suite's counter server is one):

- :class:`LocalServer`, the process as the harness owns it: a subclass says how to start it
  (:meth:`LocalServer.start`, usually through its ``command()``); this base keeps the process,
  answers :meth:`LocalServer.health` from ``GET /health`` (the answer must carry the process's
  own pid, so a stray process on the port never passes for ours) and kills and reaps it on
  :meth:`LocalServer.stop`. Together that is a :class:`fsm_runner.supervisor.Resource`.
- :class:`JsonClient`, what calls it: one JSON request, with the foreign failures (``OSError``,
  ``http.client.HTTPException``, bad JSON) turned into the subclass's own errors.
- :class:`JsonHandler`, :class:`JsonServer` and :func:`serve`, the server process's side:
  quiet, threaded, JSON answers, ``GET /health``, and a clean exit on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import http
import http.client
import http.server
import json
import os
import subprocess
import threading
import urllib.parse
from typing import Any

from fsm_runner.exceptions import SupervisorError

__all__ = ["HOST", "JsonClient", "JsonHandler", "JsonServer", "LocalServer", "serve"]

#: Where the presets' servers listen: loopback only.
HOST = "127.0.0.1"


class LocalServer:
    """A server process of ours on :data:`HOST`, with the health check and stop of a Resource.

    Args:
        port: the port it listens on, if known before it starts.
        health_timeout: seconds one health check may take.
    """

    name = "local-server"

    def __init__(self, *, port: int | None, health_timeout: float) -> None:
        self.port = port
        self.health_timeout = health_timeout
        self._process: subprocess.Popen[Any] | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The process id of the server started last, or ``None`` when it is stopped."""
        process = self._process
        return None if process is None else process.pid

    def health(self) -> bool:
        """Whether the server started last answers ``/health`` with its own pid.

        Raises:
            SupervisorError: the server process has exited; it will not become healthy.
        """
        process = self._process
        if process is None or self.port is None:
            return False
        code = process.poll()
        if code is not None:
            raise SupervisorError(self.name, f"server process {process.pid} exited with {code}")
        conn = http.client.HTTPConnection(HOST, self.port, timeout=self.health_timeout)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            data = json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()
        # The pid check: a stray process on the port must not pass for ours.
        return bool(
            response.status == http.HTTPStatus.OK
            and isinstance(data, dict)
            and data.get("pid") == process.pid
            and self._healthy(data)
        )

    def _healthy(self, answer: dict[str, Any]) -> bool:
        """What else a subclass requires of its ``/health`` answer (nothing, here)."""
        return True

    def stop(self) -> None:
        """Kill the server and wait for it; nothing happens if it is stopped or dead."""
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # died between poll() and kill()
                process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


# -- the client ---------------------------------------------------------------------------------


class JsonClient:
    """Calls a JSON server of ours; a subclass names its errors and its requests.

    Args:
        base_url: ``http://127.0.0.1:PORT``.
        connect_timeout: seconds to wait for the connection.
        read_timeout: seconds to wait for the answer.
    """

    __slots__ = ("_host", "_port", "base_url", "connect_timeout", "read_timeout")

    def __init__(self, base_url: str, *, connect_timeout: float, read_timeout: float) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"base_url must be http://HOST:PORT, not {base_url!r}")
        self.base_url = base_url
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._host = parts.hostname
        self._port = parts.port

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def _unreachable(self, url: str, detail: str) -> Exception:
        """The error to raise when the server gave no full answer."""
        raise NotImplementedError

    def _error_answer(self, url: str, status: int, detail: str) -> Exception:
        """The error to raise when the server answered with an error (or not with JSON)."""
        raise NotImplementedError

    def _request(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        url = self.base_url + path
        # http.client rather than urllib: urllib has one timeout for connecting and reading.
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.connect_timeout)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.read_timeout)
            conn.request(method, path, headers={"Content-Length": "0", **(headers or {})})
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise self._unreachable(url, detail) from exc
        finally:
            conn.close()
        try:
            data = json.loads(body)
        except ValueError:
            raise self._error_answer(url, response.status, f"not JSON: {body[:80]!r}") from None
        if response.status != http.HTTPStatus.OK or not isinstance(data, dict):
            message = data.get("error") if isinstance(data, dict) else data
            raise self._error_answer(url, response.status, str(message))
        return data


# -- the server process -------------------------------------------------------------------------


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """Answers in JSON, logs nothing, and answers ``GET /health`` with the process's pid."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Keep the request log quiet; what the server keeps is what matters."""

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _answer_health(self) -> None:
        self._answer(http.HTTPStatus.OK, {"ok": True, "pid": os.getpid()})

    def _answer_not_found(self) -> None:
        self._answer(http.HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})


class JsonServer(http.server.ThreadingHTTPServer):
    """A threaded server on :data:`HOST` whose request threads never keep the process alive."""

    daemon_threads = True

    def __init__(self, port: int, handler: type[JsonHandler]) -> None:
        super().__init__((HOST, port), handler)


def serve(server: JsonServer) -> int:
    """Serve until the process is killed; return 0 after Ctrl-C."""
    with server:
        try:
            server.serve_forever(poll_interval=0.1)
        except KeyboardInterrupt:
            return 0
    return 0
