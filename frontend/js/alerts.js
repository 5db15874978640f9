// The alerts view (#/r/<run id>/alerts): a run recorded with --mode online, its alerts in their
// latest state (bitguard.alerts/1 from GET /api/runs/{id}/alerts), what each sensor saw and checked,
// the verifier's figures, and for a confirmed alert how to replay its step offline. A run of another
// mode is the server's one-line refusal. Knows nothing of comparisons.

import { api } from "./api.js";
import { $, SEL, el, fill } from "./dom.js";
import { count } from "./format.js";

const STATES = ["confirmed", "pending", "transient", "cleared", "warning"];
const st = { runId: null, doc: null, filter: "all", open: null };

export async function open(runId) {
  st.runId = runId;
  st.open = null;
  document.title = "alerts · bitguard explorer";
  const body = $(SEL.alertsBody);
  fill(body, el("div", { class: "banner busy" }, el("span", { class: "spinner" }), "Reading the run's alerts…"));
  let doc;
  try {
    doc = await api.get(`/api/runs/${encodeURIComponent(runId)}/alerts`);
  } catch (e) {
    if (st.runId !== runId) return;
    fill(body, el("div", { class: "banner error", id: "alerts-error" }, e.message),
      el("div", {}, el("a", { href: "#/", class: "btn small" }, "Back to the runs")));
    return;
  }
  if (st.runId !== runId) return;
  st.doc = doc;
  render();
}

function stat(k, v, cls = "") {
  return el("div", { class: `stat ${cls}` }, el("div", { class: "k" }, k), el("div", { class: "v" }, v));
}

function name(path) {
  return String(path || "").split("/").filter(Boolean).pop() || path;
}

function render() {
  const doc = st.doc;
  fill($(SEL.title), el("span", { class: "title" }, el("span", { class: "run" }, name(doc.run)),
    el("span", { class: "vs" }, "alerts"),
    el("span", { class: `badge ${doc.counts.confirmed ? "diverged" : "identical"}`, id: "alerts-verdict" },
      doc.counts.confirmed ? `${doc.counts.confirmed} confirmed` : "none confirmed")));
  const counts = el("div", { class: "summary", id: "alerts-counts" },
    ...STATES.map((s) => stat(s, count(doc.counts[s] || 0), `alert-state ${s}`)),
    stat("ranks", doc.ranks.join(", ")), stat("recording", doc.status || "unknown"));
  const notes = doc.notes.length ? el("ul", { class: "notes", id: "alerts-notes" }, ...doc.notes.map((n) => el("li", {}, n))) : null;
  const filter = el("select", { id: "alerts-filter", onchange: (e) => { st.filter = e.target.value; render(); } },
    ...["all", ...STATES].map((s) => el("option", { value: s, selected: s === st.filter }, s)));
  const shown = doc.alerts.filter((a) => st.filter === "all" || a.state === st.filter);
  fill($(SEL.alertsBody), counts, notes,
    el("div", { class: "card" }, el("div", { class: "toolbar" }, el("h2", {}, "Alerts"), el("label", {}, "State ", filter)),
      table(shown, doc.alerts.length)),
    el("div", { class: "grid2" }, coverage(doc.coverage), verifier(doc.verifier)));
}

function seen(a) {
  const e = a.evidence || {};
  if (typeof e.summary === "string") return e.summary;
  if (typeof e.gap === "number" && typeof a.threshold === "number") return `gap ${e.gap.toExponential(1)} > threshold ${a.threshold.toExponential(1)}`;
  return "";
}

function verdictText(a) {
  if (!a.verdict) return a.state === "pending" ? "not verified" : "";
  const v = a.verdict;
  const words = v.evidence && typeof v.evidence.summary === "string" ? v.evidence.summary : v.state;
  return `${words}${v.latency_steps != null ? ` · after ${v.latency_steps} step${v.latency_steps === 1 ? "" : "s"}` : ""}`;
}

function table(alerts, total) {
  const t = el("table", { class: "table", id: "alerts-table" }, el("tr", {},
    ...["#", "step", "rank", "sensor", "boundary", "op", "state", "seen", "verifier"].map((h) => el("th", {}, h))));
  if (!alerts.length) {
    t.append(el("tr", {}, el("td", { class: "empty", colspan: 9 },
      total ? "No alert in this state." : "No alert: the sensors saw nothing over their thresholds.")));
    return t;
  }
  for (const a of alerts) {
    const key = `${a.rank}:${a.alert_id}`;
    t.append(el("tr", { class: "link", dataset: { alert: key, state: a.state }, onclick: () => { st.open = st.open === key ? null : key; render(); } },
      el("td", {}, String(a.alert_id)), el("td", {}, String(a.step)), el("td", {}, String(a.rank)), el("td", {}, a.sensor),
      el("td", { class: "mono" }, a.boundary), el("td", { class: "mono" }, a.op || ""),
      el("td", {}, el("span", { class: `badge alert-${a.state}` }, a.state)),
      el("td", {}, seen(a)), el("td", {}, verdictText(a))));
    if (st.open === key) t.append(el("tr", { class: "alert-detail" }, el("td", { colspan: 9 }, detail(a))));
  }
  return t;
}

function detail(a) {
  return el("div", { id: "alert-detail" },
    a.afterwards ? el("div", { class: "afterwards" }, el("h3", {}, "Afterwards: replay it offline"), el("pre", { id: "alert-afterwards" }, a.afterwards.text)) : null,
    el("h3", {}, "Evidence when raised"), el("pre", {}, JSON.stringify(a.evidence, null, 2)),
    a.verdict ? el("h3", {}, `Verifier: ${a.verdict.state}`) : null,
    a.verdict ? el("pre", {}, JSON.stringify(a.verdict.evidence, null, 2)) : null,
    el("div", { class: "note" }, `History: ${a.history.map((h) => `${h.state} (step ${h.step})`).join(" → ")}`));
}

function num(v, digits = 3) {
  if (v == null) return "—";
  return Number.isInteger(v) ? count(v) : Number(v).toPrecision(digits);
}

function coverage(rows) {
  const t = el("table", { class: "table", id: "alerts-coverage" }, el("tr", {},
    ...["sensor", "steps", "calls", "checked", "FLOPs seen", "of them checked", "seconds"].map((h) => el("th", {}, h))));
  if (!rows.length) t.append(el("tr", {}, el("td", { class: "empty", colspan: 7 }, "No sensor figures in this run.")));
  for (const s of rows) {
    t.append(el("tr", { dataset: { sensor: s.sensor } }, el("td", {}, s.sensor), el("td", {}, num(s.steps)), el("td", {}, num(s.calls)),
      el("td", {}, num(s.checked)), el("td", {}, num(s.flops_seen)),
      el("td", {}, s.checked_share == null ? "—" : `${(100 * s.checked_share).toFixed(1)}%`), el("td", {}, num(s.seconds))));
  }
  return el("div", { class: "card" }, el("h2", {}, "What the sensors saw"), t);
}

function verifier(v) {
  return el("div", { class: "card", id: "alerts-verifier" }, el("h2", {}, "Verifier"),
    el("div", { class: "summary" },
      stat("tasks", num(v.tasks)), stat("verified", num(v.verified)), stat("unverified", num(v.unverified)),
      stat("latency (steps)", v.latency_steps_median == null ? "—" : `${v.latency_steps_median} median · ${v.latency_steps_max} max`),
      stat("time", `${num(v.seconds)} s`), stat("queue max", num(v.queue_max))));
}
