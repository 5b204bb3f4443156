"""The run inspector and durable waits (issue 29): waiting runs listed, answered, and shown.

Server-side: a real inspector on a free loopback port (a `fsm-runner ui` process over a SQLite
file or a PostgreSQL schema; the app on a thread of this process over a memory journal), requests with urllib: the
waiting tab (what each run waits for, since when, its deadline, its pending signals; read per
waiting state from the index), the run page's prompt and schema escaped, the answer forms and
their guards (actions off: 403; no or a wrong CSRF token: 403; a payload that is not JSON: 400;
an ended run or a refused name: the refusal page; nothing written in each case), a successful
answer and what the page then says, the timeline's consumed signals and the live update.

Acceptance, in Debian's chromium through Playwright, on every journal: a run parked in a
waiting state, a real worker (``Engine.work`` on a thread) waiting for work; a click on APPROVE
in the inspector; the run continues, and the open page shows its new states live, without a
reload. Then the issue's own: the demo's agent loop with its approval gate (real scripted agent,
pytest and git), rejected once and approved from the inspector, followed live.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import re
import threading
import time
from urllib.parse import urlencode

import pytest

from fsm_runner import Engine, MachineSpec, SignalStatus, State, Transition
from fsm_runner.engine import abort_run
from fsm_runner.engine.waits import deadline, signal_run
from fsm_runner.journal import MemoryJournal, open_journal
from fsm_runner.ui import views
from fsm_runner.ui.app import create_app
from tests.helpers import NEXT, linear_spec
from tests.ui_helpers import ARTIFACTS, AppServer, Server
from tests.ui_journals import (
    APPROVAL_HANDLERS,
    APPROVAL_PROMPT,
    APPROVAL_SCHEMA,
    SCRIPT,
    approval_spec,
)

NO_TRACEBACK = ("Traceback", 'File "', "Exception in ASGI")
APPROVAL = approval_spec()
#: A waiting state whose prompt and schema are hostile HTML.
HOSTILE = approval_spec("approval-xss", prompt=f"approve {SCRIPT}?", schema={"title": SCRIPT})


class Site:
    """A journal (for the test to make runs in and read) and inspectors serving it."""

    def __init__(self, backend: str, journal, location: str) -> None:
        self.backend = backend
        self.journal = journal
        self.location = location
        self.servers: list = []

    def serve(self, *, actions: bool = False, process: bool = False):
        """An inspector: ``fsm-runner ui`` in a process of its own (``process``: the browser
        tests'), else the app over a journal of its own on a thread of this process (a memory
        journal: this one)."""
        if self.backend == "memory":
            app = create_app(self.location, allow_actions=actions, journal=self.journal)
            server = AppServer(app)
        elif process:
            server = Server(self.location, *(["--allow-actions"] if actions else []))
        else:
            server = AppServer(create_app(self.location, allow_actions=actions))
        self.servers.append(server)
        return server

    def engine(self, spec: MachineSpec = APPROVAL) -> Engine:
        return Engine(spec, handlers=APPROVAL_HANDLERS, journal=self.journal)

    def parked(self, spec: MachineSpec = APPROVAL, data=None) -> str:
        """A run of ``spec`` waiting in ``awaiting``, nobody holding it."""
        engine = self.engine(spec)
        run_id = engine.start(data or {})
        run = engine.run(run_id)
        assert (run.state, run.lease_owner) == ("awaiting", None)
        return run_id


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def site(request, tmp_path):
    """The journal of each kind (PostgreSQL: a schema of the pool), and its inspectors."""
    postgres = schema = None
    if request.param == "memory":
        journal, location = MemoryJournal(), "memory"
    else:
        if request.param == "sqlite":
            location = str(tmp_path / "journal.db")
        else:
            postgres = request.getfixturevalue("postgres_server")
            schema = postgres.take()
            location = f"{postgres.url}?schema={schema}"
        journal = open_journal(location)
    site = Site(request.param, journal, location)
    yield site
    for server in site.servers:
        server.stop()
    journal.close()
    if postgres is not None:  # once every server and worker has let go of it
        postgres.give_back(schema)


def csrf_token(body: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', body)
    assert found, "no CSRF token in the page"
    return found.group(1)


def form(**fields: str) -> bytes:
    return urlencode(fields).encode()


def cells(body: str, row_class: str) -> list[dict[str, str]]:
    """Each ``<tr class="... row_class ...">``'s cells, by their class (text, unescaped)."""
    rows = []
    for row in re.findall(
        rf'<tr class="(?:[^"]* )?{row_class}(?: [^"]*)?"[^>]*>(.*?)</tr>', body, re.S
    ):
        found = re.findall(r'<td(?: class="([^"]*)")?>(.*?)</td>', row, re.S)
        rows.append(
            {cls: html.unescape(re.sub(r"<[^>]+>", "", text)).strip() for cls, text in found}
        )
    return rows


