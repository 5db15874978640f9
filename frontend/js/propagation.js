// The propagation view: from the pivot, column by column, the divergent events each node fed.
// Clicking a node expands its consumers in the next column and selects its event in the
// timelines; Back and Forward walk the trail of clicks without losing the expanded columns.
// Above the columns, an overview: how many nodes and edges, the edges by type with a filter per
// type (nesting, a call inside the call it belongs to rather than data, is hidden at first), and
// in words what a node's and an edge's counts mean.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, on, toast, fill } from "./dom.js";
import { count } from "./format.js";

const st = {
  c: null,
  nodes: new Map(), // id -> node (with its timeline position)
  neighbours: new Map(), // id -> {node, consumers, producers}
  pivot: null,
  history: [], // trails of node ids; a trail is the path of clicked nodes from the pivot
  at: -1,
  edges: new Map(), // "source\ntarget\nkind" -> edge {count, first_step}
  kinds: new Map(), // edge kind -> how many edges of the graph have it
  hidden: new Set(["nesting"]), // edge kinds not followed in the columns
};

// what each edge type means, shown on its filter (the kinds themselves come with the graph)
const EDGE_MEANS = {
  dataflow: "a tensor one event wrote is another's input",
  nesting: "a child call inside the call it belongs to (not data)",
  activation: "a forward's saved activations used by its backward",
  "weight-grad": "a module's backward making its weights' gradients",
  update: "a gradient used by its optimizer step",
  weights: "an optimizer step's weights used by the next forward (or met by the next step's start)",
  final: "an optimizer step's weights as the recording's final state, or a later save, holds them",
  inferred: "an input no recorded event wrote (a functional op between modules), from the call just before",
};
const plural = (n, one, many) => `${count(n)} ${n === 1 ? one : many}`;

export function init() {
  on(EV.comparisonLoaded, (c) => load(c));
  $(SEL.propBack).addEventListener("click", () => go(st.at - 1));
  $(SEL.propForward).addEventListener("click", () => go(st.at + 1));
  on(EV.showTrail, (ids) => showTrail(ids)); // a link's trail, or the browser's Back (viewstate.js)
}

async function load(c) {
  st.c = c;
  st.nodes.clear();
  st.neighbours.clear();
  st.history = [];
  st.at = -1;
  st.pivot = null;
  st.edges.clear();
  st.kinds.clear();
  st.hidden = new Set(["nesting"]);
  fill(overviewBox());
  const total = (c.summary && c.summary.propagation) || {};
  $(SEL.propTotal).textContent = total.nodes != null
    ? `${count(total.nodes)} divergent node${total.nodes === 1 ? "" : "s"} · ${count(total.edges)} edge${total.edges === 1 ? "" : "s"} in all` : "";
  if (!c.pivot_position) {
    fill($(SEL.propagation), el("p", { class: "note" }, "No divergence, nothing propagated."));
    syncButtons([]);
    return;
  }
  try {
    const g = await api.get(comparisonPath(c.id, "/graph"), { limit: 5000 });
    if (st.c !== c) return;
    for (const n of g.nodes) st.nodes.set(n.id, n);
    for (const e of g.edges) {
      st.edges.set(`${e.source}\n${e.target}\n${e.kind}`, e);
      st.kinds.set(e.kind, (st.kinds.get(e.kind) || 0) + 1);
    }
    overview(g);
    st.pivot = g.nodes.find((n) => n.is_pivot) || null;
    if (!st.pivot) {
      fill($(SEL.propagation), el("p", { class: "note" }, "The propagation graph has no pivot node."));
      return;
    }
    await expand(st.pivot.id);
    st.history = [[st.pivot.id]];
    st.at = 0;
    render();
    emit(EV.propagationReady, c);
  } catch (e) {
    toast(e.message, "error");
  }
}

async function expand(id) {
  if (st.neighbours.has(id)) return st.neighbours.get(id);
  const n = await api.get(comparisonPath(st.c.id, `/graph/nodes/${encodeURIComponent(id)}`));
  st.neighbours.set(id, n);
  for (const x of [n.node, ...n.consumers, ...n.producers]) if (!st.nodes.has(x.id)) st.nodes.set(x.id, x);
  return n;
}

const trail = () => st.history[st.at] || [];

async function clickNode(column, node) {
  const path = trail().slice(0, column).concat([node.id]);
  try {
    await expand(node.id);
  } catch (e) {
    toast(e.message, "error");
    return;
  }
  st.history = st.history.slice(0, st.at + 1);
  st.history.push(path);
  st.at = st.history.length - 1;
  render();
  emit(EV.trailChanged, { trail: path, push: true }); // a new history entry, which select() then fills
  select(node);
  const again = $(SEL.propagation).querySelectorAll(".column")[column]?.querySelector(".node.selected");
  if (again) again.focus({ preventScroll: true }); // the keyboard stays where it was
}

// a trail given by node ids after the pivot, each expanded in turn (a node not reached stops it);
// shown without a selection and without a history entry of its own (the URL already has it)
async function showTrail(ids) {
  if (!st.pivot) return;
  const path = [st.pivot.id];
  try {
    for (const id of ids) {
      const from = st.neighbours.get(path[path.length - 1]) || await expand(path[path.length - 1]);
      if (!from.consumers.some((n) => n.id === id)) break;
      await expand(id);
      path.push(id);
    }
  } catch (e) {
    toast(e.message, "error");
  }
  const i = st.history.findIndex((t) => t.join("\n") === path.join("\n"));
  if (i >= 0) st.at = i;
  else {
    st.history = st.history.slice(0, st.at + 1).concat([path]);
    st.at = st.history.length - 1;
  }
  render();
}

