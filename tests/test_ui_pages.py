"""What the inspector's pages say is right, and stays right while the run moves (issue 32).

The stale and wrong items operators found, each shown on a real ``fsm-runner ui`` server over a
real journal, SQLite and PostgreSQL (every test runs on both), in Debian's chromium where the
browser is what changes: the offered fork line of an ended run, short ids shared by coordinator
tasks, a long error without spaces, the live timeline's length, a run that ends while its page
is open (its lease, resume line, fork seq and abort form gone with the end), the live badge
after a server restart, a form sent after a restart, counts in words, lease times, the "forked
from" link, each transition's output and a status the runs list does not know (one line, no
list); and for everyone: a narrow screen, dark mode, labelled fields, named landmarks (the
bulk abort's confirm page and error pages too), local times and JSON as a tree.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import uuid

import pytest
from click.testing import CliRunner
from playwright.sync_api import expect

from fsm_runner import Engine, MachineSpec, PhaseResult, State, Transition
from fsm_runner.cli import cli
from fsm_runner.journal import open_journal
from fsm_runner.ui.views import STATUSES
from tests.helpers import NEXT, approval_engine, loop_spec
from tests.ui_helpers import Server, follow, journal_location

#: One worker runs the module: its module fixtures (a journal and a server a backend) are built
#: once, not once on each pytest-xdist worker that would otherwise take some of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-pages")]

LONG_WORD = "x" * 3000  # an error with no spaces: it must wrap, not widen the page

OUTPUT_SPEC = MachineSpec(
    "outputs",
    [State("measuring", handler="measure"), State("measured", terminal=True)],
    [Transition("measuring", NEXT, "measured")],
)
FAILING_SPEC = MachineSpec(
    "failing",
    [
        State("parsing", handler="parse"),
        State("parsed", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [Transition("parsing", NEXT, "parsed"), Transition("parsing", "SYSTEM_ERROR", "failed")],
)


def waiting_spec(name: str) -> MachineSpec:
    """Runs that wait for ``GO`` from their start: listed, never moving by themselves."""
    return MachineSpec(
        name,
        [State("waiting"), State("done", terminal=True)],
        [Transition("waiting", "GO", "done")],
    )


def _fail(_ctx):
    raise ValueError(LONG_WORD)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def location(request, tmp_path_factory):
    """Where the module's journal is (its ``--journal``): a SQLite file, or a PostgreSQL schema."""
    backend = request.param
    with journal_location(request, backend, tmp_path_factory.mktemp("pages")) as where:
        yield where


@pytest.fixture(scope="module")
def journal(location):
    """The module's journal, open in this process while its tests write and read it.

    On PostgreSQL a lease owner is alive while this journal's session holds its advisory
    lock: the owners its tests claim leases for are named uniquely (:func:`owner`).
    """
    opened = open_journal(location)
    yield opened
    opened.close()


