"""The helper server process: this package's ``__main__``.

:class:`~fsm_runner.presets.subphases.helper_server.HelperServer` runs it as a script (``python
DIR``, DIR this package's directory), so that the process imports only the HTTP half it is built
on (:mod:`fsm_runner.presets._local_server`), not the preset and the engine; ``python -m
fsm_runner.presets.subphases.helper_server`` runs it too. See the package for what it answers.
"""

from __future__ import annotations

import argparse
import http
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from fsm_runner.presets._local_server import JsonHandler, JsonServer, serve

__all__ = ["main"]


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


class _Handler(JsonHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        """``/health``."""
        if urllib.parse.urlsplit(self.path).path == "/health":
            self._answer_health()
        else:
            self._answer_not_found()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        """``/work/<name>?delay=S&fail=MESSAGE``."""
        parts = urllib.parse.urlsplit(self.path)
        prefix = "/work/"
        name = urllib.parse.unquote(parts.path[len(prefix) :])
        if not parts.path.startswith(prefix) or not name or " " in name:
            self._answer_not_found()
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


class _Server(JsonServer):
    def __init__(self, port: int, work_log: _WorkLog) -> None:
        self.work_log = work_log
        super().__init__(port, _Handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the helper server until it is killed.

    Returns:
        1 at once when ``--refuse-if-exists`` names an existing path; otherwise it never
        returns on its own (0 after Ctrl-C).
    """
    parser = argparse.ArgumentParser(
        prog="python -m fsm_runner.presets.subphases.helper_server",
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
    return serve(_Server(args.port, _WorkLog(args.log)))


if __name__ == "__main__":
    sys.exit(main())
