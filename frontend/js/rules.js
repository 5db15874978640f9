// The rules panel: the comparison's benign-difference rule set. "Mark as benign" on a
// divergence opens a rule prefilled from it; rules are edited in a draft, and saving stores a
// new version on the server, which reruns the comparison (the pivot moves). Rule sets can be
// saved under a name, exported as the file `bitguard compare --rules` reads, and imported.
// "Add & save" adds the rule and saves in one click; every saved version's result can be reopened
// (the version picker reruns the comparison with that version).

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, on, toast, fill } from "./dom.js";
import { slug, today } from "./format.js";
import { pairTensors } from "./detail.js";

const st = {
  c: null,
  vocab: null, // phases, roles, actions from /api/schema
  sets: [],
  current: null, // the saved rule set (latest version) attached to the comparison
  draft: [],
  dirty: false,
  editing: null, // {index (-1: new), rule}
  naming: null, // "save" | "save-as" while asking for a name
  error: null,
};

export async function init() {
  on(EV.comparisonLoaded, (c) => load(c));
  on(EV.markBenign, (d) => openFromEvent(d));
  st.vocab = await api.get("/api/schema");
}

async function load(c) {
  const changedSet = !st.c || st.c.id !== c.id || (c.rule_set && c.rule_set.id) !== (st.current && st.current.id)
    || (c.rule_set && c.rule_set.version) !== (st.current && st.current.version);
  st.c = c;
  st.sets = await api.get("/api/rulesets");
  if (changedSet || !st.dirty) {
    // the version the comparison ran with (an earlier one when reopened), not always the latest
    st.current = c.rule_set ? await api.get(`/api/rulesets/${c.rule_set.id}`, { version: c.rule_set.version }) : null;
    st.draft = st.current ? structuredClone(st.current.rules) : [];
    st.dirty = false;
    st.editing = null;
    st.naming = null;
  }
  st.error = null;
  render();
}

function uniqueId(base) {
  const taken = new Set(st.draft.map((r) => r.id));
  let id = base;
  for (let i = 2; taken.has(id); i += 1) id = `${base}-${i}`;
  return id;
}

function openFromEvent(d) {
  const e = d.event;
  const gap = d.status === "only_a" || d.status === "only_b";
  const differing = pairTensors(d.tensors_a, d.tensors_b).filter((t) => t.differs);
  const roles = [...new Set(differing.map((t) => t.role))];
  const match = { boundary: e.boundary, module_type: e.module_type, phase: e.phase };
  if (!gap && roles.length === 1) match.role = roles[0];
  const runs = st.c ? `${st.c.run_a.name} vs ${st.c.run_b.name}` : "";
  st.editing = {
    index: -1,
    rule: {
      id: uniqueId(slug(`benign-${e.boundary}`)),
      action: gap ? "allow-gap" : "ignore",
      match,
      note: `${gap ? "present on one side only" : "digests differ"} at step ${e.step} in ${runs}; judged benign`,
      author: localStorage.getItem("bitguard.author") || "",
      created: today(),
    },
  };
  st.error = null;
  render();
  $(SEL.rulesPanel).scrollIntoView({ block: "nearest" });
  const first = $("#rule-id");
  if (first) first.focus();
}

// -- rendering --------------------------------------------------------------------------------
function matchText(m) {
  const parts = Object.entries(m || {}).map(([k, v]) => `${k}=${Array.isArray(v) ? `[${v.map((x) => x ?? "").join(",")}]` : v}`);
  return parts.length ? parts.join("  ") : "(matches everything)";
}

function firedCount(id) {
  const fired = (st.c && st.c.summary && st.c.summary.rules_fired) || [];
  const f = fired.find((x) => x.id === id);
  return f ? f.count : 0;
}

