"""The recompute check: an activation recompute must agree bitwise with the forward it repeats.

Under activation checkpointing (`torch.utils.checkpoint`, reentrant or not; Hugging Face
`gradient_checkpointing_enable`) a module's forward runs twice in a step: once in the forward
pass, and again during backward to recompute the activations it did not keep. The collectors
record the second as a `recompute` event of the same module (collectors/recompute.py). The same
deterministic computation on the same inputs must give the same bytes, so a recompute whose
outputs differ from its original forward's is silent data corruption or nondeterminism seen
inside one run, with no reference run.

Pairing: a recompute of module M at step s is paired with a forward of M at step s recorded
before it and not yet paired: the first one whose inputs (tensors and RNG state) and outputs are
bitwise the recompute's, else the first whose inputs are, else the first in order (the n-th
recompute with the n-th forward). Inputs decide first because a reentrant checkpoint recomputes its
regions in backward order, so a module shared by two regions is recomputed last-region first; among
calls on the same inputs, one that computed what the recompute did is the call it repeats (a
reference pass under no_grad with an adapter switched off, then the checkpointed call: the same
inputs, two computations).

Compared: the outputs. A recompute whose inputs matched and whose outputs differ is a `source`
finding (it computed differently); one whose inputs already differed is a `consumer` (the
difference came from upstream in the recomputed region, or an input was changed in place after
the forward). Module buffers are not compared: a module that updates them in forward (batch
norm's running statistics) updates them again when recomputed, by design. A pair holding a
tensor that could not be observed is not compared, and said so.

A recompute cut short (non-reentrant checkpointing stops recomputing once the last saved tensor is
back, by an exception through the calls it is inside: the region's outermost call, a dropout whose
mask is that tensor) is recorded with its inputs and no outputs: its inputs, and the RNG state it
began from where it drew before the cut, are compared with its forward's (a dropout recomputed from
another RNG state is found so); outputs it never made are not, and the note says how many.

What this does not know: what a region computes after its last saved tensor is not recomputed, so
a difference there (code that reads a counter) is not seen; checkpointing
outside torch.utils.checkpoint (DeepSpeed's, Megatron's) is not recognised as a recompute by the
collectors. A recompute whose RNG state differs from its forward's (preserve_rng_state=False) is a
finding: the backward then used activations the forward never computed.
"""

from __future__ import annotations

import polars as pl

from bitguard.backend.check import Against, DigestPair, Finding, LoadedRun, Outcome, TensorDiff, hexdigest, register

INPUT_ROLES = ("input", "rng")
COMPARED_ROLES = ("output",)
STATE_ROLES = ("state",)  # a module's own buffers as the call left them: not compared, read to explain a finding


def _tensor_map(tensors: pl.DataFrame, seqs: list[int]) -> dict[int, dict[tuple[str, int], dict]]:
    """seq -> (role, idx) -> tensor row, for the events `seqs`."""
    out: dict[int, dict[tuple[str, int], dict]] = {s: {} for s in seqs}
    rows = tensors.filter(pl.col("seq").is_in(seqs) & pl.col("role").is_in(INPUT_ROLES + COMPARED_ROLES + STATE_ROLES))
    for row in rows.iter_rows(named=True):
        out[row["seq"]][(row["role"], row["idx"])] = row
    return out


def _same(a: dict, b: dict, roles: tuple[str, ...]) -> bool:
    keys_a = {k for k in a if k[0] in roles}
    keys_b = {k for k in b if k[0] in roles}
    return keys_a == keys_b and all(
        (a[k]["xor"], a[k]["pos"]) == (b[k]["xor"], b[k]["pos"]) and a[k]["unobserved"] is None
        and b[k]["unobserved"] is None for k in keys_a)


def _differences(expected: dict, got: dict, roles: tuple[str, ...]) -> list[TensorDiff]:
    out = []
    for key in sorted({k for k in (*expected, *got) if k[0] in roles}):
        e, g = expected.get(key), got.get(key)
        if e is not None and g is not None and (e["xor"], e["pos"]) == (g["xor"], g["pos"]) and (
                list(e["shape"]) == list(g["shape"]) and e["dtype"] == g["dtype"]):
            continue
        ref = g or e
        out.append(TensorDiff(
            role=key[0], index=key[1], path=ref["path"], shape=None if ref["shape"] is None else list(ref["shape"]),
            dtype=ref["dtype"],
            expected=DigestPair(xor=hexdigest(e["xor"]) if e else None, pos=hexdigest(e["pos"]) if e else None),
            got=DigestPair(xor=hexdigest(g["xor"]) if g else None, pos=hexdigest(g["pos"]) if g else None)))
    return out


def _unobserved(t: dict, roles: tuple[str, ...]) -> bool:
    return any(row["unobserved"] is not None for k, row in t.items() if k[0] in roles)


