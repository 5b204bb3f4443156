"""A counter server: a real external system with real side effects, in a subprocess.

It stands for the kind of service a sandboxed phase changes (see
:mod:`fsm_runner.presets.sandbox`): every hit changes a counter, durably, so a test can tell
exactly how many times a side effect happened — across kills of the process that caused it.
Only the tests use it; it is built on the HTTP half the package's own helper server is built on
(:mod:`fsm_runner.presets._local_server`). Run it as::

    python tests/servers/counter_server.py --state FILE [--port P] [--stall-after-hit MARKER]

It listens on 127.0.0.1 only (port 0, the default, picks a free one), prints the port it
listens on as its first line of output, and answers:

``GET /health``
    ``{"ok": true, "pid": ...}``.
``GET /count?key=K``
    ``{"key": K, "count": N}`` (0 for a key never hit); without ``key``: ``{"counts": {...}}``.
``GET /hits``
    ``{"hits": [{"key", "by", "idempotency_key", "replayed"}, ...]}``: every hit, in order.
``POST /hit?key=K&by=N``
    adds ``N`` (default 1) to ``K``'s counter and answers
    ``{"key", "count", "idempotency_key", "replayed": false}``. With an ``Idempotency-Key``
    header the server remembers its answer under that key: a hit with a key it has seen changes
    nothing and gets the first answer again, with ``"replayed": true``. Without the header,
    every hit counts.

Every hit is saved to the state file (written whole, fsynced, then renamed over the old one)
before it is answered, so a hit the server has counted survives the server too; a server
started on an existing state file goes on from it.

With ``--stall-after-hit MARKER``, the first hit that counts while ``MARKER`` does not exist
is saved, creates ``MARKER``, and then gets no answer for a long time: the caller is stuck
*after* the side effect happened, which is where a test kills it. Later hits answer at once.

:class:`CounterServer` starts and stops the server process (it is also a
:class:`fsm_runner.supervisor.Resource`); :class:`CounterClient` calls it, and is an
:class:`fsm_runner.presets.sandbox.ExternalStore` (``read`` a counter, ``mutate`` = a hit).
Foreign failures (``OSError``, ``http.client.HTTPException``, bad JSON) become
:class:`CounterServerError` here.
"""

from __future__ import annotations

import argparse
import http
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from fsm_runner.exceptions import FsmRunnerError, SupervisorError
from fsm_runner.presets._local_server import (
    HOST,
    JsonClient,
    JsonHandler,
    JsonServer,
    LocalServer,
    serve,
)

__all__ = ["CounterClient", "CounterServer", "CounterServerError", "main"]

#: How long a stalled hit waits before it is answered after all (the test kills first).
STALL_SECONDS = 600.0


class CounterServerError(FsmRunnerError):
    """The counter server did not answer, or answered with an error.

    Attributes:
        url: what was requested.
        status: the HTTP status, or ``None`` when there was no answer.
        detail: what went wrong, in one line.
    """

    def __init__(self, url: str, status: int | None, detail: str) -> None:
        self.url = url
        self.status = status
        self.detail = detail
        answer = "did not answer" if status is None else f"answered {status}"
        super().__init__(f"counter server {answer} to {url}: {detail}")


# -- the client --------------------------------------------------------------------------------


