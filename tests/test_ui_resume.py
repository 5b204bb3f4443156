"""Resume and Retry from a run's page, with ``fsm-runner ui --allow-actions --app`` (issue 32).

A real server over SQLite and PostgreSQL, given this module's :func:`make_engine` as its app,
in Debian's chromium: **Resume** drives a stopped run to its end in the server (the page
follows it live, then says how the drive ended); **Retry** forks a failed run at the seq
before its failure and resumes the fork, which now succeeds; a run another worker holds is
refused and the page says why. Without ``--app`` no page offers either and the POST is a 403.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import expect

from fsm_runner import Engine, MachineSpec, RunLifecycle, State, Transition
from fsm_runner.journal import open_journal
from tests.helpers import NEXT
from tests.ui_helpers import Server, journal_location

#: One worker runs the module: its journals and servers are made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-resume")]

APP = f"{__name__}:make_engine"
#: Another worker's name, its own: on PostgreSQL a lease owner's liveness is an advisory lock
#: of the database, and two modules' fake owners of one name would share it.
ELSEWHERE = f"worker-elsewhere-{uuid.uuid4().hex[:8]}"

SPEC = MachineSpec(
    "resumable",
    [
        State("fetching", handler="step"),
        State("building", handler="step"),
        State("testing", handler="flaky"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [
        Transition("fetching", NEXT, "building"),
        Transition("building", NEXT, "testing"),
        Transition("testing", NEXT, "done"),
        Transition("testing", "SYSTEM_ERROR", "failed"),
    ],
)


def _flaky(ctx):
    """Fails while the file its run's input names exists."""
    if Path(ctx.run.input["marker"]).exists():
        raise RuntimeError("the tests are flaky today")
    return NEXT


def make_engine(journal):
    """The host app the server is given (``--app tests.test_ui_resume:make_engine``)."""
    return Engine(SPEC, handlers={"step": lambda _ctx: NEXT, "flaky": _flaky}, journal=journal)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def site(request, tmp_path_factory):
    """A stopped run, a failed one (its marker then removed), one held by another worker."""
    work = tmp_path_factory.mktemp("resume")
    with journal_location(request, request.param, work) as location:
        yield from _site(work, location)


def _site(work, location):
    marker = work / "flaky"
    marker.touch()
    journal = open_journal(location)
    ids = {}
    with make_engine(journal) as engine:
        ids["stopped"] = engine.start({"marker": str(work / "never")})
        engine.run(ids["stopped"], max_steps=1)
        ids["failed"] = engine.start({"marker": str(marker)})
        engine.run(ids["failed"])
        ids["held"] = engine.start({"marker": str(work / "never")})
    journal.claim(ids["held"], ELSEWHERE, ttl=600)
    marker.unlink()  # the flake is gone: a retry passes
    server = Server(location, "--allow-actions", "--app", APP)
    yield server, journal, ids
    server.stop()
    journal.close()


def test_resume_drives_a_stopped_run_to_its_end(site, page):
    server, journal, ids = site
    assert journal.load(ids["stopped"]).state == "building"
    page.goto(f"{server.url}/runs/{ids['stopped']}")
    page.click("form.resume button")
    expect(page.locator("#run-state")).to_have_text("done", timeout=10_000)
    run = journal.load(ids["stopped"])
    assert (run.status, run.seq) == (RunLifecycle.SUCCEEDED, 3)  # STARTED, then 3 moves
    page.reload()
    expect(page.locator("p.drive")).to_have_text(
        "Resumed from this page: succeeded in state done at seq 3."
    )
    assert page.locator("form.resume").count() == 0  # ended: nothing to resume


def test_retry_forks_a_failed_run_before_its_failure_and_resumes_the_fork(site, page):
    server, journal, ids = site
    failed = journal.load(ids["failed"])
    assert (failed.status, failed.state) == (RunLifecycle.FAILED, "failed")
    page.goto(f"{server.url}/runs/{ids['failed']}")
    assert page.locator("form.resume").count() == 0
    page.click("form.retry button")
    page.wait_for_url(re.compile(r"/runs/(?!" + ids["failed"] + ")"))
    fork_id = urllib.parse.unquote(page.url.rsplit("/runs/", 1)[1])
    expect(page.locator("#run-state")).to_have_text("done", timeout=10_000)
    fork = journal.load(fork_id)
    assert fork.forked_from == f"{ids['failed']}@{failed.seq - 1}"
    assert fork.status == RunLifecycle.SUCCEEDED
    assert journal.load(ids["failed"]).status == RunLifecycle.FAILED  # the source stays


def test_a_run_another_worker_holds_is_refused_and_the_page_says_so(site, page):
    server, journal, ids = site
    page.goto(f"{server.url}/runs/{ids['held']}")
    page.click("form.resume button")
    expect(page.locator("p.drive")).to_contain_text("Resuming from this page failed: LeaseHeld")
    run = journal.load(ids["held"])
    assert (run.state, run.lease_owner) == ("fetching", ELSEWHERE)


def test_without_app_nothing_resumes(site):
    server, journal, ids = site
    args = server.proc.args
    plain = Server(args[args.index("--journal") + 1], "--allow-actions")
    try:
        body = plain.get(f"/runs/{ids['held']}").body
        assert 'class="resume"' not in body
        token = re.search(r'name="csrf_token" value="([^"]+)"', body).group(1)
        sent = urllib.parse.urlencode({"csrf_token": token}).encode()
        refused = plain.post(f"/runs/{ids['held']}/resume", sent)
    finally:
        plain.stop()
    assert refused.status == 403
    assert "Resume is off" in refused.body
    assert journal.load(ids["held"]).seq == 0
