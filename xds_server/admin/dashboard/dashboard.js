// The meshlm dashboard: renders the state the page was served with (#first-state), then each
// one of /dashboard/events (server-sent events, one JSON state each).
// Text is set with textContent only: node ids and NACK errors come from sidecars.
"use strict";

const COLORS = ["#2f6fdf", "#e8793b", "#2a9d6f", "#9b59b6", "#d4a017", "#c0392b"];

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : String(c ?? ""));
  return e;
}
const svgEl = (tag, attrs) => {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
};
const pct = (x) => (x == null ? "–" : `${Number(x).toFixed(1)} %`);
const ms = (s) => (s == null ? "–" : `${(s * 1000).toFixed(0)} ms`);
const color = (versions, v) => COLORS[Math.max(0, versions.indexOf(v)) % COLORS.length];

function table(head, rows) {
  const t = el("table", {}, el("tr", {}, ...head.map((h) => el("th", {}, h))));
  for (const r of rows) t.append(el("tr", {}, ...r.map((c) => el("td", {}, c))));
  return t;
}

function splitBar(name, svc) {
  const bar = el("div", { class: "bar", id: `split-${name}` });
  const text = [];
  for (const v of Object.keys(svc.weights).sort()) {
    const w = svc.weights[v];
    text.push(`${v} ${w}%`);
    if (!w) continue;
    const d = el("div", { title: `${v}: ${w}%` }, `${v} ${w}%`);
    d.style.width = `${w}%`;
    d.style.background = color(svc.versions, v);
    bar.append(d);
  }
  bar.dataset.split = text.join(" ");
  return bar;
}

// Where the chart starts: a little before the latest rollout began, so its steps fill the
// chart however long the control plane ran before; else at the first recorded split.
function chartStart(svc, now) {
  const first = svc.splits[0][0], started = svc.rollout?.started;
  if (started == null || started <= first) return first;
  return Math.max(first, started - Math.max(0.1 * (now - started), 2));
}

