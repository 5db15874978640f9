// The loss curve panel: each run's per-step loss as bitguard recorded it (GET /loss,
// bitguard.loss_curve/1: a root module's one-element float output, read from its digest), the
// pivot's step marked, and how many steps before the losses part bitguard saw the divergence.
// Where no loss was recorded it says so and why, with no curve.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, on, fill, plotly } from "./dom.js";
import { count } from "./format.js";

const st = { c: null, token: 0 };

export function init() {
  on(EV.comparisonLoaded, (c) => {
    st.c = c;
    load(c);
  });
}

async function load(c) {
  const mine = ++st.token;
  const panel = $(SEL.lossPanel);
  try {
    const doc = await api.get(comparisonPath(c.id, "/loss"));
    if (mine !== st.token) return;
    await render(panel, doc);
  } catch (e) {
    if (mine !== st.token) return;
    panel.dataset.state = "error";
    fill(panel, el("h2", {}, "Loss"), el("p", { class: "banner error" }, e.message));
  }
}

const num = (v) => (typeof v === "number" ? v : v == null ? null : Number(v)); // "nan", "inf" -> NaN, Infinity
const steps = (n) => `${count(Math.abs(n))} step${Math.abs(n) === 1 ? "" : "s"}`;

// "bitguard saw it N steps before the loss": the pivot against the first step over the threshold
export function leadText(doc) {
  const p = doc.pivot_step;
  const parts = [];
  if (doc.first_differs == null) parts.push(`The losses are bitwise equal at every one of the ${count(doc.steps.length)} recorded steps.`);
  else parts.push(`The losses first differ at step ${doc.first_differs} (bitwise)`
    + (doc.first_over == null ? `, and never by more than ${doc.threshold} in the ${count(doc.steps.length)} recorded steps.`
      : `, and by more than ${doc.threshold} at step ${doc.first_over}.`));
  if (p != null && doc.lead_over != null) {
    parts.push(doc.lead_over > 0 ? `bitguard saw it ${steps(doc.lead_over)} before the loss (pivot at step ${p}).`
      : doc.lead_over === 0 ? `The pivot is at the same step (${p}).` : `The pivot (step ${p}) comes ${steps(doc.lead_over)} after the loss parted.`);
  } else if (p != null && doc.first_differs != null && doc.lead_differs > 0) {
    parts.push(`bitguard saw it ${steps(doc.lead_differs)} before the loss's first bit changed (pivot at step ${p}).`);
  } else if (p != null && doc.first_differs == null) {
    parts.push(`The pivot (step ${p}) has not reached the loss in the recorded steps.`);
  }
  return parts.join(" ");
}

async function render(panel, doc) {
  panel.dataset.revision = String(st.c.revision);
  if (doc.unknown) {
    panel.dataset.state = "unknown";
    fill(panel, el("h2", {}, "Loss"), el("p", { class: "note", id: "loss-unknown" }, doc.unknown));
    return;
  }
  const src = doc.source;
  const where = `${src.boundary}${src.path ? ` ${src.path}` : ""} (${src.dtype})`;
  const several = doc.steps.some((s) => s.calls_a > 1 || s.calls_b > 1);
  const plot = el("div", { class: "plot loss", id: "loss-plot" });
  fill(panel,
    el("div", { class: "toolbar" }, el("h2", {}, "Loss"),
      el("span", { class: "version", title: "a root module's one-element float output: its digest is its value" }, `from ${where}${doc.rank ? ` · rank ${doc.rank}` : ""}${several ? " · mean of the step's calls" : ""}`)),
    el("p", { id: "loss-lead", class: "loss-lead" }, leadText(doc)),
    plot);
  panel.dataset.state = "drawing"; // "curve" once plotly (loaded after the timelines, dom.js) has drawn it
  const x = doc.steps.map((s) => s.step);
  const line = (side, color, dash) => ({
    type: "scatter", mode: "lines+markers", name: `run ${side.toUpperCase()}`, x, y: doc.steps.map((s) => num(s[side])),
    line: { color, width: 1.5, dash }, marker: { size: 4 }, hovertemplate: `run ${side.toUpperCase()}: %{y:.7g}<extra>step %{x}</extra>`,
  });
  // the gap between the runs on a log axis of its own: the curves overlap long before it shows
  const gap = doc.steps.map((s) => {
    const d = Math.abs(num(s.a) - num(s.b));
    return Number.isFinite(d) && d > 0 ? d : null;
  });
  const gapTrace = { type: "scatter", mode: "lines+markers", name: "|A − B|", x, y: gap, yaxis: "y2", connectgaps: false,
    line: { color: "#8a94a3", width: 1, dash: "dash" }, marker: { size: 3 }, hovertemplate: "|A − B|: %{y:.3g}<extra>step %{x}</extra>" };
  const marks = [["pivot", doc.pivot_step, "#7a1fa2"], ["differs", doc.first_differs, "#8a4b0f"], [`> ${doc.threshold}`, doc.first_over, "#d6453d"]]
    .filter(([, s]) => s != null);
  const layout = {
    margin: { l: 56, r: 64, t: 18, b: 30 }, height: 190, showlegend: true, legend: { orientation: "h", x: 0, y: 1.18 },
    xaxis: { title: { text: "step", standoff: 4 }, zeroline: false }, yaxis: { zeroline: false, title: { text: "loss" } },
    yaxis2: { type: "log", overlaying: "y", side: "right", showgrid: false, title: { text: "|A − B|" }, exponentformat: "power" },
    shapes: marks.map(([, s, color]) => ({ type: "line", xref: "x", yref: "paper", x0: s, x1: s, y0: 0, y1: 1, line: { color, width: 1.5, dash: "dot" } })),
    annotations: marks.map(([name, s, color], i) => ({ x: s, y: 1 - i * 0.14, xref: "x", yref: "paper", text: name, showarrow: false, xanchor: "left", font: { size: 11, color } })),
  };
  const Plotly = await plotly();
  if (!plot.isConnected) return; // another comparison (or revision) has filled the panel meanwhile
  Plotly.react(plot, [line("a", "#2f5fd0", "solid"), line("b", "#d6453d", "dot"), gapTrace], layout, { displayModeBar: false, responsive: true });
  panel.dataset.state = "curve";
}
