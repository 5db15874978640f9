// The selected-event panel: one aligned event with its status, call stack and the digests of
// its tensors on both sides. "Mark as benign" hands the event to the rules panel.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, on, toast, fill } from "./dom.js";
import { singleBitHint, XOR_POS_HELP } from "./digests.js";
import { benignLabel, duration, rowStatus, shape } from "./format.js";

let comparison = null;
let selected = null; // the event on show, read again when the comparison re-runs
let token = 0;

export function init() {
  on(EV.comparisonLoaded, (c) => {
    const same = comparison && comparison.id === c.id;
    comparison = c;
    if (!same) {
      selected = null;
      token += 1; // an answer still on its way is for the other comparison
      renderEmpty();
    } else if (selected) {
      load(selected); // a new revision (rules changed): its statuses, not the last one's
    }
  });
  on(EV.selectEvent, (sel) => load(sel, true));
  renderEmpty();
}

function renderEmpty() {
  fill($(SEL.detailPanel), 
    el("h2", {}, "Selected event"),
    el("p", { class: "note" }, "Click an event in the timelines or a node in the propagation view to see its digests on both sides."),
  );
}

async function load(sel, reveal = false) {
  if (!comparison || sel.seq == null) return;
  selected = sel;
  const mine = ++token;
  try {
    const d = await api.get(comparisonPath(comparison.id, `/events/${sel.rank}/${sel.side}/${sel.seq}`));
    if (mine !== token) return;
    render(d);
    if (reveal) bringIntoView($(SEL.detailPanel));
  } catch (e) {
    toast(e.message, "error");
  }
}

// digests of both sides, one row per (role, index): {role, index, path, shape, dtype, a, b, differs, ignored, rule_id}.
// `differs`, `ignored` and `rule_id` are the engine's when it sends them (either side's entry);
// otherwise `differs` is read from the digests and nothing counts as ignored.
export function pairTensors(tensorsA, tensorsB) {
  const rows = new Map();
  const key = (t) => `${t.role}:${t.index}`;
  const engine = (r, t) => {
    if (typeof t.differs === "boolean") r.engineDiffers = r.engineDiffers || t.differs;
    if (t.ignored) r.ignored = true;
    if (t.rule_id) r.rule_id = t.rule_id;
    if (t.unobserved) r.unobserved = t.unobserved; // why the tensor could not be digested
  };
  for (const t of tensorsA || []) {
    const r = { ...t, a: { xor: t.xor, pos: t.pos }, b: null, ignored: false, rule_id: null, engineDiffers: null };
    engine(r, t);
    rows.set(key(t), r);
  }
  for (const t of tensorsB || []) {
    const r = rows.get(key(t)) || { ...t, a: null, ignored: false, rule_id: null, engineDiffers: null };
    r.b = { xor: t.xor, pos: t.pos };
    engine(r, t);
    if (!rows.has(key(t))) rows.set(key(t), r);
  }
  for (const r of rows.values()) {
    const digests = !r.a || !r.b || r.a.xor !== r.b.xor || r.a.pos !== r.b.pos;
    r.differs = r.engineDiffers === null ? digests : r.engineDiffers || (!r.a || !r.b);
    delete r.engineDiffers;
  }
  return Array.from(rows.values());
}

// the last column of a digest row: a difference a rule accepted is "benign (rule R)", not a red "differs"
function verdictBadge(r) {
  if (r.unobserved) return el("span", { class: "badge unobserved", title: String(r.unobserved) }, "not observed");
  if (r.differs && r.ignored) return el("span", { class: "badge benign", title: r.rule_id ? `accepted by rule ${r.rule_id}` : "accepted by a rule" }, benignLabel(r.rule_id));
  if (r.differs) return el("span", { class: "badge diverged" }, "differs");
  return el("span", { class: "badge identical" }, "same");
}