function ruleCard(rule, index) {
  const fired = st.dirty ? 0 : firedCount(rule.id);
  return el("div", { class: `rule${fired ? " fired" : ""}`, dataset: { ruleId: rule.id } },
    el("div", { class: "top" },
      el("span", { class: "id" }, rule.id),
      el("span", { class: `badge ${rule.action}` }, rule.action),
      fired ? el("span", { class: "version", title: "events this rule matched in the current result" }, `fired ${fired}×`) : null,
      el("span", { class: "actions" },
        el("button", { class: "btn small", onclick: () => { st.editing = { index, rule: structuredClone(rule) }; render(); } }, "Edit"),
        el("button", { class: "btn small danger", onclick: () => { st.draft.splice(index, 1); st.dirty = true; st.editing = null; render(); } }, "Delete"))),
    el("div", { class: "match" }, matchText(rule.match)),
    rule.note ? el("div", { class: "note" }, rule.note, rule.author ? ` — ${rule.author}` : "") : null);
}

function field(label, input) {
  return [el("label", {}, label), input];
}

function select(id, options, value) {
  return el("select", { id }, ...options.map(([v, text]) => el("option", { value: v, selected: String(value ?? "") === String(v) }, text)));
}

function editor() {
  const r = st.editing.rule;
  const m = r.match || {};
  const v = st.vocab || { phases: [], roles: [], rule_actions: ["ignore", "allow-gap"] };
  const steps = m.steps || [null, null];
  return el("div", { class: "editor", id: "rule-editor" },
    ...field("id", el("input", { type: "text", id: "rule-id", value: r.id })),
    ...field("action", select("rule-action", v.rule_actions.map((a) => [a, a === "ignore" ? "ignore (digest difference is benign)" : "allow-gap (one-sided event is expected)"]), r.action)),
    ...field("boundary", el("input", { type: "text", id: "rule-boundary", value: m.boundary ?? "", placeholder: "glob, e.g. blocks.*.attn" })),
    ...field("module type", el("input", { type: "text", id: "rule-module-type", value: m.module_type ?? "", placeholder: "glob, e.g. Dropout" })),
    ...field("phase", select("rule-phase", [["", "any"], ...(v.rule_phases || v.phases).map((p) => [p, p])], m.phase)),
    ...field("role", select("rule-role", [["", "any"], ...v.roles.map((p) => [p, p])], m.role)),
    ...field("path", el("input", { type: "text", id: "rule-path", value: m.path ?? "", placeholder: "glob on a tensor's path (ignore only), e.g. *init_from*" })),
    ...field("dtype", el("input", { type: "text", id: "rule-dtype", value: m.dtype ?? "", placeholder: "any" })),
    ...field("steps", el("div", { class: "row2" },
      el("input", { type: "number", id: "rule-step-first", min: 0, value: steps[0] ?? "", placeholder: "first" }),
      el("input", { type: "number", id: "rule-step-last", min: 0, value: steps[1] ?? "", placeholder: "last" }))),
    ...field("rank", el("input", { type: "number", id: "rule-rank", min: 0, value: m.rank ?? "", placeholder: "any" })),
    ...field("note", el("textarea", { id: "rule-note", rows: 2 }, r.note || "")),
    ...field("author", el("input", { type: "text", id: "rule-author", value: r.author || "" })),
    st.current ? null : field("save as", el("input", { type: "text", id: "rule-set-name", value: suggestedName(), title: "the name the new rule set is saved under" })),
    el("div", { class: "buttons" },
      el("button", { class: "btn small", onclick: () => { st.editing = null; render(); } }, "Cancel"),
      el("button", { id: "rule-apply", class: "btn small", onclick: applyEditor, title: "Change the draft only; save it later" }, st.editing.index < 0 ? "Add to draft" : "Update draft"),
      el("button", { id: "rule-add-save", class: "btn small primary", onclick: applyAndSave, title: "Save the rule set with this rule and re-run the comparison" }, st.editing.index < 0 ? "Add & save" : "Update & save")));
}

