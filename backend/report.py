"""The terminal report of a comparison: what a user reads first after `bitguard compare`.

It reads the typed result (`Comparison.result`, result.py) and nothing else; the JSON is the
same document.
"""

from __future__ import annotations

from pathlib import Path

from bitguard.backend import api_diff
from bitguard.backend.certification import compared_windows
from bitguard.backend.pivot import phase_words
from bitguard.backend.check import CheckResult, Finding
from bitguard.backend.result import CompareResult, FirstDivergence


def _line(char: str = "─", n: int = 78) -> str:
    return char * n


_CONTROL = {i: f"\\x{i:02x}" for i in [*range(0x20), 0x7f] if chr(i) not in "\n"}


def render_text(c) -> str:
    """The report, with every control character a run's strings may hold (an ANSI escape in a
    boundary name) shown as its escape instead of reaching the terminal."""
    return _render(c).translate(_CONTROL)


def _within(c) -> str:
    """The steps the verdict covers, as the headline says them: the recorded window of run A, or,
    for a resumed run B, A's steps from the one B resumed at (with B's own numbers beside them)."""
    shift = c.run_b.step_shift
    if not shift:
        window = c.run_a.manifest.get("steps")
        return (f" within the recorded steps {window[0]}:{'' if window[1] is None else window[1]}"
                if isinstance(window, list) and len(window) == 2 else "")
    wa, wb = compared_windows(c.run_a, c.run_b)
    first = max(w[0] or 0 for w in (wa, wb))
    ends = [w[1] for w in (wa, wb) if w[1] is not None]
    end = min(ends) if ends else None
    if end is None:
        return f" from run A's step {first} on (run B resumed A at step {shift}: B's step s is A's step {shift} + s)"
    return (f" within run A's steps {first}:{end} (run B resumed A at step {shift}: its steps "
            f"{first - shift}:{end - shift})")


def _render(c) -> str:
    r: CompareResult = c.result
    al = r.alignment
    out = [f"bitguard compare  A={r.run_a}  B={r.run_b}", _line()]
    if r.manifest_diffs:
        out += _manifest_diffs(r)
    if r.incomplete:
        for side, why in r.incomplete.items():
            out.append(f"Run {side.upper()} is incomplete ({why}): compared up to where it ends.")
        out.append("")
    fd = r.first_divergence
    nothing = r.verdict == "inconclusive" and not al.matched  # (two runs of different programs: nothing compared)
    within = _within(c)
    if r.verdict == "identical":
        accepted = sum(x.count for x in r.rules_fired)
        digests = (f"every digest equal or its difference accepted by a rule ({accepted} events matched a rule)"
                   if accepted else "every digest equal")
        out.append(f"VERDICT: identical — {al.identical_prefix} matched events{within}, {digests} "
                   f"(ranks {', '.join(map(str, r.ranks))}).")
    elif r.verdict == "inconclusive":
        out.append("VERDICT: inconclusive — no event of the two runs could be paired, so nothing was compared:"
                   if nothing else f"VERDICT: inconclusive — what could be compared is identical "
                   f"({al.identical_prefix} matched events), but the runs cannot be certified identical:")
        out += [f"  • {_said(reason, r.ranks)}" for reason in r.inconclusive.reasons]
    else:
        out += _divergence(fd)
    if r.api_differences is not None:
        if nothing:
            out.append(f"  rank {r.api_differences.rank} of the two runs also called the training API differently:")
        else:
            effect = (f"these settings had no effect{within}; a step outside them was not compared" if within
                      else "these settings had no effect on what was recorded")
            out.append(f"  note: the numbers compared match, but rank {r.api_differences.rank} of the two runs called "
                       f"the training API differently ({effect}):")
        out += api_diff.lines(r.api_differences.model_dump(), "  ", header=False)
    if r.verdict != "inconclusive":
        notes = [x for x in r.certification.reasons if x.code not in _NOTES]
        if notes:
            out.append("  also not certified:")
            out += [f"    • {_said(x, r.ranks)}" for x in notes]
    out += _propagation(r)
    out += _run_checks(r)
    out.append(_line())
    out.append(f"alignment: A {al.events_a} events, B {al.events_b} events, matched {al.matched} "
               f"({al.reordered} reordered), gaps A {al.gaps_a} / B {al.gaps_b} "
               f"({al.allowed_gaps} allowed by rules, {al.not_compared} not compared), identical prefix "
               f"{al.identical_prefix}, band {al.band}, largest DP window {al.max_window}")
    if al.gaps_before_pivot:
        where = "before the pivot, " if fd is not None else ""
        out.append(f"events on one side only {where}not compared (outside what could be certified, or explained by a "
                   f"note below):")
        for g in al.gaps_before_pivot[:10]:
            # (a params event said "optimizer", its phase: helper 43)
            out.append(f"  only in {g.side.upper()}: step {g.step}, the {phase_words(g.phase, g.kind or '')} of "
                       f"{g.boundary} ({g.module_type})")
    if r.rules_fired:
        out.append("rules fired: " + ", ".join(f"{x.id}×{x.count}" for x in r.rules_fired))
    for x in r.certification.reasons:
        if x.code in _NOTES:  # informational: they do not stop a verdict
            out.append(f"note: {_said(x, r.ranks)}")
    return "\n".join(out)