class CounterClient(JsonClient):
    """Calls the counter server; an :class:`~fsm_runner.presets.sandbox.ExternalStore`.

    Args:
        base_url: ``http://127.0.0.1:PORT``.
        timeout: seconds to wait for a connection and for an answer.
    """

    __slots__ = ()

    def __init__(self, base_url: str, *, timeout: float = 30.0) -> None:
        super().__init__(base_url, connect_timeout=timeout, read_timeout=timeout)

    def hit(self, key: str, by: int = 1, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Add ``by`` to ``key``'s counter (once per ``idempotency_key``, when given).

        Returns:
            ``{"key", "count", "idempotency_key", "replayed"}``.

        Raises:
            CounterServerError: no answer, or an error answer.
        """
        query = urllib.parse.urlencode({"key": key, "by": str(int(by))})
        headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        return self._request("POST", f"/hit?{query}", headers)

    def count(self, key: str) -> int:
        """Return ``key``'s counter (0 if it was never hit)."""
        return int(self._request("GET", "/count?" + urllib.parse.urlencode({"key": key}))["count"])

    def counts(self) -> dict[str, int]:
        """Return every counter."""
        counts: dict[str, int] = self._request("GET", "/count")["counts"]
        return counts

    def hits(self) -> list[dict[str, Any]]:
        """Return every hit the server has had, in order (replays included)."""
        hits: list[dict[str, Any]] = self._request("GET", "/hits")["hits"]
        return hits

    def read(self, key: str) -> int:
        """:class:`ExternalStore` ``read``: the key's counter."""
        return self.count(key)

    def mutate(self, key: str, change: Any, *, idempotency_key: str | None = None) -> Any:
        """:class:`ExternalStore` ``mutate``: a hit adding ``change`` (an integer) to ``key``.

        Raises:
            TypeError: ``change`` is not an integer.
            CounterServerError: no answer, or an error answer.
        """
        if isinstance(change, bool) or not isinstance(change, int):
            raise TypeError(f"a counter change is an integer, not {change!r}")
        return self.hit(key, change, idempotency_key=idempotency_key)

    def _unreachable(self, url: str, detail: str) -> Exception:
        return CounterServerError(url, None, detail)

    def _error_answer(self, url: str, status: int, detail: str) -> Exception:
        return CounterServerError(url, status, detail)


# -- the resource ------------------------------------------------------------------------------


class CounterServer(LocalServer):
    """The counter server process: a :class:`fsm_runner.supervisor.Resource` and a context manager.

    :meth:`start` spawns ``python tests/servers/counter_server.py`` and returns once it
    listens. The port is the one asked for, or the one the first start picked; later starts keep
    it, so clients handed out earlier stay valid.

    Args:
        state: the server's state file (counters, remembered answers, hits).
        port: the port to listen on; a free one, picked by the first start, when not given.
        stall_after_hit: passed to the server (see the module docstring).
        health_timeout: seconds one health check may take.
    """

    name = "counter-server"

    def __init__(
        self,
        *,
        state: Path,
        port: int | None = None,
        stall_after_hit: Path | None = None,
        health_timeout: float = 0.5,
    ) -> None:
        super().__init__(port=port, health_timeout=health_timeout)
        self.state = Path(state)
        self.stall_after_hit = stall_after_hit

    def __repr__(self) -> str:
        return f"CounterServer(port={self.port}, pid={self.pid})"

    def __enter__(self) -> CounterServer:
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
    def base_url(self) -> str:
        """Where the server listens: ``http://127.0.0.1:PORT``.

        Raises:
            SupervisorError: the server has not been started yet (its port is not known).
        """
        if self.port is None:
            raise SupervisorError(self.name, "not started yet; its port is not known")
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        argv = [sys.executable, str(Path(__file__).resolve())]  # a script: from any cwd
        argv += ["--state", str(self.state), "--port", str(self.port or 0)]
        if self.stall_after_hit is not None:
            argv += ["--stall-after-hit", str(self.stall_after_hit)]
        return argv

    def start(self) -> None:
        """Spawn the server (a running one is stopped first) and wait until it listens.

        Raises:
            SupervisorError: the server exited before it listened.
            OSError: the interpreter could not be spawned.
        """
        with self._lock:
            self._stop_locked()
            process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
            )
            self._process = process
            assert process.stdout is not None
            line = process.stdout.readline()  # the server prints its port once it listens
            if not line.strip().isdigit():
                self._stop_locked()
                raise SupervisorError(self.name, f"exited before it listened ({line.strip()!r})")
            self.port = int(line)

    def client(self) -> CounterClient:
        """A client for the server."""
        return CounterClient(self.base_url)


# -- the server process ------------------------------------------------------------------------


