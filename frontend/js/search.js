// The search box above the timelines: find events of the rank on show by boundary glob, module
// type, phase, step and status, and step through the matches with Enter / Shift+Enter (or ◀ ▶).
// The query is one line of words: a boundary pattern ("blocks.5.mlp*": a glob from any dotted
// part; plain text: anywhere in the name) and filters written key:value, e.g.
//   blocks.5.mlp*  type:Linear  phase:backward  step:3-5  status:diverged
// The server finds the matches (GET .../search); this module parses the line and says where the
// jump went. It knows nothing of how the timeline draws.

import { $, SEL } from "./dom.js";
import { count } from "./format.js";
import * as timeline from "./timeline.js";

const KEYS = { type: "module_type", module: "module_type", module_type: "module_type", phase: "phase", step: "step", status: "status" };

// "blocks.5.mlp* type:Linear step:3-5" -> {query: {boundary, module_type, step_min, step_max}} or {error}
export function parseQuery(text) {
  const query = {};
  const words = String(text || "").trim().split(/\s+/).filter(Boolean);
  for (const w of words) {
    const m = w.match(/^(\w+):(.*)$/);
    if (m && KEYS[m[1].toLowerCase()]) {
      const key = KEYS[m[1].toLowerCase()];
      if (!m[2]) return { error: `${m[1]}: needs a value` };
      if (key === "step") {
        const s = m[2].match(/^(\d+)(?:(?:-|\.\.)(\d*))?$/);
        if (!s) return { error: `step:${m[2]} is not a step (step:3) or a range (step:3-5, step:3-)` };
        query.step_min = Number(s[1]);
        if (s[2] === undefined) query.step_max = Number(s[1]);
        else if (s[2] !== "") query.step_max = Number(s[2]);
      } else query[key] = m[2];
    } else if (query.boundary) {
      return { error: `one boundary pattern at a time (“${query.boundary}” and “${w}”); filters are key:value` };
    } else query.boundary = w;
  }
  if (!Object.keys(query).length) return { error: null, empty: true };
  return { query };
}

let last = null; // the query text last asked for, so Enter on it again steps on

async function find(direction) {
  const input = $(SEL.search);
  const info = $(SEL.searchInfo);
  const parsed = parseQuery(input.value);
  input.classList.toggle("bad", Boolean(parsed.error));
  if (parsed.error || parsed.empty) {
    info.textContent = parsed.error || "";
    info.classList.toggle("none", Boolean(parsed.error));
    return;
  }
  last = input.value;
  const out = await timeline.jump(parsed.query, direction);
  if (!out || input.value !== last) return;
  info.classList.toggle("none", !out.hit);
  if (!out.total) info.textContent = `no match on rank ${timeline.current().rank}`;
  else if (!out.hit) info.textContent = `no match ${direction === "next" ? "after" : "before"} this one (${count(out.total)} in all)`;
  else {
    const e = out.hit.event;
    info.textContent = `${count(out.hit.index + 1)} of ${count(out.total)} · step ${count(e.step)} · ${e.phase} ${e.boundary}`;
    info.title = `${e.boundary} (${e.module_type}) · step ${e.step} · ${e.phase} · ${e.status}`;
  }
  info.dataset.total = String(out.total);
  info.dataset.index = out.hit ? String(out.hit.index) : "";
}

export function focus() {
  const input = $(SEL.search);
  input.focus();
  input.select();
}

export function init() {
  $(SEL.searchForm).addEventListener("submit", (e) => {
    e.preventDefault();
    find("next");
  });
  $(SEL.search).addEventListener("keydown", (e) => {
    if (e.key === "Enter" && e.shiftKey) {
      e.preventDefault();
      find("prev");
    } else if (e.key === "Escape") {
      e.target.blur();
    }
  });
  $(SEL.search).addEventListener("input", () => {
    $(SEL.search).classList.remove("bad");
  });
  $(SEL.searchPrev).addEventListener("click", () => find("prev"));
}