def _manifest_diffs(r: CompareResult, shown: int = 6) -> list[str]:
    """Version differences first (the JSON's order), a library only one run imported named in one
    line at the end: an upgrade's few changed versions are not lost among its changed imports."""
    out = ["Before the bits: the manifests differ in ways that can explain a divergence by themselves:"]
    lone = [m for m in r.manifest_diffs if m.field.startswith("versions.") and (m.a is None or m.b is None)]
    for m in r.manifest_diffs:
        if m not in lone:
            out.append(f"  • {m.field}: A={m.a!r}  B={m.b!r}  ({m.why})")
    if lone:
        names = [f"{m.field.removeprefix('versions.')} {m.a or m.b} ({'A' if m.b is None else 'B'})" for m in lone]
        more = f" and {len(names) - shown} more (--json lists them)" if len(names) > shown else ""
        out.append(f"  • imported by one run only: {', '.join(names[:shown])}{more}")
    return out + [""]


def _retyped(fd: FirstDivergence) -> str:
    """What changed between the two sides of a pair made across a type change: the module's type,
    or only a tensor's dtype (autocast, a half-precision copy), or its tensors (by position)."""
    verb = "save" if fd.kind == "saved" else "run"  # (a save's type is the object it wrote: helper 77)
    if fd.module_type_b and fd.module_type_b != fd.module_type:
        return f"paired across a type change: A {verb}s {fd.module_type}, B {verb}s {fd.module_type_b}"
    changed = sorted({f"{t.dtype}→{t.dtype_b}" for t in fd.tensors if t.dtype and t.dtype_b and t.dtype != t.dtype_b})
    if changed:
        return f"paired across a dtype change ({', '.join(changed)}): both runs {verb} {fd.module_type}"
    return f"paired across a change of its tensors: both runs {verb} {fd.module_type}"


_NOTES = ("modes", "recompute", "bypassed", "retyped", "threads")  # reasons that describe what was compared: notes


def _said(reason, ranks: list[int]) -> str:
    """A reason's message, led by its rank when the runs hold several (the same words from two
    ranks were two identical lines)."""
    if reason.rank is None or len(ranks) < 2 or f"rank {reason.rank}" in reason.message:
        return reason.message
    return f"rank {reason.rank}: {reason.message}"


TENSOR_LINES = 24  # a pivot's tensors listed in full up to this many; beyond, only those that differ or are unknown


def _call_words(module_type: str | None, call) -> str:
    """`(Linear, call 3)`; `(call 3)` for a tensor no module holds (its events have no module type)."""
    return f"({module_type}, call {call})" if module_type else f"(call {call})"


