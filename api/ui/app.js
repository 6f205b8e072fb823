// The cpn dashboard: reads the REST API every two seconds and redraws. Plain JavaScript;
// the charts are uPlot (vendored by scripts/setup.sh, served by cpn serve). Every value
// from the server is put in the page as text, never as HTML.
"use strict";

const REFRESH_MS = 2000;
// Re-read this many steps before the last one shown: a step's row can still gain ranks
// (and its loss, from the last stage) after it was first drawn.
const STEP_OVERLAP = 32;
const EVENTS_SHOWN = 50;
const state = { key: null, selected: null, pinned: false, charts: {}, series: null };

function readKey() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) {
    let key = null;
    try { key = decodeURIComponent(m[1]); } catch (e) { /* a malformed escape: ignored */ }
    if (key) localStorage.setItem("cpn-api-key", key);
    history.replaceState(null, "", location.pathname); // the key leaves the address bar
  }
  state.key = localStorage.getItem("cpn-api-key");
}

async function api(path) {
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  const reply = await fetch(path, { headers });
  if (!reply.ok) {
    let detail = `${reply.status}`;
    try { detail = (await reply.json()).detail || detail; } catch (e) { /* not JSON */ }
    const err = new Error(`${path}: ${detail}`);
    err.status = reply.status;
    throw err;
  }
  return reply.json();
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, attrs) {
  const tr = document.createElement("tr");
  for (const [k, v] of Object.entries(attrs || {})) tr.setAttribute(k, v);
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
  return tr;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  for (const [unit, scale] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
    if (n >= scale) return `${+(n / scale).toFixed(2)} ${unit}`;
  }
  return `${n} B`;
}

