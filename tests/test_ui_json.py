"""The run page's JSON viewer for outputs and artifacts (issue 32, point 4).

Input and context were already a collapsible tree with a copy button; a transition's output
and an artifact's content (the journal's, JSON or text) get the same viewer, on a real
``fsm-runner ui`` server over SQLite and PostgreSQL, in Debian's chromium: an output's tree
folds and unfolds, its copy button puts the exact JSON in the clipboard (a short output stays
inline, with its button), an artifact's content is shown and copied, a row the live update
appends gets the viewer too, and HTML in an output or an artifact is shown as text.
"""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from fsm_runner import ArtifactRecord, Engine, PhaseResult
from fsm_runner.journal import open_journal
from fsm_runner.ui import payloads
from tests.helpers import NEXT, linear_spec
from tests.ui_helpers import Server, journal_location

#: One worker runs the module: its journals and servers are made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui-json")]

#: Longer than a line (80 characters): a fold, opened as a tree. "lines" has more than five
#: items: its own fold starts closed.
LONG = {
    "order": {"id": 42, "lines": [1, 2, 3, 4, 5, 6, 7]},
    "note": 'ünïcode ✓ and "quotes"',
    "ok": True,
    "nothing": None,
}
SHORT = {"tokens": 1234, "tag": "<i>not italic</i>"}  # inline, as it is
#: Markup in an output: shown as text, never made into elements (nor run).
HTML = {
    "html": '<img src=x onerror="window.hacked = 1"><script>window.hacked = 2</script>',
    "bold": "<b>not bold</b>",
}
REPORT = {"passed": 3, "failed": ["test_a", "test_b"], "html": "<b>not bold</b>", "ratio": 0.6}
LOG = "line 1\n<b>line 2</b>\n  indented ✓\n"

SPEC = linear_spec("long", "short", "html", name="json-view")
HANDLERS = {
    "long": lambda _: PhaseResult(
        NEXT,
        output=LONG,
        artifacts=[
            ArtifactRecord("report", "verification_report", content=REPORT),
            ArtifactRecord("log", "log", content=LOG),
            ArtifactRecord("marker", "marker"),  # no content: nothing to view
        ],
    ),
    "short": lambda _: PhaseResult(NEXT, output=SHORT),
    "html": lambda _: PhaseResult(NEXT, output=HTML),
}


def compact(value) -> str:
    """An output's JSON as the page holds it (and its copy button copies it)."""
    return json.dumps(value, ensure_ascii=False)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def site(request, tmp_path_factory):
    """A run that took every step (outputs, artifacts), on a server of its own per journal."""
    with journal_location(request, request.param, tmp_path_factory.mktemp("json")) as location:
        journal = open_journal(location)
        with Engine(SPEC, handlers=HANDLERS, journal=journal) as engine:
            run_id = engine.start({})
            engine.run(run_id)
        server = Server(location)
        try:
            yield server, journal, run_id
        finally:
            _, err = server.stop()
            journal.close()
        assert "Traceback" not in err


@pytest.fixture(scope="module")
def page(browser):
    """One page for the module's tests (as ``conftest.shared_page``), allowed the clipboard:
    each copy clears it first, so none reads what another test copied."""
    context = browser.new_context(
        viewport={"width": 1280, "height": 900}, permissions=["clipboard-read", "clipboard-write"]
    )
    yield context.new_page()
    context.close()


def clipboard(page) -> str:
    return page.evaluate("() => navigator.clipboard.readText()")


def output_cell(page, seq: int):
    return page.locator(f"#timeline-rows tr[data-seq='{seq}'] td.output")


def copy(page, button) -> str:
    """What clicking ``button`` puts in the clipboard (the button says it copied)."""
    page.evaluate("() => navigator.clipboard.writeText('')")
    button.click()
    expect(button).to_have_text("copied")
    return clipboard(page)


def test_an_outputs_tree_folds_and_its_copy_gives_the_exact_json(site, page):
    server, _, run_id = site
    page.goto(f"{server.url}/runs/{run_id}")
    cell = output_cell(page, 1)
    fold = cell.locator("details.payload.output")
    assert fold.locator("> summary").inner_text() == compact(LONG)[:60] + "…"
    tree = fold.locator(".json-tree")
    assert not tree.is_visible()  # folded until asked
    fold.locator("> summary").click()
    expect(tree).to_be_visible()
    root = tree.locator("> summary")
    assert root.inner_text() == "{ 4 items }"
    assert tree.locator("> .json-items > .json-leaf").all_inner_texts() == [
        '"note": "ünïcode ✓ and \\"quotes\\""',
        '"ok": true',
        '"nothing": null',
    ]
    order = tree.locator("details.json-fold", has_text='"order"').first
    lines = order.locator("details.json-fold")
    assert lines.locator("> summary").inner_text() == '"lines": [ 7 items ]'
    assert not lines.locator(".json-leaf").first.is_visible()  # more than five: closed
    lines.locator("> summary").click()
    assert lines.locator(".json-leaf").all_inner_texts() == [str(n) for n in range(1, 8)]
    root.click()  # the whole tree folds ...
    expect(order).to_be_hidden()
    root.click()  # ... and unfolds
    expect(order).to_be_visible()

    button = fold.locator("button.copy")
    assert button.get_attribute("aria-label") == "copy the output of seq 1"
    copied = copy(page, button)
    assert copied == compact(LONG)  # the JSON itself: not the tree's text, no "copy" in it
    assert json.loads(copied) == LONG


