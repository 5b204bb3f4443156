// fsm-runner inspector: copy buttons, local times, JSON shown as a tree, live updates of an
// active run's page, and the progress of the check running in the background.
// Plain JavaScript, no build step, nothing loaded from elsewhere.
"use strict";

function setupCopyButtons() {
  for (const button of document.querySelectorAll("button.copy:not([data-bound])")) {
    button.dataset.bound = "true";
    button.addEventListener("click", async () => {
      const text = document.getElementById(button.dataset.copy).textContent;
      try {
        await navigator.clipboard.writeText(text);
        button.textContent = "copied";
      } catch (err) {
        // no clipboard (not a secure context): select the text for Ctrl-C instead
        const range = document.createRange();
        range.selectNodeContents(document.getElementById(button.dataset.copy));
        const selection = window.getSelection();
        selection.removeAllRanges();
        selection.addRange(range);
        button.textContent = "selected";
      }
    });
  }
}

function setupLive() {
  const run = document.getElementById("run");
  if (!run || run.dataset.live !== "true") {
    return;
  }
  const pollMs = Number(run.dataset.pollMs) || 1000;
  const maxRows = Number(run.dataset.pageRows) || 200;
  const url = "/runs/" + encodeURIComponent(run.dataset.runId) + "/live";

  function showEarlierLink() {
    const pages = document.querySelector("nav.pages");
    if (pages && !pages.querySelector("a.earlier")) {
      pages.insertAdjacentHTML("afterbegin", '<a class="earlier" href="?from=0">« first</a> ');
    }
  }
  let seq = Number(run.dataset.seq);
  let lastSignals = null; // the signals table as the last update gave it
  let timer = null;

  async function poll() {
    try {
      const response = await fetch(url + "?after=" + seq, { headers: { Accept: "application/json" } });
      if (!response.ok) {
        throw new Error("HTTP " + response.status);
      }
      const update = await response.json();
      const badge = document.getElementById("live-badge");
      badge.textContent = "live"; // answered again (after a restart of the server too)
      if (update.rows) {
        const rows = document.getElementById("timeline-rows");
        if (update.gap) {
          rows.innerHTML = ""; // the run raced ahead: the last page alone, contiguous
          showEarlierLink();
        }
        rows.insertAdjacentHTML("beforeend", update.rows);
        jsonTrees(rows); // their outputs' viewers, as the page's own rows have them
        setupCopyButtons();
        // One page of rows at most: the oldest go, and the pages' links reach them.
        while (rows.rows.length > maxRows) {
          rows.deleteRow(0);
          showEarlierLink();
        }
      }
      if (update.diagram) {
        const diagram = document.getElementById("diagram");
        diagram.innerHTML = update.diagram;
        relayoutDiagrams(diagram);
      }
      const signals = document.getElementById("signals");
      if (signals && typeof update.signals === "string" && update.signals !== lastSignals) {
        signals.innerHTML = update.signals; // rendered (escaped) by the server, as rows are
        lastSignals = update.signals;
      }
      const waiting = document.getElementById("waiting-panel");
      if (waiting && typeof update.waiting === "string") {
        waiting.innerHTML = update.waiting; // the run moved: what it waits for now, if anything
      }
      seq = update.seq;
      run.dataset.seq = String(seq);
      document.getElementById("run-seq").textContent = String(seq);
      document.getElementById("run-state").textContent = update.state;
      const status = document.getElementById("run-status");
      status.textContent = update.status;
      status.className = "status " + update.status;
      if (update.ended) {
        // The lease, the resume line, the fork's seq and the abort form end with the run: its
        // summary and commands as the server renders them now (escaped there, as rows are).
        document.getElementById("run-summary").innerHTML = update.summary;
        document.getElementById("run-commands").innerHTML = update.commands;
        setupCopyButtons();
        localTimes(document);
        jsonTrees(document);
        run.dataset.ended = "true";
        run.dataset.live = "false";
        return; // no more polling
      }
    } catch (err) {
      document.getElementById("live-badge").textContent = "live (retrying)";
    }
    timer = window.setTimeout(poll, pollMs);
  }
  timer = window.setTimeout(poll, pollMs);
  window.addEventListener("pagehide", () => window.clearTimeout(timer));
}

