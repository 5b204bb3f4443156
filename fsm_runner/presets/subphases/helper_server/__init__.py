"""A small helper server for the sub-phases preset: a real HTTP server in a subprocess.

The server stands for the kind of helper a harness runs beside its phases (a language server,
an analysis daemon): the sub-phases of :mod:`fsm_runner.presets.subphases` call it, and it may
die at any moment. Run it as::

    python -m fsm_runner.presets.subphases.helper_server --port P --log FILE \
        [--refuse-if-exists PATH]

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

The server process is this package's ``__main__``. This module is the I/O edge of the preset
that uses it: :class:`HelperServer` is the harness's :class:`fsm_runner.supervisor.Resource` for
the server process, and :class:`HelperClient` is all a phase gets — it can do work, and nothing
else. Foreign failures (``OSError``,
``http.client.HTTPException``, bad JSON) become :class:`ServerUnreachableError` or
:class:`HelperServerError` here.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from fsm_runner.exceptions import FsmRunnerError
from fsm_runner.presets._local_server import (
    HOST,
    JsonClient,
    LocalServer,
)

__all__ = [
    "HelperClient",
    "HelperServer",
    "HelperServerError",
    "ServerUnreachableError",
    "free_port",
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


class HelperClient(JsonClient):
    """Calls the helper server; has no handle on its process or lifecycle.

    It keeps only the server's address and its timeouts, so it goes on working after the
    harness restarts the server on the same port.

    Args:
        base_url: ``http://127.0.0.1:PORT``.
        connect_timeout: seconds to wait for the connection (short: a dead server refuses
            at once, a hung one should not stall the phase).
        read_timeout: seconds to wait for the answer (generous: work takes time).
    """

    __slots__ = ()

    def __init__(
        self, base_url: str, *, connect_timeout: float = 2.0, read_timeout: float = 300.0
    ) -> None:
        super().__init__(base_url, connect_timeout=connect_timeout, read_timeout=read_timeout)

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

    def _unreachable(self, url: str, detail: str) -> Exception:
        return ServerUnreachableError(url, detail)

    def _error_answer(self, url: str, status: int, detail: str) -> Exception:
        return HelperServerError(url, status, detail)


# -- the resource: what the harness owns ------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


class HelperServer(LocalServer):
    """The helper server as a supervised :class:`fsm_runner.supervisor.Resource`.

    Each :meth:`start` spawns the server process (this package's ``__main__``) in the caller's
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
        # This package's directory, run as a script (its __main__.py): the server process then
        # imports only the HTTP half it is built on. ``python -m`` would import the sub-phases
        # preset first, and with it the engine: ~70 ms more for every (re)start.
        argv = [
            sys.executable,
            str(Path(__file__).resolve().parent),
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
