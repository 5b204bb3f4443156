// fsm-runner inspector: copy buttons, live updates of an active run's page, and the progress
// of the check running in the background.
// Plain JavaScript, no build step, nothing loaded from elsewhere.
"use strict";

function setupCopyButtons() {
  for (const button of document.querySelectorAll("button.copy")) {
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
  const url = "/runs/" + encodeURIComponent(run.dataset.runId) + "/live";
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
      if (update.rows) {
        document.getElementById("timeline-rows").insertAdjacentHTML("beforeend", update.rows);
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
        run.dataset.ended = "true";
        run.dataset.live = "false";
        document.getElementById("live-badge").hidden = true;
        return; // the run has ended: no more polling
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

document.addEventListener("DOMContentLoaded", () => {
  setupCopyButtons();
  setupLive();
  setupCheck();
});