function readEditor() {
  const val = (id) => $(`#${id}`).value.trim();
  const num = (id) => (val(id) === "" ? null : Number(val(id)));
  const match = {};
  for (const [key, id] of [["boundary", "rule-boundary"], ["module_type", "rule-module-type"], ["phase", "rule-phase"], ["role", "rule-role"], ["path", "rule-path"], ["dtype", "rule-dtype"]]) {
    if (val(id)) match[key] = val(id);
  }
  const first = num("rule-step-first");
  const last = num("rule-step-last");
  if (first !== null || last !== null) match.steps = [first, last];
  if (num("rule-rank") !== null) match.rank = num("rule-rank");
  const rule = { id: val("rule-id"), action: val("rule-action"), match, note: val("rule-note"), author: val("rule-author"), created: st.editing.rule.created || today() };
  if (rule.author) localStorage.setItem("bitguard.author", rule.author);
  return rule;
}

function applyEditor() {
  const rule = readEditor();
  if (!rule.id) {
    st.error = "A rule needs an id (letters, digits, _ . : -).";
    render();
    return false;
  }
  const clash = st.draft.findIndex((r) => r.id === rule.id);
  if (clash >= 0 && clash !== st.editing.index) {
    st.error = `Another rule is already called ${rule.id}; pick another id.`;
    render();
    return false;
  }
  if (st.editing.index < 0) st.draft.push(rule);
  else st.draft[st.editing.index] = rule;
  st.editing = null;
  st.dirty = true;
  st.error = null;
  render();
  return true;
}

// "Add & save": the rule goes into the draft and the draft is saved (a new set under the name given)
function applyAndSave() {
  const name = st.current ? null : $("#rule-set-name").value;
  if (!applyEditor()) return;
  if (st.current) save();
  else saveNew(name);
}

// a name no saved set has yet: "rules for A vs B", else "rules for A vs B (2)", ...
function suggestedName() {
  const base = `rules for ${st.c.run_a.name} vs ${st.c.run_b.name}`;
  const taken = new Set(st.sets.map((s) => s.name));
  let name = base;
  for (let i = 2; taken.has(name); i += 1) name = `${base} (${i})`;
  return name;
}

function nameBox() {
  const suggestion = st.naming === "save-as" && st.current ? `${st.current.name} (copy)` : suggestedName();
  const input = el("input", { type: "text", id: "ruleset-name", value: suggestion, style: "flex:1" });
  return el("div", { class: "rules-head" }, el("label", {}, "Name"), input,
    el("button", { id: "ruleset-name-ok", class: "btn small primary", onclick: () => saveNew(input.value) }, "Save"),
    el("button", { class: "btn small", onclick: () => { st.naming = null; render(); } }, "Cancel"));
}

function render() {
  const panel = $(SEL.rulesPanel);
  if (!st.c) return;
  const setOptions = [["", "no rule set"], ...st.sets.map((s) => [s.id, s.name])];
  const head = el("div", { class: "rules-head" },
    el("h2", { style: "margin:0" }, "Benign-difference rules"));
  const chooser = el("div", { class: "rules-head" },
    select("ruleset-select", setOptions, st.current ? st.current.id : ""),
    st.current ? el("span", { class: "version", id: "ruleset-version" }, `v${st.current.version}${st.current.versions ? ` of ${st.current.versions.length}` : ""}`) : null,
    versionPicker(),
    st.dirty ? el("span", { class: "dirty", id: "rules-dirty" }, "● unsaved changes") : null);
  chooser.querySelector("select").addEventListener("change", (e) => attach(e.target.value || null));
  const list = st.draft.length ? st.draft.map(ruleCard) : [el("p", { class: "note" }, "No rules: every digest difference counts as a divergence. Select a divergence and choose \u201cMark as benign\u201d to add one.")];
  const actions = el("div", { class: "panel-actions" },
    el("button", { id: "rule-add", class: "btn small", onclick: () => { st.editing = { index: -1, rule: { id: uniqueId("rule"), action: "ignore", match: {}, created: today() } }; render(); } }, "+ Rule"),
    el("button", { id: "ruleset-save", class: "btn small primary", disabled: !st.dirty && !!st.current, onclick: save }, st.current ? "Save rule set" : "Save as rule set…"),
    st.current ? el("button", { id: "ruleset-save-as", class: "btn small", onclick: () => { st.naming = "save-as"; render(); } }, "Save as…") : null,
    st.current ? el("a", { id: "ruleset-export", class: "btn small", href: `/api/rulesets/${st.current.id}/export`, download: "", title: "The rules file of bitguard compare --rules (the saved version)" }, "Export") : null,
    el("label", { class: "btn small", title: "Import a rules file (bitguard.rules/1)" }, "Import…",
      el("input", { type: "file", id: "ruleset-import", accept: ".json,application/json", hidden: true, onchange: (e) => importFile(e.target.files[0]) })),
    st.current ? el("button", { id: "ruleset-delete", class: "btn small danger", onclick: removeSet }, "Delete set") : null);
  fill(panel, head, chooser, ...list,
    st.editing ? editor() : null,
    st.naming ? nameBox() : null,
    st.error ? el("p", { id: "rules-error", class: "banner error" }, st.error) : null,
    actions);
}

