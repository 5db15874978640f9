// The divergences table: every event that is not identical, one row per rank, step, phase, module
// and status (GET /divergences, bitguard.divergences/1), filtered by rank, phase, module type and
// cause and paged on the server. A row selects its first event in the timeline; benign rows and
// allowed gaps name their rules.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, on, fill } from "./dom.js";
import { count } from "./format.js";

const PAGE = 25;
// the cause filter: what each choice asks the server for
const CAUSES = [
  ["", "any cause"],
  ["diverged", "digest (diverged)"],
  ["only_a,only_b", "structure (one side only)"],
  ["benign", "benign (a rule accepted it)"],
  ["follows", "follows an accepted difference"],
  ["unobserved", "not observed"],
];
const FILTERS = ["rank", "phase", "module_type", "status"];

const st = { c: null, filters: {}, offset: 0, data: null, token: 0, error: null };

export function init() {
  on(EV.comparisonLoaded, (c) => {
    if (!st.c || st.c.id !== c.id) {
      st.filters = {};
      st.offset = 0;
    }
    st.c = c;
    load();
  });
}

async function load() {
  const mine = ++st.token;
  const params = { offset: st.offset, limit: PAGE };
  for (const k of FILTERS) if (st.filters[k] !== undefined && st.filters[k] !== "") params[k] = st.filters[k];
  try {
    const data = await api.get(comparisonPath(st.c.id, "/divergences"), params);
    if (mine !== st.token) return;
    st.data = data;
    st.error = null;
  } catch (e) {
    if (mine !== st.token) return;
    st.error = e.message;
  }
  render();
}

function setFilter(key, value) {
  st.filters[key] = value;
  st.offset = 0;
  load();
}

function facetSelect(key, label, facets, text = (v) => String(v)) {
  const opts = [el("option", { value: "" }, `any ${label}`),
    ...(facets || []).map((f) => el("option", { value: f.value ?? "", selected: String(st.filters[key] ?? "") === String(f.value ?? "") },
      `${text(f.value)} (${count(f.events)})`))];
  const s = el("select", { id: `div-${key.replace("_", "-")}`, "aria-label": `filter by ${label}` }, ...opts);
  s.addEventListener("change", () => setFilter(key, s.value));
  return s;
}

// the cause choices, each with how many events it covers in the whole table
function causeSelect(facets) {
  const events = new Map((facets || []).map((f) => [f.value, f.events]));
  const n = (v) => v.split(",").reduce((acc, s) => acc + (events.get(s) || 0), 0);
  const s = el("select", { id: "div-cause", "aria-label": "filter by cause" },
    ...CAUSES.map(([v, t]) => el("option", { value: v, selected: (st.filters.status ?? "") === v }, v && facets ? `${t} (${count(n(v))})` : t)));
  s.addEventListener("change", () => setFilter("status", s.value));
  return s;
}

// the status badge and the cause in words (the server names the rules of benign rows and allowed gaps)
function causeCell(r) {
  return el("td", {}, el("span", { class: `badge ${r.status}` }, r.status.replace("_", " ")), " ", el("span", { class: "sub" }, r.cause));
}

function row(r) {
  const select = () => {
    emit(EV.selectEvent, { rank: r.rank, pos: r.first_pos, side: r.side, seq: r.seq, source: "divergences" });
    $(SEL.timeline).closest(".card").scrollIntoView({ block: "nearest" }); // the timeline moves to it: show it
  };
  const tr = el("tr", { class: "link", tabindex: 0, dataset: { pos: r.first_pos, rank: r.rank, status: r.status, phase: r.phase },
    title: "Show this event in the timeline", onclick: select,
    onkeydown: (e) => { if (e.key === "Enter") select(); } },
  el("td", { class: "num" }, r.step),
  el("td", { class: "mono" }, r.boundary),
  el("td", { class: "mono" }, r.module_type || ""),
  el("td", {}, r.phase),
  el("td", { class: "num" }, r.rank),
  causeCell(r),
  el("td", { class: "num" }, count(r.count)));
  return tr;
}

function render() {
  const panel = $(SEL.divergencesPanel);
  const d = st.data;
  if (!panel || !st.c) return;
  const head = el("div", { class: "toolbar" },
    el("h2", {}, "Divergences"),
    d ? facetSelect("rank", "rank", d.facets.rank, (v) => `rank ${v}`) : null,
    d ? facetSelect("phase", "phase", d.facets.phase) : null,
    d ? facetSelect("module_type", "module type", d.facets.module_type) : null,
    causeSelect(d && d.facets.status));
  if (st.error) {
    fill(panel, head, el("p", { class: "banner error" }, st.error));
    return;
  }
  if (!d) {
    fill(panel, head);
    return;
  }
  panel.dataset.total = String(d.total);
  panel.dataset.offset = String(d.offset);
  panel.dataset.revision = String(st.c.revision);
  if (!d.all_events) {
    fill(panel, head, el("p", { class: "note", id: "divergences-empty" }, "Every aligned event is identical: nothing diverged, no gaps, nothing unobserved."));
    return;
  }
  const last = Math.min(d.offset + d.rows.length, d.total);
  const pager = el("div", { class: "pager" },
    el("button", { id: "div-prev", class: "btn small", disabled: d.offset === 0, onclick: () => { st.offset = Math.max(0, d.offset - PAGE); load(); } }, "◀ Previous"),
    el("span", { id: "div-range", class: "version" }, d.total ? `rows ${count(d.offset + 1)}–${count(last)} of ${count(d.total)} (${count(d.events)} of ${count(d.all_events)} events)` : "no row matches these filters"),
    el("button", { id: "div-next", class: "btn small", disabled: last >= d.total, onclick: () => { st.offset = d.offset + PAGE; load(); } }, "Next ▶"));
  const table = el("table", { class: "table divergences", id: "divergences-table" },
    el("thead", {}, el("tr", {}, ...["step", "boundary", "module", "phase", "rank", "cause", "events"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...d.rows.map(row)));
  fill(panel, head, table, pager);
}
