// The drill panel: from the pivot down to the operation. "Drill down" on the pivot panel asks the
// server to replay both runs' pivot step and trace the blame window op by op (POST .../drill,
// seconds to minutes); this panel polls until the drill is done, then shows the op-level pivot with
// its source line and the chain from the boundary down to it, the replay check, the fault signature
// of the differing tensor with its bit-position histogram, and a heat map of where its elements
// differ. It reads the engine's bitguard.drill/1 document as the server passes it through.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, fill, on, plotly, show } from "./dom.js";
import { count, plotText } from "./format.js";
import { digestTable } from "./detail.js";

const POLL_MS = 400;
const NOT_REPRODUCED = "the replay does not reproduce the record: nondeterminism or a changed environment";
const VERDICT = {
  op_pivot: ["diverged", "op pivot"],
  no_difference: ["identical", "no difference"],
  not_reproduced: ["inconclusive", "not reproduced"],
};
const CAUSE = {
  digest: "its inputs are equal on both sides and an output differs: this operation computed differently",
  structure: "the runs ran different operations here",
};

let comparison = null;
let token = 0; // a newer load or start makes older answers stale
let timer = null;

export function init() {
  on(EV.comparisonLoaded, (c) => {
    const same = comparison && comparison.id === c.id && comparison.revision === c.revision;
    comparison = c;
    if (!same) load();
  });
  on(EV.drillRequested, () => start());
  // leaving the comparison stops the polling; coming back loads its drill again
  window.addEventListener("hashchange", () => {
    if (comparison && !location.hash.startsWith(`#/c/${comparison.id}`)) {
      stop();
      token += 1;
      comparison = null;
      show($(SEL.drillPanel), false);
    }
  });
}

const path = () => comparisonPath(comparison.id, "/drill");

function stop() {
  clearTimeout(timer);
  timer = null;
}

// the comparison's latest drill, if it has one (404: never drilled, the panel stays hidden)
async function load() {
  stop();
  const mine = ++token;
  const panel = $(SEL.drillPanel);
  if (!comparison || !(comparison.summary && comparison.summary.first_divergence)) {
    show(panel, false);
    return;
  }
  try {
    const state = await api.get(path());
    if (mine === token) render(state);
  } catch (e) {
    if (mine !== token) return;
    if (e.status === 404) show(panel, false);
    else renderError(e.type, e.message);
  }
}

async function start() {
  if (!comparison) return;
  stop();
  const mine = ++token;
  renderBusy({ state: "queued", elapsed_s: null });
  try {
    const state = await api.post(path(), {});
    if (mine === token) render(state);
  } catch (e) {
    if (mine === token) renderError(e.type, e.message);
  }
}

async function poll(mine) {
  try {
    const state = await api.get(path());
    if (mine === token) render(state);
  } catch (e) {
    if (mine === token) renderError(e.type, e.message);
  }
}

function render(state) {
  setButton(state.state === "queued" || state.state === "running");
  if (state.state === "queued" || state.state === "running") {
    renderBusy(state);
    const mine = token;
    timer = setTimeout(() => poll(mine), POLL_MS);
    return;
  }
  if (state.state === "failed") {
    renderError(state.error ? state.error.type : "InternalError", state.error ? state.error.message : "the drill failed without saying why");
    return;
  }
  renderDone(state);
}

// the pivot panel's button says that a drill is under way (pivot.js draws it; it may be redrawn)
function setButton(busy) {
  const button = $(SEL.drillButton);
  if (!button) return;
  button.disabled = busy;
  button.textContent = busy ? "Drilling…" : "Drill down";
}

function head(badge) {
  return el("div", { class: "pivot-head" },
    el("span", { class: "dot" }), el("h2", { style: "margin:0" }, "Drill-down"), badge);
}

function renderBusy(state) {
  const panel = $(SEL.drillPanel);
  panel.dataset.state = state.state;
  const secs = state.elapsed_s == null ? "" : ` ${Math.floor(state.elapsed_s)} s`;
  fill(panel,
    head(el("span", { class: "badge running" }, state.state)),
    el("div", { id: "drill-progress", class: "banner busy" }, el("span", { class: "spinner" }),
      state.state === "queued" ? "Waiting for another drill to finish…" : `Replaying both runs' pivot step and tracing each operation…${secs}`),
    el("p", { class: "note" }, "The drill reruns both runs' recorded commands for the pivot's step, side by side, tracing each torch operation inside the blame window."),
  );
  show(panel, true);
}

