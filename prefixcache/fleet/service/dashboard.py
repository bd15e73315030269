"""``GET /dashboard``: a live page of the fleet, served by the service itself.

The page is static (no data in it, so it is open like ``/health``); its script reads the
operator endpoints every few seconds (``?every=N``, 3 by default) and redraws in place, without
reloading: each replica's state (up, degraded and why, in flight, blocks the index holds), the
what-if curves (``/v1/whatif``: token hit rate against KV capacity, each replica's and the
fleet's as one cache, drawn as SVG on a log axis; the table gives each point with two standard
errors, the rate sampled now and the one asked for, and no figure for a curve whose sample is
too small to answer; no fleet line for replicas of several block sizes), the counterfactual
fleets (N-1, N+1 and 2N replicas, each other policy: the last replay of the recorded trace, and
a button that starts one, ``POST /v1/whatif/counterfactuals``), and where reuse went per
tenant and model (``/v1/stats``: available, captured, delivered). With API keys the endpoints
want an operator key: the page asks for one and keeps it in the tab's session storage only.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import HTMLResponse

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>prefixcache fleet</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
 h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
 table { border-collapse: collapse; } td, th { padding: 3px 10px; border-bottom: 1px solid #ddd;
 text-align: right; } td:first-child, th:first-child { text-align: left; }
 .bad { color: #b3261e; font-weight: 600; } .ok { color: #1b7a3a; } .muted { color: #777; }
 #key { display: none; margin: 12px 0; } .reason { text-align: left; max-width: 640px; }
 svg text { font-size: 11px; fill: #444; }
</style></head>
<body data-refreshes="0">
<h1>prefixcache fleet</h1>
<div class="muted" id="status">loading...</div>
<form id="key"><label>Operator key <input type="password" id="keyvalue" size="40"></label>
 <button>Use</button> <span class="muted">(kept in this tab only)</span></form>
<h2>Replicas</h2>
<table id="replicas"><thead><tr><th>Replica</th><th>State</th><th>In flight</th>
<th>Index blocks</th><th>Capacity</th><th>Reported requests</th><th class="reason">Why</th>
</tr></thead><tbody></tbody></table>
<h2>What more KV memory would buy</h2>
<div class="muted" id="whatif-note"></div>
<svg id="curves" width="720" height="320" role="img" aria-label="what-if curves"></svg>
<table id="points"><thead></thead><tbody></tbody></table>
<h2>Other fleets, same traffic</h2>
<div class="muted" id="counterfactuals-note"></div>
<button id="replay">Replay the recorded window</button>
<table id="counterfactuals"><thead><tr><th>Fleet</th><th>Replicas</th><th>Policy</th>
<th>Token hit rate</th><th>Replay</th></tr></thead><tbody></tbody></table>
<h2>Where reuse went</h2>
<table id="attribution"><thead><tr><th>Tenant</th><th>Model</th><th>Requests</th>
<th>Available</th><th>Captured</th><th>Delivered</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"];
const FLEET_COLOR = "#111111";
const every = Number(new URLSearchParams(location.search).get("every")) || 3;
function key() { return sessionStorage.getItem("prefixcache-key"); }
document.getElementById("key").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("prefixcache-key", document.getElementById("keyvalue").value);
  refresh();
});
async function get(path, method) {
  const headers = key() ? {"authorization": "Bearer " + key()} : {};
  const r = await fetch(path, {headers, method: method || "GET"});
  if (r.status === 401 || r.status === 403) {
    document.getElementById("key").style.display = "block";
    throw new Error("an operator key is needed");
  }
  const body = await r.json();
  if (!r.ok) throw new Error(path + " answered " + r.status + ": " +
    ((body.error || {}).message || ""));
  return body;
}
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function ratePct(x) { return x >= 0.01 ? pct(x) : (100 * x).toPrecision(2) + "%"; }
function esc(t) {
  return String(t).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;"})[c]);
}
function cell(row, text, cls) {
  const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td;
}
function fill(id, rows, make) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  for (const r of rows) make(body.insertRow(), r);
}
function drawCurves(w) {
  const svg = document.getElementById("curves");
  const W = 720, H = 320, L = 56, R = 150, T = 12, B = 36;
  const all = [...w.replicas, w.fleet].filter((c) => c.points.length);
  // a curve whose sample is too small to answer has no figures: listed, not drawn
  const curves = all.filter((c) => !c.too_few_sampled);
  const xs = w.factors.map(Math.log2), x0 = Math.min(...xs), x1 = Math.max(...xs);
  const X = (f) => L + (Math.log2(f) - x0) / (x1 - x0) * (W - L - R);
  const Y = (h) => T + (1 - h) * (H - T - B);
  let s = "";
  for (const t of [0, 0.25, 0.5, 0.75, 1]) {
    s += `<line x1="${L}" x2="${W - R}" y1="${Y(t)}" y2="${Y(t)}" stroke="#eee"/>`;
    s += `<text x="${L - 6}" y="${Y(t) + 4}" text-anchor="end">${pct(t)}</text>`;
  }
  for (const f of w.factors) {
    s += `<text x="${X(f)}" y="${H - B + 16}" text-anchor="middle">${f}x</text>`;
  }
  s += `<text x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle">` +
    "KV capacity (x today's)</text>";
  curves.forEach((c, i) => {
    const color = c.name === "fleet" ? FLEET_COLOR : COLORS[i % COLORS.length];
    const pts = c.points.map((p) => `${X(p.factor)},${Y(p.token_hit_rate)}`).join(" ");
    const dash = c.name === "fleet" ? ' stroke-dasharray="6 4"' : "";
    s += `<polyline fill="none" stroke="${color}" stroke-width="2.5"${dash} points="${pts}"/>`;
    const label = c.name === "fleet" ? "fleet as one cache" : c.name;
    s += `<text x="${W - R + 8}" y="${T + 14 + 16 * i}" style="fill: ${color}">` +
      `${esc(label)}</text>`;
  });
  svg.innerHTML = s;
  const head = document.querySelector("#points thead");
  head.innerHTML =
    "<tr><th>Curve</th>" + w.factors.map((f) => `<th>${f}x</th>`).join("") + "</tr>";
  fill("points", all, (row, c) => {
    cell(row, c.name);
    for (const p of c.points) {
      cell(row, p.token_hit_rate === null ? "-" :
        `${pct(p.token_hit_rate)} \u00b1 ${(100 * 2 * p.stderr).toFixed(1)}`);
    }
  });
  // the rate the curves sample at now; the one asked for when the memory bound lowered it
  const sampling = w.sampling;
  const lowered = !sampling.rate_lowered ? "" :
    ` (asked ${ratePct(sampling.requested_rate)}, lowered to stay within ` +
    "whatif.max_memory_mib)";
  const few = all.filter((c) => c.too_few_sampled && c.points.length).map((c) => c.name);
  const tooFew = !few.length ? "" :
    `; too few sampled blocks to answer for ${few.join(", ")} (under ` +
    `${all[0].min_sampled_blocks}): raise whatif.rate or wait for more traffic`;
  const note = document.getElementById("whatif-note");
  note.className = few.length ? "bad" : "muted";
  note.textContent =
    `sampling ${ratePct(sampling.rate)} of blocks${lowered}, ` +
    `${w.window.routed_requests} routed requests in ${Math.round(w.window.seconds)} s; ` +
    `LRU estimate (SHARDS), \u00b1 two standard errors${tooFew}` +
    (w.fleet.mixed_block_sizes ? `; no fleet line: the replicas' block sizes differ ` +
      `(${w.fleet.mixed_block_sizes.join(", ")})` : "");
}
let replayError = "";  // why the last start was refused, until one is not
function drawCounterfactuals(c) {
  fill("counterfactuals", c.scenarios, (row, r) => {
    cell(row, r.scenario); cell(row, r.replicas); cell(row, r.policy);
    cell(row, r.token_hit_rate === null ? "-" : pct(r.token_hit_rate));
    cell(row, r.seconds === null ? "" : r.seconds.toFixed(1) + " s");
  });
  const note = document.getElementById("counterfactuals-note");
  note.className = c.state === "failed" ? "bad" : "muted";
  document.getElementById("replay").disabled = c.state === "running";
  const when = c.finished_at ? new Date(1000 * c.finished_at).toLocaleTimeString() : "";
  const span = c.window_requests === null || c.window_requests === undefined ? "" :
    ` over ${c.window_requests} recorded requests`;
  note.textContent = {
    idle: "no replay yet: replay the recorded window (needs --record-trace)",
    running: `replaying${span}: ${c.scenarios.filter((r) => r.seconds !== null).length} ` +
      `of ${c.scenarios.length} fleets done`,
    done: `replay${span}, replicas of ${c.capacity_blocks} blocks, finished ${when}; ` +
      "the prompts alone, no load",
    failed: `the replay failed: ${c.error}`,
  }[c.state] + (replayError ? "; " + replayError : "");
  if (replayError) note.className = "bad";
}
document.getElementById("replay").addEventListener("click", async () => {
  try {
    const state = await get("/v1/whatif/counterfactuals", "POST");
    replayError = "";
    drawCounterfactuals(state);
  } catch (err) {
    replayError = String(err);
    drawCounterfactuals(await get("/v1/whatif/counterfactuals"));
  }
});
async function refresh() {
  try {
    const [reps, whatif, stats] = await Promise.all(
      [get("/v1/replicas"), get("/v1/whatif"), get("/v1/stats")]);
    document.getElementById("key").style.display = "none";
    fill("replicas", reps.replicas, (row, r) => {
      cell(row, r.name);
      const state = !r.up ? "down" : r.degraded ? "degraded" : "up";
      cell(row, state, state === "up" ? "ok" : "bad");
      cell(row, r.in_flight); cell(row, r.index_blocks); cell(row, r.capacity_blocks);
      cell(row, r.delivery.requests);
      cell(row, r.degraded_reason || r.down_reason || "", "reason");
    });
    drawCurves(whatif);
    drawCounterfactuals(whatif.counterfactuals);
    fill("attribution", stats.attribution, (row, a) => {
      const p = a.prompt_tokens || 1;
      cell(row, a.tenant || "(none)"); cell(row, a.model); cell(row, a.requests);
      cell(row, pct(a.available_tokens / p)); cell(row, pct(a.captured_tokens / p));
      cell(row, pct(a.delivered_tokens / p));
    });
    const n = Number(document.body.dataset.refreshes) + 1;
    document.body.dataset.refreshes = String(n);
    document.getElementById("status").textContent =
      `policy ${reps.policy}; updated ${new Date().toLocaleTimeString()} (every ${every} s)`;
  } catch (err) {
    document.getElementById("status").textContent = String(err);
  }
}
refresh();
setInterval(refresh, every * 1000);
</script></body></html>
"""


async def dashboard(request: Request) -> HTMLResponse:
    """The live page (static: its script reads the operator endpoints)."""
    return HTMLResponse(PAGE)