def test_a_short_output_stays_inline_with_its_copy_button(site, page):
    server, _, run_id = site
    page.goto(f"{server.url}/runs/{run_id}")
    cell = output_cell(page, 2)
    assert cell.locator("details").count() == 0
    assert cell.locator("code").inner_text() == compact(SHORT)
    assert json.loads(cell.inner_text()) == SHORT  # the cell's text: the JSON alone
    button = cell.locator("button.copy")
    assert button.inner_text() == ""  # its word drawn by the stylesheet
    assert page.evaluate("b => getComputedStyle(b, '::before').content", button.element_handle())
    assert copy(page, button) == compact(SHORT)


def test_html_in_an_output_stays_text(site, page):
    server, _, run_id = site
    page.goto(f"{server.url}/runs/{run_id}")
    inline = output_cell(page, 2)
    assert "<i>not italic</i>" in inline.inner_text()
    folded = output_cell(page, 3)
    folded.locator("details.payload > summary").click()
    leaves = folded.locator(".json-tree .json-leaf").all_inner_texts()
    assert leaves == [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in HTML.items()]
    rows = page.locator("#timeline-rows")
    assert rows.locator("img, script, b, i").count() == 0  # none became an element
    assert page.evaluate("window.hacked") is None
    assert copy(page, folded.locator("button.copy")) == compact(HTML)


def test_an_artifacts_content_is_shown_and_copied(site, page):
    server, _, run_id = site
    page.goto(f"{server.url}/runs/{run_id}")
    report = page.locator("table.artifacts tr[data-name='report'] td.content")
    report.locator("details.payload > summary").click()
    tree = report.locator(".json-tree")
    expect(tree).to_be_visible()
    assert tree.locator("> summary").inner_text() == "{ 4 items }"
    assert '"html": "<b>not bold</b>"' in tree.inner_text()  # as text
    assert '"failed": [ 2 items ]' in tree.inner_text()
    copied = copy(page, report.locator("button.copy"))
    assert copied == json.dumps(REPORT, ensure_ascii=False, indent=1)
    assert json.loads(copied) == REPORT

    log = page.locator("table.artifacts tr[data-name='log'] td.content")
    log.locator("details.payload > summary").click()
    text = log.locator("pre.artifact")
    expect(text).to_be_visible()  # text: shown as it is, no tree
    assert log.locator(".json-tree").count() == 0
    assert text.text_content() == LOG
    assert copy(page, log.locator("button.copy")) == LOG
    assert page.locator("table.artifacts").locator("b, img, script").count() == 0

    marker = page.locator("table.artifacts tr[data-name='marker'] td.content")
    assert marker.inner_text() == ""  # the journal holds no content of it
    assert page.locator("a.download").count() == 3  # the download links stay


def test_a_row_the_live_update_appends_gets_the_viewer(site, page):
    server, journal, _ = site
    with Engine(SPEC, handlers=HANDLERS, journal=journal) as engine:
        run_id = engine.start({})
        page.goto(f"{server.url}/runs/{run_id}")
        assert page.locator("#timeline-rows tr").count() == 1
        engine.step(run_id)  # seq 1: the long output, while the page is open
        engine.step(run_id)  # seq 2: the short one
    page.wait_for_selector("#timeline-rows tr[data-seq='2']", timeout=10_000)
    assert page.evaluate("document.getElementById('run').dataset.live") == "true"
    cell = output_cell(page, 1)
    cell.locator("details.payload > summary").click()
    expect(cell.locator(".json-tree")).to_be_visible()
    assert cell.locator(".json-tree > summary").inner_text() == "{ 4 items }"
    assert copy(page, cell.locator("button.copy")) == compact(LONG)
    assert copy(page, output_cell(page, 2).locator("button.copy")) == compact(SHORT)


def test_open_viewers_on_a_narrow_dark_screen(site, browser):
    """Every viewer open: no sideways scroll at 400 px, and the trees dark in dark mode."""
    server, _, run_id = site
    context = browser.new_context(viewport={"width": 400, "height": 800}, color_scheme="dark")
    try:
        page = context.new_page()
        page.goto(f"{server.url}/runs/{run_id}")
        page.evaluate("() => document.querySelectorAll('details').forEach(d => d.open = true)")
        assert page.evaluate("document.documentElement.scrollWidth") <= 400
        backgrounds = page.locator(".json-tree").evaluate_all(
            "trees => trees.map(t => getComputedStyle(t).backgroundColor)"
        )
        assert len(backgrounds) == 5  # input, context, the two long outputs, the report
        assert set(backgrounds) == {"rgb(22, 27, 34)"}  # --head in dark mode
    finally:
        context.close()


def test_big_contents_are_clipped_and_past_the_pages_share_left_to_the_download():
    """No browser: what the page is given of artifacts too big to show whole."""
    big = {"x": "y" * payloads.SHOWN_CHARS}
    many = payloads.ARTIFACT_CHARS // payloads.SHOWN_CHARS
    records = [ArtifactRecord(f"a{n}", content=big) for n in range(many + 1)]
    records.append(ArtifactRecord("small", content={"ok": True}))
    rows = payloads.artifact_rows(records)
    first = rows[0]
    assert (first["shown"], first["clipped"], first["withheld"]) == ("json", True, False)
    assert "characters more" in first["content"]  # said so, and no copy of part of it
    assert first["preview"] == '{"x": "' + "y" * 53 + "…"
    assert [row["withheld"] for row in rows] == [False] * many + [True, True]
    assert rows[-1]["content"] == ""
    assert payloads.artifact_rows([ArtifactRecord("t", content="a\nb")])[0]["shown"] == "text"
    assert payloads.artifact_rows([ArtifactRecord("none")])[0]["shown"] == ""
