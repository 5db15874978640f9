// The violations view (#/r/<run id>/violations): a run's training-invariant violations.
// What the run recorded while training with --check (bitguard.violations/1 from
// GET /api/runs/{id}/violations), and, on demand, the run checked against an invariants file the
// user picks (POST the bitguard.invariants/1 document: bitguard.invariant-check/1 with the
// invariants that applied and those skipped, and why). Knows nothing of comparisons.

import { api } from "./api.js";
import { $, SEL, el, fill } from "./dom.js";
import { count } from "./format.js";

const st = { runId: null, doc: null, check: null, filter: "all", open: null, error: null };

export async function open(runId) {
  Object.assign(st, { runId, doc: null, check: null, filter: "all", open: null, error: null });
  document.title = "violations · bitguard explorer";
  const body = $(SEL.violationsBody);
  fill(body, el("div", { class: "banner busy" }, el("span", { class: "spinner" }), "Reading the run's violations…"));
  let doc;
  try {
    doc = await api.get(`/api/runs/${encodeURIComponent(runId)}/violations`);
  } catch (e) {
    if (st.runId !== runId) return;
    fill(body, el("div", { class: "banner error", id: "violations-error" }, e.message),
      el("div", {}, el("a", { href: "#/", class: "btn small" }, "Back to the runs")));
    return;
  }
  if (st.runId !== runId) return;
  st.doc = doc;
  render();
}

async function checkWith(file) {
  const runId = st.runId;
  st.error = null;
  let invariants;
  try {
    invariants = JSON.parse(await file.text());
  } catch (e) {
    st.error = `${file.name} is not JSON (${e.message}): pick a file written by 'bitguard invariants infer -o'`;
    return render();
  }
  try {
    const check = await api.post(`/api/runs/${encodeURIComponent(runId)}/violations`, invariants);
    if (st.runId !== runId) return;
    st.check = { ...check, file: file.name };
    st.filter = "all";
  } catch (e) {
    st.error = e.message;
  }
  render();
}

function stat(k, v, cls = "") {
  return el("div", { class: `stat ${cls}` }, el("div", { class: "k" }, k), el("div", { class: "v" }, v));
}

// the violations shown: the offline check's when one was made, else the recorded ones
function current() {
  return st.check ? st.check.violations : st.doc.violations;
}

function byInvariant(rows) {
  const out = new Map();
  for (const v of rows) {
    const c = out.get(v.invariant_id) || { id: v.invariant_id, template: v.template, count: 0, first_step: v.step };
    c.count += 1;
    c.first_step = Math.min(c.first_step, v.step);
    out.set(v.invariant_id, c);
  }
  return [...out.values()].sort((a, b) => a.first_step - b.first_step || a.id.localeCompare(b.id));
}

function render() {
  const doc = st.doc;
  const rows = current();
  const verdict = st.check ? st.check.verdict : rows.length ? "violated" : "none recorded";
  const cls = verdict === "clean" || verdict === "none recorded" ? "identical" : verdict === "violated" ? "diverged" : "inconclusive";
  fill($(SEL.title), el("span", { class: "title" }, el("span", { class: "run" }, doc.run),
    el("span", { class: "vs" }, "invariants"),
    el("span", { class: `badge ${cls}`, id: "violations-verdict" }, verdict)));
  const picker = el("input", { type: "file", accept: ".json,application/json", id: "violations-file",
    onchange: (e) => e.target.files[0] && checkWith(e.target.files[0]) });
  const source = st.check
    ? `Checked offline against ${st.check.file}: ${count(st.check.applied.length)} of ${count(st.check.invariants)} invariants applied, ${count(st.check.skipped.length)} skipped.`
    : `Recorded while training with --check (ranks checked: ${doc.checked_ranks.length ? doc.checked_ranks.join(", ") : "none said so"}).`;
  const notes = [...doc.notes, ...(st.check ? st.check.notes || [] : [])];
  const groups = byInvariant(rows);
  const filter = el("select", { id: "violations-filter", onchange: (e) => { st.filter = e.target.value; st.open = null; render(); } },
    el("option", { value: "all", selected: st.filter === "all" }, `every invariant (${count(rows.length)})`),
    ...groups.map((g) => el("option", { value: g.id, selected: g.id === st.filter }, `${g.id} (${count(g.count)})`)));
  const shown = rows.filter((v) => st.filter === "all" || v.invariant_id === st.filter);
  fill($(SEL.violationsBody),
    el("div", { class: "summary", id: "violations-counts" },
      stat("violations", count(rows.length)), stat("invariants violated", count(groups.length)),
      stat("first step", rows.length ? String(Math.min(...rows.map((v) => v.step))) : "—"),
      stat("ranks", doc.ranks.join(", "))),
    el("div", { class: "card" }, el("div", { class: "toolbar" },
      el("span", { id: "violations-source" }, source), " ",
      el("label", { class: "btn small", title: "Check this run against a bitguard.invariants/1 file (bitguard invariants infer -o)" },
        "Check against an invariants file… ", picker),
      st.check ? el("button", { class: "btn small", id: "violations-recorded", onclick: () => { st.check = null; st.filter = "all"; render(); } }, "Show the recorded ones") : null)),
    st.error ? el("div", { class: "banner error", id: "violations-check-error" }, st.error) : null,
    notes.length ? el("ul", { class: "notes", id: "violations-notes" }, ...notes.map((n) => el("li", {}, n))) : null,
    el("div", { class: "card" }, el("div", { class: "toolbar" }, el("h2", {}, "Violations"), el("label", {}, "Invariant ", filter)),
      table(shown)),
    st.check ? skipped(st.check.skipped) : null);
}

function table(rows) {
  const t = el("table", { class: "table", id: "violations-table" }, el("tr", {},
    ...["step", "rank", "template", "invariant", "what was violated"].map((h) => el("th", {}, h))));
  if (!rows.length) {
    t.append(el("tr", {}, el("td", { class: "empty", colspan: 5 },
      st.check ? "No invariant that applied was violated." : "No violation recorded.")));
    return t;
  }
  rows.slice(0, 2000).forEach((v, i) => {
    const key = `${v.step}:${v.rank}:${v.invariant_id}:${i}`;
    t.append(el("tr", { class: "link", dataset: { invariant: v.invariant_id, step: String(v.step) },
      onclick: () => { st.open = st.open === key ? null : key; render(); } },
      el("td", {}, String(v.step)), el("td", {}, v.rank == null ? "every rank" : String(v.rank)), el("td", {}, v.template),
      el("td", { class: "mono" }, v.invariant_id), el("td", {}, v.message)));
    if (st.open === key) {
      t.append(el("tr", { class: "violation-detail" }, el("td", { colspan: 5 },
        el("h3", {}, "Evidence"), el("pre", { id: "violation-evidence" }, JSON.stringify(v.evidence, null, 2)))));
    }
  });
  if (rows.length > 2000) t.append(el("tr", {}, el("td", { class: "empty", colspan: 5 }, `${count(rows.length - 2000)} more: filter by invariant`)));
  return t;
}

function skipped(rows) {
  const t = el("table", { class: "table", id: "violations-skipped" }, el("tr", {}, el("th", {}, "invariant"), el("th", {}, "why it did not apply")));
  if (!rows.length) t.append(el("tr", {}, el("td", { class: "empty", colspan: 2 }, "Every invariant applied to this run.")));
  for (const s of rows) t.append(el("tr", {}, el("td", { class: "mono" }, s.id), el("td", {}, s.why)));
  return el("details", { class: "card" }, el("summary", {}, `Skipped invariants (${count(rows.length)}): names or precondition absent in this run`), t);
}
