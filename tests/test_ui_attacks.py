"""The run inspector attacked as a hostile user would: run data, requests, journals, writers.

Everything the inspector shows comes from apps: run ids and inputs, contexts, handler outputs
and exception messages, artifact names and paths, effect names, even the state, event and
machine names of a stored spec. Here all of it is hostile (``<script>``, attribute-breaking
quotes, ``javascript:`` paths, ``</textarea>``, ``{{ 7*7 }}``, bidi controls, NUL, shell
metacharacters), and a real `fsm-runner ui` process on a free loopback port serves it. Pages
are parsed (``html.parser``): the only script is the inspector's own, no element carries an
event handler, and each hostile string is there as text. Requests are real HTTP (urllib,
``http.client``, raw sockets for what no client sends): traversals, bad numbers, odd methods
and Host headers get a clean 4xx and the server keeps serving. A damaged spec, a transition
whose result is not JSON and a multi-megabyte input are readable pages; a writer process
committing runs meanwhile never makes a page fail. One test drives Debian's chromium: a live
update appends hostile rows to an open page (``insertAdjacentHTML``) and no script runs.
"""

from __future__ import annotations

import contextlib
import html
import http.client
import json
import re
import socket
import sqlite3
import subprocess
import sys
from html.parser import HTMLParser
from urllib.parse import quote, urljoin

import pytest

from fsm_runner import Engine, MachineSpec, PhaseResult, RunEvent, SqliteJournal, State, Transition
from fsm_runner.journal import _head
from fsm_runner.records import ArtifactRecord
from fsm_runner.run_ids import shown
from tests.helpers import NEXT, linear_spec, rename_run
from tests.ui_helpers import CHROMIUM, ROOT, Server

#: Breaks out of an attribute, opens tags with handlers, and a script.
ATTR = "\"'><img src=x onerror=alert(1)><script>alert(2)</script>"
#: Closes what a payload might sit in, looks like a template, turns text around, holds a NUL.
ODD = "</textarea></pre></title>{{ 7*7 }}{% raw %}\u202egnp.exe\u202c \x00 end"
#: A run id that is a shell command once pasted, and ids that are paths.
SHELL_ID = "x;touch pwn;#"
PATH_IDS = ("../../static/style.css", "a/b", "..%2f..")
#: Names in the stored spec itself: they reach the SVG diagram and the machine page.
MACHINE = 'm"><svg onload=alert(3)>'
STATE = "parsing</text><script>alert(4)</script>"
EVENT = "DONE\"><foreignObject><iframe src='javascript:alert(5)'/>"
#: Where the page answers with a server traceback (a run's own error traceback is data).
SERVER_TRACE = ("Exception in ASGI", 'File "' + str(ROOT / "fsm_runner"), "site-packages")

