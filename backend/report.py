"""The terminal report of a comparison: what a user reads first after `bitguard compare`."""

from __future__ import annotations


def _line(char: str = "─", n: int = 78) -> str:
    return char * n


def render_text(c) -> str:
    d = c.to_dict()
    al = d["alignment"]
    out = [f"bitguard compare  A={d['run_a']}  B={d['run_b']}", _line()]
    if d["manifest_diffs"]:
        out.append("Before the bits: the manifests differ in ways that can explain a divergence by themselves:")
        for m in d["manifest_diffs"]:
            out.append(f"  • {m['field']}: A={m['a']!r}  B={m['b']!r}  ({m['why']})")
        out.append("")
    if d["incomplete"]:
        for side, why in d["incomplete"].items():
            out.append(f"Run {side.upper()} is incomplete ({why}): compared up to where it ends.")
        out.append("")
    fd = d["first_divergence"]
    if fd is None:
        out.append(f"VERDICT: identical — {al['identical_prefix']} matched events, every digest equal "
                   f"(ranks {', '.join(map(str, d['ranks']))}).")
    else:
        out.append(f"VERDICT: diverged — first divergence on rank {fd['rank']}, step {fd['step']}, "
                   f"{fd['phase']} of {fd['boundary']} ({fd['module_type']}, call {fd['call']})")
        out.append(f"  blame: {fd['blame']} ({fd['fault_class']})")
        if fd.get("retyped"):
            out.append(f"  note: paired across a type change: A runs {fd['module_type']}, B runs {fd['module_type_b']} "
                       f"(or a dtype differs, see the tensors)")
        w = fd["blame_window"]
        if w:
            if w.get("module"):
                out.append(f"  blame window: {w['module']}" + (f" minus children {', '.join(w['excluding_children'])}"
                                                               if w.get("excluding_children") else ""))
            out.append(f"    {w.get('detail', '')}")
        out.append("  tensors (A / B digests, xor:pos):")
        for t in fd["tensors"]:
            mark = "≠" if t["differs"] and not t["ignored"] else ("~" if t["ignored"] else "=")
            dtype = t["dtype"] if t.get("dtype_b") in (None, t["dtype"]) else f"{t['dtype']}→{t['dtype_b']}"
            out.append(f"    {mark} {t['role']}[{t['index']}]{t['path'] or ''} {dtype}{list(t['shape'])}  "
                       f"A {t['a']['xor']}:{t['a']['pos']}  B {t['b']['xor']}:{t['b']['pos']}")
        if fd["stack"]:
            out.append("  call stack (innermost last):")
            out += [f"    {f}" for f in fd["stack"][-8:]]
        nodes = d["propagation"]["nodes"]
        if nodes:
            out.append(f"  propagation: reaches {len(nodes)} module/phase nodes; first hops:")
            edges = d["propagation"]["edges"]
            by_id = {n["id"]: n for n in nodes}
            frontier = [n["id"] for n in nodes if n["is_pivot"]]
            shown = 0
            for _ in range(3):
                nxt = []
                for e in edges:
                    if e["source"] in frontier and shown < 12:
                        t = by_id[e["target"]]
                        out.append(f"    {by_id[e['source']]['boundary']} ({by_id[e['source']]['phase']}) -> "
                                   f"{t['boundary']} ({t['phase']}) via {e['kind']}, first at step {e['first_step']}")
                        nxt.append(e["target"])
                        shown += 1
                frontier = nxt
    out.append(_line())
    out.append(f"alignment: A {al['events_a']} events, B {al['events_b']} events, matched {al['matched']} "
               f"({al['reordered']} reordered), gaps A {al['gaps_a']} / B {al['gaps_b']} "
               f"({al['allowed_gaps']} allowed by rules), identical prefix {al['identical_prefix']}, "
               f"band {al['band']}, largest DP window {al['max_window']}")
    if al["gaps_before_pivot"]:
        out.append("structural differences before the pivot (events on one side only):")
        for g in al["gaps_before_pivot"][:10]:
            out.append(f"  only in {g['side'].upper()}: step {g['step']} {g['phase']} {g['boundary']} ({g['module_type']})")
    if d["rules_fired"]:
        out.append("rules fired: " + ", ".join(f"{r['id']}×{r['count']}" for r in d["rules_fired"]))
    return "\n".join(out)