// The weight of each version over time, as steps (a change holds until the next).
function splitChart(name, svc, now, t0) {
  const W = 600, H = 90;
  const svg = svgEl("svg", { class: "chart", id: `split-chart-${name}`, viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  if (!svc.splits.length) return svg;
  const before = svc.splits.filter(([t]) => t <= t0);
  const pts = [[t0, before[before.length - 1][1]], ...svc.splits.slice(before.length)];
  const span = Math.max(now - t0, 1);
  const x = (t) => ((t - t0) / span) * (W - 4) + 2, y = (w) => H - 4 - (w / 100) * (H - 8);
  for (const v of svc.versions) {
    let d = "";
    const weights = [];
    pts.forEach(([t, ws], i) => {
      const w = ws[v] || 0;
      if (weights[weights.length - 1] !== w) weights.push(w);
      d += i ? ` H${x(t).toFixed(1)} V${y(w).toFixed(1)}` : `M${x(t).toFixed(1)} ${y(w).toFixed(1)}`;
    });
    d += ` H${x(now).toFixed(1)}`;
    svg.append(svgEl("path", { d, fill: "none", stroke: color(svc.versions, v), "stroke-width": 2,
      "data-version": v, "data-weights": weights.join(" ") }));
  }
  return svg;
}

function rollout(r) {
  if (!r) return el("p", { class: "muted" }, "no rollout");
  // Steps count from 1, as `meshlm rollout status` and the demo count them.
  const steps = r.steps.map((w, i) => (i === r.step ? `[${w}]` : w)).join(" → ");
  const at = r.step >= 0 ? `, step ${r.step + 1}/${r.steps.length}` : "";
  const box = el("div", {},
    el("p", {}, el("b", { class: `state-${r.state}` }, r.state), ` ${r.from} → ${r.canary}, canary ${r.canary_weight}%${at}, steps ${steps}`,
      r.failures ? `, ${r.failures} failed interval(s)` : "", el("br"), el("span", { class: "muted" }, r.message)));
  if (r.analyses.length) {
    box.append(table(["step", "weight", "gate", "success", "calls", "TTFT p99", "TPOT p99", "reason"],
      r.analyses.slice().reverse().map((a) => [a.step + 1, `${a.canary_weight}%`,
        el("span", { class: a.outcome === "pass" ? "ok" : "bad" }, a.outcome),
        pct(a.success_rate), a.requests ?? "–", ms(a.ttft_p99), ms(a.tpot_p99), a.reason])));
  }
  return box;
}

function service(name, svc, now) {
  const t0 = svc.splits.length ? chartStart(svc, now) : null;
  const since = t0 == null ? "" : new Date(t0 * 1000).toLocaleTimeString();
  const card = el("div", { class: "service" }, el("h2", {}, name), splitBar(name, svc), splitChart(name, svc, now, t0),
    el("div", { class: "muted" }, `traffic split (0–100 %) since ${since}`));
  const m = svc.measured || {};
  card.append(el("h3", {}, "Per version (what the gates read)"),
    table(["version", "weight", "calls (all time)", "success", "TTFT p99", "TPOT p99"],
      svc.versions.map((v) => [v, `${svc.weights[v] ?? 0}%`, m[v]?.requests ?? "–",
        pct(m[v]?.success_rate), ms(m[v]?.ttft_p99), ms(m[v]?.tpot_p99)])));
  card.append(el("h3", {}, "Rollout"), el("div", { id: `rollout-${name}` }, rollout(svc.rollout)));
  const side = el("div", { class: "grid" });
  side.append(el("p", {}, "Quarantined classes: ",
    svc.quarantined == null ? el("span", { class: "muted" }, "isolation off")
      : el("b", { class: svc.quarantined ? "bad" : "ok" }, svc.quarantined), svc.classes_tracked == null ? "" : ` of ${svc.classes_tracked} watched`));
  if (svc.slo) {
    side.append(el("p", {}, `SLO loop: level ${svc.slo.level}, in force: ${svc.slo.in_force.join(", ") || "nothing"}`));
  }
  card.append(side);
  if (svc.slo && svc.slo.actions.length) {
    card.append(table(["time", "action", "", "result"], svc.slo.actions.slice().reverse().map((a) =>
      [new Date(a.time * 1000).toLocaleTimeString(), a.action, a.direction, a.done])));
  }
  return card;
}

function sidecars(list) {
  const types = [...new Set(list.flatMap((s) => Object.keys(s.types)))].sort();
  return table(["sidecar", "stream", ...types.map((t) => `${t} ACKed`), "last NACK"],
    list.map((s) => {
      const nacks = Object.entries(s.types).filter(([, t]) => t.nack);
      return [s.id,
        el("span", { class: s.connected && !s.lagging ? "ok" : "bad" },
          s.connected ? (s.lagging ? `${s.api}, lagging` : s.api) : "gone"),
        ...types.map((t) => s.types[t]?.acked || "–"),
        nacks.length ? el("span", { class: "nack" }, nacks.map(([t, n]) => `${t} ${n.nack}: ${n.nack_error}`).join("; ")) : "–"];
    }));
}

function render(doc) {
  const now = Date.now() / 1000;
  document.getElementById("meta").textContent =
    `incarnation ${doc.incarnation}, generation ${doc.generation}, changed ${new Date(doc.changed_at * 1000).toLocaleTimeString()}`;
  document.getElementById("services").replaceChildren(
    ...Object.entries(doc.services).map(([n, s]) => service(n, s, now)));
  document.getElementById("sidecars").replaceWith(Object.assign(sidecars(doc.sidecars), { id: "sidecars" }));
  const tenants = Object.entries(doc.tenants).sort();
  document.getElementById("tenants").replaceWith(Object.assign(tenants.length
    ? table(["tenant", "allowed", "denied"], tenants.map(([t, c]) => [t, c.allowed, c.denied]))
    : el("p", { class: "muted" }, TENANTS_NONE), { id: "tenants" }));
  document.getElementById("errors").replaceChildren(...(doc.errors.length
    ? [el("h2", {}, "Sources not read"), ...doc.errors.map((e) => el("p", { class: "bad" }, e))] : []));
  document.body.dataset.generation = doc.generation;
}

// Why the tenants table can be empty, in plain words.
const TENANTS_NONE = "No per-tenant counts to show: API keys are checked, and calls counted " +
  "per tenant, by the sidecar in front of each model, while this page reads the caller-side " +
  "sidecars (caller_sidecars in the mesh file). Each runtime's /metrics counts calls per tenant.";

let last = null;  // re-rendered every second: the split chart runs up to now

function connect() {
  const conn = document.getElementById("conn");
  const events = new EventSource("/dashboard/events");
  events.onopen = () => { conn.textContent = "live"; conn.className = "ok"; };
  events.onmessage = (e) => render((last = JSON.parse(e.data)));
  events.onerror = () => { conn.textContent = "reconnecting"; conn.className = "bad"; };
}

render((last = JSON.parse(document.getElementById("first-state").textContent)));
connect();
setInterval(() => last && render(last), 1000);