HOSTILE_SPEC = MachineSpec(
    MACHINE,
    states=[
        State(STATE, handler="parse", allows=[ATTR], starts_iteration=True),
        State("parsed", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    transitions=[
        Transition(STATE, EVENT, "parsed"),
        Transition(STATE, RunEvent.SYSTEM_ERROR, "failed"),
        Transition(STATE, RunEvent.USER_ABORTED, "failed"),
    ],
)


def _parse(ctx):
    if ctx.input.get("fail"):
        raise ValueError(ATTR + ODD)
    ctx.effect(ATTR, lambda params: {"x": params}, {"param": ATTR}, kind=ATTR)
    return PhaseResult(
        EVENT,
        output={"out": ATTR},
        context={"ctx": ATTR, "odd": ODD},
        iteration={
            "model": ATTR,
            "agent_session_id": ATTR,
            "error_message": ATTR,
            "levels_run": [ATTR],
            "tokens_total": 7,
            "cost_usd": 0.5,
        },
        artifacts=[
            ArtifactRecord(ATTR, kind=ATTR, content={"x": ATTR}, path="javascript:alert(6)"),
            ArtifactRecord("reports/junit.xml", content={"tests": 3}),
            ArtifactRecord("failed " + ATTR, status="failed", error=ATTR, path=ATTR),
        ],
    )


class Page(HTMLParser):
    """A page's elements (tag, attributes) and its text, as a browser's parser splits them."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.parts: list[str] = []
        self.feed(html)
        self.close()
        self.text = "".join(self.parts)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.parts.append(data)

    def hrefs(self) -> list[str]:
        return [a["href"] or "" for tag, a in self.elements if tag == "a" and "href" in a]


def assert_inert(html: str, *, svgs: int | None = None) -> Page:
    """Nothing from run data became markup: no script but ours, no handler, no foreign tag."""
    page = Page(html)
    scripts = [a for tag, a in page.elements if tag == "script"]
    assert scripts in ([], [{"src": "/static/inspector.js", "defer": None}]), scripts
    for tag, attrs in page.elements:
        assert tag not in {"img", "iframe", "foreignobject", "textarea", "object", "embed"}, tag
        handlers = [name for name in attrs if name.startswith("on")]
        assert not handlers, (tag, attrs)
        for name in ("href", "src", "action"):
            assert not (attrs.get(name) or "").lower().startswith("javascript:"), (tag, attrs)
    if svgs is not None:
        assert sum(tag == "svg" for tag, _ in page.elements) == svgs
    return page


SURROGATES_SQL = """UPDATE run_rows SET input = '{"x": "\\ud800"}', context = '{"y": "\\udbff"}',
    error = '{"type": "E\\ud800", "message": "m", "traceback": "t\\udc00"}' WHERE run_id = ?"""


def assert_clean_error(answer, *statuses: int) -> None:
    assert answer.status in statuses, (answer.status, answer.body[:300])
    assert not any(word in answer.body for word in SERVER_TRACE), answer.body[:300]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A journal of hostile runs (and two damaged ones), served by one inspector."""
    path = tmp_path_factory.mktemp("ui-attacks") / "journal.db"
    ids = {}
    with SqliteJournal(path) as journal:
        engine = Engine(HOSTILE_SPEC, handlers={"parse": _parse}, journal=journal,
                        worker_id=ATTR)  # fmt: skip
        # Ids that break the rule of run ids are given by raw SQL below (rename_run), as a
        # journal written before the rule may hold them.
        engine.run(engine.start({"doc": ATTR, "odd": ODD}, run_id="ok"))
        engine.abort(engine.start({}, run_id="child", parent_run_id="ok"), ATTR)
        ids["ok"], ids["child"] = "ok-" + ATTR, "child-" + ATTR
        ids["failed"] = engine.start({"fail": True}, run_id="failed-run")
        engine.run(ids["failed"])
        engine.start({"doc": ATTR}, run_id="waiting")
        ids["waiting"] = SHELL_ID
        for n, run_id in enumerate(PATH_IDS):
            engine.start({}, run_id=f"path{n}")
            ids[f"path{n}"] = run_id
        ids["big"] = engine.start({"blob": "<b>" * 1_000_000}, run_id="big")
        plain = Engine(linear_spec("a", name="damaged"), handlers={"a": lambda c: NEXT},
                       journal=journal)  # fmt: skip
        ids["bad_result"] = plain.start(run_id="bad-result")
        plain.run(ids["bad_result"])
        ids["surrogates"] = plain.start(run_id="surrogates")
        plain.run(ids["surrogates"])
        other = Engine(linear_spec("a", name="bad-spec"), handlers={"a": lambda c: NEXT},
                       journal=journal)  # fmt: skip
        ids["bad_spec"] = other.start(run_id="bad-spec")
    for placeholder in ("ok", "child", "waiting", *(f"path{n}" for n in range(len(PATH_IDS)))):
        rename_run(path, placeholder, ids[placeholder])
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE transitions SET result = '{not json' WHERE run_id = 'bad-result'")
        db.execute("UPDATE specs SET json = '{\"name\": [' WHERE machine = 'bad-spec'")
        # What another writer may leave (the engine refuses it): lone surrogates, as JSON
        # escapes, in the input, the run's error, a transition's error and an artifact.
        db.execute(SURROGATES_SQL, ("surrogates",))
        db.execute(
            "UPDATE transitions SET result = ? WHERE run_id = 'surrogates' AND seq = 1",
            ('{"error": {"type": "E\\ud800", "message": "m\\udfff"}}',),
        )
        db.execute(
            "INSERT INTO artifacts (run_id, name, kind, seq, status, content, created_at)"
            " SELECT run_id, 'lone', 'artifact', 1, 'stored', '{\"x\": \"\\udc00\"}', at"
            " FROM transitions WHERE run_id = 'surrogates' AND seq = 1"
        )
    server = Server(str(path))
    yield server, path, ids
    _, err = server.stop()
    assert "OverflowError" not in err


class TestInjection:
    """Hostile strings in every field a page shows are text: nothing runs, the structure holds."""

    def test_run_page(self, hostile):
        server, _, ids = hostile
        answer = server.get(f"/runs/{quote(ids['ok'], safe='')}")
        assert answer.status == 200
        page = assert_inert(answer.body, svgs=1)
        # ids that break the rule of run ids are shown escaped (their repr)
        shown_too = ("javascript:alert(6)", "reports/junit.xml", repr(ids["child"]))
        for text in (repr(ids["ok"]), MACHINE, STATE, *shown_too):
            assert text in page.text
        assert json.dumps(ATTR)[1:-1] in page.text  # input and context, as JSON
        assert "{{ 7*7 }}" in page.text
        tables = {a.get("class") for tag, a in page.elements if tag == "table"}
        assert {"iterations", "effects", "artifacts"} <= tables  # each holds ATTR as text
        svg = answer.body[answer.body.index("<svg") : answer.body.index("</svg>")]
        assert_inert(svg)
        states = [a.get("data-state") for tag, a in Page(svg).elements if tag == "g"]
        assert STATE in states
        assert EVENT in [a.get("data-event") for tag, a in Page(svg).elements if tag == "g"]

    def test_failed_run_error_and_traceback(self, hostile):
        server, _, ids = hostile
        answer = server.get(f"/runs/{ids['failed']}")
        assert answer.status == 200
        page = assert_inert(answer.body, svgs=1)
        assert f"ValueError: {ATTR}" in page.text

    def test_live_fragment(self, hostile):
        server, _, ids = hostile
        answer = server.get(f"/runs/{quote(ids['failed'], safe='')}/live?after=0")
        update = json.loads(answer.body)
        assert_inert(update["rows"])
        assert_inert(update["diagram"], svgs=1)
        assert ATTR in Page(update["rows"]).text

    def test_runs_machine_and_check_pages(self, hostile):
        server, _, ids = hostile
        for path in ("/runs", f"/runs?machine={quote(MACHINE)}", f"/runs?q={quote(ids['ok'])}",
                     f"/machines/{quote(MACHINE, safe='')}"):  # fmt: skip
            answer = server.get(path)
            assert answer.status == 200, path
            page = assert_inert(answer.body)
            assert MACHINE in page.text, path
        filters = Page(server.get(f"/runs?q={quote(ids['ok'])}&state={quote(STATE)}").body)
        values = {a.get("name"): a.get("value") for tag, a in filters.elements if tag == "input"}
        assert (values["q"], values["state"]) == (ids["ok"], STATE)
        assert_inert(server.checked().body)

    def test_error_pages_echo_as_text(self, hostile):
        server, _, _ = hostile
        for path in (f"/runs/{quote(ATTR, safe='')}", f"/machines/{quote(ATTR, safe='')}",
                     f"/runs/failed-run/artifacts/{quote(ATTR, safe='')}"):  # fmt: skip
            answer = server.get(path)
            assert_clean_error(answer, 404)
            assert (
                "<img src=x onerror=alert(1)><script>alert(2)</script>"
                in assert_inert(answer.body).text
            )

    def test_pages_forbid_inline_scripts_and_framing(self, hostile):
        """A second line behind escaping: a script that got in would not run, nor a frame."""
        server, _, ids = hostile
        for path in ("/runs", f"/runs/{ids['failed']}", "/runs/no-such-run", "/check"):
            headers = server.get(path).headers
            policy = dict(p.strip().split(" ", 1) for p in headers["content-security-policy"]
                          .split(";"))  # fmt: skip
            # no inline script, no eval; WebAssembly may compile (Viz.js, the page's layout)
            assert policy["script-src"] == "'self' 'wasm-unsafe-eval'", path
            assert policy["frame-ancestors"] == "'none'", path  # no clickjacking of actions
            assert policy["object-src"] == "'none'"
            assert headers["x-content-type-options"] == "nosniff"

    def test_artifact_download_is_json_not_html(self, hostile):
        server, _, ids = hostile
        page = Page(server.get(f"/runs/{quote(ids['ok'], safe='')}").body)
        links = [h for h in page.hrefs() if "/artifacts/" in h]
        assert len(links) == 2  # the failed one has no link
        for link in links:
            answer = server.get(urljoin(f"/runs/{quote(ids['ok'], safe='')}", link))
            assert answer.status == 200, link
            assert answer.headers["content-type"] == "application/json"
            disposition = answer.headers["content-disposition"]
            assert re.fullmatch(r'attachment; filename="[\w.-]+\.json"', disposition)
        assert json.loads(answer.body) in ({"x": ATTR}, {"tests": 3})


class TestLinksAndCommands:
    """Run ids that are paths or shell code: links still lead to the run, commands stay words."""

    def test_links_lead_to_their_run(self, hostile):
        server, _, ids = hostile
        for run_id in (*PATH_IDS, SHELL_ID, ids["ok"], ids["child"]):
            listing = Page(server.get(f"/runs?q={quote(run_id)}").body)
            links = [h for h in listing.hrefs() if h.startswith("/runs/")]
            assert links, run_id
            for link in links:
                answer = server.get(urljoin(server.url + "/runs", link)[len(server.url) :])
                assert answer.status == 200, (run_id, link)
                assert shown(run_id) in Page(answer.body).text, (run_id, link)

    def test_copied_commands_are_one_command_with_the_run_id(self, hostile, tmp_path):
        server, path, _ = hostile
        body = server.get(f"/runs/{quote(SHELL_ID, safe='')}").body
        found = [html.unescape(c) for c in re.findall(r'<code id="cmd-\w+">(.*?)</code>', body)]
        assert len(found) == 2  # fork and resume
        for command in found:
            # What a person does with the copy button: paste it into a shell.
            script = f'fsm-runner() {{ printf "%s\\n" "$@"; }}\n{command}\n'
            done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=10, check=True)  # fmt: skip
            assert list(tmp_path.iterdir()) == [], f"{command!r} ran more than fsm-runner"
            argv = done.stdout.splitlines()
            assert argv[:2] == ["--journal", str(path)]
            assert argv[3] == SHELL_ID[:12], command


class TestRequests:
    """Traversals, bad numbers, odd methods, long URLs, bad Host headers: a clean 4xx, still up."""

    @pytest.mark.parametrize(
        "path",
        ["/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py",
         "/static/%2e%2e%2f%2e%2e%2fpyproject.toml", "/static//etc/passwd", "/static/%00",
         "/static/style.css%00.js", "/runs/%00", "/runs/..%2f..%2fetc%2fpasswd", "/runs/%ff",
         "/runs/%ED%A0%80", "/runs/%C0%AE%C0%AE%C0%AF", "/static/%C0%AE%C0%AE%C0%AFapp.py", "/machines/%00", "/runs/big/artifacts/..%2f..%2fx",
         "/runs/big?from=abc", "/runs/big?from=1e3", "/runs/big?from=" + "9" * 5000,
         "/runs/big/live?after=-" + "9" * 30, "/runs/big/live?after=" + "9" * 30,
         "/runs/big?from=-" + "9" * 30, "/runs/big/live?after=%00", "/runs?parent=%00",
         "/runs/" + "a" * 60_000],
    )  # fmt: skip
    def test_bad_paths_and_numbers(self, hostile, path):
        server, _, _ = hostile
        answer = server.get(path)
        if answer.status != 200:  # a number out of range may show the nearest page instead
            assert_clean_error(answer, 400, 404, 414)
        assert server.get("/runs").status == 200

    def test_static_files_are_served_and_nothing_else(self, hostile):
        server, _, _ = hostile
        assert server.get("/static/inspector.js").status == 200
        assert_clean_error(server.get("/static/../ui/app.py"), 404)
        assert_clean_error(server.get("/static/"), 404)

    def test_unknown_params_are_ignored(self, hostile):
        server, _, _ = hostile
        answer = server.get("/runs?limit=-1&seq=abc&page=%ff&before=%00&q=%25")
        assert answer.status == 200
        assert_inert(answer.body)

    @pytest.mark.parametrize("status", ["%ff", "bogus", "<script>"])
    def test_a_status_that_is_none_is_refused_not_ignored(self, hostile, status):
        server, _, _ = hostile
        answer = server.get(f"/runs?status={status}")
        assert answer.status == 400
        assert (
            "status must be one of active, succeeded, failed, aborted, dead_letter" in answer.body
        )
        assert_inert(answer.body)

    @pytest.mark.parametrize("method", ["HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS",
                                        "TRACE", "PROPFIND"])  # fmt: skip
    def test_methods(self, hostile, method):
        server, _, ids = hostile
        for path in ("/runs", f"/runs/{ids['failed']}", f"/runs/{ids['failed']}/live",
                     f"/runs/{ids['failed']}/abort", "/static/style.css", "/check"):  # fmt: skip
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request(method, path, body=b"x=1" if method != "HEAD" else None)
            answer = conn.getresponse()
            body = answer.read().decode()
            conn.close()
            if method == "HEAD":
                assert answer.status in (200, 404, 405), path
                assert body == ""
            else:
                assert answer.status in (403, 405), (method, path, answer.status)
                assert not any(word in body for word in SERVER_TRACE)
        assert server.get("/runs").status == 200

    @pytest.mark.parametrize(
        "request_bytes",
        [b"GET /runs HTTP/1.1\r\nHost: \r\n\r\n",
         b"GET /runs HTTP/1.1\r\nHost: a b\r\n\r\n",
         b"GET /runs HTTP/1.1\r\nHost: [::1\r\n\r\n",
         b"GET /runs HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
         b"GET /runs HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil\r\n\r\n",
         b"GET /runs HTTP/1.1\r\n\r\n",
         b"GET /\x00 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
         b"GET /runs?" + b"a" * 200_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
         b"GARBAGE\r\n\r\n"],
        ids=["empty-host", "space", "bad-ipv6", "nul", "two-hosts", "no-host", "nul-path",
             "200k-url", "garbage"],
    )  # fmt: skip
    def test_malformed_requests(self, hostile, request_bytes):
        server, _, _ = hostile
        answer = b""
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            try:
                sock.sendall(request_bytes)
                sock.shutdown(socket.SHUT_WR)
                while chunk := sock.recv(65536):
                    answer += chunk
            except OSError:  # reset or closed: refused before it read all we sent
                answer = b""
        if answer:  # the server may also just close the connection
            status = int(answer.split(b" ", 2)[1])
            # A long query string of unknown parameters is ignored, like a short one.
            assert 400 <= status < 500 or (status == 200 and len(request_bytes) > 1000), answer[
                :200
            ]
            assert b"Traceback" not in answer
        assert server.get("/runs").status == 200

    def test_foreign_host_header_is_refused(self, hostile):
        """A page another site's DNS points at 127.0.0.1 (DNS rebinding) must not read runs."""
        server, _, _ = hostile
        for host, status in ((f"127.0.0.1:{server.port}", 200), (f"localhost:{server.port}", 200),
                             (f"[::1]:{server.port}", 200), ("LOCALHOST", 200),
                             ("evil.example", 400), (f"evil.example:{server.port}", 400),
                             ("127.0.0.1.evil.example", 400)):  # fmt: skip
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", "/runs", headers={"Host": host})
            answer = conn.getresponse()
            body = answer.read().decode()
            conn.close()
            assert answer.status == status, (host, answer.status)
            if status != 200:
                assert "failed-run" not in body


class TestDamagedJournals:
    """A damaged spec, a result that is not JSON, a huge input: a readable page, never a 500."""

    def test_damaged_rows_are_a_readable_error(self, hostile):
        server, _, ids = hostile
        for run_id, says in ((ids["bad_spec"], "spec"), (ids["bad_result"], "JSON")):
            for path in (f"/runs/{run_id}", f"/runs/{run_id}/live?after=-1"):
                answer = server.get(path)
                assert_clean_error(answer, 503)
                assert says in answer.body, path
            assert server.get("/runs").status == 200  # the rest of the journal still reads
        assert_clean_error(server.get("/machines/bad-spec"), 503)
        assert server.get("/machines/damaged").status == 200
        check = server.checked()
        assert check.status == 200
        assert "bad-spec" in check.body

    def test_lone_surrogates_are_shown_escaped(self, hostile):
        server, _, ids = hostile
        answer = server.get(f"/runs/{ids['surrogates']}")
        assert answer.status == 200, answer.body[:300]
        page = assert_inert(answer.body, svgs=1)
        for escaped in ("\\ud800", "\\udbff", "E\\ud800", "m\\udfff"):
            assert escaped in page.text, escaped
        live = server.get(f"/runs/{ids['surrogates']}/live?after=-1")
        assert live.status == 200
        assert "m\udfff" in Page(json.loads(live.body)["rows"]).text  # a JSON escape there
        artifact = server.get(f"/runs/{ids['surrogates']}/artifacts/lone")
        assert artifact.status == 200
        assert json.loads(artifact.body) == {"x": "\udc00"}  # still the same JSON

    def test_a_huge_input_is_shown_truncated(self, hostile):
        server, _, ids = hostile
        answer = server.get(f"/runs/{ids['big']}")
        assert answer.status == 200
        assert len(answer.body) < 1_000_000, len(answer.body)  # its input is 3 MB
        page = assert_inert(answer.body, svgs=1)
        assert "characters more" in page.text
        assert "fsm-runner show" in page.text


WRITER = """
import sys
from fsm_runner import Engine, SqliteJournal
from tests.helpers import linear_spec
with SqliteJournal(sys.argv[1]) as journal:
    engine = Engine(linear_spec("a", "b", "c"), journal=journal,
                    handlers={p: (lambda ctx: "NEXT") for p in "abc"})
    print("ready", flush=True)
    for n in range(int(sys.argv[2])):
        engine.run(engine.start({"n": n}))
"""


class TestReadingWhileWriting:
    """Another process commits runs while the inspector reads: every page answers, consistent."""

    def test_pages_during_writes(self, tmp_path):
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            handlers = {p: (lambda ctx: NEXT) for p in "abc"}
            Engine(linear_spec("a", "b", "c"), handlers=handlers, journal=journal).start()
        server = Server(str(path))
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "1000"], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert writer.stdout.readline() == "ready\n"
            reads = during = 0
            while writer.poll() is None or reads < 5:
                reads += 1
                during += writer.poll() is None  # this read began while the writer committed
                listing = server.get("/runs?machine=linear")
                assert listing.status == 200, listing.body[:300]
                shown = re.findall(r'data-run-id="([^"]+)"', listing.body)
                assert shown, "no runs listed"
                newest = shown[0]
                run = server.get(f"/runs/{newest}")
                assert run.status == 200, run.body[:300]
                seqs = [int(s) for s in re.findall(r'<tr class="transition[^"]*" data-seq="(\d+)"',
                                                   run.body)]  # fmt: skip
                assert seqs == list(range(len(seqs))), seqs  # gapless, as committed
                live = json.loads(server.get(f"/runs/{newest}/live?after=0").body)
                assert live["seq"] >= seqs[-1]
                assert server.get("/machines/linear").status == 200
            assert writer.wait(timeout=60) == 0
            assert during >= 1  # not how many: a loaded machine reads slowly, the writer is quick
            final = server.get("/runs?machine=linear&status=succeeded").body
            assert len(re.findall(r'data-run-id="([^"]+)"', final)) == 50  # a full page
        finally:
            if writer.poll() is None:
                writer.kill()
            writer.communicate()
            _, err = server.stop()
        assert "locked" not in err
        assert "Traceback" not in err


