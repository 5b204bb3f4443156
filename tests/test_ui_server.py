"""The run inspector's server over HTTP: bad input, error pages, actions and their guard, the CLI.

A real `fsm-runner ui` process on a free port on 127.0.0.1, over a SQLite journal made by real
runs (a small machine whose handler raises); requests with urllib, no browser. The journal
reads the inspector added (`Journal.runs(before=..., run_id_prefix=...)`, `run_counts`) are
tested on every journal, and the SVG drawing on hand-built graphs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from urllib.parse import urlencode

import pytest
from click.testing import CliRunner

from fsm_runner import Engine, SqliteJournal
from fsm_runner.cli import cli
from fsm_runner.diagrams import Composite, Edge, Graph, Node
from fsm_runner.ui import command, views
from fsm_runner.ui.svg import render_svg
from tests.helpers import NEXT, linear_spec, loop_spec
from tests.ui_helpers import ROOT, Server
from tests.ui_journals import SCRIPT, XSS_SPEC, _parse

NO_TRACEBACK = ("Traceback", 'File "', "Exception in ASGI")


@pytest.fixture(scope="module")
def journal_file(tmp_path_factory):
    """Two real runs: one failed with HTML in its error, one waiting in its first state."""
    path = tmp_path_factory.mktemp("ui-server") / "journal.db"
    with SqliteJournal(path) as journal:
        engine = Engine(XSS_SPEC, handlers={"parse": _parse}, journal=journal)
        failed = engine.start({"document": SCRIPT})
        engine.run(failed)
        waiting = engine.start({"document": "later"})
    return path, failed, waiting


@pytest.fixture(scope="module")
def server(journal_file):
    server = Server(str(journal_file[0]))
    yield server
    server.stop()


def csrf_token(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, "no CSRF token in the page"
    return found.group(1)


class TestPages:
    """Every page answers HTML; run data is escaped; no traceback ever reaches the browser."""

    def test_runs_and_run_pages(self, server, journal_file):
        _, failed, waiting = journal_file
        listing = server.get("/runs")
        assert listing.status == 200
        assert listing.headers["content-type"].startswith("text/html")
        assert listing.body.index(waiting) < listing.body.index(failed)  # newest first
        page = server.get(f"/runs/{failed}")
        assert page.status == 200
        assert SCRIPT not in page.body
        assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in page.body
        assert server.get("/").status == 302

    def test_runs_are_paged(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            engine = Engine(linear_spec("a"), handlers={"a": lambda ctx: NEXT}, journal=journal)
            ids = [engine.start({"n": n}) for n in range(57)]
        server = Server(str(path))
        try:
            first = server.get("/runs?machine=linear")
            shown = re.findall(r'data-run-id="([^"]+)"', first.body)
            assert shown == ids[::-1][:50]
            older = re.search(r'class="older" href="([^"]+)"', first.body)
            assert older, "no link to the older runs"
            second = server.get(older.group(1).replace("&amp;", "&"))
            assert re.findall(r'data-run-id="([^"]+)"', second.body) == ids[::-1][50:]
            assert 'class="older"' not in second.body
            assert "machine=linear" in older.group(1)  # the filters stay
        finally:
            server.stop()

    def test_unknown_run_is_a_404_page(self, server):
        for path in ("/runs/no-such-run", "/runs/no-such-run/artifacts/x"):
            answer = server.get(path)
            assert answer.status == 404
            assert "<h1>No such run</h1>" in answer.body
            assert not any(word in answer.body for word in NO_TRACEBACK)
        assert server.get("/machines/nope").status == 404
        assert server.get("/no/such/page").status == 404

    def test_ambiguous_prefix_and_bad_numbers(self, server):
        answer = server.get("/runs/")
        assert answer.status in (302, 404, 400)
        assert server.get("/runs?before=nope").status == 200  # an unknown cursor: no rows
        assert server.get(f"/runs/{'x' * 3}?from=abc").status in (400, 404)

    def test_the_check_page_shows_what_the_check_found(self, server):
        """Over HTTP, on every Python (the browser and a big journal: test_ui_nonblocking)."""
        assert server.get("/check").status == 200  # starts the check, in the background
        deadline = time.monotonic() + 60
        while json.loads(server.get("/check/progress").body)["state"] == "running":
            assert time.monotonic() < deadline, "a check of 2 runs did not end in 60 s"
            time.sleep(0.02)
        done = server.get("/check")
        assert "2 runs checked, no problems" in done.body
        assert 'data-state="done"' in done.body

    def test_live_endpoint(self, server, journal_file):
        _, failed, _ = journal_file
        update = server.get(f"/runs/{failed}/live?after=0")
        assert update.status == 200
        assert '"ended":true' in update.body.replace(" ", "")
        assert "&lt;script&gt;" in update.body
        assert SCRIPT not in update.body
        assert server.get("/runs/nope/live").status == 404


class TestAMovingRun:
    """A run that moves between the page's reads: no row past the seq the answer reports.

    The run page and ``/live`` load the run, then read its rows (no snapshot spans the two). A
    row past the reported seq would come again from the next poll: the browser showed it twice.
    """

    class StaleLoads:
        """A journal whose ``load`` answers the run as it was when the page loaded it."""

        def __init__(self, journal, stale):
            self._journal, self._stale = journal, stale

        def load(self, run_id):
            return self._stale

        def __getattr__(self, name):
            return getattr(self._journal, name)

    def test_rows_stop_at_the_loaded_seq(self, tmp_path):
        with SqliteJournal(tmp_path / "journal.db") as journal:
            handlers = {p: (lambda ctx: NEXT) for p in "abc"}
            engine = Engine(linear_spec("a", "b", "c"), handlers=handlers, journal=journal)
            run_id = engine.start({})
            engine.step(run_id)
            stale = journal.load(run_id)
            engine.run(run_id)  # it moves on after the page loaded it
            assert journal.load(run_id).seq > stale.seq
            moving = self.StaleLoads(journal, stale)

            page = views.run_page(moving, run_id, from_seq=None)
            assert [row["seq"] for row in page["timeline"]] == list(range(stale.seq + 1))
            update = views.live_update(moving, run_id, after=0)
            assert [row["seq"] for row in update["rows"]] == list(range(1, stale.seq + 1))
            assert update["run"].seq == stale.seq


def test_too_many_runs_to_sort_by_update_are_listed_newest_first(tmp_path, monkeypatch):
    with SqliteJournal(tmp_path / "journal.db") as journal:
        engine = Engine(linear_spec("a"), handlers={"a": lambda ctx: NEXT}, journal=journal)
        ids = [engine.start({}) for _ in range(3)]
        engine.run(ids[0])  # updated last
        query = views.RunsQuery.from_params({"sort": "updated"})
        page = views.runs_page(journal, query)
        assert [run.run_id for run in page["runs"]] == [ids[0], ids[2], ids[1]]
        assert not page["unsorted"]
        monkeypatch.setattr(views, "COUNT_CAP", 2)  # more runs match than a page sorts
        page = views.runs_page(journal, query)
        assert [run.run_id for run in page["runs"]] == ids[::-1]
        assert page["unsorted"]
        with pytest.raises(ValueError, match="sort must be one of updated"):
            views.RunsQuery.from_params({"sort": "name"})


class TestBrokenJournals:
    """A missing, foreign or damaged journal is a clear error page, never a stack trace."""

    @pytest.mark.parametrize(
        ("content", "says"),
        [
            (None, "no journal at"),
            (b"", "is not an fsm_runner journal"),
            (b"hello, I am a README\n", "is a text file"),
            (b"SQLite format 3\x00" + bytes(range(256)) * 8, "journal"),
        ],
        ids=["missing", "empty", "text", "damaged"],
    )
    def test_error_page(self, tmp_path, content, says):
        path = tmp_path / "journal.db"
        if content is not None:
            path.write_bytes(content)
        server = Server(str(path))
        try:
            for page in ("/runs", "/runs/abc", "/check", "/machines/x"):
                answer = server.get(page)
                assert answer.status == 503, (page, answer.body)
                assert "<h1>The journal cannot be opened</h1>" in answer.body
                assert says in answer.body
                assert not any(word in answer.body for word in NO_TRACEBACK)
        finally:
            _, err = server.stop()
        assert "Traceback" not in err

    def test_a_journal_that_appears_later_is_opened(self, tmp_path):
        path = tmp_path / "journal.db"
        server = Server(str(path))
        try:
            assert server.get("/runs").status == 503
            with SqliteJournal(path) as journal:
                Engine(
                    linear_spec("a"), handlers={"a": lambda ctx: "NEXT"}, journal=journal
                ).start()
            assert server.get("/runs").status == 200
        finally:
            server.stop()


class TestActions:
    """Actions are off by default; on, they take POST with the server's CSRF token only."""

    def test_off_by_default(self, server, journal_file):
        _, _, waiting = journal_file
        page = server.get(f"/runs/{waiting}")
        assert "csrf_token" not in page.body
        assert '<form method="post"' not in page.body
        answer = server.post(f"/runs/{waiting}/abort", urlencode({"reason": "x"}).encode())
        assert answer.status == 403
        assert "--allow-actions" in answer.body
        assert server.post(f"/runs/{waiting}/fork", b"").status == 403
        assert server.get(f"/runs/{waiting}/abort").status in (404, 405)  # a GET never writes
        with SqliteJournal(journal_file[0]) as journal:
            assert journal.load(waiting).status.value == "active"

    def test_csrf_token_required(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            engine = Engine(XSS_SPEC, handlers={"parse": _parse}, journal=journal)
            run_id = engine.start({"document": "x"})
        server = Server(str(path), "--allow-actions")
        try:
            token = csrf_token(server.get(f"/runs/{run_id}").body)
            for form in ({"reason": "r"}, {"reason": "r", "csrf_token": "forged"}):
                answer = server.post(f"/runs/{run_id}/abort", urlencode(form).encode())
                assert answer.status == 403
            answer = server.post(
                f"/runs/{run_id}/abort", urlencode({"reason": "", "csrf_token": token}).encode()
            )
            assert answer.status == 400  # a reason is needed
            with SqliteJournal(path) as journal:
                assert journal.load(run_id).status.value == "active"
            answer = server.post(
                f"/runs/{run_id}/abort", urlencode({"reason": "done", "csrf_token": token}).encode()
            )
            assert answer.status == 303
            again = server.post(
                f"/runs/{run_id}/abort",
                urlencode({"reason": "again", "csrf_token": token}).encode(),
            )
            assert again.status == 409  # it has ended
            assert "has ended" in again.body
            fork = server.post(
                f"/runs/{run_id}/fork", urlencode({"at": "0", "csrf_token": token}).encode()
            )
            assert fork.status == 303
            with SqliteJournal(path) as journal:
                run = journal.load(run_id)
                assert (run.state, run.error) == (
                    "canceled",
                    {"type": "USER_ABORTED", "message": "done"},
                )
                forks = [r for r in journal.runs() if r.forked_from == f"{run_id}@0"]
                assert len(forks) == 1
                assert fork.headers["location"] == f"/runs/{forks[0].run_id}"
        finally:
            server.stop()


class TestCommand:
    """`fsm-runner ui`: loopback by default, a remote host only when asked, with a warning."""

    def test_non_loopback_host_is_refused_without_allow_remote(self, tmp_path):
        result = CliRunner().invoke(cli, ["--journal", str(tmp_path / "j.db"), "ui", "--host",
                                          "0.0.0.0"])  # fmt: skip
        assert result.exit_code == 2
        assert "--allow-remote" in result.output

    def test_allow_remote_warns(self, tmp_path, monkeypatch):
        served = []
        monkeypatch.setattr(command, "_serve", lambda *args, **kwargs: served.append(args))
        result = CliRunner().invoke(
            cli, ["--journal", "j.db", "ui", "--host", "0.0.0.0", "--allow-remote"]
        )
        assert result.exit_code == 0, result.output
        assert "Warning: serving the journal on 0.0.0.0" in result.output
        assert served == [("j.db", "0.0.0.0", 8765)]

    def test_loopback_is_the_default(self, monkeypatch):
        served = []
        monkeypatch.setattr(command, "_serve", lambda *args, **kwargs: served.append(args))
        result = CliRunner().invoke(cli, ["--journal", "j.db", "ui", "--journal", "k.db"])
        assert result.exit_code == 0
        assert "Warning" not in result.output
        assert served == [("k.db", "127.0.0.1", 8765)]

    def test_the_poll_interval_reaches_the_pages(self, server, journal_file):
        _, _, waiting = journal_file  # (the tests' servers look every quarter of a second)
        assert 'data-poll-ms="250"' in server.get(f"/runs/{waiting}").body  # its run's page
        assert 'data-poll-ms="500"' in server.get("/runs").body  # the newest runs: twice that
        result = CliRunner().invoke(cli, ["--journal", "j.db", "ui", "--poll-interval", "0.01"])
        assert result.exit_code == 2
        assert "--poll-interval" in result.output

    @pytest.mark.parametrize(
        ("host", "loopback"),
        [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True),
         ("0.0.0.0", False), ("192.168.1.20", False), ("::", False)],
    )  # fmt: skip
    def test_is_loopback(self, host, loopback):
        assert command.is_loopback(host) is loopback

    def test_help_does_not_import_the_web_stack(self):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "fsm_runner", "--help"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert " ui " in done.stdout
        for name in ("starlette", "uvicorn", "jinja2"):
            assert f" {name}" not in done.stderr, f"`fsm-runner --help` imports {name}"