function renderError(type, message) {
  setButton(false);
  const panel = $(SEL.drillPanel);
  panel.dataset.state = "failed";
  fill(panel,
    head(el("span", { class: "badge failed" }, "failed")),
    el("div", { id: "drill-error", class: "banner error" }, el("b", {}, `${type}: `), message),
  );
  show(panel, true);
}

const where = (p) => (p.file ? `${p.file}:${p.line ?? "?"} in ${p.function || "?"}` : "no user frame recorded");

function replayCheck(replay) {
  if (!replay) return null;
  if (replay.reproduced) {
    return el("div", { id: "drill-replay", class: "drill-replay ok", dataset: { reproduced: "true" } },
      el("span", { class: "badge identical" }, "replay reproduced"), " ", replay.detail || "");
  }
  // the engine's detail opens with the same sentence, then says why in parentheses
  let detail = String(replay.detail || "");
  if (detail.startsWith(NOT_REPRODUCED)) detail = detail.slice(NOT_REPRODUCED.length).trim().replace(/^\((.*)\)$/s, "$1");
  return el("div", { id: "drill-replay", class: "banner inconclusive drill-replay", dataset: { reproduced: "false" } },
    el("b", {}, `Warning: ${NOT_REPRODUCED}.`), detail ? el("div", {}, detail) : null);
}

// the op's inputs and outputs as the digest table of the other panels: {"a": {...}, "b": {...}, "differs"}
function opTensors(op) {
  const row = (role) => (t, index) => {
    const side = t.a || t.b || {};
    return { role, index: t.index ?? index, shape: side.shape, dtype: side.dtype, a: t.a && t.a.xor ? t.a : null, b: t.b && t.b.xor ? t.b : null, differs: !!t.differs, ignored: false };
  };
  return [...(op.inputs || []).map(row("input")), ...(op.outputs || []).map(row("output"))];
}

function sideOnly(op) {
  if (!op.side_only) return null;
  const has = op.side_only.toUpperCase();
  const lacks = has === "A" ? "B" : "A";
  const other = (op.other_side || []).map((o) => (typeof o === "string" ? o : o.line ? `${o.op} (line ${o.line})` : o.op)).filter(Boolean);
  const few = other.length > 6 ? [...other.slice(0, 6), `… ${other.length - 6} more`] : other;
  return el("p", { id: "drill-side-only", class: "note structure" },
    `Run ${has} runs this operation and run ${lacks} does not`,
    few.length ? `; run ${lacks} runs ${few.join(", ")} at that place.` : ".");
}

function opPivot(op) {
  // the engine's chain: the window module, the modules open at the op, the user frames, the op itself
  const chain = [...(op.chain || [])];
  if (chain[chain.length - 1] !== op.op) chain.push(op.op);
  return [
    el("div", { id: "drill-op", class: "boundary-name" }, op.op),
    el("div", { id: "drill-source", class: "mono drill-source" }, where(op)),
    sideOnly(op),
    el("div", { class: "kv", style: "margin-top:6px" },
      el("span", { class: "k" }, "cause"), el("span", { class: "v", id: "drill-cause" }, el("b", {}, op.cause), `: ${CAUSE[op.cause] || ""}`),
      el("span", { class: "k" }, "boundary"), el("span", { class: "v mono" }, op.boundary || ""),
      el("span", { class: "k" }, "step · rank"), el("span", { class: "v" }, `${op.step} · ${op.rank}`),
      el("span", { class: "k" }, "op # A · B"), el("span", { class: "v mono" }, `${op.index_a ?? "—"} · ${op.index_b ?? "—"}`),
      op.side_only ? [el("span", { class: "k" }, `args ${op.side_only.toUpperCase()}`), el("span", { class: "v mono" }, (op.side_only === "a" ? op.args_a : op.args_b) ?? "—")]
        : op.args_a !== op.args_b ? [el("span", { class: "k" }, "args A"), el("span", { class: "v mono" }, op.args_a ?? "—"),
          el("span", { class: "k" }, "args B"), el("span", { class: "v mono" }, op.args_b ?? "—")] : null,
    ),
    el("h3", {}, "From the boundary down to the op"),
    el("pre", { id: "drill-chain", class: "stack" }, chain.join("\n")),
    op.inputs || op.outputs ? [el("h3", {}, "Op digests"), digestTable(opTensors(op))] : null,
  ].flat(); // fill() flattens one level only
}

const num = (x) => (x == null ? "—" : Number(x) === 0 ? "0" : Math.abs(x) >= 1e4 || Math.abs(x) < 1e-3 ? Number(x).toExponential(3) : String(Number(x.toPrecision(4))));

// the signature's bit histogram as [bit position, count] pairs, lowest bit first
const bitCounts = (sig) => Object.entries(sig.bits || {}).map(([b, n]) => [Number(b), n]).sort((x, y) => x[0] - y[0]);