export function digestTable(rows) {
  if (!rows.length) return el("p", { class: "note" }, "No tensors recorded for this event.");
  const body = rows.flatMap((r) => {
    const hint = r.a && r.b && !r.unobserved ? singleBitHint(r.a.xor, r.b.xor, r.dtype) : null;
    return [
      el("tr", { class: r.differs && r.ignored ? "ignored" : r.differs ? "differs" : "" },
        el("td", {}, `${r.role}[${r.index}]`, el("br"), el("span", { class: "mono", style: "color:#5f6b7a" }, `${shape(r.shape)} ${r.dtype || ""}`)),
        el("td", { class: "hex" }, r.a ? r.a.xor : "—", el("br"), r.a ? r.a.pos : ""),
        el("td", { class: "hex" }, r.b ? r.b.xor : "—", el("br"), r.b ? r.b.pos : ""),
        el("td", {}, verdictBadge(r)),
      ),
      hint ? el("tr", { class: "bit-hint", dataset: { bit: hint.bit } }, el("td", { colspan: 4 }, hint.text)) : null,
    ];
  });
  const help = (side) => el("th", { title: XOR_POS_HELP, class: "help" }, `${side} xor / pos`);
  return el("table", { class: "digests" },
    el("thead", {}, el("tr", {}, el("th", {}, "tensor"), help("A"), help("B"), el("th", {}, ""))),
    el("tbody", {}, body));
}

export function stackBlock(frames) {
  if (!frames || !frames.length) return el("p", { class: "note" }, "No call stack recorded.");
  return el("pre", { class: "stack" }, frames.join("\n"));
}

// the side column scrolls on its own (style.css): the panel comes to its top, the page stays where it is
function bringIntoView(panel) {
  const side = panel.parentElement;
  if (side && side.scrollHeight > side.clientHeight && getComputedStyle(side).overflowY === "auto") side.scrollTop = panel.offsetTop - side.firstElementChild.offsetTop;
}

// the event's status; a benign one (or one that follows it, or an allowed gap) names its rule
function statusText(d) {
  if (d.rule_id && (d.status === "only_a" || d.status === "only_b")) return `${d.status.replace("_", " ")} (allowed by rule ${d.rule_id})`;
  return rowStatus(d).replace("_", " ");
}

function render(d) {
  const e = d.event;
  const rows = pairTensors(d.tensors_a, d.tensors_b);
  const pair = d.pair || {};
  const benignable = ["diverged", "only_a", "only_b"].includes(d.status);
  const panel = $(SEL.detailPanel);
  panel.dataset.boundary = e.boundary;
  panel.dataset.revision = String(comparison.revision); // the browser tests wait for a re-run's answer
  fill(panel, 
    el("div", { class: "pivot-head" }, el("h2", { style: "margin:0" }, "Selected event"), el("span", { class: `badge ${d.status}`, id: "detail-status" }, statusText(d)), d.is_pivot ? el("span", { class: "badge", style: "background:#f3e8f7;color:#7a1fa2" }, "pivot") : null),
    el("div", { class: "boundary-name" }, e.boundary),
    el("div", { class: "kv", style: "margin-top:6px" },
      el("span", { class: "k" }, "step · phase"), el("span", { class: "v" }, `${e.step} · ${e.phase} (${e.kind})`),
      el("span", { class: "k" }, "module"), el("span", { class: "v mono" }, e.module_type || ""),
      el("span", { class: "k" }, "rank · call"), el("span", { class: "v" }, `${d.rank} · ${e.call}`),
      el("span", { class: "k" }, "seq A · B"), el("span", { class: "v mono" }, `${pair.a_seq ?? "—"} · ${pair.b_seq ?? "—"}`),
      el("span", { class: "k" }, "duration"), el("span", { class: "v" }, duration(e.t_end_ns - e.t_start_ns)),
    ),
    el("h3", {}, "Digests"),
    digestTable(rows),
    el("h3", {}, "Call stack"),
    stackBlock(d.stack),
    el("div", { class: "panel-actions" },
      benignable ? el("button", { id: "mark-benign", class: "btn benign", onclick: () => emit(EV.markBenign, d), title: "Open a rule prefilled from this event" }, "Mark as benign…") : null),
  );
}