def _divergence(fd: FirstDivergence) -> list[str]:
    if fd.cause == "structure" and fd.fault_class == "signature":
        out = [f"VERDICT: diverged — first divergence on rank {fd.rank}, step {fd.step}: both runs record the "
               f"{phase_words(fd.phase, fd.kind)} of {fd.boundary} {_call_words(fd.module_type, fd.call)}, with different "
               f"tensors"]
    elif fd.cause == "structure" and fd.kind == "final":  # (helper 33: an early stop read as A lacking something)
        ends, goes_on = ("B", "A") if fd.missing_side == "a" else ("A", "B")
        out = [f"VERDICT: diverged — first divergence on rank {fd.rank}, step {fd.step}: run {ends} takes the final "
               f"state of {fd.boundary} ({fd.module_type}) here, where run {goes_on} goes on"]
    elif fd.cause == "structure":
        lacking = fd.missing_side.upper()
        out = [f"VERDICT: diverged — first divergence on rank {fd.rank}, step {fd.step}: run {lacking} lacks the "
               f"{phase_words(fd.phase, fd.kind)} of {fd.boundary} {_call_words(fd.module_type, fd.call)} that the other "
               f"run records"]
    else:
        what = phase_words(fd.phase, fd.kind)
        out = [f"VERDICT: diverged — first divergence on rank {fd.rank}, step {fd.step}, "
               f"{what} of {fd.boundary} {_call_words(fd.module_type, fd.call)}"]
    out.append(f"  blame: {fd.blame} ({fd.fault_class})")
    if fd.retyped:
        out.append(f"  note: {_retyped(fd)}")
    out += [f"  note: {n}" for n in fd.notes]
    if fd.api_differences is not None:
        out += api_diff.lines(fd.api_differences.model_dump())
    w = fd.blame_window
    if w:
        # (a window without a module still gets its heading: under the API lines its detail read as one of them)
        out.append(f"  blame window: {w.module or 'none'}" + (f" minus children {', '.join(w.excluding_children)}"
                                                             if w.module and w.excluding_children else ""))
        out.append(f"    {w.detail}")
    out.append("  tensors (A / B digests, xor:pos):")
    shown = fd.tensors
    if len(shown) > TENSOR_LINES:  # (a checkpoint's thousands: the ones that differ or are unknown, first ones first)
        shown = [t for t in shown if t.unobserved or (t.differs and not t.ignored)][:TENSOR_LINES]
    for t in shown:
        if t.unobserved:
            mark = "?"
        elif t.differs and not t.ignored:
            mark = "≠"
        else:
            mark = "~" if t.ignored else "="
        dtype = t.dtype or t.dtype_b
        if t.dtype and t.dtype_b and t.dtype_b != t.dtype:
            dtype = f"{t.dtype}→{t.dtype_b}"
        rule = f"  benign (rule {t.rule_id})" if t.ignored else ""
        why = f"  unobserved: {t.unobserved}" if t.unobserved else ""
        shape = f"{list(t.shape or [])}" + (f"→{t.shape_b}" if t.shape_b is not None else "")
        path = (t.path or "") + (f" (B: {t.path_b})" if t.path_b is not None else "")
        out.append(f"    {mark} {t.role}[{t.index}]{path} {dtype}{shape}  "
                   f"A {t.a.xor or '—'}:{t.a.pos or '—'}  B {t.b.xor or '—'}:{t.b.pos or '—'}{rule}{why}")
    if len(shown) < len(fd.tensors):
        listed = {id(t) for t in shown}
        left = [t for t in fd.tensors if id(t) not in listed]
        differ = sum(1 for t in left if t.differs and not t.ignored)
        out.append(f"    … and {len(left)} more tensor(s)" + (f", {differ} of them differing" if differ else ", all equal")
                   + " (--json lists every one)")
    if fd.stack:
        out.append("  call stack (innermost last):" if fd.stack_b is None else "  call stack in A (innermost last):")
        out += [f"    {f}" for f in fd.stack[-8:]]
    if fd.stack_b:
        out.append("  call stack in B, which differs (innermost last):")
        out += [f"    {f}" for f in fd.stack_b[-8:]]
    return out


def _propagation(r: CompareResult) -> list[str]:
    nodes, edges = r.propagation.nodes, r.propagation.edges
    if not nodes:
        return []
    out = [f"  propagation: reaches {len(nodes)} module/phase node(s)" + ("; first hops:" if edges else "")]
    by_id = {n.id: n for n in nodes}
    frontier = [n.id for n in nodes if n.is_pivot]
    ranks = len({n.rank for n in nodes}) > 1  # several ranks' graphs: each hop says whose it is
    shown = 0
    for _ in range(3):
        nxt = []
        for e in edges:
            if e.source in frontier and shown < 12:
                s, t = by_id[e.source], by_id[e.target]
                out.append(f"    {f'rank {s.rank}: ' if ranks else ''}{s.boundary} ({phase_words(s.phase, s.kind)}) -> "
                           f"{t.boundary} ({phase_words(t.phase, t.kind)}) via {e.kind}, first at step {e.first_step}")
                nxt.append(e.target)
                shown += 1
        frontier = nxt
    return out