def _cut_short(got: dict, expected: dict) -> bool:
    """A recompute recorded with no outputs where its forward made some: one non-reentrant checkpointing
    stopped inside (collectors/hooks.py records such a call when the stop passes through it)."""
    return not any(k[0] == "output" for k in got) and any(k[0] == "output" for k in expected)


def _pair(recomputes: list[dict], forwards: list[dict], digests: dict) -> list[tuple[dict, dict | None]]:
    """Each recompute with its original forward (None: no forward of it was recorded before it)."""
    free = list(forwards)
    out = []
    for r in recomputes:
        earlier = [f for f in free if f["seq"] < r["seq"]]
        same_inputs = [f for f in earlier if _same(digests[f["seq"]], digests[r["seq"]], INPUT_ROLES)]
        # (a call on the same inputs that computed something else, an adapter switched off for a
        # reference pass under no_grad, is another computation: the one the recompute repeats is
        # preferred, helper 44's PEFT case)
        match = next((f for f in same_inputs if _same(digests[f["seq"]], digests[r["seq"]], COMPARED_ROLES)),
                     same_inputs[0] if same_inputs else None)
        if match is None and earlier:
            match = earlier[0]
        if match is not None:
            free.remove(match)
        out.append((r, match))
    return out


def _finding(rank: int, r: dict, f: dict, diffs: list[TensorDiff], inputs_differ: bool,
             state: list[TensorDiff] = ()) -> Finding:
    roles = sorted({d.role for d in diffs})
    where = f"the recompute of {r['boundary']} at step {r['step']} (recompute call {r['call']})"
    if state and not inputs_differ:  # (helper 85: spectral_norm's power iteration, checkpointed, read as SDC)
        paths = ", ".join(d.path for d in state[:3])
        detail = (f"{where} returned different {', '.join(roles)} from its original forward (call {f['call']}) on "
                  f"bitwise the same inputs, and its buffers ({paths}) differ as the two calls left them: the module "
                  f"updates its own buffers when called (spectral norm's power iteration, a running estimate), so the "
                  f"recompute began from the buffers the forward left and computed otherwise: the backward used "
                  f"other activations than the forward (checkpointing a module that updates its state), not "
                  f"silent data corruption")
        diffs = diffs + list(state)
        roles = sorted({d.role for d in diffs})
    elif inputs_differ and {d.role for d in diffs if d.role in INPUT_ROLES} == {"rng"}:
        detail = (f"{where} started from another RNG state than its original forward (call {f['call']}), so it drew "
                  f"other random numbers (checkpoint(..., preserve_rng_state=False), or a generator the checkpoint "
                  f"does not restore): the backward used activations the forward never computed")
    elif inputs_differ:
        detail = (f"{where} already had inputs ({', '.join(x for x in roles if x in INPUT_ROLES)}) that differ from "
                  f"its original forward's (call {f['call']}): a difference upstream in the recomputed region, or an "
                  f"input changed in place after the forward")
    else:
        detail = (f"{where} returned different {', '.join(roles)} from its original forward (call {f['call']}) on "
                  f"bitwise the same inputs: the same computation gave two results (silent data corruption, a "
                  f"nondeterministic kernel, or code that behaves differently when recomputed)")
    return Finding(check="recompute", rank=rank, step=r["step"], phase=r["phase"], kind=r["kind"],
                   boundary=r["boundary"], module_type=r["module_type"], call=r["call"], seq=r["seq"],
                   against=Against(rank=rank, seq=f["seq"], phase=f["phase"], call=f["call"]),
                   blame="consumer" if inputs_differ else "source", differing_roles=roles, tensors=diffs,
                   detail=detail)


def _inner_first(findings: list[Finding]) -> None:
    """A source finding whose call holds an earlier source finding of the same step (the parametrization inside
    a parametrized Linear, the Linear inside its block) says so rather than naming silent data corruption: the
    call inside computed differently first, and this one returned what it made."""
    by_step: dict[int, list[Finding]] = {}
    for f in findings:
        if f.blame == "source":
            by_step.setdefault(f.step, []).append(f)
    for f in (f for same in by_step.values() for f in same):
        inner = next((g for g in by_step[f.step] if g.seq < f.seq and g.boundary.startswith(f"{f.boundary}.")), None)
        if inner is not None:
            f.detail = (f"the recompute of {f.boundary} at step {f.step} (recompute call {f.call}) returned different "
                        f"{', '.join(f.differing_roles)} from its original forward (call {f.against.call}) on bitwise "
                        f"the same inputs: {inner.boundary}, a call inside it, computed differently first (its finding)")


