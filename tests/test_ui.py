"""Acceptance: the run inspector in a real browser, over journals made by real runs.

A real `fsm-runner ui` server on a free port on 127.0.0.1, driven by Playwright through
Debian's chromium, on a SQLite and on a PostgreSQL journal. The journals hold the demo's agent
loop, a coordinator session with its child runs, the sub-phases preset whose helper server was
killed and restarted, a run that failed with ``<script>`` in its error, and a waiting run; both
are built at once, in two processes, when the first test needs one (see ``ui_journals.py``).
The assertions are on what a person sees: table rows, the timeline, the highlighted state in the
diagram, the iteration totals, the escaped ``<script>``, a live transition appearing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from fsm_runner.journal import open_journal
from tests.test_ui_diagram import MEASURE, problems
from tests.ui_helpers import ARTIFACTS, ROOT, Server
from tests.ui_journals import SCRIPT

pytestmark = pytest.mark.slow  # one worker runs it: conftest's PROCESS_MODULES


@pytest.fixture(scope="session")
def ui_builds(request, tmp_path_factory):
    """Start building both journals at once, each in a process of its own.

    Without PostgreSQL (FSM_RUNNER_TEST_POSTGRES=skip) only the SQLite one, and the PostgreSQL
    tests skip.
    """
    locations = {"sqlite": str(tmp_path_factory.mktemp("ui-sqlite") / "journal.db")}
    postgres_server = schema = None
    try:
        postgres_server = request.getfixturevalue("postgres_server")
    except pytest.skip.Exception:
        pass
    else:
        schema = postgres_server.new_schema()
        locations["postgres"] = f"{postgres_server.url}?schema={schema}"
    builds = {}
    for backend, location in locations.items():
        workdir = tmp_path_factory.mktemp(f"ui-work-{backend}")
        builds[backend] = (
            location,
            subprocess.Popen(
                [sys.executable, "-m", "tests.ui_journals", location, str(workdir)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    yield builds
    for _, proc in builds.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    if postgres_server is not None:
        postgres_server.drop(schema)


class Site:
    """A journal of real runs, and the inspector serving it."""

    def __init__(self, backend: str, location: str, ids: dict[str, str]) -> None:
        self.backend = backend
        self.location = location
        self.ids = ids
        self.server = Server(location)
        self.url = self.server.url

    def journal(self):
        return open_journal(self.location, create=False)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def site(request, ui_builds):
    if request.param not in ui_builds:
        pytest.skip("PostgreSQL is unreachable and FSM_RUNNER_TEST_POSTGRES=skip")
    location, proc = ui_builds[request.param]
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"building the {request.param} journal failed:\n{err}"
    site = Site(request.param, location, json.loads(out.splitlines()[-1]))
    yield site
    site.server.stop()


#: The text of each element matching a selector that the browser laid out on more than one line.
CUT_IN_TWO = """(selector) => [...document.querySelectorAll(selector)].filter((element) => {
    const range = document.createRange();
    range.selectNodeContents(element);
    return new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size > 1;
}).map((element) => element.textContent)"""


def rows(page, selector: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in row.locator("td").all_inner_texts()]
        for row in page.locator(selector).all()
    ]


class TestRunsPage:
    """The runs table: every run, newest first, filters, prefix search, parents."""

    def test_lists_every_run_newest_first(self, site, page):
        page.goto(f"{site.url}/runs")
        shown = [row.get_attribute("data-run-id") for row in page.locator("tr.run").all()]
        with site.journal() as journal:
            assert shown == [run.run_id for run in journal.runs()]
        assert len(shown) == 9  # agent loop, session + 3 tasks, sub-phases, effects, 2 xss
        first = rows(page, "tr.run")[0]
        assert first[:4] == [site.ids["waiting"][:12], "xss", "parsing", "active"]

    def test_filters_and_prefix_search(self, site, page):
        page.goto(f"{site.url}/runs")
        page.fill("input[name=machine]", "xss")
        page.select_option("select[name=status]", "failed")
        page.click("form.filters button")
        page.wait_for_url(lambda url: "status=failed" in url)
        assert [r[:4] for r in rows(page, "tr.run")] == [
            [site.ids["failed"][:12], "xss", "failed", "failed"]
        ]
        page.goto(f"{site.url}/runs?q={site.ids['agent_loop'][:6]}")
        assert [r[1] for r in rows(page, "tr.run")] == ["agent-loop"]
        page.goto(f"{site.url}/runs?parent={site.ids['session']}")
        children = rows(page, "tr.run")
        assert len(children) == 3
        assert {r[1] for r in children} == {"coordinator-task"}

    def test_statuses_states_and_machines_are_never_cut_in_two(self, site, page):
        page.goto(f"{site.url}/runs")
        cut = page.evaluate(CUT_IN_TWO, "table.runs span.status, table.runs td.state, td.machine")
        assert cut == []
        assert page.locator("table.runs span.status").count() >= 9

    def test_the_machine_link_shows_counts_per_state(self, site, page):
        page.goto(f"{site.url}/runs?machine=xss")
        page.click("tr.run >> nth=0 >> td:nth-child(2) a")
        page.wait_for_url("**/machines/xss")
        assert page.locator("h1").inner_text() == "Machine xss"
        counts = {
            row.get_attribute("data-state"): row.locator("td.total").inner_text()
            for row in page.locator("table.counts tbody tr").all()
        }
        assert counts == {"parsing": "1", "parsed": "0", "failed": "1", "canceled": "0"}
        badges = page.locator("svg.fsm g.badge")
        assert sorted(b.get_attribute("data-state") for b in badges.all()) == ["failed", "parsing"]
        drawn = page.evaluate(MEASURE)
        assert (drawn["layout"], problems(drawn)) == ("graphviz", [])


class TestRunPage:
    """A run: summary, timeline, diagram with its path, iterations, children, artifacts."""

    def test_agent_loop_run(self, site, page):
        run_id = site.ids["agent_loop"]
        page.goto(f"{site.url}/runs/{run_id[:8]}")  # a prefix: redirected to the full id
        assert page.url.endswith(f"/runs/{run_id}")
        assert page.locator("#run-state").inner_text() == "succeeded"
        events = [r[3] for r in rows(page, "#timeline-rows tr")]
        assert events == [
            "STARTED", "RUN_ACCEPTED", "BUILD_SUCCEEDED", "SNAPSHOT_TAKEN",
            "VERIFY_FAILED_RETRYABLE", "FEEDBACK_READY", "BUILD_SUCCEEDED", "SNAPSHOT_TAKEN",
            "VERIFY_PASSED",
        ]  # fmt: skip
        failed_check = page.locator("#timeline-rows tr[data-seq='4'] td.error").inner_text()
        assert "level L1 failed" in failed_check
        durations = [float(r[5]) for r in rows(page, "#timeline-rows tr")]
        assert durations[4] > 0  # verification ran pytest: it took time

        svg = page.locator("#diagram svg.fsm")
        assert svg.locator("g.node.current").get_attribute("data-state") == "succeeded"
        visited = {n.get_attribute("data-state") for n in svg.locator("g.node.visited").all()}
        assert visited == {"queued", "building", "snapshotting", "verifying", "feedback",
                           "succeeded"}  # fmt: skip
        loop = svg.locator("g.edge.traversed[data-event='FEEDBACK_READY'] text").text_content()
        assert loop.endswith("×1")  # noqa: RUF001 - the diagram's own multiplication sign
        drawn = page.evaluate(MEASURE)
        assert (drawn["layout"], problems(drawn)) == ("graphviz", [])

        with site.journal() as journal:
            iterations = journal.iterations(run_id)
        assert len(rows(page, "table.iterations tbody tr")) == 2
        tokens = sum(i.tokens_total for i in iterations)
        cost = sum(i.cost_usd for i in iterations)
        assert page.locator("td.tokens-total").inner_text() == str(tokens)
        assert page.locator("td.cost-total").inner_text() == f"{cost:.4f}"

        # Its seq, time, states, event, ms and attempt each on one line (the table scrolls).
        cells = "table.timeline td:nth-child(-n+7), td.num, table.iterations td.state"
        assert page.evaluate(CUT_IN_TWO, cells) == []

        fork = page.locator("#cmd-fork").inner_text()
        assert fork.endswith(f"fork {run_id[:12]} --at 7")  # an ended run's last seq but one
        with page.expect_download() as download:
            page.click("a.download >> text=agent-1")
        saved = json.loads(download.value.path().read_text())
        assert saved["model"] == "scripted-demo"

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / f"run-{site.backend}.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the run page: {shot}")

    def test_html_in_run_data_is_escaped(self, site, page):
        page.goto(f"{site.url}/runs/{site.ids['failed']}")
        assert page.locator(".run-error").inner_text() == f"ValueError: cannot parse {SCRIPT}"
        error = page.locator("#timeline-rows tr[data-seq='1'] .message").inner_text()
        assert error == f"ValueError: cannot parse {SCRIPT}"
        page.click("summary >> text=input")
        assert SCRIPT in page.locator("pre.input").inner_text()
        assert page.locator("script").count() == 1  # the inspector's own, nothing injected
        traceback = page.locator("details.traceback pre")
        assert not traceback.is_visible()  # collapsed until asked for
        page.click("details.traceback summary")
        assert traceback.is_visible()
        assert "Traceback (most recent call last)" in traceback.inner_text()
        assert page.locator("svg.fsm g.node.failed").get_attribute("data-state") == "parsing"

    def test_session_with_child_runs(self, site, page):
        session = site.ids["session"]
        page.goto(f"{site.url}/runs/{session}")
        children = page.locator("section.children li.child")
        assert sorted(c.get_attribute("data-run-id") for c in children.all()) == [
            f"{session}:1:{task}" for task in "abc"
        ]
        page.click(f"li.child a >> text={session}:1:b")
        page.wait_for_url(lambda url: url.endswith("%3A1%3Ab") or url.endswith(":1:b"))
        assert page.locator("h1 .id").inner_text() == f"{session}:1:b"
        assert page.locator("svg.fsm g.node.current").get_attribute("data-state") == "done"
        page.click(f"dd a >> text={session}")  # back to the parent
        page.wait_for_url(f"**/runs/{session}")
        assert page.locator("h1 .id").inner_text() == session

    def test_sub_phases_through_a_server_restart(self, site, page):
        page.goto(f"{site.url}/runs/{site.ids['subphases']}")
        table = {r[0]: r for r in rows(page, "table.subphases tbody tr")}
        assert table["1b"][2:4] == ["2", "1"]  # two attempts, one server restart
        assert table["1a"][2:4] == ["1", "0"]
        events = [r[3] for r in rows(page, "#timeline-rows tr")]
        assert events.count("SERVER_UNREACHABLE") == 1
        assert events.count("SERVER_RECOVERED") == 1
        svg = page.locator("svg.fsm")
        assert svg.locator("g.composite[data-state='analysis']").count() == 1
        assert svg.locator("g.node.current").get_attribute("data-state") == "done"
        assert svg.locator("g.node.visited[data-state='recovering']").count() == 1

    def test_effects_caught_in_flight_are_highlighted(self, site, page):
        page.goto(f"{site.url}/runs/{site.ids['effects']}")
        assert page.locator("section h2 .warn").inner_text() == "1 in flight"
        effects = {r[0]: r[4] for r in rows(page, "table.effects tbody tr")}
        assert effects == {"notify": "done", "upload": "in_flight"}
        highlighted = page.locator("tr.effect.in_flight td").first
        assert highlighted.evaluate("cell => getComputedStyle(cell).backgroundColor") == (
            "rgb(255, 248, 197)"
        )
        resume = page.locator("#cmd-resume").inner_text()
        assert resume.endswith(f"resume {site.ids['effects'][:12]} --app MODULE:ATTR")

    def test_check_page(self, site, page):
        page.goto(f"{site.url}/check")
        # The check runs in the background; the page shows what it found once it ends.
        summary = page.wait_for_selector("p.summary.ok", timeout=30_000)
        assert summary.inner_text().endswith("runs checked, no problems")

    def test_unknown_run_is_a_404_page(self, site, page):
        answer = page.goto(f"{site.url}/runs/no-such-run")
        assert answer.status == 404
        assert page.locator("h1").inner_text() == "No such run"


#: Every page of the inspector a person reads, and what shows it was drawn: (name, path, selector).
PAGES = (
    ("runs", "/runs", "table.runs"),
    ("runs-filtered", "/runs?machine=xss&status=active", "table.runs"),
    ("runs-waiting", "/runs?waiting=1", "nav.tabs a.waiting-tab.current"),
    ("machine", "/machines/xss", "table.counts"),
    ("run-agent-loop", "/runs/{agent_loop}", "#diagram svg.fsm"),
    ("run-session", "/runs/{session}", "#diagram svg.fsm"),
    ("run-subphases", "/runs/{subphases}", "#diagram svg.fsm"),
    ("run-effects", "/runs/{effects}", "#diagram svg.fsm"),
    ("run-failed", "/runs/{failed}", ".run-error"),
    ("run-waiting", "/runs/{waiting}", "#diagram svg.fsm"),
    ("check", "/check", "p.summary.ok"),
    ("not-found", "/runs/no-such-run", "h1"),
)


class TestScreenshots:
    """A screenshot of every page, on each journal, left where CI lists them."""

    def test_every_page_is_drawn_and_saved(self, site, page):
        ARTIFACTS.mkdir(exist_ok=True)
        saved = []
        for name, path, drawn in PAGES:
            page.goto(site.url + path.format(**site.ids))
            page.wait_for_selector(drawn, timeout=30_000)
            shot = ARTIFACTS / f"page-{name}-{site.backend}.png"
            shot.unlink(missing_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            saved.append(shot)
        for shot in saved:  # a PNG of a page, not an empty or cut file
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot
            assert shot.stat().st_size > 5_000, shot
        print("\nscreenshots:", *saved, sep="\n  ")


class TestLive:
    """An active run's page shows each transition within 2 s, without a reload, then stops."""

    def test_transitions_appear_live_then_polling_stops(self, site, page, tmp_path):
        runner = subprocess.Popen(
            [sys.executable, "-m", "fsm_runner.presets.subphases", "--journal", site.location,
             "--workdir", str(tmp_path), "start", "--delay", "0.4"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            run_id = runner.stdout.readline().strip()
            polls: list[float] = []
            page.on("request", lambda r: "/live" in r.url and polls.append(time.monotonic()))
            page.goto(f"{site.url}/runs/{run_id}")
            page.evaluate("window.notReloaded = true")
            with site.journal() as journal:
                seen = loaded = journal.load(run_id).seq
                while not journal.load(run_id).ended:
                    seq = journal.load(run_id).seq
                    for new in range(seen + 1, seq + 1):  # journaled: on the page within 2 s
                        page.wait_for_selector(f"#timeline-rows tr[data-seq='{new}']", timeout=2000)
                    seen = seq
                    time.sleep(0.05)
                last = journal.load(run_id).seq
            page.wait_for_selector(f"#timeline-rows tr[data-seq='{last}']", timeout=2000)
            page.wait_for_selector("#live-badge", state="hidden", timeout=2000)
        finally:
            runner.communicate(timeout=30)
        assert runner.returncode == 0
        assert page.evaluate("window.notReloaded") is True
        assert page.locator("#run-status").inner_text() == "succeeded"
        assert page.locator("svg.fsm g.node.current").get_attribute("data-state") == "done"
        assert [r[0] for r in rows(page, "#timeline-rows tr")] == [str(s) for s in range(last + 1)]
        assert last - loaded >= 3  # transitions journaled after the page was loaded
        assert len(polls) >= 2
        ended = len(polls)
        time.sleep(1.3)  # the run has ended: no more polls (one a second while it ran)
        assert len(polls) == ended


class TestActions:
    """With --allow-actions: abort (with a reason) and fork, as forms with a CSRF token."""

    def test_abort_and_fork(self, site, page):
        from playwright.sync_api import expect

        server = Server(site.location, "--allow-actions")
        try:
            page.goto(f"{server.url}/runs/{site.ids['waiting']}")
            page.fill("form.abort input[name=reason]", "<b>not needed</b>")
            page.click("form.abort button")
            expect(page.locator("#run-status")).to_have_text("aborted")  # the page after the POST
            assert page.locator("#run-state").inner_text() == "canceled"
            assert "<b>not needed</b>" in page.locator("section.summary").inner_text()

            source = site.ids["agent_loop"]
            page.goto(f"{server.url}/runs/{source}")
            page.fill("form.fork input[name=at]", "3")
            page.click("form.fork button")
            page.wait_for_url(lambda url: source not in url)
            assert page.locator("h1 .id").inner_text() != source
            assert page.locator("#run-state").inner_text() == "verifying"
            assert f"{source} at seq 3" in page.locator("section.summary").inner_text()
            assert [r[0] for r in rows(page, "#timeline-rows tr")] == ["0", "1", "2", "3"]
        finally:
            server.stop()
