// The pivot panel: the first divergent event, why bitguard blames it, where the fault sits,
// its call stack and the input and output digests on each side.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, on, toast, fill } from "./dom.js";
import { count } from "./format.js";
import { digestTable, stackBlock } from "./detail.js";

const BLAME = {
  source: "its inputs matched and an output differs: this boundary computed differently",
  consumer: "an input already differed: the fault sits upstream, between observed boundaries",
  data: "the input batch itself differs",
  structure: "the runs recorded different events here (one side lacks it, or its tensors differ in kind)",
};

let comparison = null;

export function init() {
  on(EV.comparisonLoaded, (c) => {
    comparison = c;
    render(c);
  });
}

// the reasons an inconclusive verdict gives, as a list (the engine's {"reasons": [{code, message}]})
export function inconclusiveReasons(summary) {
  const inc = summary && summary.inconclusive;
  const reasons = inc && Array.isArray(inc.reasons) ? inc.reasons : [];
  return reasons.map((r) => (r && typeof r === "object" ? { code: String(r.code ?? ""), message: String(r.message ?? r.code ?? "") } : { code: "", message: String(r) }));
}

export function reasonList(reasons) {
  return el("ul", { class: "reasons" }, ...reasons.map((r) => el("li", { dataset: { code: r.code } }, r.message)));
}

function renderNoPivot(panel, c) {
  const s = c.summary || {};
  const al = s.alignment || {};
  panel.dataset.boundary = "";
  if (c.verdict === "inconclusive") {
    fill(panel,
      el("h2", {}, "Inconclusive"),
      el("p", {}, `No divergence on the ${count(al.matched)} matched events, but bitguard cannot certify the runs identical:`),
      reasonList(inconclusiveReasons(s)),
    );
    return;
  }
  fill(panel,
    el("h2", {}, "No divergence"),
    el("p", {}, `The two runs computed the same thing on all ${count(al.matched)} matched events`,
      al.gaps_a || al.gaps_b ? ` (with ${count(al.gaps_a)} events only in A and ${count(al.gaps_b)} only in B)` : "", "."),
  );
}

// a structure divergence: an event one run has and the other lacks
function structureNote(fd) {
  if (fd.cause !== "structure") return null;
  const missing = fd.missing_side === "a" || fd.missing_side === "b" ? fd.missing_side.toUpperCase() : null;
  const has = missing === "A" ? "B" : missing === "B" ? "A" : null;
  return el("p", { class: "note structure", id: "pivot-structure" },
    missing ? `Run ${has} has this event and run ${missing} does not: the runs differ in what they computed, not only in values.`
      : "This event is on one side only: the runs differ in what they computed, not only in values.");
}

function render(c) {
  const panel = $(SEL.pivotPanel);
  const fd = c.summary && c.summary.first_divergence;
  if (!fd) {
    renderNoPivot(panel, c);
    return;
  }
  panel.dataset.boundary = fd.boundary;
  const win = fd.blame_window;
  const rows = (fd.tensors || []).map((t) => ({ ...t, a: t.a && t.a.xor ? t.a : null, b: t.b && t.b.xor ? t.b : null }));
  const structure = fd.cause === "structure";
  fill(panel,
    el("div", { class: "pivot-head" }, el("span", { class: "dot" }), el("h2", { style: "margin:0" }, "Pivot"), el("span", { class: "badge diverged" }, structure ? "first divergence · structure" : "first divergence")),
    el("div", { id: "pivot-boundary", class: "boundary-name" }, fd.boundary),
    // at a glance: which module, when, and whom bitguard blames
    el("div", { id: "pivot-where", class: "sub" }, [fd.module_type && fd.module_type !== fd.boundary ? fd.module_type : null,
      `step ${fd.step}`, fd.phase, fd.rank ? `rank ${fd.rank}` : null, `blame: ${fd.blame}`].filter(Boolean).join(" · ")),
    structureNote(fd),
    el("div", { class: "kv", style: "margin-top:6px" },
      el("span", { class: "k" }, "step · phase"), el("span", { class: "v" }, `${fd.step} · ${fd.phase} (${fd.kind})`),
      el("span", { class: "k" }, "module"), el("span", { class: "v mono" }, fd.module_type || ""),
      el("span", { class: "k" }, "rank · call"), el("span", { class: "v" }, `${fd.rank} · ${fd.call}`),
      el("span", { class: "k" }, "blame"), el("span", { class: "v" }, el("b", {}, fd.blame), ` (${fd.fault_class}): ${BLAME[fd.blame] || ""}`),
      el("span", { class: "k" }, "blame window"), el("span", { class: "v" }, win ? [win.module ? el("span", { class: "mono" }, win.module) : "", win.module ? ": " : "", win.detail || ""] : "this boundary"),
      el("span", { class: "k" }, "differs in"), el("span", { class: "v" }, (fd.differing_roles || []).join(", ") || "—"),
      el("span", { class: "k" }, "seq A · B"), el("span", { class: "v mono" }, `${fd.a_seq ?? "—"} · ${fd.b_seq ?? "—"}`),
    ),
    apiDifferences(fd.api_differences),
    el("h3", {}, "Input and output digests"),
    digestTable(rows),
    el("h3", {}, fd.stack_b ? "Call stack in A" : "Call stack"),
    stackBlock(fd.stack),
    fd.stack_b ? [el("h3", { id: "pivot-stack-b" }, "Call stack in B, which differs"), stackBlock(fd.stack_b)] : null,
    c.verdict === "inconclusive" ? el("div", {}, el("h3", {}, "Not certified"), reasonList(inconclusiveReasons(c.summary))) : null,
    el("div", { class: "panel-actions" },
      el("button", { class: "btn small", onclick: () => selectPivot() }, "Show in timeline"),
      el("button", { id: "pivot-benign", class: "btn small benign", onclick: () => markPivotBenign(fd) }, "Mark as benign…"),
      el("button", { id: "drill-down", class: "btn small primary", onclick: () => emit(EV.drillRequested), title: "Replay both runs' pivot step and name the first operation that differs, with its source line" }, "Drill down"),
    ),
  );
}