// The ended check's section, put in place of the running one's. Not a reload: a navigation of
// the page's own would cancel one the reader has just begun (a link clicked mid-poll).
async function showFound(check) {
  const response = await fetch("/check", { headers: { Accept: "text/html" } });
  if (!response.ok) {
    return false;
  }
  const page = new DOMParser().parseFromString(await response.text(), "text/html");
  const found = page.getElementById("check");
  if (!found || found.dataset.state === "running") {
    return false; // started again meanwhile: poll on
  }
  check.replaceWith(found);
  localTimes(found);
  return true;
}

function setupCheck() {
  const check = document.getElementById("check");
  if (!check || check.dataset.state !== "running") {
    return;
  }
  const pollMs = Number(check.dataset.pollMs) || 1000;
  let timer = null;

  async function poll() {
    try {
      const response = await fetch("/check/progress", { headers: { Accept: "application/json" } });
      if (response.ok) {
        const progress = await response.json();
        if (progress.state !== "running" && (await showFound(check))) {
          return;
        }
        document.getElementById("check-done").textContent = String(progress.done);
        if (progress.total) {
          const bar = document.getElementById("check-progress");
          bar.value = Math.min(100, Math.round((100 * progress.done) / progress.total));
        }
      }
    } catch (err) {
      // the server is away for a moment: poll again
    }
    timer = window.setTimeout(poll, pollMs);
  }
  timer = window.setTimeout(poll, pollMs);
  window.addEventListener("pagehide", () => window.clearTimeout(timer));
}

// Times: the server writes UTC (kept on hover); shown here in the reader's own time zone, with
// how long ago.
function pad(number) {
  return String(number).padStart(2, "0");
}

function ago(seconds) {
  const units = [["day", 86400], ["h", 3600], ["min", 60], ["s", 1]];
  const future = seconds < 0;
  const span = Math.abs(seconds);
  for (const [unit, size] of units) {
    if (span >= size || unit === "s") {
      const count = Math.floor(span / size);
      const text = unit === "day" ? count + (count === 1 ? " day" : " days") : count + " " + unit;
      return future ? "in " + text : text + " ago";
    }
  }
  return "";
}

function localTimes(root) {
  for (const element of root.querySelectorAll("time[datetime]:not([data-local])")) {
    const moment = new Date(element.getAttribute("datetime"));
    if (Number.isNaN(moment.getTime())) {
      continue;
    }
    const local =
      moment.getFullYear() + "-" + pad(moment.getMonth() + 1) + "-" + pad(moment.getDate()) +
      " " + pad(moment.getHours()) + ":" + pad(moment.getMinutes()) + ":" + pad(moment.getSeconds());
    element.textContent = local + " (" + ago((Date.now() - moment.getTime()) / 1000) + ")";
    element.dataset.local = "true";
  }
}

// JSON payloads (input, context, outputs, artifacts; templates/json_view.html): a tree of
// folds, each object and array one <details>, built with text nodes only (nothing from the
// data is parsed as HTML). Text that is not whole JSON (cut short on the page) stays as it is.
function jsonNode(value, key) {
  const label = key === null ? "" : JSON.stringify(key) + ": ";
  if (value !== null && typeof value === "object") {
    const entries = Array.isArray(value) ? value.map((v, i) => [i, v]) : Object.entries(value);
    const fold = document.createElement("details");
    fold.className = "json-fold";
    fold.open = key === null || entries.length <= 5;
    const summary = document.createElement("summary");
    const brackets = Array.isArray(value) ? ["[", "]"] : ["{", "}"];
    summary.textContent = label + brackets[0] + " " + entries.length + (entries.length === 1 ? " item " : " items ") + brackets[1];
    fold.appendChild(summary);
    const list = document.createElement("div");
    list.className = "json-items";
    for (const [k, v] of entries) {
      list.appendChild(jsonNode(v, Array.isArray(value) ? null : k));
    }
    fold.appendChild(list);
    return fold;
  }
  const leaf = document.createElement("div");
  leaf.className = "json-leaf";
  leaf.textContent = label + JSON.stringify(value);
  return leaf;
}