class TestExposure:
    """Bound to loopback only; no request without --allow-actions changes the journal."""

    def test_listens_on_loopback_only(self, hostile):
        server, _, _ = hostile
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as lines:
                for line in list(lines)[1:]:
                    local, state = line.split()[1], line.split()[3]
                    address, port = local.split(":")
                    if state == "0A" and int(port, 16) == server.port:  # LISTEN
                        listening.append(address)
        assert listening == ["0100007F"]  # 127.0.0.1, and nothing on IPv6

    def test_no_request_writes(self, hostile):
        server, path, ids = hostile
        before = dump(path)
        waiting = quote(ids["waiting"], safe="")
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            for route in ("abort", "fork", "live", "artifacts/x", ""):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
                conn.request(
                    method,
                    f"/runs/{waiting}/{route}",
                    body=b"reason=x&at=0",
                    headers={"Content-Type": "application/x-www-form-urlencoded"},
                )
                assert conn.getresponse().status < 500
                conn.close()
        assert dump(path) == before


def dump(path) -> str:
    """The journal's whole content as SQL (a connection of its own, closed)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return "\n".join(conn.iterdump())


#: Chromium on a run's page, in a process of its own (test_ui.py's Playwright may be running in
#: this one, and a second sync Playwright cannot start beside it): says "live" once the page
#: polls, then, told "go", waits for the run's last row and prints what the page shows.
BROWSE = """
import json, sys
from playwright.sync_api import sync_playwright
url, chromium = sys.argv[1:]
with sync_playwright() as playwright:
    browser = playwright.chromium.launch(executable_path=chromium)
    page = browser.new_page()
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(url)
    print(page.locator("#run").get_attribute("data-live"), flush=True)
    sys.stdin.readline()
    page.locator("#run[data-ended='true']").wait_for()  # no wait_for_function: CSP, no eval
    shown = {
        "dialogs": dialogs,
        "event": page.locator("#timeline-rows tr[data-seq='1'] td.event").inner_text(),
        "current": page.locator("#diagram svg.fsm g.node.current").get_attribute("data-state"),
        "foreign": page.locator("img, iframe, foreignObject").count(),
        "scripts": page.locator("script").count(),
    }
    browser.close()