// how the two scripts called the training API differently up to the pivot's step (backend/api_diff.py):
// the likely cause (a clipping threshold, a learning rate, a zero_grad made in one run only)
function apiValue(v) {
  if (Array.isArray(v)) return v.length > 6 ? `[${v.slice(0, 6).join(", ")}, … (${v.length})]` : `[${v.join(", ")}]`;
  return v === null || v === undefined ? "absent" : String(v);
}

// `step 3`, `steps 0-4`, `steps 0-2, 5` (as the terminal report says them: backend/api_diff.py)
function stepsText(steps) {
  const runs = [];
  for (const s of steps) {
    if (runs.length && s === runs[runs.length - 1][1] + 1) runs[runs.length - 1][1] = s;
    else runs.push([s, s]);
  }
  const text = runs.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(", ");
  return steps.length === 1 ? `step ${text}` : `steps ${text}`;
}

function apiDifferences(d) {
  if (!d || !d.differences || !d.differences.length) return null;
  const rows = d.differences.map((x) => el("tr", {},
    el("td", {}, stepsText(x.steps && x.steps.length ? x.steps : [x.step])),
    el("td", { class: "mono" }, `${x.kind} (${x.target})${x.call ? ` call ${x.call}` : ""}`, x.field ? el("br") : null, x.field ? x.field : null),
    el("td", { class: "mono" }, apiValue(x.a)), el("td", { class: "mono" }, apiValue(x.b))));
  return el("div", { id: "pivot-api" },
    el("h3", {}, "Training API calls that differ"),
    el("p", { class: "note" }, "At or before this step, from the API events both runs recorded: the likely cause."),
    el("table", { class: "digests" },
      el("thead", {}, el("tr", {}, el("th", {}, "when"), el("th", {}, "call · field"), el("th", {}, "A"), el("th", {}, "B"))),
      el("tbody", {}, rows)),
    d.more ? el("p", { class: "note" }, `… and ${d.more} more.`) : null);
}

// the side that has the pivot event: A, unless A is the side lacking it (a structure divergence)
function pivotSide(fd) {
  return fd.a_seq == null && fd.b_seq != null ? ["b", fd.b_seq] : ["a", fd.a_seq];
}

function selectPivot() {
  const p = comparison.pivot_position;
  const [side, seq] = pivotSide(comparison.summary.first_divergence);
  if (p) emit(EV.selectEvent, { rank: p.rank, pos: p.pos, side, seq, source: "pivot" });
}

async function markPivotBenign(fd) {
  try {
    const [side, seq] = pivotSide(fd);
    const d = await api.get(comparisonPath(comparison.id, `/events/${fd.rank}/${side}/${seq}`));
    emit(EV.markBenign, d);
  } catch (e) {
    toast(e.message, "error");
  }
}
