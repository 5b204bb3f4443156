"""Bulk abort of the runs the list's filters show, from the inspector (issue 32, point 4).

On a real ``fsm-runner ui --allow-actions`` server over SQLite and PostgreSQL, in Debian's
chromium: the runs list offers to abort the active runs its filters show; a confirm page says
how many and which filters, and asks why; the POST aborts each (a run a worker holds gets the
request, its holder ends it) and says what happened. Ended runs and runs the filters leave out
are not touched; without the CSRF token or without ``--allow-actions`` nothing is done.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid

import pytest

from fsm_runner import Engine, RunLifecycle
from fsm_runner.journal import open_journal
from tests.test_ui_pages import waiting_spec
from tests.ui_helpers import ARTIFACTS, Server, follow, journal_location

#: One worker runs the module: its journals and servers are made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-bulk")]

WAITING = 30


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def site(request, tmp_path_factory):
    """30 waiting runs of ``bulk`` (one held by a worker), 2 of them ended; 5 of ``other``.

    One per module: only the first test aborts, and only runs of ``bulk``.
    """
    with journal_location(request, request.param, tmp_path_factory.mktemp("bulk")) as location:
        yield from _site(location)


def _site(location):
    journal = open_journal(location)
    with Engine(waiting_spec("bulk"), handlers={}, journal=journal) as engine:
        ids = list(engine.start_many([{"n": n} for n in range(WAITING + 2)]))
        for run_id in ids[:2]:
            engine.send(run_id, "GO")  # to done: ended
    with Engine(waiting_spec("other"), handlers={}, journal=journal) as engine:
        others = engine.start_many([{}] * 5)
    held = ids[2]
    journal.claim(held, f"worker-elsewhere-{uuid.uuid4().hex[:8]}", ttl=600)
    server = Server(location, "--allow-actions")
    yield server, journal, ids, others, held
    server.stop()
    journal.close()


def test_abort_what_the_filters_show_after_a_confirm(site, page):
    server, journal, ids, others, held = site
    page.goto(f"{server.url}/runs?machine=bulk")
    follow(page, "p.bulk a")
    assert page.locator("p.bulk-count").inner_text().startswith(f"{WAITING} active runs match")
    assert page.locator("dl.bulk-filters").inner_text().split() == ["machine", "bulk"]
    backend = "postgres" if "Postgres" in type(journal).__name__ else "sqlite"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"page-bulk-abort-{backend}.png"), full_page=True)
    page.fill("form.bulk-abort input[name=reason]", "bad batch")
    follow(page, f"form.bulk-abort button >> text=Abort {WAITING} runs")
    page.screenshot(path=str(ARTIFACTS / f"page-bulk-aborted-{backend}.png"), full_page=True)
    done = page.locator("p.bulk-done").inner_text()
    assert done == (
        f"Abort asked of {WAITING} runs: {WAITING - 1} runs ended at once,"
        " 1 run held by a worker (it ends it at its next step)."
    )

    runs = {run.run_id: run for run in journal.runs(limit=100)}
    assert {runs[i].status for i in ids[:2]} == {RunLifecycle.SUCCEEDED}  # ended: untouched
    assert runs[held].status == RunLifecycle.ACTIVE
    assert runs[held].abort_reason == "bad batch"  # its holder carries it out
    aborted = [runs[i] for i in ids[3:]]
    assert {run.status for run in aborted} == {RunLifecycle.ABORTED}
    assert {runs[i].status for i in others} == {RunLifecycle.ACTIVE}  # another machine


def test_the_confirm_page_counts_no_more_than_match(site, page):
    server, _, _, others, _ = site
    page.goto(f"{server.url}/bulk-abort?machine=bulk&status=succeeded")
    assert "No active run matches these filters" in page.content()
    page.goto(f"{server.url}/bulk-abort?machine=other&q={others[0][:12]}")
    assert page.locator("p.bulk-count").inner_text().startswith("1 active run matches")


def test_without_the_token_or_actions_nothing_is_aborted(site):
    server, journal, _, others, _ = site
    form = urllib.parse.urlencode({"machine": "other", "reason": "forged"}).encode()
    refused = server.post("/bulk-abort", form)
    assert refused.status == 403
    token = re.search(r'name="csrf_token" value="([^"]+)"', refused.body).group(1)
    assert "Send it again" in refused.body  # offered to the user, never carried out
    read_only = Server(server_location(server), port=None)
    try:
        assert read_only.get("/bulk-abort?machine=other").status == 403
        sent = urllib.parse.urlencode({"machine": "other", "reason": "r", "csrf_token": token})
        assert read_only.post("/bulk-abort", sent.encode()).status == 403
    finally:
        read_only.stop()
    assert {journal.load(run_id).status for run_id in others} == {RunLifecycle.ACTIVE}


def test_the_list_by_state_sorted_by_update_and_the_machines_counts(site, page):
    """What this module's runs look like afterwards, on either journal (issue 32, points 2, 4)."""
    server, journal, ids, others, _ = site
    shown = lambda: page.locator("#runs-rows tr").evaluate_all(  # noqa: E731
        "rows => rows.map(row => row.dataset.runId)"
    )
    page.goto(f"{server.url}/runs?machine=bulk&state=done")
    assert shown() == [ids[1], ids[0]]  # the two ended runs, newest first
    assert page.locator("p.total").inner_text() == "2 runs match."
    with Engine(waiting_spec("other"), handlers={}, journal=journal) as engine:
        engine.send(others[0], "GO")  # the oldest, updated last
    page.goto(f"{server.url}/runs?machine=other")
    assert shown() == others[::-1]
    page.select_option("select[name=sort]", "updated")
    follow(page, "form.filters button[type=submit]")
    assert shown() == [others[0], *others[:0:-1]]
    page.goto(f"{server.url}/runs?machine=other&state=waiting&sort=updated")
    assert shown() == others[:0:-1]
    page.goto(f"{server.url}/machines/other")
    badges = page.locator("svg.fsm g.badge").evaluate_all(
        "badges => badges.map(b => [b.dataset.state, b.textContent])"
    )
    assert sorted(badges) == [["done", "1"], ["waiting", "4"]]


def server_location(server: Server) -> str:
    """The journal location a test server was started on (its ``--journal``)."""
    args = server.proc.args
    return args[args.index("--journal") + 1]
