"""What the presets' own server processes share: a child process on 127.0.0.1, supervised.

A subclass says how to start it (:meth:`LocalServer.start`, usually through its ``command()``);
this base keeps the process, answers :meth:`LocalServer.health` from ``GET /health`` (the
answer must carry the process's own pid, so a stray process on the port never passes for ours)
and kills and reaps it on :meth:`LocalServer.stop`. Together that is a
:class:`fsm_runner.supervisor.Resource`.
"""

from __future__ import annotations

import contextlib
import http
import http.client
import json
import subprocess
import threading
from typing import Any

from fsm_runner.exceptions import SupervisorError

__all__ = ["HOST", "LocalServer"]

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