def _check_rank(run: LoadedRun, rank: int, outcome: Outcome) -> None:
    events = run.events(rank)
    recomputes = events.filter((pl.col("phase") == "recompute") & (pl.col("kind") == "module"))
    if recomputes.is_empty():
        return
    names = recomputes["boundary"].unique().implode()
    forwards = events.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                             & pl.col("boundary").is_in(names))
    columns = ["seq", "step", "phase", "kind", "boundary", "module_type", "call"]
    by_key: dict[tuple, list[dict]] = {}
    for row in forwards.select(columns).sort("seq").iter_rows(named=True):
        by_key.setdefault((row["step"], row["boundary"]), []).append(row)
    digests = _tensor_map(run.tensors(rank), recomputes["seq"].to_list() + forwards["seq"].to_list())
    unpaired = unobserved = cut = 0
    groups: dict[tuple, list[dict]] = {}
    for row in recomputes.select(columns).sort("seq").iter_rows(named=True):
        groups.setdefault((row["step"], row["boundary"]), []).append(row)
    for key, group in groups.items():
        for r, f in _pair(group, by_key.get(key, []), digests):
            if f is None:
                unpaired += 1
                continue
            got, expected = digests[r["seq"]], digests[f["seq"]]
            if _unobserved(got, COMPARED_ROLES + INPUT_ROLES) or _unobserved(expected, COMPARED_ROLES + INPUT_ROLES):
                unobserved += 1
                continue
            outcome.compared += 1
            if _cut_short(got, expected):
                cut += 1
                inputs = _differences({k: v for k, v in expected.items() if k in got or k[0] != "rng"}, got,
                                      INPUT_ROLES)  # (a draw after the cut was not made again: no rng row)
                if inputs:
                    outcome.findings.append(_finding(rank, r, f, inputs, True))
                continue
            diffs = _differences(expected, got, COMPARED_ROLES)
            if diffs:
                inputs = _differences(expected, got, INPUT_ROLES)
                outcome.findings.append(_finding(rank, r, f, inputs + diffs, bool(inputs),
                                                 _differences(expected, got, STATE_ROLES)))
    if unpaired:
        outcome.notes.append(f"rank {rank}: {unpaired} recompute(s) had no forward of their module recorded before "
                             f"them in their step (outside the recorded step window?): not checked")
    _inner_first([f for f in outcome.findings if f.rank == rank])
    outcome.inputs_only += cut
    if cut:
        outcome.notes.append(f"rank {rank}: {cut} recompute(s) were cut short by non-reentrant checkpointing (it stops "
                             f"once the last saved tensor is back): their inputs, and the RNG state they began from, "
                             f"were compared with their forward's; outputs they never made were not, nor what the "
                             f"region computes after its last saved tensor")
    if unobserved:
        outcome.notes.append(f"rank {rank}: {unobserved} recompute(s) hold a tensor that could not be observed "
                             f"(on a side): not checked")


def one_sided(gaps: pl.DataFrame, ea: pl.DataFrame, eb: pl.DataFrame, rank: int) -> tuple[pl.DataFrame, list[dict]]:
    """compare.py: recompute events on one side only are not a structural divergence. A recompute
    repeats a forward and changes no number by itself (what it feeds, the backward, is compared):
    one run checkpointing and the other not, or another checkpoint mode (non-reentrant stops
    recomputing early), records other recompute events for the same training. `gaps` with those
    no longer counted, and an informational reason (certification.py `Reason`) saying how many."""
    if not gaps.height:
        return gaps, []
    counts, seqs = {}, {}
    for side, events in (("a", ea), ("b", eb)):
        rec = events.filter(pl.col("phase") == "recompute")["seq"]
        mine = gaps.filter((pl.col("side") == side) & pl.col("seq").is_in(rec.implode()))["seq"]
        if mine.len():
            counts[side], seqs[side] = mine.len(), mine.to_list()
    if not counts:
        return gaps, []
    off = pl.lit(False)
    for side, values in seqs.items():
        off = off | ((pl.col("side") == side) & pl.col("seq").is_in(values))
    gaps = gaps.with_columns((pl.col("counted") & ~off).alias("counted"))
    which = " and ".join(f"run {side.upper()} {n}" for side, n in sorted(counts.items()))
    from bitguard.backend.certification import reason

    return gaps, [reason("recompute", rank=rank, message=
                         f"activation recomputes recorded in one run only ({which} on rank {rank}: checkpointing, or "
                         f"its mode, differs between the runs): a recompute repeats a forward and changes no number "
                         f"itself, so these are not a divergence; each run's recomputes are held to its own forwards "
                         f"(run_checks)")]


_RECOMPUTES = (pl.col("phase") == "recompute") & (pl.col("kind") == "module")
# the events `_check_rank` reads: the module recomputes and the forwards of the same modules
_READS = _RECOMPUTES | ((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                        & pl.col("boundary").is_in(pl.col("boundary").filter(_RECOMPUTES).implode()))


@register("recompute", reads=_READS)
def check_recompute(run: LoadedRun) -> Outcome:
    """Every recompute against its original forward, on every rank of `run`."""
    outcome = Outcome(compared=0)
    for rank in run.ranks:
        _check_rank(run, rank, outcome)
    if not outcome.compared and not outcome.notes:
        outcome.notes.append("the run recorded no activation recompute (no torch.utils.checkpoint region)")
    return outcome