print(json.dumps(shown), flush=True)
"""


@pytest.mark.slow
class TestInBrowser:
    """In chromium: hostile rows a live update appends run no script and show as text."""

    def test_live_rows_stay_text(self, tmp_path, monkeypatch):
        # The run is advanced under an id from before the rule of run ids, as a writer of
        # then would: the rule's refusal to drive it (journal._head) is set aside here.
        monkeypatch.setattr(_head, "check_stored_id", lambda _run_id: None)
        path = tmp_path / "journal.db"
        with SqliteJournal(path) as journal:
            engine = Engine(HOSTILE_SPEC, handlers={"parse": _parse}, journal=journal)
            engine.start({"doc": ATTR}, run_id="shell")
        rename_run(path, "shell", run_id := SHELL_ID)  # an id written before the rule
        server = Server(str(path))
        url = f"{server.url}/runs/{quote(run_id, safe='')}"
        browse = subprocess.Popen([sys.executable, "-c", BROWSE, url, CHROMIUM], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert browse.stdout.readline() == "true\n"  # the page polls for updates
            with SqliteJournal(path) as journal:
                Engine(HOSTILE_SPEC, handlers={"parse": _parse}, journal=journal).run(run_id)
            out, _ = browse.communicate("go\n", timeout=60)
            shown = json.loads(out)
        finally:
            if browse.poll() is None:
                browse.kill()
                browse.communicate()
            server.stop()
        assert shown["dialogs"] == [], "a script from run data ran in the page"
        assert shown["event"] == EVENT  # the appended row shows it as text
        assert shown["current"] == "parsed"  # the redrawn diagram
        assert (shown["foreign"], shown["scripts"]) == (0, 1)
