"""Propagation: which divergent events the pivot reaches, summarised per module and phase.

Edges run forward in time between divergent events of one rank:
- dataflow: an event's output tensor is another's input (same tensor identity), forward
  (`output` -> `input`) and backward (`grad_input` of a consumer -> `grad_output` of its producer);
- nesting: a divergent child forward call -> the enclosing call it belongs to;
- forward -> backward of the same module in the same step (saved activations);
- a module's backward -> its parameters' gradient events; gradient -> optimizer step of that
  parameter; optimizer step -> the owning module's next forward (the updated weights);
- inferred: a divergent forward call whose input tensor no observed event produced (a
  functional op between modules made it) -> from the divergent forward call completed just before.
The graph is returned summarised: one node per (phase, kind, boundary) with the first step
reached and the number of divergent events, one edge per (source node, target node, kind).
"""

from __future__ import annotations

from collections import defaultdict, deque

import polars as pl


def node_id(rank: int, phase: str, kind: str, boundary: str) -> str:
    return f"r{rank}:{phase}:{kind}:{boundary}"


def _dataflow(tensors: pl.DataFrame, producer_role: str, consumer_role: str) -> list[tuple[int, int]]:
    prod = tensors.filter((pl.col("role") == producer_role) & (pl.col("tid") > 0)).select(
        pl.col("seq").alias("src"), "tid")
    cons = tensors.filter((pl.col("role") == consumer_role) & (pl.col("tid") > 0)).select(
        pl.col("seq").alias("dst"), "tid")
    joined = prod.join(cons, on="tid").filter(pl.col("src") != pl.col("dst"))
    return list(zip(joined["src"].to_list(), joined["dst"].to_list()))


def build(rank: int, events: pl.DataFrame, tensors: pl.DataFrame, divergent: set[int], pivot_seq: int) -> dict:
    """Summarised propagation graph from `pivot_seq` over the divergent A-side events."""
    info, out = graph(events, tensors, divergent)
    reached = reachable(out, [pivot_seq])
    return _summarise(rank, info, reached, out, pivot_seq, len(divergent))


def reachable(out: dict[int, list], sources) -> dict[int, int]:
    """Every event reachable from `sources` over the edges `out`, with the source it was first
    reached from (sources taken in the order given)."""
    reached: dict[int, int] = {}
    for source in sources:
        if source in reached:
            continue
        reached[source] = source
        queue = deque([source])
        while queue:
            s = queue.popleft()
            for d, _ in out.get(s, ()):
                if d not in reached:
                    reached[d] = source
                    queue.append(d)
    return reached