function jsonTrees(root) {
  for (const pre of root.querySelectorAll("pre.json:not([data-tree])")) {
    pre.dataset.tree = "true";
    let value;
    try {
      value = JSON.parse(pre.textContent);
    } catch (err) {
      continue;
    }
    if (value === null || typeof value !== "object") {
      continue;
    }
    const tree = jsonNode(value, null);
    tree.classList.add("json-tree");
    pre.hidden = true; // kept: the copy button copies the JSON as it is
    pre.after(tree);
  }
}

// The newest page of runs refreshes its rows (new runs, states moving on) every two seconds.
function setupRunsList() {
  const rows = document.getElementById("runs-rows");
  if (!rows || rows.dataset.live === undefined) {
    return;
  }
  const pollMs = Number(rows.dataset.pollMs) || 5000;
  const url = "/runs?" + (rows.dataset.live ? rows.dataset.live + "&" : "") + "rows=1";
  let timer = null;

  async function poll() {
    try {
      const response = await fetch(url, { headers: { Accept: "text/html" } });
      if (response.ok) {
        rows.innerHTML = await response.text(); // rendered (escaped) by the server
        localTimes(rows);
      }
    } catch (err) {
      // the server is away for a moment: ask again
    }
    timer = window.setTimeout(poll, pollMs);
  }
  timer = window.setTimeout(poll, pollMs);
  window.addEventListener("pagehide", () => window.clearTimeout(timer));
}

// Diagrams the server could not lay out with Graphviz (no `dot` there): it drew its built-in
// layout and gave the DOT Graphviz would have laid out (data-dot). Viz.js, Graphviz compiled to
// WebAssembly and served from here, lays that out in the page, and what was drawn moves to
// where Graphviz puts it, as fsm_runner/ui/dot_layout.py places it from `dot -Tjson`.
const LAYOUT_MARGIN = 24; // dot_layout._MARGIN
const LABEL_H = 14; // geometry.LABEL_H
const COMPOSITE_PAD = 14; // svg._PAD
const INITIAL = "$initial"; // diagrams.dot.INITIAL
let vizReady = null;
const layouts = new Map(); // DOT text -> Graphviz's answer (a live run's diagram repeats)

function loadViz() {
  if (vizReady === null) {
    vizReady = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = "/static/viz-global.js";
      script.onload = () => window.Viz.instance().then(resolve, reject);
      script.onerror = reject;
      document.head.appendChild(script);
    });
  }
  return vizReady;
}

function numbers(text) {
  return text.split(",").map(Number);
}