def _run_checks(r: CompareResult) -> list[str]:
    """What each run says about itself (the in-run checks, backend/check.py), when it found something."""
    out = []
    for side, findings in sorted((r.run_checks or {}).items()):
        if findings:
            out.append(f"  within run {side.upper()} alone (bitguard check): {len(findings)} finding(s)")
            out += _findings(findings, "    ")
    return out


def _findings(findings: list[Finding], indent: str, limit: int = 5) -> list[str]:
    """The findings whose inputs agreed first (where it arose), then a count of those that follow."""
    sources = [f for f in findings if f.blame == "source"]
    out = []
    for f in (sources or findings)[:limit]:
        out.append(f"{indent}• rank {f.rank}, step {f.step}, {phase_words(f.phase, f.kind)} of {f.boundary} "
                   f"{_call_words(f.module_type, f.call)} [{f.check}, {f.blame}]")
        out.append(f"{indent}  {f.detail}")
        for t in f.tensors[:4]:
            out.append(f"{indent}  ≠ {t.role}[{t.index}]{t.path or ''} {t.dtype}{list(t.shape or [])}  "
                       f"expected {t.expected.xor or '—'}:{t.expected.pos or '—'}  got {t.got.xor or '—'}:{t.got.pos or '—'}")
    rest = len(findings) - min(len(sources or findings), limit)
    if rest:
        first = next((f for f in findings if f not in (sources or findings)[:limit]), None)
        out.append(f"{indent}… and {rest} more" + (f" (first: step {first.step} {first.phase} of {first.boundary}, "
                                                    f"{first.blame})" if first else ""))
    return out


def render_check(r: CheckResult) -> str:
    """The terminal report of `bitguard check RUN` (control characters shown as escapes)."""
    out = [f"bitguard check  {r.run}  (ranks {', '.join(map(str, r.ranks))})", _line()]
    compared = sum(c.compared for c in r.checks)
    if r.verdict == "findings":
        out.append(f"VERDICT: findings — {len(r.findings)} computation(s) that must agree within the run differ:")
        out += _findings(r.findings, "  ")
    elif r.verdict == "clean":
        partly = sum(c.inputs_only for c in r.checks)
        out.append(f"VERDICT: clean — {compared} in-run comparison(s), every one bitwise equal" + (
            f"; {partly} of them of inputs alone (recomputes cut short by non-reentrant checkpointing: what they "
            f"would have computed after their last saved tensor was not compared, see the note)." if partly else "."))
    else:
        out.append(f"VERDICT: inconclusive — no finding in {compared} in-run comparison(s), but the run cannot be "
                   f"called clean:")
    out += [f"  • {x.message}" for x in r.reasons]
    out.append(_line())
    for c in r.checks:
        out.append(f"{c.name}: {c.compared} compared, {c.findings} finding(s)")
        out += [f"  note: {n}" for n in c.notes]
    return "\n".join(out).translate(_CONTROL)


def _through_another(op: dict) -> str | None:
    """The innermost module through which the other run calls the same function at the same line where a
    structure op pivot's run calls it through another; None when it calls nothing so."""
    mine = (op.get("modules") or [None])[-1]
    for o in op.get("other_side") or []:
        theirs = (o.get("modules") or [None])[-1]
        if o.get("op") == op.get("op") and (o.get("file"), o.get("line")) == (op.get("file"), op.get("line")) \
                and mine and theirs and theirs != mine:
            return theirs
    return None


