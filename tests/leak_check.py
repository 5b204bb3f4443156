"""Opens and drops journals and engines in every documented way, then says what was left open.

Run by ``tests/test_leaks.py`` in a fresh interpreter with ``-W error::ResourceWarning`` and
``-X tracemalloc=3``::

    python -W error::ResourceWarning -X tracemalloc=3 -m tests.leak_check WORKDIR [PG_URL]

The library (``SqliteJournal``, ``MemoryJournal``, ``PostgresJournal``, ``open_journal``, an
``Engine`` given a journal and one opening its own, each closed, used in ``with`` and, where it
documents a warning for it, dropped unclosed), the CLI (click's runner: the commands that open
the journal, a failed open among them) and the inspector embedded (its ASGI app called with its
lifespan, pages read, then shut down). Then the garbage collector runs, and the process's open
descriptors of the journal files are listed. Prints ``leaks: N`` and each one found; a warning
the library gives for a journal dropped on purpose is expected (and must name what to close).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from fsm_runner import MemoryJournal, SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.journal import open_journal
from tests.helpers import approval_engine, two_phase_engine


def journal_fds(folder: Path) -> list[str]:
    """This process's open descriptors of files in ``folder`` (journals, -wal, -shm)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return sorted(found)


def library(folder: Path, pg_url: str | None) -> None:
    path = folder / "lib.db"
    with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:
        engine.run(engine.start({}))
    journal = SqliteJournal(path)
    journal.runs()
    journal.close()
    with open_journal(str(path)) as journal:
        journal.runs()
    with MemoryJournal() as journal, two_phase_engine(journal) as engine:
        engine.run(engine.start({}))
    os.chdir(folder)  # an engine without a journal opens ./fsm-runner.db, and closes it
    with approval_engine() as e:
        e.run(e.start({}))
    if pg_url is not None:
        from fsm_runner import PostgresJournal

        with PostgresJournal(pg_url) as journal, two_phase_engine(journal) as engine:
            engine.run(engine.start({}))
        with open_journal(pg_url) as journal:
            journal.runs()

    async def from_a_loop() -> None:
        with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:
            run_id = await engine.astart({})
            await engine.arun(run_id)

    asyncio.run(from_a_loop())


def dropped(folder: Path) -> list[str]:
    """Journals and an engine dropped unclosed on purpose: the warnings the library gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        journal = SqliteJournal(folder / "dropped.db")
        journal.runs()
        del journal
        engine = approval_engine()
        del engine
        gc.collect()
    return [str(w.message) for w in caught]


def command_line(folder: Path) -> None:
    path = str(folder / "cli.db")
    runner = CliRunner()
    with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:
        run_id = engine.start({})
        engine.run(run_id)
        waiting = engine.start({})
    for args in (
        ["runs"], ["show", run_id], ["check"], ["replay", run_id], ["fork", run_id, "--at", "1"],
        ["abort", waiting, "--reason", "leak check"], ["export", run_id, str(folder / "export")],
        ["effects", run_id],
        ["diagram", "--run", run_id],
    ):  # fmt: skip
        result = runner.invoke(cli, ["--journal", path, *args])
        assert result.exit_code == 0, (args, result.output)
    for bad in (str(folder / "missing" / "x.db"), str(folder / "not-a-journal.txt")):
        Path(folder / "not-a-journal.txt").write_text("hello\n")
        result = runner.invoke(cli, ["--journal", bad, "runs"])
        assert result.exit_code != 0, (bad, result.output)


def inspector(folder: Path) -> None:
    from fsm_runner.ui.app import create_app

    path = str(folder / "ui.db")
    with SqliteJournal(path) as journal, two_phase_engine(journal) as engine:
        run_id = engine.start({})
        engine.run(run_id)
    app = create_app(path)

    async def serve() -> None:
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        await messages.put({"type": "lifespan.startup"})
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "lifespan.startup.complete":
                for page in ("/runs", f"/runs/{run_id}", "/machines/linear", "/check"):
                    await get(page)
                await messages.put({"type": "lifespan.shutdown"})

        async def get(page: str) -> None:
            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "GET", "scheme": "http", "path": page, "raw_path": page.encode(),
                "query_string": b"", "root_path": "", "headers": [(b"host", b"localhost")],
                "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8765),
            }  # fmt: skip

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def answer(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    assert message["status"] == 200, (page, message["status"])

            await app(scope, receive, answer)

        await app({"type": "lifespan", "asgi": {"version": "3.0"}}, messages.get, send)
        assert sent[-1]["type"] == "lifespan.shutdown.complete", sent

    asyncio.run(serve())
    check = app.state.inspector.check
    if check is not None:
        check.wait(30)


def main() -> int:
    folder = Path(sys.argv[1]).resolve()
    pg_url = sys.argv[2] if len(sys.argv) > 2 else None
    baseline = journal_fds(folder)
    library(folder, pg_url)
    expected = dropped(folder)
    command_line(folder)
    inspector(folder)
    gc.collect()
    leaks = [f"open: {target}" for target in journal_fds(folder) if target not in baseline]
    print(f"expected warnings: {len(expected)}")
    for message in expected:
        print(f"  {message}")
    print(f"leaks: {len(leaks)}")
    for leak in leaks:
        print(f"  {leak}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