function go(index) {
  if (index < 0 || index >= st.history.length) return;
  st.at = index;
  const path = trail(); // every node on a trail was expanded when it was clicked
  render();
  emit(EV.trailChanged, { trail: path, push: false });
  select(st.nodes.get(path[path.length - 1]));
}

function select(node) {
  if (!node) return;
  emit(EV.selectEvent, { rank: node.rank, pos: node.pos, side: "a", seq: node.a_seq, source: "propagation" });
}

function card(node, column, selected, edge) {
  return el("div", {
    class: `node${selected ? " selected" : ""}${node.is_pivot ? " pivot" : ""}`,
    dataset: { nodeId: node.id, boundary: node.boundary },
    title: `${node.phase} ${node.boundary}: ${node.count} divergent event(s) from step ${node.first_step}`,
    onclick: () => clickNode(column, node),
    tabindex: 0, // focusable; Enter or Space clicks it
    role: "button",
    onkeydown: (e) => (e.key === "Enter" || e.key === " ") && (e.preventDefault(), clickNode(column, node)),
  },
  el("div", { class: "b" }, node.boundary),
  el("div", { class: "m" }, el("span", {}, `${node.phase}${node.kind && node.kind !== "module" ? ` · ${node.kind}` : ""}`), el("span", {}, `step ${node.first_step}`), el("span", { title: "divergent events of this boundary and phase, over all steps" }, `${count(node.count)} event${node.count === 1 ? "" : "s"}`), node.is_pivot ? el("b", { style: "color:#7a1fa2" }, "pivot") : null),
  edge ? el("div", { class: "edge" }, `via ${edge.kind}${edge.count ? ` · ${plural(edge.count, "time", "times")}` : ""}`) : null);
}

// the panel's overview, made once above the columns
function overviewBox() {
  let box = document.querySelector(".prop-overview");
  if (!box) {
    box = el("div", { class: "prop-overview" });
    $(SEL.propagation).before(box);
  }
  return box;
}

function overview(g) {
  // the counts in all are in the toolbar (prop-total); here only what was loaded, when that is less
  const cut = g.total_nodes != null && g.total_nodes > g.nodes.length
    ? `${count(g.nodes.length)} of the ${count(g.total_nodes)} nodes loaded (${plural(g.edges.length, "edge", "edges")} among them) · ` : "";
  const filters = [...st.kinds.entries()].sort((x, y) => y[1] - x[1]).map(([kind, n]) => el("label", { class: "edge-kind", title: EDGE_MEANS[kind] || kind },
    el("input", { type: "checkbox", dataset: { kind }, checked: !st.hidden.has(kind), onchange: (e) => {
      if (e.target.checked) st.hidden.delete(kind);
      else st.hidden.add(kind);
      render();
    } }), ` ${kind} ${count(n)}`));
  fill(overviewBox(),
    el("div", {}, cut, filters.length ? el("span", { class: "edge-kinds" }, el("b", {}, "Edges by type"), " (ticked: followed in the columns): ", ...filters) : "No edges: the pivot fed no other divergent event."),
    el("div", { class: "note" }, "On a node, “n events”: its divergent events (that module and phase, over all steps). On an edge, “n times”: how many divergent event pairs it links."));
}

function render() {
  const path = trail();
  const columns = [];
  // column 0: the pivot; column i+1: the consumers of the node clicked in column i
  columns.push(el("div", { class: "column" }, el("h4", {}, "Pivot"), card(st.pivot, 0, path[0] === st.pivot.id)));
  path.forEach((id, i) => {
    const n = st.neighbours.get(id);
    if (!n) return;
    const from = st.nodes.get(id);
    const col = el("div", { class: "column" }, el("h4", { title: `${from.phase} ${from.boundary}` }, `Fed by ${from.boundary} · ${from.phase}`));
    const followed = n.consumers.filter((c) => !st.hidden.has(c.edge) || path[i + 1] === c.id);
    if (!n.consumers.length) col.append(el("p", { class: "note" }, "No divergent consumer: the difference stops here or leaves the recorded boundaries."));
    for (const c of followed) col.append(card(c, i + 1, path[i + 1] === c.id, { kind: c.edge, count: (st.edges.get(`${id}\n${c.id}\n${c.edge}`) || {}).count }));
    const hidden = n.consumers.length - followed.length;
    if (hidden) col.append(el("p", { class: "note hidden-edges" }, `${plural(hidden, "more", "more")} via ${[...new Set(n.consumers.filter((c) => !followed.includes(c)).map((c) => c.edge))].join(", ")}, not followed (tick it above)`));
    columns.push(col);
  });
  fill($(SEL.propagation), ...columns);
  syncButtons(path);
  const box = $(SEL.propagation);
  box.scrollLeft = box.scrollWidth;
}

function syncButtons(path) {
  $(SEL.propBack).disabled = st.at <= 0;
  $(SEL.propForward).disabled = st.at < 0 || st.at >= st.history.length - 1;
  fill($(SEL.propCrumbs), ...path.flatMap((id, i) => {
    const n = st.nodes.get(id);
    const name = n ? n.boundary : id;
    return i === path.length - 1 ? [el("b", {}, name)] : [name, " › "];
  }));
}
