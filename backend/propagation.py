"""Propagation: which divergent events the pivot reaches, summarised per module and phase.

Edges run forward in time between divergent events of one rank:
- dataflow: an event's output tensor is another's input (same tensor identity), forward
  (`output` -> `input`; a data event's batch -> the calls that read it) and backward
  (`grad_input` of a consumer -> `grad_output` of its producer; one `grad_output` shared by a
  module and the part it returns, from the first event to the later ones);
- nesting: a divergent child forward call -> the enclosing call it belongs to;
- forward -> backward of the same module in the same step (saved activations);
- a module's backward -> its parameters' gradient events; gradient -> optimizer step of that
  parameter; optimizer step -> the owning module's next forward (the updated weights), -> the
  next `params` event (a root's parameters as a step's first call meets them; it -> the first
  divergent forward after it in its step, and -> the root's next `params` event), and -> a `final` event after it (the weights the
  recording's final state holds);
- inferred: a divergent forward call whose input tensor no observed event produced (a
  functional op between modules made it) -> from the divergent forward call completed just before;
  the same in backward (a root's backward from the root backward just before it: a loss module fed a
  view of the model's output), and a part's backward that is its step's first divergent one, whose incoming
  gradient no backward returned -> from the divergent root forward before it (the loss the root computed).
The graph is returned summarised: one node per (phase, kind, boundary) with the first step
reached and the number of divergent events, one edge per (source node, target node, kind).

Columnar: the edges are polars joins over the divergent events (one row per edge, duplicates
kept: an edge's count is how many event pairs it joins), the nesting stack and the breadth-first
search are Numba loops over arrays; nothing walks the events in Python (a million-event rank
diverged from its middle made 13 s of Python here before, 0.3 s now: docs/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from numba import njit

_INFO = ("seq", "step", "phase", "kind", "boundary", "module_type", "depth", "t_start_ns", "t_end_ns")
_EDGES = {"src": pl.Int64, "dst": pl.Int64, "kind": pl.String}


def node_id(rank: int, phase: str, kind: str, boundary: str) -> str:
    return f"r{rank}:{phase}:{kind}:{boundary}"


@dataclass
class Graph:
    """The divergent events (`info`, in seq order, the fields `_INFO`) and the edges between
    them (`edges`: src, dst, kind, one row per edge; a negative id is a step node of `loss`)."""

    info: pl.DataFrame
    edges: pl.DataFrame


def _owner(boundary: pl.Expr) -> pl.Expr:
    """`boundary.rpartition(".")[0]`: the dotted path without its last part ("" for a name with no dot)."""
    boundary = boundary.cast(pl.String)
    return pl.when(boundary.str.contains(".", literal=True)).then(boundary.str.replace(r"\.[^.]*$", "")) \
        .otherwise(pl.lit("")).cast(pl.Categorical)


def _pairs(left: pl.DataFrame, right: pl.DataFrame, on, kind: str, right_on=None) -> pl.DataFrame:
    """Every (left seq, right seq) joined on `on`: edges of `kind`, source on the left."""
    joined = left.select(pl.col("seq").alias("src"), *on).join(
        right.select(pl.col("seq").alias("dst"), *(right_on or on)), left_on=on, right_on=right_on or on)
    return joined.select("src", "dst", pl.lit(kind).alias("kind"))


def _dataflow(tens: pl.DataFrame, producer_role: str, consumer_role: str) -> pl.DataFrame:
    prod = tens.filter((pl.col("role") == producer_role) & (pl.col("tid") > 0))
    cons = tens.filter((pl.col("role") == consumer_role) & (pl.col("tid") > 0))
    return _pairs(prod, cons, ["tid"], "dataflow").filter(pl.col("src") != pl.col("dst"))


@njit(cache=True)
def _enclosing(t_end, depth):  # pragma: no cover - compiled
    """For calls sorted by (start, -end): the index of the innermost open call enclosing each, or -1."""
    n = len(t_end)
    parent = np.full(n, -1, np.int64)
    stack = np.empty(n, np.int64)
    top = 0
    for i in range(n):
        while top > 0 and t_end[stack[top - 1]] < t_end[i]:
            top -= 1
        if top > 0 and depth[stack[top - 1]] < depth[i]:
            parent[i] = stack[top - 1]
        stack[top] = i
        top += 1
    return parent


def _nesting(fwd: pl.DataFrame) -> pl.DataFrame:
    """child forward -> the innermost enclosing forward call (calls in start order, longer first)."""
    seq, start, end = (fwd[c].to_numpy() for c in ("seq", "t_start_ns", "t_end_ns"))
    order = np.lexsort((seq, -end, start))
    parent = _enclosing(end[order], fwd["depth"].to_numpy()[order].astype(np.int64))
    child = parent >= 0
    return pl.DataFrame({"src": seq[order][child], "dst": seq[order][parent[child]], "kind": "nesting"}, schema=_EDGES)


def graph(events: pl.DataFrame, tensors: pl.DataFrame, divergent, loss: bool = False) -> Graph:
    """The divergent events (`divergent`: their seqs) and the edges between them. `loss` adds what
    no tensor identity shows but every step obeys: the root module's forward (it returns the
    loss) feeds every backward and optimizer event of its step, and an optimizer step feeds the
    next step's first divergent forward (and, through it, the rest). Too coarse to draw, it is
    what "follows from an accepted difference" must assume."""
    div = pl.Series("seq", np.fromiter(divergent, np.int64, len(divergent))).unique().implode()
    # (columns chosen before rows: a filter copies every column it keeps, half a run's events here)
    info = events.select(_INFO).filter(pl.col("seq").is_in(div)).with_columns(
        pl.col("boundary").cast(pl.Categorical))  # (as ingest reads it: a frame made by hand may hold strings)
    tens = tensors.select("seq", "role", "tid").filter(pl.col("seq").is_in(div))
    phase, kind = pl.col("phase"), pl.col("kind")
    fwd = info.filter(phase == "forward")
    back = info.filter((phase == "backward") & (kind == "module"))
    grads = info.filter((phase == "backward") & (kind == "grad")).with_columns(
        _owner(pl.col("boundary")).alias("owner"))
    opt_steps = info.filter((phase == "optimizer") & (kind == "step"))
    # the batch: a data event's inputs are the root call's, the same tensors its first modules read
    data_seqs = info.filter(phase == "data")["seq"].implode()
    batch = tens.filter((pl.col("role") == "input") & (pl.col("tid") > 0))
    # (a module and the last of its parts it returns get one gradient: the outer one's backward, first, reaches the inner)
    shared = tens.filter((pl.col("role") == "grad_output") & (pl.col("tid") > 0))
    parts = [_dataflow(tens, "output", "input"), _dataflow(tens, "grad_input", "grad_output"), _nesting(fwd),
             _pairs(shared, shared, ["tid"], "dataflow").filter(pl.col("src") < pl.col("dst")),
             _pairs(batch.filter(pl.col("seq").is_in(data_seqs)), batch.filter(~pl.col("seq").is_in(data_seqs)),
                    ["tid"], "dataflow").filter(pl.col("src") < pl.col("dst")),
             # a recompute's outputs are the activations backward uses
             _pairs(info.filter(phase.is_in(["forward", "recompute"])), back, ["boundary", "step"], "activation"),
             _pairs(back, grads, ["boundary", "step"], "weight-grad", right_on=["owner", "step"]),
             _pairs(grads, opt_steps, ["boundary", "step"], "update")]
    # inferred: a divergent call whose input no observed event produced (a functional op between
    # modules made it) hangs off the divergent forward call that completed just before it
    first_out = (tensors.select("seq", "role", "tid").filter((pl.col("role") == "output") & (pl.col("tid") > 0))
                 .group_by("tid").agg(pl.col("seq").min().alias("producer")))
    ins = tens.filter((pl.col("role") == "input") & (pl.col("tid") > 0)).join(first_out, on="tid", how="left")
    orphans = ins.filter(pl.col("producer").is_null() | (pl.col("producer") >= pl.col("seq")))["seq"].unique()
    parts.append(fwd.select(pl.col("seq").shift().alias("src"), pl.col("seq").alias("dst"),
                            pl.lit("inferred").alias("kind"), (pl.col("step").shift() == pl.col("step")).alias("_same"))
                 .filter(pl.col("dst").is_in(orphans.implode()) & pl.col("_same").fill_null(False)).drop("_same"))
    # the same in backward: a divergent backward whose incoming gradient no observed backward returned (a
    # functional op between modules, torch.relu, made it) hangs off the divergent backward just before it
    # (helper 35: a fault in l2's backward "reached 1 node" with a relu before l1)
    first_in = (tensors.select("seq", "role", "tid").filter((pl.col("role") == "grad_input") & (pl.col("tid") > 0))
                .group_by("tid").agg(pl.col("seq").min().alias("producer")))
    outs = tens.filter((pl.col("role") == "grad_output") & (pl.col("tid") > 0)).join(first_in, on="tid", how="left")
    orphans = outs.filter(pl.col("producer").is_null() | (pl.col("producer") >= pl.col("seq")))["seq"].unique()
    # (a root's gradient comes from its loss: from the backward before it where that is a root's too, a loss
    # module fed a view of the model's output, as CTC's (T, N, C) is: helper 88, "reached 2 nodes" of 1,249)
    parts.append(back.select(pl.col("seq").shift().alias("src"), pl.col("seq").alias("dst"),
                             pl.lit("inferred").alias("kind"), (pl.col("step").shift() == pl.col("step")).alias("_same"),
                             ((pl.col("depth") > 0) | (pl.col("depth").shift() == 0)).alias("_inner"))
                 .filter(pl.col("dst").is_in(orphans.implode()) & pl.col("_same").fill_null(False) & pl.col("_inner"))
                 .drop("_same", "_inner"))
    # such a backward of a part that is its step's first divergent backward: the code of the root call around
    # it made its gradient after the part returned -> from the divergent root forward before it in its step
    # (helper 61: a loss computed and weighted inside the root's forward, as ultralytics' DetectionModel(batch)
    # does; propagation "reached 1 node" while every gradient, step and weight after it differed)
    lone = back.filter(pl.col("seq").is_in(orphans.implode()) & (pl.col("depth") > 0)
                       & (pl.col("seq") == pl.col("seq").min().over("step")))
    if lone.height:
        roots = fwd.filter(pl.col("depth") == 0).select(pl.col("seq").alias("src"), pl.col("seq").alias("_at"), "step")
        parts.append(lone.select(pl.col("seq").alias("dst"), pl.col("seq").alias("_at"), "step").sort("_at")
                     .join_asof(roots.sort("_at"), on="_at", by="step", strategy="backward", check_sortedness=False)
                     .filter(pl.col("src").is_not_null()).select("src", "dst", pl.lit("inferred").alias("kind")))
    # weights: a parameter's (last) optimizer event of a step -> the owner's first divergent forward of a later step
    params = (opt_steps.group_by("boundary", "step").agg(pl.col("seq").max())
              .select("seq", _owner(pl.col("boundary")).alias("owner"), (pl.col("step") + 1).alias("_after")))
    later = (fwd.group_by("boundary", "step").agg(pl.col("seq").min())
             .sort("boundary", "step", descending=[False, True])  # _first: the first seq of this step or a later one
             .with_columns(pl.col("seq").cum_min().over("boundary").alias("_first")).sort("step"))
    if params.height and later.height:
        first = later.select(pl.col("boundary").alias("owner"), pl.col("step").alias("_after"), "_first")
        hit = params.sort("_after").join_asof(first, on="_after", by="owner", strategy="forward",
                                              check_sortedness=False)
        parts.append(hit.filter(pl.col("_first").is_not_null()).select(
            pl.col("seq").alias("src"), pl.col("_first").alias("dst"), pl.lit("weights").alias("kind")))
    # a root's parameters as a step's first call meets them: the optimizer events before it -> it
    # (each to the first after it), and it -> the first divergent forward after it in its step
    starts = info.filter((phase == "optimizer") & (kind == "params")).select(
        "seq", "step", "boundary", (pl.col("module_type") == "optimizer").fill_null(False).alias("_held")).sort("seq")
    if starts.height:
        # and to the root's next one: weights that differ from the start but are read steps later (an
        # adapter used from step 3 on) reach what reads them through the params events between
        parts.append(starts.select(pl.col("seq").alias("src"), pl.col("seq").shift(-1).over("boundary").alias("dst"),
                                   pl.lit("weights").alias("kind")).filter(pl.col("dst").is_not_null()))
        at = starts.select(pl.col("seq").alias("dst"), pl.col("seq").alias("_at"))
        hit = opt_steps.select(pl.col("seq").alias("src"), pl.col("seq").alias("_at")).sort("_at").join_asof(
            at, on="_at", strategy="forward")
        # (what only an optimizer holds, a learned temperature, is read by code outside every module: -> the
        # first divergent event after it in its step, whatever it is)
        anything = info.filter(~((phase == "optimizer") & (kind == "params")))
        hits = [hit]
        for held, readers in ((False, fwd), (True, anything)):
            after = readers.select(pl.col("seq").alias("dst"), pl.col("seq").alias("_at"), "step").sort("_at")
            hits.append(starts.filter(pl.col("_held") == held).select(
                pl.col("seq").alias("src"), pl.col("seq").alias("_at"), "step").join_asof(
                after, on="_at", by="step", strategy="forward", check_sortedness=False))
        parts += [h.filter(pl.col("dst").is_not_null()).select("src", "dst", pl.lit("weights").alias("kind"))
                  for h in hits]
    # final, saved: each parameter's last optimizer event before a final-state or saved event -> that
    # event (such events are few: one per root model at its end, one per checkpoint written)
    for at in info.filter((phase == "optimizer") & kind.is_in(["final", "saved"]))["seq"].to_list():
        last = opt_steps.filter(pl.col("seq") < at).group_by("boundary").agg(pl.col("seq").max())
        parts.append(last.select(pl.col("seq").alias("src"), pl.lit(at).alias("dst"), pl.lit("final").alias("kind")))
    if loss:
        parts.append(_pairs(fwd.filter(pl.col("depth") == 0),  # (a params event comes before its step's forward)
                            info.filter(phase.is_in(["backward", "optimizer"]) & (kind != "params")), ["step"], "loss"))
    seqs = info["seq"].implode()
    edges = pl.concat([p.cast(_EDGES) for p in parts]).filter(pl.col("src").is_in(seqs) & pl.col("dst").is_in(seqs))
    if loss:
        # updated weights feed every later forward, whichever parameters the hooks saw change:
        # one node per step (a negative id, never an event's seq) keeps this linear in the events
        steps = fwd["step"].unique().sort().to_numpy()
        opt = info.filter(phase == "optimizer")
        nxt = np.searchsorted(steps, opt["step"].to_numpy(), side="right")
        has = nxt < len(steps)
        edges = pl.concat([edges, pl.DataFrame(
            {"src": opt["seq"].to_numpy()[has], "dst": -1 - steps[nxt[has]], "kind": "loss"}, schema=_EDGES),
            fwd.select((-1 - pl.col("step")).alias("src"), pl.col("seq").alias("dst"), pl.lit("loss").alias("kind"))
            .cast(_EDGES)])
    return Graph(info, edges)


@njit(cache=True)
def _search(indptr, indices, sources):  # pragma: no cover - compiled
    """Breadth-first from each source in turn: the index (into `sources`) of the first source
    that reaches each node, -1 for none."""
    label = np.full(len(indptr) - 1, -1, np.int64)
    queue = np.empty(len(indptr) - 1, np.int64)
    for k in range(len(sources)):
        s = sources[k]
        if label[s] >= 0:
            continue
        label[s] = k
        head, tail = 0, 1
        queue[0] = s
        while head < tail:
            u = queue[head]
            head += 1
            for e in range(indptr[u], indptr[u + 1]):
                v = indices[e]
                if label[v] < 0:
                    label[v] = k
                    queue[tail] = v
                    tail += 1
    return label


def _nodes(seqs: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """Every node id once, sorted: the events' seqs (unique, nearly always in order already: one
    merge, where np.unique over every edge end took seconds) and the few others (step nodes,
    sources)."""
    extra = np.unique(extra)
    if len(seqs) > 1 and not (seqs[1:] > seqs[:-1]).all():
        return np.unique(np.concatenate([seqs, extra]))
    at = np.minimum(np.searchsorted(seqs, extra), max(len(seqs) - 1, 0))
    known = (seqs[at] == extra) if len(seqs) else np.zeros(len(extra), bool)
    return np.sort(np.concatenate([seqs, extra[~known]]), kind="stable")


def reachable(g: Graph, sources) -> pl.DataFrame:
    """Every event (or step node) reachable from `sources` over the edges of `g`: seq and the
    source it was first reached from (sources taken in the order given; a source reaches itself)."""
    sources = np.asarray(list(sources), np.int64)
    src, dst = g.edges["src"].to_numpy(), g.edges["dst"].to_numpy()
    ids = _nodes(g.info["seq"].to_numpy(), np.concatenate([src[src < 0], dst[dst < 0], sources]))
    s, d = np.searchsorted(ids, src), np.searchsorted(ids, dst)
    order = np.argsort(s, kind="stable")
    indptr = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(np.bincount(s, minlength=len(ids)), out=indptr[1:])
    label = _search(indptr, d[order], np.searchsorted(ids, sources))
    hit = label >= 0
    return pl.DataFrame({"seq": ids[hit], "source": sources[label[hit]]}, schema={"seq": pl.Int64, "source": pl.Int64})


def build(rank: int, events: pl.DataFrame, tensors: pl.DataFrame, divergent, pivot_seq: int) -> dict:
    """Summarised propagation graph from `pivot_seq` over the divergent A-side events."""
    g = graph(events, tensors, divergent)
    reached = reachable(g, [pivot_seq])
    return _summarise(rank, g, reached["seq"], pivot_seq, len(divergent))


def _summarise(rank: int, g: Graph, reached: pl.Series, pivot_seq: int, n_divergent: int) -> dict:
    hit = g.info.filter(pl.col("seq").is_in(reached.implode()))
    nid = pl.concat_str(pl.lit(f"r{rank}:"), "phase", pl.lit(":"), "kind", pl.lit(":"), "boundary").alias("id")
    nodes = (hit.with_columns(nid).group_by("id", maintain_order=True).agg(
        pl.col("phase").first(), pl.col("kind").first(), pl.col("boundary").first(), pl.col("module_type").first(),
        pl.col("step").first(), pl.col("step").min().alias("first_step"), pl.len().cast(pl.Int64).alias("count"),
        pl.col("seq").first().alias("a_seq"), (pl.col("seq") == pivot_seq).any().alias("is_pivot"))
        .sort("a_seq").select("id", pl.lit(rank, pl.Int64).alias("rank"), "phase", "kind", "boundary", "module_type",
                              "step", "first_step", "count", "a_seq", "is_pivot"))
    ends = hit.select("seq", "step", nid)
    edges = (g.edges.join(ends.select(pl.col("seq").alias("src"), pl.col("id").alias("source")), on="src")
             .join(ends.select(pl.col("seq").alias("dst"), pl.col("id").alias("target"), "step"), on="dst")
             .filter(pl.col("source") != pl.col("target"))
             .group_by("source", "target", "kind")
             .agg(pl.len().cast(pl.Int64).alias("count"), pl.col("step").min().alias("first_step"))
             .sort("first_step", "source", "target", "kind"))
    return {"nodes": nodes.to_dicts(),
            "edges": edges.select("source", "target", "kind", "count", "first_step").to_dicts(),
            "reached_events": reached.len(), "divergent_events": n_divergent}