def owner(name: str) -> str:
    """A lease owner no other test module (on PostgreSQL: no other session) shares."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ids(journal):
    """The runs the tests read: ended, waiting, sharing a prefix, failed long, with an output."""
    found = {}
    with approval_engine(journal) as engine:
        found["ended"] = engine.start({})
        engine.run(found["ended"])
        engine.send(found["ended"], "APPROVED")
        engine.run(found["ended"])
        for task in ("1:hello", "2:world"):  # a session's tasks: their first 12 alike
            run_id = engine.start({}, run_id=f"SESSION-0123:{task}")
            engine.run(run_id)
            found[task] = run_id
        found["forked"] = engine.fork(found["ended"], at_seq=1).run_id
    with Engine(waiting_spec("many"), handlers={}, journal=journal) as many:
        found["many"] = many.start_many([{"n": n} for n in range(120)])  # 3 pages
    with Engine(FAILING_SPEC, handlers={"parse": _fail}, journal=journal) as engine:
        found["failed"] = engine.start({})
        engine.run(found["failed"])
    measure = {"measure": lambda _: PhaseResult(NEXT, output={"tokens": 1234, "ok": True})}
    with Engine(OUTPUT_SPEC, handlers=measure, journal=journal) as engine:
        found["output"] = engine.start({"order": {"id": 42, "lines": [1, 2, 3]}})
        engine.run(found["output"])
    return found


@pytest.fixture(scope="module")
def server(location, ids):
    server = Server(location, "--allow-actions")
    yield server
    _, err = server.stop()
    assert "Traceback" not in err


def run_cli(location: str, line: str):
    """A command line the page offers, run as pasted (``fsm-runner --journal J ...``).

    The line names the journal the server reads, as given to it: run elsewhere, it finds it.
    """
    args = shlex.split(line)
    assert args[:3] == ["fsm-runner", "--journal", location]
    return CliRunner().invoke(cli, args[1:], catch_exceptions=False)


class TestCommands:
    def test_an_ended_runs_fork_line_works_as_offered(self, server, page, ids, journal, location):
        last = journal.load(ids["ended"]).seq
        page.goto(f"{server.url}/runs/{ids['ended']}")
        line = page.locator("#cmd-fork").inner_text()
        assert line.endswith(f" --at {last - 1}")  # at its last seq, the fork would be ended
        assert page.locator("form.fork input[name=at]").input_value() == str(last - 1)
        assert run_cli(location, line.replace(f"--at {last - 1}", f"--at {last}")).exit_code
        result = run_cli(location, line)
        assert result.exit_code == 0, result.output

    def test_tasks_sharing_their_sessions_prefix_get_ids_that_name_them_alone(
        self, server, page, ids, location
    ):
        page.goto(f"{server.url}/runs?q=SESSION-0123")
        shown = sorted(page.locator("table.runs td.id a").all_inner_texts())
        assert shown == ["SESSION-0123:1:hello", "SESSION-0123:2:world"]  # 20 characters
        page.goto(f"{server.url}/runs/{ids['1:hello']}")
        line = page.locator("#cmd-fork").inner_text()
        result = run_cli(location, line)
        assert result.exit_code == 0, result.output


class TestLayout:
    def test_a_long_error_without_spaces_wraps(self, server, page, ids):
        for path in (f"/runs/{ids['failed']}", "/runs"):
            page.goto(server.url + path)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 1280, (path, width)

    def test_counts_in_words_lease_times_and_the_forked_from_link(self, server, page, ids, journal):
        page.goto(f"{server.url}/machines/failing")
        assert page.locator("main p").first.inner_text().startswith("1 run;")
        someone = owner("someone")
        token = journal.claim(ids["forked"], someone, ttl=3600).lease_token
        try:
            page.goto(f"{server.url}/runs/{ids['forked']}")
            lease = page.locator("dt:text-is('lease') + dd time").get_attribute("title")
            assert dt.datetime.strptime(lease, "%Y-%m-%d %H:%M:%S UTC")  # no +00:00, no µs
            page.locator("dt:text-is('forked from') + dd a").click()
            page.wait_for_url(lambda url: f"/runs/{ids['ended']}?from=1" in url, timeout=5000)
            assert "forked from" not in page.locator("section.summary").inner_text()
        finally:
            journal.release(ids["forked"], someone, token)

    def test_each_transitions_output_is_shown(self, server, page, ids):
        page.goto(f"{server.url}/runs/{ids['output']}")
        output = page.locator("#timeline-rows tr[data-seq='1'] td.output").inner_text()
        assert json.loads(output) == {"tokens": 1234, "ok": True}


class TestLive:
    def test_a_run_that_ends_while_its_page_is_open(self, server, page, journal):
        """Held by a worker that is gone, taken over and ended: the page drops what ended."""
        with approval_engine(journal) as engine:
            run_id = engine.start({})
            engine.run(run_id)  # waits for approval
            gone = owner("worker-elsewhere")
            journal.claim(run_id, gone, ttl=600)  # its worker took it, then died
            page.goto(f"{server.url}/runs/{run_id}")
            page.evaluate("window.notReloaded = true")
            assert gone in page.locator("dt:text-is('lease') + dd").inner_text()
            assert page.locator("form.abort").count() == 1
            assert page.locator("#cmd-resume").count() == 1
            journal.claim(run_id, engine.worker_id, ttl=60, take_over=gone)
            engine.send(run_id, "APPROVED")
            engine.run(run_id)
            ended = journal.load(run_id)
        assert ended.lease_owner is None
        page.wait_for_selector("#run-status.succeeded", timeout=5000)
        assert page.locator("dt:text-is('lease')").count() == 0
        assert gone not in page.locator("section.summary").inner_text()
        assert page.locator("form.abort").count() == 0
        assert page.locator("#cmd-resume").count() == 0
        assert page.locator("#cmd-fork").inner_text().endswith(f" --at {ended.seq - 1}")
        assert page.locator("form.fork input[name=at]").input_value() == str(ended.seq - 1)
        assert page.locator("#live-badge").is_hidden()
        assert page.evaluate("window.notReloaded") is True

    def test_the_live_timeline_keeps_one_page(self, server, page, journal):
        with Engine(loop_spec(), handlers={"noop": lambda _: NEXT}, journal=journal) as engine:
            run_id = engine.start({})
            page.goto(f"{server.url}/runs/{run_id}")
            for _ in range(3):  # three bursts, polled in between: rows pile up, then go
                engine.run(run_id, max_steps=150)
                seq = journal.load(run_id).seq
                page.wait_for_selector(f"#timeline-rows tr[data-seq='{seq}']", timeout=5000)
        shown = page.locator("#timeline-rows tr").count()
        assert shown <= 200
        assert page.locator("nav.pages a.earlier").count() == 1

    def test_the_live_badge_comes_back_after_a_restart(self, location, journal, page):
        with approval_engine(journal) as engine:
            run_id = engine.start({})
        first = Server(location)
        page.goto(f"{first.url}/runs/{run_id}")
        first.stop()
        page.wait_for_selector("#live-badge >> text=live (retrying)", timeout=5000)
        again = Server(location, port=first.port)
        try:
            expect(page.locator("#live-badge")).to_have_text("live", timeout=5000)
        finally:
            again.stop()


def test_a_form_sent_after_a_restart_is_offered_again_with_what_was_typed(location, journal, page):
    with approval_engine(journal) as engine:
        run_id = engine.start({})
    first = Server(location, "--allow-actions")
    page.goto(f"{first.url}/runs/{run_id}")
    first.stop()
    again = Server(location, "--allow-actions", port=first.port)  # a new CSRF secret
    try:
        page.fill("form.abort input[name=reason]", "typed before the restart")
        follow(page, "form.abort button")
        assert page.locator("h1").inner_text() == "Refused"
        assert "typed before the restart" in page.locator("form.resend").inner_text()
        assert journal.load(run_id).status.value == "active"  # nothing was done
        page.click("form.resend button")
        page.wait_for_selector("#run-status.aborted", timeout=5000)
        assert "typed before the restart" in page.locator("section.summary").inner_text()
    finally:
        again.stop()


#: What a form field's accessible name comes from, and which landmarks lack one (in the page).
UNLABELLED = """() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
    .filter(el => !el.labels.length && !el.getAttribute('aria-label')
                  && !el.getAttribute('aria-labelledby'))
    .map(el => el.outerHTML)"""
UNNAMED = """() => [...document.querySelectorAll('nav, section, form[role=search], aside')]
    .filter(el => !el.getAttribute('aria-label') && !el.getAttribute('aria-labelledby'))
    .map(el => el.outerHTML.slice(0, 80))"""
#: An unknown run whose id, a long word, the 404 page names.
NO_SUCH_RUN = "y" * 300


class TestForEveryone:
    def pages(self, ids):
        """The pages looked at, with the bulk abort's confirm page (the module's server takes
        actions) and two error pages: a refused filter, and a long unknown run id."""
        return ["/runs", f"/runs/{ids['failed']}", f"/runs/{ids['output']}", "/machines/failing",
                "/check", "/runs?waiting=1", "/bulk-abort?machine=many", "/runs?status=bogus",
                f"/runs/{NO_SUCH_RUN}"]  # fmt: skip

    def test_the_pages_looked_at_are_what_they_say(self, server, page, ids):
        """The confirm page and the error pages of :meth:`pages` are those pages, not others."""
        page.goto(f"{server.url}/bulk-abort?machine=many")
        assert page.locator("p.bulk-count").inner_text().startswith("120 active runs match")
        assert page.locator("form.bulk-abort input[name=reason]").count() == 1
        for path, status in (("/runs?status=bogus", 400), (f"/runs/{NO_SUCH_RUN}", 404)):
            assert page.goto(server.url + path).status == status
            assert page.locator("section.error-page").count() == 1
        assert NO_SUCH_RUN in page.locator("p.detail").inner_text()  # a long word to wrap

    def test_a_narrow_screen_never_scrolls_sideways(self, server, page, ids):
        wide = page.viewport_size
        page.set_viewport_size({"width": 400, "height": 800})
        try:
            for path in self.pages(ids):
                page.goto(server.url + path)
                width = page.evaluate("document.documentElement.scrollWidth")
                assert width <= 400, (path, width)
        finally:
            page.set_viewport_size(wide)

    def test_dark_mode_follows_the_system(self, server, page, ids):
        page.emulate_media(color_scheme="dark")
        try:
            page.goto(f"{server.url}/runs/{ids['output']}")
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert background == "rgb(13, 17, 23)"
        finally:
            page.emulate_media(color_scheme="light")

    def test_every_field_labelled_and_every_landmark_named(self, server, journal, page, ids):
        with approval_engine(journal) as engine:
            waiting = engine.start({})
            engine.run(waiting)
        for path in [*self.pages(ids), f"/runs/{waiting}"]:
            page.goto(server.url + path)
            assert page.evaluate(UNLABELLED) == [], path
            assert page.evaluate(UNNAMED) == [], path

    def test_times_in_the_readers_zone_with_utc_on_hover(self, server, browser, ids):
        context = browser.new_context(timezone_id="Asia/Tokyo")  # UTC+9, no summer time
        page = context.new_page()
        try:
            page.goto(f"{server.url}/runs/{ids['output']}")
            started = page.locator(".summary time").first
            utc = dt.datetime.strptime(started.get_attribute("title"), "%Y-%m-%d %H:%M:%S UTC")
            local, _, rest = started.inner_text().partition(" (")
            assert dt.datetime.strptime(local, "%Y-%m-%d %H:%M:%S") == utc + dt.timedelta(hours=9)
            assert rest.endswith("ago)")
        finally:
            context.close()

    def test_json_as_a_tree_with_copy(self, server, page, ids):
        page.goto(f"{server.url}/runs/{ids['output']}")
        page.click("details.payload > summary >> text=input")
        tree = page.locator("details.payload .json-tree").first
        assert tree.is_visible()
        text = tree.inner_text()
        assert '"order": { 2 items }' in text
        assert '"id": 42' in text
        assert page.locator("button.copy[data-copy=run-input]").count() == 1
        raw = page.locator("#run-input").text_content()
        assert json.loads(raw) == {"order": {"id": 42, "lines": [1, 2, 3]}}


class TestRunsList:
    def test_pages_older_and_newer(self, server, page, ids):
        newest_first = ids["many"][::-1]
        page.goto(f"{server.url}/runs?machine=many")
        shown = lambda: page.locator("#runs-rows tr").evaluate_all(  # noqa: E731
            "rows => rows.map(row => row.dataset.runId)"
        )
        assert shown() == newest_first[:50]
        assert page.locator("a.newer").count() == 0
        follow(page, "a.older")
        assert shown() == newest_first[50:100]
        follow(page, "a.older")
        assert shown() == newest_first[100:]
        assert page.locator("a.older").count() == 0
        follow(page, "a.newer")
        assert shown() == newest_first[50:100]
        follow(page, "a.newer")
        assert shown() == newest_first[:50]
        assert page.locator("a.newer").count() == 0

    def test_the_newest_page_shows_new_runs_as_they_start(self, server, page, journal):
        with Engine(waiting_spec("fresh"), handlers={}, journal=journal) as engine:
            first = engine.start({})
            page.goto(f"{server.url}/runs?machine=fresh")
            assert page.locator("#runs-rows tr").count() == 1
            second = engine.start({})
        page.wait_for_selector(f"#runs-rows tr[data-run-id='{second}']", timeout=10_000)
        rows = page.locator("#runs-rows tr").evaluate_all("rows => rows.map(r => r.dataset.runId)")
        assert rows == [second, first]

    def test_search_by_input_days_and_the_total(self, server, page, ids, journal, location):
        """Search box, start days and "N runs match", filled in as an operator would."""
        page.goto(f"{server.url}/runs")
        page.fill("input[name=where]", "input.order.id = 42")
        follow(page, "form.filters button[type=submit]")
        rows = page.locator("#runs-rows tr").evaluate_all("rows => rows.map(r => r.dataset.runId)")
        assert rows == [ids["output"]]
        assert page.locator("p.total").inner_text() == "1 run matches."
        assert page.locator("input[name=where]").input_value() == "input.order.id = 42"
        # No search index serves it: the page says so, and how to add one; then it is served.
        assert "fsm-runner index add input.order.id" in page.locator("#unindexed").inner_text()
        journal.search_indexes.add("input.order.id")
        page.reload()
        assert page.locator("#unindexed").count() == 0
        assert page.locator("p.total").inner_text() == "1 run matches."

        page.goto(f"{server.url}/runs?machine=many&where=input.n+%3D+7")  # n is a number
        assert page.locator("#runs-rows tr").count() == 1
        page.goto(f"{server.url}/runs?machine=many&where=input.n+%3D+%227%22")  # "7": a string
        assert page.locator("p.empty").inner_text() == "No runs match."

        today = dt.datetime.now(dt.timezone.utc).date()
        page.goto(f"{server.url}/runs?machine=many")
        assert page.locator("p.total").inner_text() == "120 runs match."
        page.fill("input[name=since]", today.isoformat())
        page.fill("input[name=until]", today.isoformat())
        follow(page, "form.filters button[type=submit]")
        assert page.locator("p.total").inner_text() == "120 runs match."
        if location.startswith("postgresql://"):  # its runs' created_at index serves days
            assert page.locator("#unindexed").count() == 0
        else:  # SQLite's runs have none until it is added
            assert "index add created_at" in page.locator("#unindexed").inner_text()
        yesterday = (today - dt.timedelta(days=1)).isoformat()
        page.goto(f"{server.url}/runs?machine=many&until={yesterday}")
        assert page.locator("p.total").inner_text() == "0 runs match."

    def test_sorted_by_last_update_page_after_page(self, server, page, journal):
        with Engine(waiting_spec("sorted"), handlers={}, journal=journal) as engine:
            started = engine.start_many([{"n": n} for n in range(60)])
            engine.abort(started[0], reason="the oldest, updated last")
        shown = lambda: page.locator("#runs-rows tr").evaluate_all(  # noqa: E731
            "rows => rows.map(row => row.dataset.runId)"
        )
        page.goto(f"{server.url}/runs?machine=sorted")
        assert shown()[0] == started[-1]  # newest started first
        page.select_option("select[name=sort]", "updated")
        follow(page, "form.filters button[type=submit]")
        by_update = [started[0], *started[:0:-1]]
        assert shown() == by_update[:50]
        assert page.locator("select[name=sort]").input_value() == "updated"
        follow(page, "a.older")
        assert shown() == by_update[50:]
        follow(page, "a.newer")
        assert shown() == by_update[:50]
        assert page.locator("#unsorted").count() == 0

    def test_a_search_the_box_does_not_take_is_one_line(self, server, page):
        for query, said in (
            ("where=order.id+%3D+42", "search as input.KEY = VALUE"),
            ("where=input.a+%3D+%5B1%5D", "compares a string, a number"),
            ("since=yesterday", "since must be a day as YYYY-MM-DD"),
        ):
            response = page.goto(f"{server.url}/runs?{query}")
            assert response.status == 400
            assert said in page.locator("p.detail").inner_text()

    def test_a_status_the_list_does_not_know_is_one_line(self, server, page, ids):
        """``?status=bogus`` is refused (400) in one line, not taken for no filter at all."""
        response = page.goto(f"{server.url}/runs?status=bogus")
        assert response.status == 400
        assert page.locator("h1").inner_text() == "Bad request"
        detail = page.locator("p.detail").inner_text()
        assert detail == f"status must be one of {', '.join(STATUSES)}"
        assert page.locator("#runs-rows tr, table.runs").count() == 0  # no run listed
        assert ids["output"] not in page.content()