// -- saving: every save reruns the comparison ---------------------------------------------------
async function rerunWith(ruleSetId, version = null) {
  const c = await api.post(comparisonPath(st.c.id, "/rerun"), { rule_set_id: ruleSetId, keep_rule_set: false, rule_set_version: version });
  emit(EV.rulesSaved, { comparison: c });
}

async function guard(fn) {
  try {
    st.error = null;
    await fn();
  } catch (e) {
    st.error = e.message;
    render();
  }
}

function save() {
  if (!st.current) {
    st.naming = "save";
    render();
    return;
  }
  guard(async () => {
    const saved = await api.put(`/api/rulesets/${st.current.id}`, { rules: st.draft });
    st.current = saved;
    st.dirty = false;
    render();
    toast(`Saved ${saved.name} v${saved.version}; re-running the comparison`);
    if (!(saved.comparisons || []).includes(st.c.id)) await rerunWith(saved.id);
    else emit(EV.rulesSaved, { comparison: st.c });
  });
}

function saveNew(name) {
  guard(async () => {
    const saved = await api.post("/api/rulesets", { name, rules: st.draft });
    st.current = saved;
    st.dirty = false;
    st.naming = null;
    render();
    toast(`Saved ${saved.name}; re-running the comparison`);
    await rerunWith(saved.id);
  });
}

// every saved version of the set: choosing one reruns the comparison with it (its result reopened)
function versionPicker() {
  const versions = (st.current && st.current.versions) || [];
  if (versions.length < 2) return null;
  const s = el("select", { id: "ruleset-version-select", "aria-label": "reopen the result of a saved version", title: "Reopen the comparison's result under a saved version of this rule set" },
    ...versions.map((v) => el("option", { value: v.version, selected: v.version === st.current.version },
      `v${v.version} · ${v.rules} rule${v.rules === 1 ? "" : "s"}${v.version === st.current.latest_version ? " (latest)" : ""}`)));
  s.addEventListener("change", () => {
    if (st.dirty && !confirm("Discard the unsaved rule changes?")) {
      render();
      return;
    }
    st.dirty = false;
    guard(() => rerunWith(st.current.id, Number(s.value)));
  });
  return s;
}

function attach(id) {
  if (st.dirty && !confirm("Discard the unsaved rule changes?")) {
    render();
    return;
  }
  st.dirty = false;
  guard(() => rerunWith(id));
}

function importFile(file) {
  if (!file) return;
  guard(async () => {
    const saved = await api.importRules(file);
    toast(`Imported ${saved.name} (${saved.rules.length} rules); re-running the comparison`);
    st.dirty = false;
    await rerunWith(saved.id);
  });
}

function removeSet() {
  if (!confirm(`Delete the rule set ${st.current.name} and all its versions?`)) return;
  guard(async () => {
    await api.del(`/api/rulesets/${st.current.id}`);
    st.current = null;
    st.draft = [];
    st.dirty = false;
    emit(EV.rulesSaved, { comparison: st.c });
  });
}