class _State:
    """The counters, the remembered answers and the hits, saved whole after every change."""

    def __init__(self, path: Path, stall_marker: Path | None) -> None:
        self.path = path
        self.stall_marker = stall_marker
        self.lock = threading.Lock()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            data = {}
        self.counts: dict[str, int] = data.get("counts", {})
        self.answers: dict[str, dict[str, Any]] = data.get("answers", {})
        self.hits: list[dict[str, Any]] = data.get("hits", [])

    def _save(self) -> None:
        data = {"counts": self.counts, "answers": self.answers, "hits": self.hits}
        temporary = self.path.with_name(self.path.name + ".tmp")
        with temporary.open("w", encoding="utf-8") as file:
            json.dump(data, file)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(self.path)

    def hit(self, key: str, by: int, idempotency_key: str | None) -> tuple[dict[str, Any], bool]:
        """Count a hit (or replay its answer); return the answer and whether to stall it."""
        with self.lock:
            earlier = None if idempotency_key is None else self.answers.get(idempotency_key)
            replayed = earlier is not None
            self.hits.append(
                {"key": key, "by": by, "idempotency_key": idempotency_key, "replayed": replayed}
            )
            if earlier is not None:
                answer = {**earlier, "replayed": True}
            else:
                self.counts[key] = self.counts.get(key, 0) + by
                answer = {
                    "key": key,
                    "count": self.counts[key],
                    "idempotency_key": idempotency_key,
                    "replayed": False,
                }
                if idempotency_key is not None:
                    self.answers[idempotency_key] = answer
            self._save()  # on disk before anyone hears of it
            stall = (
                not replayed and self.stall_marker is not None and not self.stall_marker.exists()
            )
            if stall:
                assert self.stall_marker is not None
                self.stall_marker.touch()
            return answer, stall


class _Handler(JsonHandler):
    server: _Server

    def do_GET(self) -> None:
        """``/health``, ``/count[?key=K]``, ``/hits``."""
        parts = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parts.query)
        state = self.server.state
        if parts.path == "/health":
            self._answer_health()
        elif parts.path == "/count":
            with state.lock:
                if "key" in query:
                    key = query["key"][0]
                    payload: dict[str, Any] = {"key": key, "count": state.counts.get(key, 0)}
                else:
                    payload = {"counts": dict(state.counts)}
            self._answer(http.HTTPStatus.OK, payload)
        elif parts.path == "/hits":
            with state.lock:
                payload = {"hits": list(state.hits)}
            self._answer(http.HTTPStatus.OK, payload)
        else:
            self._answer_not_found()

    def do_POST(self) -> None:
        """``/hit?key=K&by=N``, with an optional ``Idempotency-Key`` header."""
        parts = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parts.query)
        if parts.path != "/hit":
            self._answer_not_found()
            return
        if not query.get("key", [""])[0]:
            self._answer(http.HTTPStatus.BAD_REQUEST, {"error": "a hit needs a key"})
            return
        try:
            by = int(query.get("by", ["1"])[0])
        except ValueError:
            self._answer(http.HTTPStatus.BAD_REQUEST, {"error": "by must be an integer"})
            return
        answer, stall = self.server.state.hit(
            query["key"][0], by, self.headers.get("Idempotency-Key")
        )
        if stall:
            time.sleep(STALL_SECONDS)
        self._answer(http.HTTPStatus.OK, answer)


class _Server(JsonServer):
    def __init__(self, port: int, state: _State) -> None:
        self.state = state
        super().__init__(port, _Handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the counter server until it is killed (0 after Ctrl-C)."""
    parser = argparse.ArgumentParser(
        prog="python tests/servers/counter_server.py",
        description="A counter server with idempotency keys (127.0.0.1 only).",
    )
    parser.add_argument("--state", type=Path, required=True, help="the state file")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: a free one)")
    parser.add_argument(
        "--stall-after-hit",
        type=Path,
        help="stall the first counted hit while this marker does not exist (and create it)",
    )
    args = parser.parse_args(argv)
    server = _Server(args.port, _State(args.state, args.stall_after_hit))
    print(server.server_address[1], flush=True)  # the port: CounterServer.start waits for it
    return serve(server)


if __name__ == "__main__":
    sys.exit(main())
