// The home view: two directory pickers that upload run A and run B with progress and say
// plainly what is wrong with a folder that is not a run; the workspace's comparisons and runs.

import { api } from "./api.js";
import { $, SEL, el, toast, fill } from "./dom.js";
import { bytes, count, when } from "./format.js";

const chosen = { a: null, b: null }; // run records once uploaded
let limits = null;

export function init() {
  for (const side of ["a", "b"]) {
    const input = $(side === "a" ? SEL.pickA : SEL.pickB);
    input.addEventListener("change", () => pick(side, input.files).finally(() => (input.value = "")));
  }
  $(SEL.compare).addEventListener("click", startComparison);
}

export async function open() {
  document.title = "bitguard explorer";
  fill($(SEL.title));
  await Promise.all([refreshLists(), api.get("/api/limits").then((l) => (limits = l))]).catch((e) => toast(e.message, "error"));
}

function setStatus(side, kind, ...message) {
  const status = $(side === "a" ? SEL.statusA : SEL.statusB);
  fill(status, ...message);
  status.closest(".picker").classList.toggle("ok", kind === "ok");
  status.closest(".picker").classList.toggle("error", kind === "error");
  status.dataset.state = kind;
}

function setProgress(side, fraction) {
  $(side === "a" ? SEL.progressA : SEL.progressB).style.width = `${Math.round(fraction * 100)}%`;
}

function precheck(files) {
  if (!files.length) return "That folder is empty. Pick a run folder: it holds manifest.json and rank-N.duckdb files.";
  if (!limits) return null;
  if (files.length > limits.max_files) return `That folder holds ${count(files.length)} files; a run upload may hold at most ${count(limits.max_files)}. Is this the run folder?`;
  const total = Array.from(files).reduce((acc, f) => acc + f.size, 0);
  const big = Array.from(files).find((f) => f.size > limits.max_file_bytes);
  if (big) return `${big.webkitRelativePath || big.name} is ${bytes(big.size)}, over the ${bytes(limits.max_file_bytes)} per-file limit of this server.`;
  if (total > limits.max_run_bytes) return `That folder holds ${bytes(total)}, over the ${bytes(limits.max_run_bytes)} per-run limit of this server.`;
  return null;
}

async function pick(side, files) {
  chosen[side] = null;
  syncCompare();
  const folder = files.length ? (files[0].webkitRelativePath || files[0].name).split("/")[0] : "";
  const problem = precheck(files);
  if (problem) {
    setProgress(side, 0);
    setStatus(side, "error", problem);
    return;
  }
  setStatus(side, "busy", `Uploading ${folder} (${count(files.length)} files)…`);
  setProgress(side, 0);
  try {
    const run = await api.uploadRun(files, (f) => setProgress(side, f));
    setProgress(side, 1);
    chosen[side] = run;
    setStatus(side, "ok", el("b", {}, run.name), ` · ${run.world_size} rank${run.world_size > 1 ? "s" : ""} · ${count(run.files)} files · ${bytes(run.bytes)}${run.status && run.status !== "complete" ? ` · recording ${run.status}` : ""}`);
    refreshLists();
  } catch (e) {
    setProgress(side, 0);
    setStatus(side, "error", `${folder ? `${folder}: ` : ""}${e.message}`);
  }
  syncCompare();
}

function choose(side, run) {
  chosen[side] = run;
  setProgress(side, 1);
  setStatus(side, "ok", el("b", {}, run.name), ` · from the workspace · ${run.world_size} rank${run.world_size > 1 ? "s" : ""}`);
  syncCompare();
}

function syncCompare() {
  $(SEL.compare).disabled = !(chosen.a && chosen.b);
}

async function startComparison() {
  const button = $(SEL.compare);
  button.disabled = true;
  try {
    const ruleSet = $(SEL.homeRuleSet).value || null;
    const resumed = $(SEL.homeResumedAt).value.trim();
    if (resumed !== "" && !/^\d+$/.test(resumed)) throw new Error(`"B resumed A at step" takes a step number of 0 or more (or nothing: step for step), not ${resumed}`);
    const c = await api.post("/api/comparisons", { run_a: chosen.a.id, run_b: chosen.b.id, rule_set_id: ruleSet, resumed_at: resumed === "" ? 0 : Number(resumed) });
    location.hash = `#/c/${c.id}`;
  } catch (e) {
    toast(e.message, "error");
    button.disabled = false;
  }
}

