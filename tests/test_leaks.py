"""Nothing the library opens is left open: journals, engines, the CLI and the inspector (issue 34).

``tests/leak_check.py`` runs in a fresh interpreter with ``-W error::ResourceWarning`` and
``tracemalloc`` on (on Python 3.13, sqlite3 itself warns of a connection collected unclosed),
opening and dropping journals and engines in every documented way; and a real
``fsm-runner ui`` server runs with the same settings, answers pages and is stopped. Neither may
print a ResourceWarning (a finalizer's warning is printed, not raised: the output says it), and
no descriptor of a journal file may stay open. The warnings the library gives on purpose, for
a journal or engine dropped unclosed, must name what to close.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fsm_runner import SqliteJournal
from tests.helpers import two_phase_engine
from tests.ui_helpers import ROOT, Server

pytestmark = [pytest.mark.slow, pytest.mark.every_python]

STRICT = ["-W", "error::ResourceWarning", "-X", "tracemalloc=3"]


def clean(stderr: str) -> bool:
    return "ResourceWarning" not in stderr and "Exception ignored" not in stderr


def test_library_cli_and_embedded_inspector(tmp_path, postgres_server, postgres_schema):
    url = f"{postgres_server.url}?schema={postgres_schema}"
    result = subprocess.run(
        [sys.executable, *STRICT, "-m", "tests.leak_check", str(tmp_path), url],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert clean(result.stderr), result.stderr
    assert "leaks: 0" in result.stdout, result.stdout
    expected = [line.strip() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert len(expected) == 2, result.stdout  # the journal and the engine dropped on purpose
    assert all("close" in message for message in expected), expected


def test_the_inspector_server(tmp_path):
    path = tmp_path / "journal.db"
    with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:
        run_id = engine.start({})
        engine.run(run_id)
    os.environ["PYTHONWARNINGS"], before = (
        "error::ResourceWarning",
        os.environ.get("PYTHONWARNINGS"),
    )
    os.environ["PYTHONTRACEMALLOC"] = "3"
    try:
        server = Server(str(path))
    finally:
        del os.environ["PYTHONTRACEMALLOC"]
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before
    try:
        for page in ("/runs", f"/runs/{run_id}", "/machines/linear", "/check", "/nope"):
            server.get(page)
    finally:
        _, err = server.stop()
    assert server.proc.returncode == 0, err
    assert clean(err), err