def graph(events: pl.DataFrame, tensors: pl.DataFrame, divergent: set[int],
          loss: bool = False) -> tuple[dict, dict[int, list]]:
    """The divergent events' fields by seq, and the edges between them: seq -> [(seq, kind)].
    `loss` adds what no tensor identity shows but every step obeys: the root module's forward
    (it returns the loss) feeds every backward and optimizer event of its step, and an optimizer
    step feeds the next step's first divergent forward (and, through it, the rest). Too coarse
    to draw, it is what "follows from an accepted difference" must assume."""
    ev = events.filter(pl.col("seq").is_in(list(divergent)))
    tens = tensors.filter(pl.col("seq").is_in(list(divergent)))
    info = {r["seq"]: r for r in ev.select("seq", "step", "phase", "kind", "boundary", "module_type", "depth",
                                            "t_start_ns", "t_end_ns").iter_rows(named=True)}
    edges: list[tuple[int, int, str]] = []
    edges += [(s, d, "dataflow") for s, d in _dataflow(tens, "output", "input")]
    edges += [(s, d, "dataflow") for s, d in _dataflow(tens, "grad_input", "grad_output")]
    fwd = sorted((r for r in info.values() if r["phase"] == "forward"), key=lambda r: r["seq"])
    by_module_step: dict[tuple, list] = defaultdict(list)
    for r in info.values():
        by_module_step[(r["boundary"], r["step"], r["phase"], r["kind"])].append(r["seq"])
    # nesting: child forward -> the innermost enclosing forward call
    open_calls: list[dict] = []
    for r in sorted(fwd, key=lambda r: (r["t_start_ns"], -r["t_end_ns"])):
        while open_calls and open_calls[-1]["t_end_ns"] < r["t_end_ns"]:
            open_calls.pop()
        if open_calls and open_calls[-1]["depth"] < r["depth"]:
            edges.append((r["seq"], open_calls[-1]["seq"], "nesting"))
        open_calls.append(r)
    opt_by_param_step = {}
    for r in info.values():
        key = (r["boundary"], r["step"])
        if r["phase"] in ("forward", "recompute"):  # a recompute's outputs are the activations backward uses
            for b in by_module_step.get((r["boundary"], r["step"], "backward", "module"), []):
                edges.append((r["seq"], b, "activation"))
        elif r["phase"] == "backward" and r["kind"] == "grad":
            owner = r["boundary"].rpartition(".")[0]
            for b in by_module_step.get((owner, r["step"], "backward", "module"), []):
                edges.append((b, r["seq"], "weight-grad"))
            for o in by_module_step.get((r["boundary"], r["step"], "optimizer", "step"), []):
                edges.append((r["seq"], o, "update"))
        elif r["phase"] == "optimizer":
            opt_by_param_step[key] = r["seq"]
    # inferred: a divergent call whose input no observed event produced (a functional op between
    # modules made it) hangs off the divergent forward call that completed just before it
    first_out = (tensors.filter((pl.col("role") == "output") & (pl.col("tid") > 0))
                 .group_by("tid").agg(pl.col("seq").min().alias("producer")))
    ins = tens.filter((pl.col("role") == "input") & (pl.col("tid") > 0)).join(first_out, on="tid", how="left")
    orphan_inputs = set(ins.filter(pl.col("producer").is_null() | (pl.col("producer") >= pl.col("seq")))["seq"].to_list())
    previous = None
    for r in fwd:
        if r["seq"] in orphan_inputs and previous is not None and previous["step"] == r["step"]:
            edges.append((previous["seq"], r["seq"], "inferred"))
        previous = r
    next_forward: dict[str, list] = defaultdict(list)
    for r in fwd:
        next_forward[r["boundary"]].append((r["step"], r["seq"]))
    for (param, step), seq in opt_by_param_step.items():
        owner = param.rpartition(".")[0]
        later = [s for st, s in next_forward.get(owner, []) if st > step]
        if later:
            edges.append((seq, min(later), "weights"))
    # reachability from the pivot, forward in completion order (dataflow into an enclosing call
    # that completed later is allowed: completion order is what the record certifies)
    if loss:
        after_loss: dict[int, list[int]] = defaultdict(list)  # step -> its backward and optimizer events
        for r in info.values():
            if r["phase"] in ("backward", "optimizer"):
                after_loss[r["step"]].append(r["seq"])
        for r in fwd:
            if r["depth"] == 0:
                edges += [(r["seq"], o, "loss") for o in after_loss.get(r["step"], ())]
    out: dict[int, list] = defaultdict(list)
    for s, d, k in edges:
        if s in info and d in info:
            out[s].append((d, k))
    if loss:
        # updated weights feed every later forward, whichever parameters the hooks saw change:
        # one node per step (a negative id, never an event's seq) keeps this linear in the events
        forwards: dict[int, list[int]] = defaultdict(list)
        for r in fwd:
            forwards[r["step"]].append(r["seq"])
        steps = sorted(forwards)
        for r in info.values():
            if r["phase"] == "optimizer":
                later = [st for st in steps if st > r["step"]]
                if later:
                    out[r["seq"]].append((-1 - later[0], "loss"))
        for st in steps:
            out[-1 - st] = [(f, "loss") for f in forwards[st]]
    return info, out


def _summarise(rank, info, reached, out, pivot_seq, n_divergent) -> dict:
    nodes: dict[str, dict] = {}
    for seq in sorted(reached):
        r = info.get(seq)
        if r is None:
            continue
        nid = node_id(rank, r["phase"], r["kind"], r["boundary"])
        node = nodes.get(nid)
        if node is None:
            nodes[nid] = node = {"id": nid, "rank": rank, "phase": r["phase"], "kind": r["kind"],
                                 "boundary": r["boundary"], "module_type": r["module_type"],
                                 "step": r["step"], "first_step": r["step"], "count": 0, "a_seq": seq,
                                 "is_pivot": False}
        node["count"] += 1
        node["first_step"] = min(node["first_step"], r["step"])
        if seq == pivot_seq:
            node["is_pivot"] = True
    edges: dict[tuple, dict] = {}
    for s in reached:
        if s not in info:
            continue
        for d, kind in out.get(s, ()):
            if d not in reached:
                continue
            a, b = info[s], info[d]
            src = node_id(rank, a["phase"], a["kind"], a["boundary"])
            dst = node_id(rank, b["phase"], b["kind"], b["boundary"])
            if src == dst:
                continue
            e = edges.setdefault((src, dst, kind), {"source": src, "target": dst, "kind": kind, "count": 0,
                                                    "first_step": b["step"]})
            e["count"] += 1
            e["first_step"] = min(e["first_step"], b["step"])
    ordered = sorted(nodes.values(), key=lambda n: n["a_seq"])
    return {"nodes": ordered, "edges": sorted(edges.values(), key=lambda e: (e["first_step"], e["source"])),
            "reached_events": len(reached), "divergent_events": n_divergent}