def render_drill(doc: dict) -> str:
    """The terminal report of a `bitguard.drill/1` document."""
    w, fd = doc["window"], doc["boundary_pivot"]
    headline = doc["verdict"].replace("_", " ")
    if (doc.get("replay") or {}).get("cause") == "op_trace":  # (helper 92: "not reproduced" over "both reproduced")
        headline += " — the op trace is incomplete; both replays reproduced their records"
    out = [_line("═"), f"bitguard drill: {headline}", _line("═"),
           f"boundary pivot   step {fd['step']} rank {fd['rank']} {fd['phase']} {fd['boundary']} ({fd['blame']})",
           f"window traced    {w['boundary']} ({w.get('module_type')}), call {w['call']}: {w['why']}",
           f"replay           {doc['replay']['detail']}"]
    if doc["replay"].get("reproduced"):  # (a replay that does not reproduce has its notes in its detail)
        out += [f"  run {s.upper()}: {n}" for s in ("a", "b") for n in (doc["replay"].get(s) or {}).get("notes") or []]
    op = doc.get("op_pivot")
    if op:
        where = f"{op['file']}:{op['line']} in {op['function']}" if op.get("file") else "(no user frame)"
        if op.get("source") == "created_at":
            where += f" (the forward line that made autograd node {op.get('node')}, which runs it in backward)"
        elif op.get("node"):
            where += f" (in backward, inside autograd node {op['node']})"
        out += [_line(), f"FIRST DIFFERING OPERATION  {op['op']}", f"  at       {where}"]
        b = op.get("at_b")
        if b and (b.get("file"), b.get("line")) != (op.get("file"), op.get("line")):
            out.append(f"  in B at  {b['file']}:{b['line']} in {b['function']}")
        out.append(f"  chain    {' > '.join(op['chain'])}")
        if op["cause"] == "structure":
            side, other = op["side_only"].upper(), "B" if op["side_only"] == "a" else "A"
            there = ", ".join(f"{o['op']} ({Path(o['file']).name}:{o['line']})" if o.get("file") else o["op"]
                              for o in op["other_side"][:4]) or "nothing"
            moved = op.get("moved")
            if moved:
                at = f" at {Path(moved['file']).name}:{moved['line']}" if moved.get("file") else ""
                when = "later" if moved["index"] > op["index_" + op["side_only"]] else "sooner"
                out.append(f"  cause    structure: the order differs: run {other} calls it too, as its op "
                           f"{moved['index']}{at}, {when}, and its output differs (run {other} calls {there} here)")
            elif theirs := _through_another(op):  # (helper 76: peft's set_adapter; both ran F.linear at layer.py:1102)
                out.append(f"  cause    structure: run {side} calls it through {op['modules'][-1]}, run {other} calls "
                           f"the same function at the same line through {theirs} there: the same "
                           f"code reached through another module (an adapter or a branch switched)")
            else:
                out.append(f"  cause    structure: run {side} alone calls it (run {other} calls {there} there)")
            then = op.get("then")
            if then:
                at = f"{Path(then['file']).name}:{then['line']} in {then['function']}" if then.get("file") else "?"
                sig = then.get("signature") or {}
                fed = " (fed by what differs)" if then["inputs_differ"] else ""
                # (fed by what differs, its output's pattern says nothing of hardware: helper 44's edge count
                # that changed read "multi_bit_flip ... a hardware fault is likely")
                reading = ("what differs follows from the structural difference above (its inputs or arguments "
                           "differ)" if then["inputs_differ"] or then["args_differ"] else sig.get("reading"))
                out.append(f"  then     the first op both call whose output differs{fed}: {then['op']} at {at}: "
                           f"{sig.get('kind')}: {reading}")
        else:
            inputs = "differ" if op["inputs_differ"] else "are equal"
            args = ", its other arguments differ" if op["args_differ"] else ""
            out.append(f"  cause    digest: its tensor inputs {inputs}{args}, its output differs")
            for o in op["outputs"]:
                if o["differs"]:
                    a, b = o["a"] or {}, o["b"] or {}
                    out.append(f"  output {o['index']} A {a.get('xor')}/{a.get('pos')}  B {b.get('xor')}/{b.get('pos')}")
            if op["args_differ"]:
                out += [f"  args A   {op['args_a']}", f"  args B   {op['args_b']}"]
        if op.get("note"):
            out.append(f"  note     {op['note']}")
    elif doc.get("detail"):
        out += [_line(), doc["detail"]]
    for title, sig in (("SIGNATURE", doc.get("signature")), ("AT THE BOUNDARY", doc.get("boundary_signature"))):
        if sig:
            out += [_line(), f"{title}  {sig['kind']}: {sig['reading']}"]
            if sig.get("elements_differing") is not None:
                out.append(f"  {sig['elements_differing']:,} of {sig['elements_total']:,} elements differ; max abs "
                           f"{sig.get('max_abs')}, max ULP {sig.get('max_ulp')}; bits {sig.get('bits')}")
    out += [_line(), f"drill records: A {doc['records']['a']}", f"               B {doc['records']['b']}"]
    return "\n".join(out)