class TestJournalReads:
    """The reads the inspector added to every journal: keyset pages, id prefixes, counts."""

    def test_pages_prefix_and_counts(self, journal):
        engine = Engine(linear_spec("a", "b"), handlers={"a": lambda ctx: "NEXT",
                                                         "b": lambda ctx: "NEXT"},
                        journal=journal)  # fmt: skip
        ids = [engine.start(run_id=f"{n:02d}-run") for n in range(7)]
        engine.run(ids[0])
        engine.step(ids[1])
        newest_first = [r.run_id for r in journal.runs()]
        assert newest_first == ids[::-1]
        pages, before = [], None
        while True:
            page = [r.run_id for r in journal.runs(limit=3, before=before)]
            if not page:
                break
            pages.append(page)
            before = page[-1]
        assert pages == [ids[6:3:-1], ids[3:0:-1], ids[:1]]
        assert [r.run_id for r in journal.runs(run_id_prefix="0")] == ids[::-1]
        assert [r.run_id for r in journal.runs(run_id_prefix="03")] == [ids[3]]
        assert journal.runs(run_id_prefix="x") == []
        assert journal.runs(before="no-such-run") == []
        assert journal.run_counts(machine="linear") == {
            ("a", "active"): 5, ("b", "active"): 1, ("done", "succeeded"): 1
        }  # fmt: skip
        assert journal.run_counts(machine="other") == {}

    def test_transition_counts(self, journal):
        engine = Engine(loop_spec(), handlers={"noop": lambda ctx: NEXT}, journal=journal)
        run_id = engine.start()
        engine.run(run_id, max_steps=9)
        moves = {m[:3]: m[3:] for m in journal.transition_counts(run_id)}
        assert moves == {
            (None, "STARTED", "a"): (1, 0),
            ("a", NEXT, "b"): (3, 9),
            ("b", NEXT, "c"): (2, 6),
            ("c", NEXT, "d"): (2, 7),
            ("d", NEXT, "a"): (2, 8),
        }
        assert [m[4] for m in journal.transition_counts(run_id)] == [0, 6, 7, 8, 9]
        assert journal.transition_counts("no-such-run") == []

    def test_a_long_run_is_drawn_from_its_counted_moves(self, journal):
        """The diagram and sub-phase visits of a long run equal those read from every transition."""
        looping = Engine(loop_spec(), handlers={"noop": lambda ctx: NEXT}, journal=journal)
        loop_run = looping.start()
        looping.run(loop_run, max_steps=41)
        failing = Engine(XSS_SPEC, handlers={"parse": _parse}, journal=journal)
        failed = failing.start({"document": SCRIPT})
        failing.run(failed)
        for run_id, spec in ((loop_run, loop_spec()), (failed, XSS_SPEC)):
            run = journal.load(run_id)
            exact = views.run_path(journal, spec, run, exact_up_to=10**9)
            counted = views.run_path(journal, spec, run, exact_up_to=0)
            assert counted == exact
            assert render_svg(counted[0]) == render_svg(exact[0])