// one signature with its numbers, bit histogram and heat map; `id` prefixes its elements' ids
function signature(sig, title, id) {
  if (!sig) return null;
  const pct = sig.fraction == null ? "" : ` (${(100 * sig.fraction).toPrecision(3)}%)`;
  const bits = bitCounts(sig);
  const measured = sig.elements_differing != null; // none for a structure difference or bytes not kept
  return [
    el("h3", {}, title),
    el("div", { id: `${id}-signature`, class: "drill-signature", dataset: { kind: sig.kind } },
      el("span", { class: `badge kind-${sig.kind}` }, String(sig.kind).replace(/_/g, " ")), " ", sig.reading || ""),
    measured ? el("div", { class: "kv", style: "margin-top:6px" },
      el("span", { class: "k" }, "differing"), el("span", { class: "v", id: `${id}-differing` }, `${count(sig.elements_differing)} of ${count(sig.elements_total)} elements${pct}`),
      el("span", { class: "k" }, "max abs · rel"), el("span", { class: "v mono" }, `${num(sig.max_abs)} · ${num(sig.max_rel)}`),
      el("span", { class: "k" }, "max ULP"), el("span", { class: "v mono", id: `${id}-ulp` }, sig.max_ulp == null ? "—" : count(sig.max_ulp)),
      sig.first_indices && sig.first_indices.length ? [el("span", { class: "k" }, "first at"), el("span", { class: "v mono" }, sig.first_indices.slice(0, 4).map((i) => `[${[].concat(i).join(", ")}]`).join(" "))] : null,
      el("span", { class: "k" }, "bits differing"), el("span", { class: "v mono", id: `${id}-bits-text` }, bits.length ? bits.map(([b, n]) => `bit ${b}: ${count(n)}`).join(", ") : "—"),
    ) : null,
    bits.length ? el("div", { id: `${id}-bits`, class: "plot drill-bits", title: "How often each bit position differs (0: the least significant bit of the element's word)" }) : null,
    sig.heatmap && sig.heatmap.counts && sig.heatmap.counts.length ? [el("h3", {}, "Where the elements differ"), el("div", { id: `${id}-heatmap`, class: "plot drill-heatmap" })] : null,
  ].flat();
}

const differs = (sig) => sig && sig.kind !== "identical";

// after a structural difference: the first op both runs call whose outputs differ again
function rejoin(then) {
  if (!then) return null;
  return [
    el("h3", {}, "Where the two runs join again"),
    el("div", { id: "drill-then-op", class: "boundary-name" }, then.op),
    el("div", { id: "drill-then-source", class: "mono drill-source" }, where(then)),
    el("p", { class: "note" }, then.inputs_differ ? "Its inputs already differ: they carry the difference above." : "Its inputs are equal on both sides and its output differs."),
  ];
}

// the dtype of the tensor a signature measured: the op's output, or the boundary pivot's tensor
function dtypeOf(sig, tensors) {
  const t = sig && sig.tensor ? (tensors || []).find((x) => x.role === sig.tensor.role && x.index === sig.tensor.index) : null;
  if (!t) return sig && (sig.dtype_a || sig.dtype_b);
  return t.dtype || (t.a && t.a.dtype) || (t.b && t.b.dtype);
}