def shown(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S")


class TestWaitingTab:
    """The runs page's "waiting" tab: active runs in a waiting state, from the index."""

    def test_lists_what_each_run_waits_for_since_when_and_until_when(self, site):
        journal = site.journal
        parked = site.parked()
        held = site.parked()
        journal.claim(held, "someone", ttl=600)  # held: a signal to it stays pending
        pending = signal_run(journal, held, "REJECT", {"why": "<b>no</b>"})
        assert pending.status is SignalStatus.PENDING
        proposing = site.engine().start({})  # not waiting yet
        ended = site.parked()
        signal_run(journal, ended, "APPROVE")
        site.engine().run(ended)
        other = Engine(linear_spec("a"), handlers={"a": lambda ctx: NEXT}, journal=journal)
        plain = other.start({})  # a machine that never waits

        server = site.serve()
        listing = server.get("/runs?waiting=1")
        assert listing.status == 200
        rows = dict(
            zip(
                re.findall(r'<tr class="run waiting-run" data-run-id="([^"]+)"', listing.body),
                cells(listing.body, "waiting-run"),
                strict=True,
            )
        )
        assert set(rows) == {parked, held}  # not the proposing, ended or plain runs
        assert not {proposing, ended, plain} & set(
            re.findall(r'data-run-id="([^"]+)"', listing.body)
        )
        for run_id in (parked, held):
            assert rows[run_id]["accepts"] == "APPROVE, REJECT"
            assert rows[run_id]["since"] == shown(journal.load(run_id).updated_at)
            assert rows[run_id]["prompt"] == APPROVAL_PROMPT
        spec = APPROVAL
        due = deadline(journal, spec, journal.load(parked))
        assert journal.wake_time(parked) == due  # parked until its deadline
        assert rows[parked]["deadline"].startswith(shown(due))
        assert rows[parked]["pending"] == "-"
        # the held one's wake time is the signal's arrival (past): its timeout after since
        since = journal.load(held).updated_at
        assert rows[held]["deadline"].startswith(shown(since + dt.timedelta(days=1)))
        assert rows[held]["pending"] == "REJECT"
        assert "then TIMEOUT" in rows[held]["deadline"]

        by_machine = server.get("/runs?waiting=1&machine=approval&state=awaiting")
        assert set(re.findall(r'waiting-run" data-run-id="([^"]+)"', by_machine.body)) == {
            parked,
            held,
        }
        for query in ("machine=linear", "state=proposing", "machine=nope", f"q={plain[:8]}"):
            empty = server.get(f"/runs?waiting=1&{query}")
            assert empty.status == 200
            assert "waiting-run" not in empty.body
            assert "No run is waiting" in empty.body
        machine = server.get("/machines/approval")
        assert '<a href="/runs?waiting=1&amp;machine=approval">' in machine.body
        everything = server.get("/runs")
        # the plain tab lists them all, as before
        assert {parked, held, proposing, ended, plain} <= set(
            re.findall(r'data-run-id="([^"]+)"', everything.body)
        )
        assert 'class="tab waiting-tab"' in everything.body

    def test_an_older_spec_that_does_not_wait_there_is_not_listed(self, site):
        """A run of the machine's older spec, in a state of that name that has a handler."""
        older = MachineSpec(
            "approval",
            [State("awaiting", handler="propose"), State("applied", terminal=True)],
            [Transition("awaiting", "PROPOSED", "applied")],
        )
        old_run = Engine(older, handlers=APPROVAL_HANDLERS, journal=site.journal).start({})
        parked = site.parked()
        listing = site.serve().get("/runs?waiting=1")
        assert re.findall(r'waiting-run" data-run-id="([^"]+)"', listing.body) == [parked]
        assert old_run not in listing.body


def _review(ctx):
    answer = ctx.wait_for("verdict")
    return "DONE" if answer.get("ok") else "REDO"


#: A phase that waits from inside (``ctx.wait_for``): its run is parked in a state with a handler.
PHASE_WAITS = MachineSpec(
    "phase-waits",
    [State("reviewing", handler="review", signals=["verdict"]), State("done", terminal=True)],
    [Transition("reviewing", "DONE", "done"), Transition("reviewing", "REDO", "reviewing")],
)


class TestPhaseWaits:
    """A run its phase parked (``ctx.wait_for``) is listed, shown and answered too."""

    def test_listed_shown_and_answered(self, site):
        engine = Engine(PHASE_WAITS, handlers={"review": _review}, journal=site.journal)
        run_id = engine.start({})
        assert engine.run(run_id).state == "reviewing"
        running = engine.start({})  # in the same state, not parked: not waiting
        server = site.serve(actions=True)
        listing = server.get("/runs?waiting=1")
        (row,) = cells(listing.body, "waiting-run")
        assert re.findall(r'waiting-run" data-run-id="([^"]+)"', listing.body) == [run_id]
        assert running not in listing.body
        assert (row["accepts"], row["deadline"]) == ("verdict", "none")
        page = server.get(f"/runs/{run_id}")
        assert "Its phase waits in" in page.body
        assert re.findall(r'class="answer" data-signal="([^"]+)"', page.body) == ["verdict"]
        token = csrf_token(page.body)
        answer = server.post(
            f"/runs/{run_id}/signal", form(csrf_token=token, name="verdict", payload='{"ok": true}')
        )
        assert answer.status == 303
        engine.work(exit_when_idle=True, max_runs=1)  # a worker of the app wakes the phase
        assert site.journal.load(run_id).state == "done"
        done = server.get(f"/runs/{run_id}")
        assert '<section class="waiting"' not in done.body
        woken = re.search(r'data-seq="2" data-signal="(\d+)"', done.body)
        assert woken
        engine.close()


class TestRunPage:
    """A waiting run's page: its prompt and schema, escaped; answer forms only with actions."""

    def test_prompt_and_schema_are_escaped_and_no_form_without_actions(self, site):
        run_id = site.parked(HOSTILE)
        server = site.serve()
        page = server.get(f"/runs/{run_id}")
        assert page.status == 200
        assert SCRIPT not in page.body
        assert page.body.count("<script") == 1  # the inspector's own
        prompt = re.search(r'<p class="prompt">(.*?)</p>', page.body, re.S)
        assert prompt
        assert html.unescape(prompt.group(1)) == f"approve {SCRIPT}?"
        schema = re.search(r'<pre class="schema">(.*?)</pre>', page.body, re.S)
        assert schema
        assert json.loads(html.unescape(schema.group(1))) == {"title": SCRIPT}
        assert '<section class="waiting"' in page.body
        assert 'class="answer"' not in page.body  # actions off: no buttons
        assert "--allow-actions" in page.body
        command = re.search(r'<code id="cmd-signal">(.*?)</code>', page.body)
        assert command
        assert html.unescape(command.group(1)).endswith(f" signal {run_id[:12]} APPROVE")
        listing = server.get("/runs?waiting=1")
        assert SCRIPT not in listing.body
        assert "approve &lt;script&gt;" in listing.body

    def test_answer_forms_with_actions(self, site):
        run_id = site.parked()
        page = site.serve(actions=True).get(f"/runs/{run_id}")
        forms = re.findall(
            r'<form method="post" action="([^"]+)" class="answer" data-signal="([^"]+)"', page.body
        )
        assert forms == [
            (f"/runs/{run_id}/signal", "APPROVE"),
            (f"/runs/{run_id}/signal", "REJECT"),
        ]
        assert page.body.count('name="payload"') == 2
        assert page.body.count('name="signal_id"') == 2
        assert html.escape(APPROVAL_SCHEMA["properties"]["note"]["type"]) in page.body
        ended = site.parked()
        signal_run(site.journal, ended, "APPROVE")
        site.engine().run(ended)
        done = site.servers[-1].get(f"/runs/{ended}")
        assert '<section class="waiting"' not in done.body


class TestAnswerGuards:
    """Every refused answer writes nothing and is an error page, never a traceback."""

    def nothing_written(self, site, run_id: str) -> None:
        assert site.journal.signals(run_id) == []
        run = site.journal.load(run_id)
        assert (run.state, run.seq) == ("awaiting", 1)

    def test_refused_when_actions_are_off(self, site):
        run_id = site.parked()
        server = site.serve()
        token = csrf_token(site.serve(actions=True).get(f"/runs/{run_id}").body)
        answer = server.post(f"/runs/{run_id}/signal", form(csrf_token=token, name="APPROVE"))
        assert answer.status == 403
        assert "Actions are off" in answer.body
        assert not any(t in answer.body for t in NO_TRACEBACK)
        assert server.get(f"/runs/{run_id}/signal").status in (404, 405)  # POST only
        self.nothing_written(site, run_id)

    def test_refused_without_or_with_a_wrong_csrf_token(self, site):
        run_id = site.parked()
        server = site.serve(actions=True)
        for fields in ({}, {"csrf_token": ""}, {"csrf_token": "x" * 43}):
            answer = server.post(f"/runs/{run_id}/signal", form(name="APPROVE", **fields))
            assert answer.status == 403
            assert "CSRF token" in answer.body
        self.nothing_written(site, run_id)

    def test_a_payload_that_is_not_json_is_refused(self, site):
        run_id = site.parked()
        server = site.serve(actions=True)
        token = csrf_token(server.get(f"/runs/{run_id}").body)
        for payload in ("{not json", "NaN", "[1, 2", "'single'", "[" * 100_000):
            answer = server.post(
                f"/runs/{run_id}/signal", form(csrf_token=token, name="APPROVE", payload=payload)
            )
            assert answer.status == 400, payload[:20]
            assert "The payload is not JSON" in answer.body
            assert "nothing was sent" in answer.body
            assert not any(t in answer.body for t in NO_TRACEBACK)
        self.nothing_written(site, run_id)

    def test_a_refused_name_an_ended_run_or_no_run(self, site):
        run_id = site.parked()
        server = site.serve(actions=True)
        token = csrf_token(server.get(f"/runs/{run_id}").body)
        for name in ("DEPLOY", "TIMEOUT", "PROPOSED", "SYSTEM_ERROR", "<b>x</b>", ""):
            answer = server.post(f"/runs/{run_id}/signal", form(csrf_token=token, name=name))
            assert answer.status in (400, 409), name
            assert "<b>x</b>" not in answer.body
            assert not any(t in answer.body for t in NO_TRACEBACK)
        self.nothing_written(site, run_id)
        signal_run(site.journal, run_id, "APPROVE")
        site.engine().run(run_id)
        ended = server.post(f"/runs/{run_id}/signal", form(csrf_token=token, name="APPROVE"))
        assert ended.status == 409
        assert "Refused" in ended.body
        assert len(site.journal.signals(run_id)) == 1
        missing = server.post("/runs/no-such-run/signal", form(csrf_token=token, name="APPROVE"))
        assert missing.status == 404
        assert "No such run" in missing.body


class TestAnswer:
    """An answer journals the signal; the run page says what became of it, and shows it."""

    def test_approve_moves_the_run_on(self, site):
        run_id = site.parked()
        server = site.serve(actions=True)
        token = csrf_token(server.get(f"/runs/{run_id}").body)
        payload = '{"note": "<b>ship it</b>"}'
        fields = {"csrf_token": token, "name": "APPROVE", "payload": payload, "signal_id": "hook-1"}
        answer = server.post(f"/runs/{run_id}/signal", form(**fields))
        assert answer.status == 303
        (sent,) = site.journal.signals(run_id)
        assert (sent.name, sent.payload, sent.signal_id) == (
            "APPROVE",
            {"note": "<b>ship it</b>"},
            "hook-1",
        )
        assert sent.status is SignalStatus.CONSUMED
        assert sent.consumed_seq == 2
        assert answer.headers["Location"] == f"/runs/{run_id}?signal={sent.number}#outcome"
        assert site.journal.load(run_id).state == "applying"

        page = server.get(f"/runs/{run_id}?signal={sent.number}")
        outcome = re.search(
            r'<p id="outcome" class="outcome consumed"[^>]*>(.*?)</p>', page.body, re.S
        )
        assert outcome, "the page says nothing of the signal"
        assert "consumed at seq 2: the run moved on" in outcome.group(1)
        assert '<span id="run-state" class="state">applying</span>' in page.body
        assert '<section class="waiting"' not in page.body  # it waits no more
        consumed = re.search(
            r'<tr class="transition consumed-signal" data-seq="2" data-signal="(\d+)">', page.body
        )
        assert consumed
        assert int(consumed.group(1)) == sent.number
        (row,) = cells(page.body, "signal")
        assert row["name"] == "APPROVE"
        assert row["signal-id"] == "hook-1"
        assert row["consumed"].startswith("seq 2 at ")
        assert row["payload"] == '{"note": "<b>ship it</b>"}'
        assert "<b>ship it</b>" not in page.body  # escaped

        again = server.post(f"/runs/{run_id}/signal", form(**{**fields, "name": "REJECT"}))
        assert again.status == 303  # the same signal id: the first signal, nothing written
        assert again.headers["Location"] == answer.headers["Location"]
        assert len(site.journal.signals(run_id)) == 1
        assert site.engine().run(run_id).state == "applied"

    def test_a_signal_to_a_held_run_stays_pending_and_the_page_says_so(self, site):
        run_id = site.parked()
        site.journal.claim(run_id, "a-worker", ttl=600)
        server = site.serve(actions=True)
        token = csrf_token(server.get(f"/runs/{run_id}").body)
        hostile = {
            "csrf_token": token,
            "name": "REJECT",
            "signal_id": SCRIPT,
            "payload": '"</pre>"',
        }
        answer = server.post(f"/runs/{run_id}/signal", form(**hostile))
        assert answer.status == 303
        page = server.get(answer.headers["Location"].split("#")[0])
        assert '<p id="outcome" class="outcome pending"' in page.body
        assert SCRIPT not in page.body
        assert page.body.count("<script") == 1  # the inspector's own
        assert page.body.count("</pre>") == page.body.count("<pre")
        (row,) = cells(page.body, "signal")
        assert (row["signal-id"], row["payload"]) == (SCRIPT, '"</pre>"')
        assert re.search(
            r'<dd class="pending"><span class="signal-chip">#\d+ REJECT</span>', page.body
        )
        assert site.journal.load(run_id).state == "awaiting"

    def test_a_signal_its_run_never_consumed_is_shown_expired(self, site):
        run_id = site.engine().start({})  # not waiting yet: a signal stays pending
        early = signal_run(site.journal, run_id, "APPROVE", {"early": True})
        assert early.status is SignalStatus.PENDING
        abort_run(site.journal, run_id, "not needed")
        assert site.journal.load(run_id).ended
        page = site.serve().get(f"/runs/{run_id}?signal={early.number}")
        (row,) = cells(page.body, "signal")
        assert (row["name"], row["consumed"]) == ("APPROVE", "-")
        assert '<tr class="signal expired"' in page.body
        assert '<p id="outcome" class="outcome expired"' in page.body
        assert "expired: the run ended before consuming it" in page.body

    def test_the_live_update_carries_signals_and_what_the_run_waits_for(self, site):
        run_id = site.parked()
        server = site.serve()
        still = server.get(f"/runs/{run_id}/live?after=1")
        update = json.loads(still.body)
        assert update["waiting"] is None  # nothing moved: the page's panel stands
        assert "No signals" in update["signals"]
        signal_run(site.journal, run_id, "APPROVE", {"by": "ana"})
        moved = json.loads(server.get(f"/runs/{run_id}/live?after=1").body)
        assert moved["state"] == "applying"
        assert moved["waiting"] == ""  # it waits no more: the panel goes
        assert 'data-signal="' in moved["rows"]
        assert "signal #" in moved["rows"]
        assert 'data-status="consumed"' in moved["signals"]


class Worker:
    """``Engine.work`` on a thread of its own, with its own journal (the memory one shared)."""

    def __init__(self, site: Site, spec: MachineSpec, handlers) -> None:
        self.stop = threading.Event()
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._work, args=(site, spec, handlers))
        self.thread.start()

    def _work(self, site: Site, spec: MachineSpec, handlers) -> None:
        own = site.backend != "memory"
        journal = open_journal(site.location) if own else site.journal
        engine = Engine(spec, handlers=handlers, journal=journal)
        try:
            engine.work(stop=self.stop, idle_wait=0.2)
        except BaseException as exc:
            self.failure.append(exc)
            raise
        finally:
            engine.close()
            if own:
                journal.close()

    def join(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        assert self.failure == []


def wait_until(check, what: str, timeout: float = 30) -> None:
    deadline_at = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline_at, f"waited {timeout} s for {what}"
        time.sleep(0.05)


@pytest.mark.slow
class TestInBrowser:
    """Acceptance: approve a waiting run from the inspector; it continues, the page shows it live."""

    def test_approve_a_waiting_run_and_watch_it_continue(self, site, page):
        from playwright.sync_api import expect

        gate = threading.Event()  # the apply phase runs until the page has been seen waiting

        def apply(ctx):
            assert gate.wait(60), "the test never opened the gate"
            return "APPLIED"

        worker = Worker(site, APPROVAL, {**APPROVAL_HANDLERS, "apply": apply})
        try:
            run_id = site.engine().start({"change": "<b>rename</b>"})

            def parked() -> bool:
                run = site.journal.load(run_id)
                return run.state == "awaiting" and run.lease_owner is None

            wait_until(parked, "the worker to park the run in awaiting")
            server = site.serve(actions=True, process=True)
            page.goto(f"{server.url}/runs?waiting=1")
            page.click(f"tr.waiting-run[data-run-id='{run_id}'] td.id a")
            page.wait_for_url(f"**/runs/{run_id}")
            expect(page.locator("#waiting p.prompt")).to_have_text(APPROVAL_PROMPT)
            assert page.locator("#waiting dd.accepts").inner_text() == "APPROVE, REJECT"
            assert page.locator("#live-badge").is_visible()

            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"waits-waiting-{site.backend}.png"))
            approve = page.locator("form.answer[data-signal='APPROVE']")
            approve.locator("textarea[name=payload]").fill('{"note": "looks <i>right</i>"}')
            approve.locator("input[name=signal_id]").fill("review-1")
            approve.locator("button").click()
            page.wait_for_url(lambda url: "signal=" in url)
            assert page.locator("#outcome").get_attribute("data-status") in ("consumed", "pending")
            page.evaluate("window.notReloaded = true")

            # consumed (at once, or by the worker): the run moves on to applying, on the page
            expect(page.locator("#run-state")).to_have_text("applying", timeout=10_000)
            expect(page.locator("#waiting")).to_have_count(0)  # it waits no more
            expect(page.locator("#signals tr.signal.consumed")).to_have_count(1)
            (signal,) = site.journal.signals(run_id)
            assert (signal.name, signal.signal_id) == ("APPROVE", "review-1")
            assert signal.payload == {"note": "looks <i>right</i>"}
            consumed = page.locator(f"#timeline-rows tr[data-signal='{signal.number}']")
            expect(consumed).to_have_attribute("data-seq", str(signal.consumed_seq))
            assert "APPROVE" in consumed.locator("td.event").inner_text()
            shown_seq = int(page.locator("#run-seq").inner_text())

            gate.set()  # the worker's apply phase ends: the run succeeds, live on the page
            expect(page.locator("#run-status")).to_have_text("succeeded", timeout=10_000)
            expect(page.locator("#run-state")).to_have_text("applied")
            expect(page.locator("#live-badge")).to_be_hidden()
            assert page.evaluate("window.notReloaded") is True
            last = site.journal.load(run_id).seq
            assert last > shown_seq  # journaled after the page was loaded, shown without reload
            events = [
                row.locator("td.event").inner_text().split()[0]
                for row in page.locator("#timeline-rows tr").all()
            ]
            assert events == ["STARTED", "PROPOSED", "APPROVE", "APPLIED"]
            svg = page.locator("#diagram svg.fsm")
            assert svg.locator("g.node.current").get_attribute("data-state") == "applied"
            shot = ARTIFACTS / f"waits-approved-{site.backend}.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nscreenshot of the approved run: {shot}")
        finally:
            gate.set()
            worker.join()

    @pytest.mark.parametrize("site", ["sqlite"], indirect=True)  # the real agent loop: once
    def test_approve_a_waiting_agent_loop_run(self, site, page, browser, tmp_path):
        """The issue's acceptance: the demo's agent loop with its approval gate, real services.

        A worker runs it (the scripted agent and pytest as subprocesses, git snapshots) to the
        gate. From the inspector: REJECT with a comment; the watching page shows the loop build
        again, live, and stand at the gate again with its answer buttons back; APPROVE; the run
        succeeds, and a second page, open on the run all along, shows every step live.
        """
        from playwright.sync_api import expect

        from fsm_runner.presets.agent_loop import APPROVAL_PROMPT as GATE_PROMPT
        from fsm_runner.presets.agent_loop import commands

        worker = AgentWorker(site, commands.make_approval_engine)
        try:
            spec_engine = commands.make_approval_engine(site.journal)
            work = commands.create_demo_project(tmp_path)
            run_id = spec_engine.start(commands.demo_input(work, approval=True))

            def at_the_gate() -> bool:
                run = site.journal.load(run_id)
                return run.state == "awaiting_approval" and run.lease_owner is None

            wait_until(at_the_gate, "the agent loop to reach its approval gate", timeout=180)
            server = site.serve(actions=True, process=True)
            watcher = browser.new_page(viewport={"width": 1280, "height": 900})
            watcher.goto(f"{server.url}/runs/{run_id}")
            watcher.evaluate("window.notReloaded = true")

            page.goto(f"{server.url}/runs?waiting=1&machine=agent-loop-approval")
            page.click(f"tr.waiting-run[data-run-id='{run_id}'] td.id a")
            page.wait_for_url(f"**/runs/{run_id}")
            expect(page.locator("#waiting p.prompt")).to_have_text(GATE_PROMPT)
            reject = page.locator("form.answer[data-signal='REJECT']")
            reject.locator("textarea[name=payload]").fill('{"comment": "Say what add does."}')
            reject.locator("button").click()
            page.wait_for_url(lambda url: "signal=" in url)
            before = site.journal.load(run_id).seq

            # the worker builds again with the comment as feedback; the page follows live
            expect(page.locator("#run-state")).to_have_text("awaiting_approval", timeout=180_000)
            approve = page.locator("form.answer[data-signal='APPROVE']")  # back, live
            expect(approve).to_have_count(1)
            assert site.journal.load(run_id).seq > before
            assert page.locator("#timeline-rows tr.consumed-signal").count() == 1  # the REJECT
            approve.locator("button").click()
            page.wait_for_url(lambda url: "signal=" in url)
            expect(page.locator("#outcome")).to_have_attribute("data-status", "consumed")
            expect(page.locator("#run-status")).to_have_text("succeeded")

            expect(watcher.locator("#run-status")).to_have_text("succeeded", timeout=10_000)
            expect(watcher.locator("#waiting")).to_have_count(0)
            assert watcher.evaluate("window.notReloaded") is True
            last = site.journal.load(run_id).seq
            expect(watcher.locator(f"#timeline-rows tr[data-seq='{last}']")).to_have_count(1)
            marked = watcher.locator("#timeline-rows tr.consumed-signal td.event").all_inner_texts()
            assert [m.split()[0] for m in marked] == ["REJECT", "APPROVE"]
            statuses = watcher.locator("#signals tr.signal").evaluate_all(
                "rows => rows.map(r => r.dataset.status)"
            )
            assert statuses == ["consumed", "consumed"]
            assert '"Say what add does."' in (work / "calc.py").read_text()
            watcher.screenshot(
                path=str(ARTIFACTS / f"waits-agent-loop-{site.backend}.png"), full_page=True
            )
            watcher.close()
        finally:
            worker.join()