async function refreshLists() {
  const [comparisons, runs, sets] = await Promise.all([api.get("/api/comparisons"), api.get("/api/runs"), api.get("/api/rulesets")]);
  const select = $(SEL.homeRuleSet);
  const keep = select.value;
  fill(select, el("option", { value: "" }, "none"), ...sets.map((s) => el("option", { value: s.id, selected: s.id === keep }, `${s.name} (v${s.version}, ${s.rules.length} rules)`)));

  const ct = $(SEL.comparisonsTable);
  fill(ct, el("tr", {}, el("th", {}, "Run A"), el("th", {}, "Run B"), el("th", {}, "Result"), el("th", {}, "Pivot"), el("th", {}, "Rules"), el("th", {}, "")));
  if (!comparisons.length) ct.append(el("tr", {}, el("td", { class: "empty", colspan: 6 }, "No comparisons yet.")));
  for (const c of comparisons) {
    const fd = c.summary && c.summary.first_divergence;
    const state = c.status === "ready" ? c.verdict : c.status;
    ct.append(el("tr", { class: "link", onclick: () => (location.hash = `#/c/${c.id}`) },
      el("td", {}, c.run_a.name), el("td", {}, c.run_b.name, c.resumed_at ? el("div", { class: "note" }, `resumed at step ${c.resumed_at}`) : null),
      el("td", {}, el("span", { class: `badge ${state}` }, state)),
      el("td", { class: "mono" }, fd ? `${fd.boundary} · step ${fd.step}` : ""),
      el("td", {}, c.rule_set ? `${c.rule_set.name} v${c.rule_set.version}` : ""),
      el("td", {}, el("button", { class: "btn small danger", title: "Delete this comparison", onclick: (e) => { e.stopPropagation(); remove(`/api/comparisons/${c.id}`); } }, "Delete"))));
  }

  const rt = $(SEL.runsTable);
  fill(rt, el("tr", {}, el("th", {}, "Name"), el("th", {}, "Ranks"), el("th", {}, "Size"), el("th", {}, "Uploaded"), el("th", {}, "")));
  if (!runs.length) rt.append(el("tr", {}, el("td", { class: "empty", colspan: 5 }, "No runs uploaded yet.")));
  for (const r of runs) {
    // a run kept by an older version that fails today's checks: listed with why, not usable
    const badge = r.problem ? el("span", { class: "badge unusable", style: "margin-left:6px", title: r.problem }, "unusable")
      : r.status && r.status !== "complete" ? el("span", { class: "badge failed", style: "margin-left:6px" }, r.status) : null;
    rt.append(el("tr", { dataset: { runId: r.id } },
      el("td", {}, el("b", {}, r.name), badge, r.problem ? el("div", { class: "note" }, r.problem) : null),
      el("td", {}, r.ranks.join(", ")), el("td", {}, bytes(r.bytes)), el("td", {}, when(r.created)),
      el("td", { style: "text-align:right;white-space:nowrap" },
        r.mode === "online" ? el("a", { class: "btn small", href: `#/r/${r.id}/alerts`, title: "This run was recorded with --mode online: its alerts" }, "Alerts") : null, r.mode === "online" ? " " : null,
        r.mode !== "online" && !r.problem ? el("a", { class: "btn small", href: `#/r/${r.id}/violations`, title: "Training-invariant violations: recorded with --check, or check against an invariants file" }, "Invariants") : null, r.mode !== "online" && !r.problem ? " " : null,
        el("button", { class: "btn small", disabled: !!r.problem, onclick: () => choose("a", r) }, "Use as A"), " ",
        el("button", { class: "btn small", disabled: !!r.problem, onclick: () => choose("b", r) }, "Use as B"), " ",
        el("button", { class: "btn small danger", title: "Delete this run and its comparisons", onclick: () => remove(`/api/runs/${r.id}`, `Delete ${r.name} and every comparison that uses it?`) }, "Delete"))));
  }
}

async function remove(path, question) {
  if (question && !confirm(question)) return;
  try {
    await api.del(path);
    await refreshLists();
  } catch (e) {
    toast(e.message, "error");
  }
}