function renderDone(state) {
  const doc = state.document || {};
  const panel = $(SEL.drillPanel);
  panel.dataset.state = "done";
  const [cls, label] = VERDICT[doc.verdict] || ["", doc.verdict || "done"];
  const op = doc.op_pivot;
  const sig = differs(doc.signature) ? doc.signature : null;
  const bsig = differs(doc.boundary_signature) ? doc.boundary_signature : null;
  const bp = doc.boundary_pivot || {};
  const w = doc.window || {};
  const old = comparison && state.revision != null && state.revision !== comparison.revision;
  fill(panel,
    head(el("span", { class: `badge ${cls}`, id: "drill-verdict" }, label)),
    old ? el("p", { class: "note structure" }, `Drilled before the comparison was re-run (revision ${state.revision}); drill again for the current pivot.`) : null,
    el("div", { class: "kv" },
      el("span", { class: "k" }, "window"), el("span", { class: "v" }, el("span", { class: "mono" }, w.boundary || ""), w.module_type ? ` (${w.module_type})` : "", w.why ? `: ${w.why}` : ""),
      el("span", { class: "k" }, "took"), el("span", { class: "v" }, state.elapsed_s == null ? "—" : `${state.elapsed_s.toFixed(1)} s`,
        doc.cost && doc.cost.ops_a != null ? ` · ${count(doc.cost.ops_a)} / ${count(doc.cost.ops_b)} ops traced` : ""),
    ),
    replayCheck(doc.replay),
    op ? opPivot(op) : el("p", { id: "drill-no-op", class: "note" }, doc.detail || (doc.verdict === "no_difference"
      ? "The replay found no operation that differs inside the window."
      : "No operation-level pivot was named.")),
    signature(sig, "Fault signature of the op's output", "drill"),
    op ? rejoin(op.then) : null,
    op && op.then ? signature(differs(op.then.signature) ? op.then.signature : null, "Fault signature of its output", "drill-then") : null,
    signature(bsig, ["Fault signature at the boundary pivot", bp.boundary ? [" ", el("span", { class: "mono" }, bp.boundary)] : null], "drill-boundary"),
  );
  show(panel, true);
  if (sig) draw(sig, wordBits(sig, dtypeOf(sig, ((op && op.outputs) || []).map((o) => ({ ...o, role: "output" })))), "drill");
  const then = op && op.then && differs(op.then.signature) ? op.then : null;
  if (then) draw(then.signature, wordBits(then.signature, (then.a && then.a.dtype) || (then.b && then.b.dtype)), "drill-then");
  if (bsig) draw(bsig, wordBits(bsig, dtypeOf(bsig, bp.tensors)), "drill-boundary");
}

// how many bits an element's word has: from its dtype when known, else enough for the bits seen
function wordBits(sig, dtype) {
  dtype = String(dtype || "");
  const m = dtype.match(/(\d+)/);
  if (m) return Number(m[1]);
  if (/bool/.test(dtype)) return 8;
  const top = Math.max(0, ...bitCounts(sig).map((b) => b[0]));
  return top < 16 ? 16 : top < 32 ? 32 : 64;
}

async function draw(sig, width, id) {
  const Plotly = await plotly();
  const bits = bitCounts(sig);
  const bitsNode = $(`#${id}-bits`);
  if (bitsNode && bits.length) {
    Plotly.react(bitsNode, [{ type: "bar", x: bits.map((b) => b[0]), y: bits.map((b) => b[1]), marker: { color: "#d6453d" }, hovertemplate: "bit %{x}: %{y} elements<extra></extra>" }],
      { margin: { l: 36, r: 8, t: 6, b: 30 }, xaxis: { title: { text: `bit position (0: least significant of ${width})`, standoff: 4 }, range: [-0.5, Math.max(width - 1, ...bits.map((b) => b[0])) + 0.5], dtick: width > 32 ? 8 : 4 }, yaxis: { rangemode: "tozero" }, bargap: 0.1, height: 120 },
      { displayModeBar: false, responsive: true });
  }
  const heat = $(`#${id}-heatmap`);
  const hm = sig.heatmap;
  if (!heat || !hm || !hm.counts) return;
  const rows = hm.counts.length;
  const cols = rows ? hm.counts[0].length : 0;
  const [R, C] = hm.shape2d || [rows, cols];
  // cell i holds rows i*bin .. (i+1)*bin - 1 of the 2-D view (the last cell may hold fewer)
  const binR = hm.bin_rows || Math.ceil(R / Math.max(1, rows));
  const binC = hm.bin_cols || Math.ceil(C / Math.max(1, cols));
  const span = (i, bin, N) => { const lo = i * bin; const hi = Math.min((i + 1) * bin, N) - 1; return lo >= hi ? `${lo}` : `${lo}–${hi}`; };
  const text = hm.counts.map((row, i) => row.map((n, j) => plotText(`rows ${span(i, binR, R)}, cols ${span(j, binC, C)}: ${count(n)} differing`)));
  // 0 (no differing element) is always the palest colour, whatever the counts' range
  const top = Math.max(1, ...hm.counts.map((row) => Math.max(...row)));
  Plotly.react(heat, [{ type: "heatmap", z: hm.counts, text, hoverinfo: "text", zauto: false, zmin: 0, zmax: top, colorscale: [[0, "#f7f8fa"], [1e-6, "#fbd3cf"], [1, "#a1261f"]], colorbar: { thickness: 10, len: 0.9, title: { text: "elements", side: "right" } }, xgap: 1, ygap: 1 }],
    { margin: { l: 44, r: 8, t: 6, b: 36 }, height: 220, xaxis: { title: { text: `columns (of ${count(C)})`, standoff: 4 }, showticklabels: false, ticks: "" }, yaxis: { title: { text: `rows (of ${count(R)})`, standoff: 4 }, autorange: "reversed", showticklabels: false, ticks: "" } },
    { displayModeBar: false, responsive: true });
}
