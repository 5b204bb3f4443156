"""The inspector never blocks: pages read off the event loop, and ``check`` runs in the background.

Issue 32, point 1, on SQLite and PostgreSQL. A real ``fsm-runner ui`` server over a real
journal: ``check`` of tens of thousands of runs is a job with its progress on its page, one at
a time (a second start while it runs goes on with the same job) and cancellable, and ``/runs``
answers while it runs; a page whose read is held up (a PostgreSQL table locked by another
session) is answered with an error page after ``--read-timeout`` while other pages answer
meanwhile. Nothing here measures time: what it shows is the order in which things happen;
the issue's target, every ``/runs`` answered in under 200 ms while the check runs, is measured
by ``tests/bench/bench_ui_nonblocking.py``.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass

import psycopg
import pytest

from fsm_runner import PostgresJournal
from fsm_runner.journal import open_journal
from tests.helpers import two_phase_engine
from tests.ui_helpers import Server, journal_location

#: One worker runs the module: its module fixtures (journals, a server) are built once, not
#: once on each pytest-xdist worker that would otherwise take some of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-nonblocking")]

#: Runs in each backend's journal, multiples of the fixture's batches of 5,000: enough that a
#: check outlasts a few requests by far. On SQLite, with 20,000 a check (a second here) ended,
#: on a quiet CI machine, before the cancel sent right after "running" was read (the check then
#: ran in a thread of the server, whose requests waited on the GIL it held). PostgreSQL's
#: journal is slower to fill and needs fewer: now checked in 2 processes, 20,000 runs there took
#: 1.3 s on a quiet machine, the first range of 2,000 checked at 0.5 s, and every cancel (sent
#: 5 ms after that range, or the browser's click, 0.4 s after it asked for the page) took effect
#: at the first or second range; 30,000 (15 ranges) leaves a wider margin (the browser's click is
#: tested on SQLite alone now).
RUNS = {"sqlite": 100_000, "postgres": 30_000}


@dataclass(frozen=True)
class BigJournal:
    location: str  # a SQLite path or a PostgreSQL URL with its schema
    runs: int  # started runs, all of them waiting in their first state


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def big_journal(request, tmp_path_factory):
    """A journal of ``RUNS[backend]`` started runs: its check takes a while (seconds)."""
    runs = RUNS[request.param]
    with journal_location(request, request.param, tmp_path_factory.mktemp("big")) as location:
        with open_journal(location) as journal, two_phase_engine(journal) as engine:
            for _ in range(runs // 5000):
                engine.start_many([{}] * 5000)
        yield BigJournal(location, runs)


@pytest.fixture
def server(big_journal):
    server = Server(big_journal.location)
    yield server
    _, err = server.stop()
    assert "Traceback" not in err


def progress(server: Server) -> dict:
    answer = server.get("/check/progress")
    assert answer.status == 200
    return json.loads(answer.body)


def csrf(body: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', body).group(1)


def post_check(server: Server, action: str, token: str):
    data = urllib.parse.urlencode({"csrf_token": token, "action": action}).encode()
    return server.post("/check", data)


def wait_until_ended(server: Server) -> dict:
    deadline = time.monotonic() + 120
    while (state := progress(server))["state"] == "running":
        assert time.monotonic() < deadline, "the check did not end in 120 s"
        time.sleep(0.05)
    return state


def wait_until_some_checked(server: Server) -> dict:
    """The running job's progress once it has checked some runs (its first range of them)."""
    deadline = time.monotonic() + 120
    while (state := progress(server))["state"] == "running" and not state["done"]:
        assert time.monotonic() < deadline, "the check checked no run in 120 s"
        time.sleep(0.01)
    assert state["state"] == "running", f"the check ended before its progress was read: {state}"
    return state