// The moves of one diagram to Graphviz's places: computed whole before any is made, so an
// answer not as expected leaves the built-in layout as it was.
function layoutMoves(svg, answer) {
  const [, , width, height] = numbers(answer.bb);
  const point = (text) => {
    const [x, y] = numbers(text);
    return [x + LAYOUT_MARGIN, height - y + LAYOUT_MARGIN];
  };
  const f = (n) => n.toFixed(1);
  const path = (spline) => {
    let end = null;
    const points = [];
    for (const token of spline.split(";")[0].trim().split(/\s+/)) {
      if (token.startsWith("e,")) {
        end = point(token.slice(2));
      } else if (!token.startsWith("s,")) {
        points.push(point(token));
      }
    }
    const parts = ["M" + f(points[0][0]) + "," + f(points[0][1])];
    for (let i = 1; i < points.length - 2; i += 3) {
      const [a, b, c] = points.slice(i, i + 3);
      parts.push("C" + [a, b, c].map((p) => f(p[0]) + "," + f(p[1])).join(" "));
    }
    if (end !== null) {
      parts.push("L" + f(end[0]) + "," + f(end[1]));
    }
    return parts.join(" ");
  };
  const centres = new Map();
  const clusters = new Map();
  let start = null;
  for (const item of answer.objects || []) {
    if (item.bb && item.name.startsWith("cluster_")) {
      const [x0, y0, x1, y1] = numbers(item.bb);
      clusters.set(item.name.slice(8), [x0 + LAYOUT_MARGIN, height - y1 + LAYOUT_MARGIN, x1 - x0, y1 - y0]);
    } else if (item.name === INITIAL && item.pos) {
      start = point(item.pos);
    } else if (item.pos) {
      centres.set(item.name, point(item.pos));
    }
  }
  const edges = new Map((answer.edges || []).filter((e) => e.id).map((e) => [e.id, e]));
  const attr = (el, name) => Number(el.getAttribute(name));
  const moves = [];
  for (const g of svg.querySelectorAll("g.node")) {
    const centre = centres.get(g.dataset.state);
    const shape = g.querySelector("rect.outer") || g.querySelector("rect, circle");
    const [x, y] = shape.tagName === "circle"
      ? [attr(shape, "cx"), attr(shape, "cy")]
      : [attr(shape, "x") + attr(shape, "width") / 2, attr(shape, "y") + attr(shape, "height") / 2];
    const shift = "translate(" + f(centre[0] - x) + "," + f(centre[1] - y) + ")";
    const badge = svg.querySelector('g.badge[data-state="' + CSS.escape(g.dataset.state) + '"]');
    moves.push(() => g.setAttribute("transform", shift));
    if (badge) {
      moves.push(() => badge.setAttribute("transform", shift));
    }
  }
  for (const g of svg.querySelectorAll("g.composite")) {
    const [x, y, w, h] = clusters.get(g.dataset.state);
    const rect = g.querySelector("rect");
    const title = g.querySelector("text");
    moves.push(() => {
      rect.setAttribute("x", f(x));
      rect.setAttribute("y", f(y));
      rect.setAttribute("width", f(w));
      rect.setAttribute("height", f(h));
      title.setAttribute("x", f(x + COMPOSITE_PAD));
      title.setAttribute("y", f(y + 16));
    });
  }
  const widest = new Map(); // a state's loops: their labels stacked, left-aligned
  for (const g of svg.querySelectorAll("g.edge[data-layout-id]")) {
    const w = attr(g.querySelector("rect"), "width");
    widest.set(g.dataset.layoutId, Math.max(w, widest.get(g.dataset.layoutId) || 0));
  }
  for (const g of svg.querySelectorAll("g.edge[data-layout-id]")) {
    const edge = edges.get(g.dataset.layoutId);
    const [k, n] = g.dataset.stack.split(" ").map(Number);
    const [x, y] = point(edge.lp);
    const left = x - widest.get(g.dataset.layoutId) / 2;
    const top = y - (LABEL_H * n) / 2 + LABEL_H * k;
    const d = path(edge.pos);
    const rect = g.querySelector("rect");
    const text = g.querySelector("text");
    const w = attr(rect, "width");
    moves.push(() => {
      g.querySelector("path").setAttribute("d", d);
      rect.setAttribute("x", f(left));
      rect.setAttribute("y", f(top));
      text.setAttribute("x", f(left + w / 2));
      text.setAttribute("y", f(top + LABEL_H / 2 + 3.5));
    });
  }
  const initial = svg.querySelector("g.initial");
  if (initial && start !== null && edges.has("initial")) {
    const d = path(edges.get("initial").pos);
    moves.push(() => {
      initial.querySelector("circle").setAttribute("cx", f(start[0]));
      initial.querySelector("circle").setAttribute("cy", f(start[1]));
      initial.querySelector("path").setAttribute("d", d);
    });
  }
  const w = (width + 2 * LAYOUT_MARGIN).toFixed(0);
  const h = (height + 2 * LAYOUT_MARGIN).toFixed(0);
  moves.push(() => {
    svg.setAttribute("width", w);
    svg.setAttribute("height", h);
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.dataset.layout = "viz";
  });
  return moves;
}

async function relayoutDiagrams(root) {
  const diagrams = root.querySelectorAll("svg.fsm[data-layout='builtin'][data-dot]");
  if (diagrams.length === 0) {
    return;
  }
  let viz;
  try {
    viz = await loadViz();
  } catch (err) {
    return; // no WebAssembly here: the built-in layout stays
  }
  for (const svg of diagrams) {
    try {
      const dot = svg.dataset.dot;
      if (!layouts.has(dot)) {
        layouts.set(dot, viz.renderJSON(dot));
      }
      for (const move of layoutMoves(svg, layouts.get(dot))) {
        move();
      }
    } catch (err) {
      svg.dataset.layout = "builtin-kept"; // laid out as the server drew it
    }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  relayoutDiagrams(document);
  setupCopyButtons();
  localTimes(document);
  jsonTrees(document);
  setupRunsList();
  setupLive();
  setupCheck();
});