class TestSvg:
    """The SVG drawing, on hand-built graphs."""

    def test_classes_and_escaping(self):
        graph = Graph(
            "<m>",
            nodes=[
                Node("a<b>", visited=True),
                Node("x&y", parent="box", visited=True, current=True),
                Node("end", terminal=True),
                Node("*", kind="wildcard"),
            ],
            edges=[
                Edge("a<b>", "GO", "box", count=2),
                Edge("x&y", "<EV>", "end"),
                Edge("*", "STOP", "end", wildcard=True),
            ],
            composites=[Composite("box", children=["x&y"])],
            initial="a<b>",
            has_run=True,
        )
        svg = render_svg(graph, counts={"end": 3})
        assert "<b>" not in svg
        assert "<m>" not in svg
        assert "<EV>" not in svg
        assert 'data-state="a&lt;b&gt;"' in svg
        assert re.search(r'<g class="node state visited current" data-state="x&amp;y">', svg)
        assert 'class="edge transition traversed" data-event="GO"' in svg
        assert ">GO \N{MULTIPLICATION SIGN}2</text>" in svg
        assert '<g class="composite visited" data-state="box">' in svg
        assert '<g class="badge" data-state="end">' in svg
        assert svg == render_svg(graph, counts={"end": 3})  # deterministic