class TestCheckInTheBackground:
    def test_runs_answers_while_check_runs(self, server):
        assert progress(server) == {"state": None}
        page = server.get("/check")
        assert page.status == 200
        assert "checking journal" in page.body
        answered_while_running = 0
        for _ in range(5):
            before = progress(server)["state"]
            runs = server.get("/runs")
            after = progress(server)["state"]
            assert runs.status == 200
            if before == after == "running":
                answered_while_running += 1
        assert answered_while_running > 0, "the check ended before /runs was asked"
        # What the check finds once it ends: TestInBrowser (a whole check costs seconds of CPU).
        assert post_check(server, "cancel", csrf(page.body)).status == 303
        assert wait_until_ended(server)["state"] == "cancelled"

    def test_one_at_a_time_and_cancelled(self, server, big_journal):
        page = server.get("/check")
        token = csrf(page.body)
        # A second visit, and a second start while it runs, go on with the same job: its count
        # of runs checked never goes back, as a job started again would (from 0, its total not
        # known until its first range is checked, half a second or more after it starts).
        assert "checking journal" in server.get("/check").body
        before = wait_until_some_checked(server)
        assert post_check(server, "start", token).status == 303
        after = progress(server)
        assert after["state"] == "running"
        assert after["total"] == before["total"] == big_journal.runs
        assert after["done"] >= before["done"] > 0
        assert post_check(server, "cancel", token).status == 303
        assert wait_until_ended(server)["state"] == "cancelled"
        cancelled = server.get("/check")
        assert "the check was cancelled after" in cancelled.body
        assert "Check again" in cancelled.body  # started again: TestInBrowser

    def test_a_form_without_the_token_is_refused(self, server):
        assert post_check(server, "start", "wrong").status == 403
        assert progress(server) == {"state": None}


@pytest.fixture
def pg_location(postgres_server, postgres_schema):
    location = f"{postgres_server.url}?schema={postgres_schema}"
    with (
        PostgresJournal(postgres_server.url, schema=postgres_schema) as journal,
        two_phase_engine(journal) as engine,
    ):
        run_id = engine.start({})
    return location, postgres_schema, run_id


def test_a_held_up_page_is_answered_after_its_timeout_and_delays_no_other(
    postgres_server, pg_location
):
    location, schema, run_id = pg_location
    server = Server(location, "--read-timeout", "2")
    try:
        assert server.get(f"/runs/{run_id}").status == 200
        with psycopg.connect(postgres_server.url) as locker:
            locker.execute(f'LOCK TABLE "{schema}".transitions IN ACCESS EXCLUSIVE MODE')
            held: list = []
            reader = threading.Thread(target=lambda: held.append(server.get(f"/runs/{run_id}")))
            reader.start()
            # While the run page waits on the lock, the list of runs and the check's progress
            # answer: neither waits behind it.
            others = [server.get("/runs").status, server.get("/check/progress").status]
            still_held = reader.is_alive()
            reader.join(timeout=60)
            locker.rollback()
        assert others == [200, 200]
        assert still_held, "the held-up page answered before the others were asked"
        assert held[0].status == 503
        assert "The journal is slow" in held[0].body
        assert "longer than 2 s" in held[0].body
        # The lock gone, the same page answers again.
        assert server.get(f"/runs/{run_id}").status == 200
    finally:
        _, err = server.stop()
    assert "Traceback" not in err


class TestInBrowser:
    # On SQLite alone: the page's script is the same over either journal, and its whole check of
    # PostgreSQL's 30,000 runs cost ~10 s of the suite; the server's side of each page is tested
    # on both (TestCheckInTheBackground, over HTTP).
    @pytest.mark.parametrize("big_journal", ["sqlite"], indirect=True)
    def test_progress_cancel_and_check_again(self, server, big_journal, page):
        page.goto(f"{server.url}/check")
        assert page.locator("#check progress").count() == 1
        page.get_by_role("button", name="Cancel the check").click()
        page.wait_for_selector("p.summary.cancelled", timeout=60_000)
        page.get_by_role("button", name="Check again").click()
        page.wait_for_selector("p.summary.running")
        page.evaluate("window.sameDocument = true")
        # The page polls the job's progress and shows what it found once it ends, in place:
        # a reload of its own would cancel a navigation the reader has just begun.
        summary = page.wait_for_selector("p.summary.ok", timeout=120_000)
        assert summary.inner_text().endswith(f"{big_journal.runs:,} runs checked, no problems")
        assert page.evaluate("window.sameDocument") is True