class AgentWorker(Worker):
    """A worker of the agent loop's app (its engine made by ``make``)."""

    def __init__(self, site: Site, make) -> None:
        self.stop = threading.Event()
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(site, make))
        self.thread.start()

    def _run(self, site: Site, make) -> None:
        own = site.backend != "memory"
        journal = open_journal(site.location) if own else site.journal
        engine = make(journal)
        try:
            engine.work(stop=self.stop, idle_wait=0.2)
        except BaseException as exc:
            self.failure.append(exc)
            raise
        finally:
            engine.close()
            if own:
                journal.close()


class TestIndexReads:
    """The waiting tab reads runs per machine and waiting state, never a listing of every run."""

    def test_reads(self):
        journal = MemoryJournal()
        calls: list[dict] = []
        runs = journal.runs

        def recorded(**kwargs):
            calls.append(kwargs)
            return runs(**kwargs)

        site = Site("memory", journal, "memory")
        waiting = [site.parked() for _ in range(3)]
        engine = Engine(linear_spec("a"), handlers={"a": lambda ctx: NEXT}, journal=journal)
        for _ in range(5):
            engine.run(engine.start({}))  # ended runs of another machine
        journal.runs = recorded
        listed = views.waiting_page(journal, views.RunsQuery(waiting="1"))
        assert sorted(row["run"].run_id for row in listed["waiting"]) == sorted(waiting)
        scans = [c for c in calls if "machine" not in c]
        assert scans == [{"status": "active", "limit": views.WAITING_SCAN + 1}]
        for call in calls:
            if call.get("state"):
                assert call["status"] == "active"
                assert call["limit"] == views.RUNS_PAGE + 1
            elif "machine" in call:
                assert call["limit"] == 1  # the machine's newest run: its spec
        assert {c["state"] for c in calls if c.get("state")} == {"awaiting"}
        calls.clear()
        views.waiting_page(journal, views.RunsQuery(waiting="1", machine="approval"))
        assert all(c.get("machine") == "approval" for c in calls)  # no scan at all
