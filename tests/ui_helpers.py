"""Shared by the run inspector's tests: a real `fsm-runner ui` server on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parents[1]
#: Debian's chromium: Playwright drives it (its own browser downloads are not possible here).
CHROMIUM = os.environ.get("FSM_RUNNER_TEST_CHROMIUM", "/usr/bin/chromium")
#: How often the servers' open pages look for news (``ui --poll-interval``; by default a
#: second): the tests that wait for a live row or a refreshed list wait a quarter of that.
POLL_INTERVAL = "0.25"
#: Where the tests leave their screenshots (ignored by git; CI prints the paths).
ARTIFACTS = ROOT / "tests" / "ui-artifacts"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Response:
    def __init__(self, status: int, headers, body: str) -> None:
        self.status = status
        self.headers = headers
        self.body = body


def fetch(url: str, *, data: bytes | None = None, method: str | None = None) -> Response:
    """One HTTP request; an error status is a response too. Redirects are not followed."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with opener.open(request, timeout=30) as answer:
            return Response(answer.status, answer.headers, answer.read().decode())
    except urllib.error.HTTPError as exc:
        with exc:
            return Response(exc.code, exc.headers, exc.read().decode())


def follow(page, selector: str) -> None:
    """Click what leads to another page and wait for that page to load.

    A click waits for neither: a read at once may see the old page or a new one not parsed yet.
    """
    with page.expect_navigation():
        page.click(selector)


def wait_for_check(server, timeout: float = 60) -> Response:
    """Start the inspector's check (its page), wait for its job to end, and read its page."""
    import json

    server.get("/check")
    deadline = time.monotonic() + timeout
    while json.loads(server.get("/check/progress").body).get("state") == "running":
        assert time.monotonic() < deadline, f"the check did not end in {timeout} s"
        time.sleep(0.05)
    return server.get("/check")


class Server:
    """`python -m fsm_runner --journal LOCATION ui --port P ...` in a process of its own."""

    def __init__(
        self, location: str, *options: str, port: int | None = None, env: dict | None = None
    ) -> None:
        """``env``: variables set for the server over this process's own."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fsm_runner", "--journal", location, "ui",
             "--port", str(self.port), "--poll-interval", POLL_INTERVAL, *options],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the ui server exited: {self.proc.communicate()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("the ui server did not start listening in 20 s")
            time.sleep(0.05)

    def get(self, path: str) -> Response:
        return fetch(self.url + path)

    def post(self, path: str, data: bytes) -> Response:
        return fetch(self.url + path, data=data, method="POST")

    def checked(self, timeout: float = 60) -> Response:
        """The check page once its background job has ended (the first visit starts it)."""
        return wait_for_check(self, timeout)

    def stop(self) -> tuple[str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.communicate()


class AppServer:
    """An inspector app served by uvicorn on a thread of this process, on a free loopback port.

    For a journal only this process can reach (a memory journal given to ``create_app``); a
    journal in a file or a database is served by :class:`Server`, a process of its own.
    """

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError("the in-process ui server did not start")
            time.sleep(0.02)

    def get(self, path: str) -> Response:
        return fetch(self.url + path)

    def post(self, path: str, data: bytes) -> Response:
        return fetch(self.url + path, data=data, method="POST")

    def stop(self) -> tuple[str, str]:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        return "", ""


@contextlib.contextmanager
def journal_location(request, backend: str, directory):
    """Where a journal of ``backend`` lives for a test: a SQLite file in ``directory``, or a
    PostgreSQL schema of the pool (given back, emptied, when the test is done with it)."""
    if backend == "sqlite":
        yield str(directory / "journal.db")
        return
    postgres = request.getfixturevalue("postgres_server")
    schema = postgres.take()
    try:
        yield f"{postgres.url}?schema={schema}"
    finally:
        postgres.give_back(schema)