function ago(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  return s < 90 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(0)} min ago`;
}

async function refreshSites() {
  const sites = await api("/v1/sites");
  const agents = await Promise.all(
    sites.map((s) => api(`/v1/sites/${encodeURIComponent(s.name)}/agents`))
  );
  const siteRows = sites.map((s, i) => {
    const health = agents[i].map((a) => `${a.agent_id}: ${a.status}, ${a.health}`).join("; ");
    return row(
      [s.name, `${s.agents_alive} / ${s.agents_total}`,
       el("td", health || "no agent", s.agents_alive ? "ok" : "bad"),
       s.gpus_total, s.gpus_free, s.gpus_allocated, s.gpus_lost],
      { "data-site": s.name }
    );
  });
  fill(document.querySelector("#sites tbody"), siteRows);
  const seen = new Set();
  const linkRows = [];
  for (const s of sites) {
    for (const l of s.links) {
      // One row per direction: uplinks are often asymmetric.
      const key = `${s.name} → ${l.peer}`;
      if (seen.has(key)) continue;
      seen.add(key);
      linkRows.push(row(
        [key, `${(l.bandwidth_gbps * 1000).toFixed(1)} Mbit/s`, `${l.rtt_ms.toFixed(2)} ms`,
         ago(l.measured_at), l.reported_by],
        { "data-link": key }
      ));
    }
  }
  fill(document.querySelector("#links tbody"), linkRows);
}

function placement(job) {
  if (!job.plan) return job.reason || "–";
  const per = {};
  for (const sh of job.plan.shards) per[sh.site] = (per[sh.site] || 0) + sh.gpus.length;
  return Object.entries(per).map(([site, n]) => `${site}: ${n} GPU${n > 1 ? "s" : ""}`).join(", ");
}

function clearJobs(message) {
  const need = document.getElementById("jobs-need-key");
  need.textContent = message;
  need.hidden = false;
  fill(document.querySelector("#jobs tbody"), []);
  document.getElementById("job-detail").hidden = true;
  state.series = null;
}

async function refreshJobs() {
  if (!state.key) {
    clearJobs("Enter an API key (cpn keys create) to see jobs.");
    return;
  }
  let jobs, running;
  try {
    // The newest jobs, and the running ones however old (the detail panel shows one).
    [jobs, running] = await Promise.all([
      api("/v1/jobs?limit=20").then((r) => r.data),
      api("/v1/jobs?state=running&limit=1").then((r) => r.data),
    ]);
  } catch (e) {
    if (e.status === 401) {
      clearJobs("This API key was rejected: enter a valid one (cpn keys create).");
      return;
    }
    throw e;
  }
  document.getElementById("jobs-need-key").hidden = true;
  const known = jobs.concat(running.filter((r) => !jobs.some((j) => j.id === r.id)));
  if (!state.pinned || !known.some((j) => j.id === state.selected)) {
    const live = running[0] || jobs.find((j) => j.state === "scheduled")
      || jobs.find((j) => j.state === "pending");
    state.selected = (live || jobs[0] || {}).id || null;
  }
  fill(document.querySelector("#jobs tbody"), jobs.map((j) => {
    const wan = j.progress.bytes.wan;
    const tr = row(
      [j.id, j.name, el("td", j.state, `state ${j.state}`), `${j.progress.step} / ${j.progress.steps}`,
       j.progress.loss === null ? "–" : j.progress.loss.toFixed(4),
       wan ? `${bytes(wan.measured)} / ${bytes(wan.predicted)}` : "–", placement(j)],
      { "data-job": j.id, "data-state": j.state }
    );
    if (j.id === state.selected) tr.classList.add("selected");
    tr.addEventListener("click", () => { state.selected = j.id; state.pinned = true; refresh(); });
    return tr;
  }));
  const job = known.find((j) => j.id === state.selected);
  if (job) await refreshJob(job);
  else document.getElementById("job-detail").hidden = true;
}

function chart(id, label, color, xs, ys, format) {
  const box = document.getElementById(id);
  box.dataset.points = String(xs.length);
  if (typeof uPlot === "undefined") {
    box.textContent = "charts need uPlot: run scripts/setup.sh";
    return;
  }
  const data = [xs, ys];
  const existing = state.charts[id];
  if (existing) {
    existing.setData(data);
    return;
  }
  state.charts[id] = new uPlot({
    width: 520, height: 240,
    scales: { x: { time: false } },
    series: [{ label: "step" }, { label, stroke: color, width: 2 }],
    axes: [{ label: "step" }, { size: 80, values: (u, vals) => vals.map(format || String) }],
  }, data, box);
}

async function refreshJob(job) {
  document.getElementById("job-detail").hidden = false;
  document.getElementById("job-id").textContent = job.id;
  const st = document.getElementById("job-state");
  st.textContent = job.state;
  st.className = `state ${job.state}`;
  document.getElementById("job-reason").textContent = job.reason;
  // Only what is new since the last refresh: the server pages from the oldest step and
  // event, so asking for everything would stop at its page size (10 000 steps, 1000
  // events) and move megabytes every two seconds.
  if (!state.series || state.series.job !== job.id) {
    state.series = { job: job.id, steps: new Map(), lastStep: -1, events: [], lastEvent: 0 };
  }
  const series = state.series;
  const id = encodeURIComponent(job.id);
  const [metrics, events] = await Promise.all([
    api(`/v1/jobs/${id}/metrics?after=${Math.max(-1, series.lastStep - STEP_OVERLAP)}`),
    api(`/v1/jobs/${id}/events?after=${series.lastEvent}`),
  ]);
  if (state.series !== series) return; // another job was selected meanwhile
  for (const s of metrics.steps) {
    series.steps.set(s.step, s);
    series.lastStep = Math.max(series.lastStep, s.step);
  }
  for (const e of events) series.lastEvent = Math.max(series.lastEvent, e.id);
  series.events = series.events.concat(events).slice(-EVENTS_SHOWN);
  const all = [...series.steps.values()].sort((a, b) => a.step - b.step);
  const steps = all.filter((s) => s.loss !== null);
  chart("loss-chart", "loss", "#1f6feb", steps.map((s) => s.step), steps.map((s) => s.loss));
  let total = 0;
  const wan = all.map((s) => (total += s.bytes.wan || 0));
  chart("wan-chart", "WAN bytes", "#bf3989", all.map((s) => s.step), wan, bytes);
  fill(document.getElementById("events"), series.events.slice().reverse().map((e) => {
    const li = el("li", `${new Date(e.at).toLocaleTimeString()}  ${e.kind}: ${e.message}`);
    li.dataset.kind = e.kind;
    return li;
  }));
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    await refreshSites();
    await refreshJobs();
    error.hidden = true;
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    error.textContent = String(e.message || e);
    error.hidden = false;
  }
}

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const value = document.getElementById("key").value.trim();
  if (value) localStorage.setItem("cpn-api-key", value); else localStorage.removeItem("cpn-api-key");
  state.key = value || null;
  refresh();
});

// A link with another key opened in this tab changes only the fragment: no reload.
window.addEventListener("hashchange", () => { readKey(); refresh(); });

readKey();
refresh();
setInterval(refresh, REFRESH_MS);
