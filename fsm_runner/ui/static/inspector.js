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
        jsonTrees(rows);
        // One page of rows at most: the oldest go, and the pages' links reach them.
        while (rows.rows.length > maxRows) {
          rows.deleteRow(0);
          showEarlierLink();
        }
      }
      if (update.diagram) {
        document.getElementById("diagram").innerHTML = update.diagram;
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
        if (progress.state !== "running") {
          window.location.reload(); // ended: the page shows what it found
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

// JSON payloads (input, context, outputs): a tree of folds, each object and array one
// <details>, built with text nodes only (nothing from the data is parsed as HTML). Text that
// is not whole JSON (cut short on the page) stays as it is.
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

document.addEventListener("DOMContentLoaded", () => {
  setupCopyButtons();
  localTimes(document);
  jsonTrees(document);
  setupRunsList();
  setupLive();
  setupCheck();
});
