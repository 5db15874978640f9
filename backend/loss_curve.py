"""The per-step loss of both runs of a comparison, read from what bitguard recorded, and how many
steps before the loss parts the pivot came.

bitguard records digests, not values, but a digest of a one-element tensor is its value: `xor` is
the XOR of the tensor's bytes as zero-padded little-endian 64-bit words (docs/DIGESTS.md), so for
a single float of at most 8 bytes it is that float's bits, exactly. The loss is the one-element
float output of a root module's forward (depth 0): a model whose forward returns its loss
(nanoGPT's `(logits, loss)`, a transformers `ModelOutput.loss`) or an `nn.Module` loss such as
`nn.CrossEntropyLoss` called at the top level. A loss computed by a function outside every module
(`F.cross_entropy(model(x), y)`) is never observed, and bitguard does not see what a script logs:
then, when the run recorded API events (collectors/api_events.py), the loss is the one-element
tensor `backward()` was called on, its value read by the recorder at the step's end (divided by
GradScaler's scale when it was a scaled loss: source `{"boundary": "backward", "api": true}`);
otherwise the document says "no scalar loss recorded" and why, never a curve made up.

Where a step holds several calls (gradient accumulation, an evaluation pass), its value is their
mean and the calls are compared bit for bit one by one. This module knows the engine's loaded
frames (`Comparison.ranks[r].events_a/tensors_a`); nothing about HTTP (api_panels.py).
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import polars as pl

SCHEMA = "bitguard.loss_curve/1"
THRESHOLD = 1e-3  # "differ by more than": |A - B| of the step's loss
# dtype -> how the value's bits sit in the low bytes of the one-word xor
_FLOATS = {"float32": (0xFFFFFFFF, np.uint32, np.float32), "float64": (None, np.uint64, np.float64),
           "float16": (0xFFFF, np.uint16, np.float16), "bfloat16": (0xFFFF, np.uint16, None)}

_cache: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def decode(xor: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values of one-element tensors of `dtype` from their `xor` digests."""
    mask, bits, floats = _FLOATS[dtype]
    w = np.asarray(xor, dtype=np.uint64)
    if mask is not None:
        w = w & np.uint64(mask)
    if dtype == "bfloat16":  # the upper half of a float32
        return (w.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return w.astype(bits).view(floats).astype(np.float64)


def _scalars(events: pl.DataFrame, tensors: pl.DataFrame) -> pl.DataFrame:
    """Every digested one-element float output of a root module's forward: seq, step, call,
    boundary, module_type, idx, path, dtype, xor."""
    roots = events.filter((pl.col("depth") == 0) & (pl.col("phase") == "forward") & (pl.col("kind") == "module"))
    t = tensors.filter((pl.col("role") == "output") & pl.col("dtype").is_in(list(_FLOATS))
                       & pl.col("shape").list.eval(pl.element() == 1).list.all())
    if "unobserved" in t.columns:
        t = t.filter(pl.col("unobserved").is_null())
    if "shard" in t.columns:
        t = t.filter(pl.col("shard").is_null())
    return roots.select("seq", "step", "call", "boundary", "module_type").join(
        t.select("seq", "idx", "path", "dtype", "xor"), on="seq", how="inner")


def _source(cands: pl.DataFrame) -> dict:
    """The loss among the candidates: one named loss first, then the one present in most steps."""
    g = (cands.group_by("boundary", "module_type", "idx", "path", "dtype")
         .agg(pl.col("step").n_unique().alias("steps"), pl.col("seq").min().alias("first")))
    g = g.with_columns(named=pl.concat_str([pl.col("boundary"), pl.col("module_type").fill_null(""),
                                            pl.col("path").fill_null("")]).str.to_lowercase().str.contains("loss"))
    best = g.sort(["named", "steps", "first"], descending=[True, True, False]).row(0, named=True)
    return {k: best[k] for k in ("boundary", "module_type", "idx", "path", "dtype")}


def _values(cands: pl.DataFrame, src: dict) -> pl.DataFrame:
    rows = cands.filter((pl.col("boundary") == src["boundary"]) & (pl.col("idx") == src["idx"])
                        & (pl.col("dtype") == src["dtype"]) & (pl.col("path").eq_missing(src["path"])))
    return rows.with_columns(value=pl.Series(decode(rows["xor"].to_numpy(), src["dtype"]), dtype=pl.Float64)) \
        .select("step", "call", "xor", "value")


def _json(x):
    """A float as JSON carries it: NaN and infinities as the strings "nan", "inf", "-inf"."""
    if x is None:
        return None
    return float(x) if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def backward_losses(run, rank: int) -> pl.DataFrame | None:
    """step, call, xor (the value's text: bitwise equality of two values), value: the one-element
    roots of backward() in a run's API events (unscaled), None when there are none."""
    import json

    from bitguard import schema
    from bitguard.backend.ingest import rank_table

    if run is None or rank not in run.ranks:
        return None
    api = rank_table(run, rank, schema.API_EVENTS)
    if api is None:
        return None
    rows = []
    for step, value in api.filter(pl.col("kind") == "backward").select("step", "value").iter_rows():
        v = json.loads(value)
        loss = v.get("value")
        if loss is None:
            continue
        loss = float(loss)  # (non-finite values are written as the strings "nan", "inf", "-inf")
        scale = v.get("scaled_by")
        if scale not in (None, 0):
            loss = loss / float(scale)
        rows.append({"step": step, "call": v.get("call", 0), "xor": repr(loss), "value": loss})
    if not rows:
        return None
    return pl.DataFrame(rows, schema={"step": pl.Int64, "call": pl.Int64, "xor": pl.String, "value": pl.Float64})


def _unknown(events_a: pl.DataFrame) -> str:
    roots = events_a.filter((pl.col("depth") == 0) & (pl.col("phase") == "forward") & (pl.col("kind") == "module"))
    if not roots.height:
        return "no scalar loss recorded: run A recorded no forward of a root module"
    names = ", ".join(sorted(set(roots["boundary"].to_list()))[:4])
    return (f"no scalar loss recorded: no root module ({names}) returns a one-element float tensor, and run A's API "
            "events hold no one-element tensor that backward() was called on (recorded before bitguard recorded API "
            "events, or backward() of a tensor of several elements); bitguard does not see what the script logs; "
            "re-record it, return the loss from the model's forward, or compute it with an nn.Module loss "
            "(nn.CrossEntropyLoss) to see it here")


def curve(rc, pivot: dict | None = None, threshold: float = THRESHOLD, runs: tuple | None = None) -> dict:
    """The loss curve of one rank's comparison (`compare.RankComparison`): the document
    {"schema", "rank", "source" ({boundary, module_type, idx, path, dtype} or None), "unknown"
    (why there is no curve, or None), "steps": [{step, a, b, calls_a, calls_b, equal}] (a, b: the
    step's mean loss; equal: every call bitwise the same), "first_differs", "first_over",
    "threshold", "pivot_step", "lead_differs", "lead_over" (steps from the pivot to each)}. `runs`: the
    comparison's (run A, run B) RunInfos, for the loss of backward() in their API events when no root
    module returns a scalar."""
    pivot_step = pivot.get("step") if pivot and pivot.get("rank") == rc.rank else None
    doc = {"schema": SCHEMA, "rank": rc.rank, "source": None, "unknown": None, "steps": [], "threshold": threshold,
           "first_differs": None, "first_over": None, "pivot_step": pivot_step, "lead_differs": None,
           "lead_over": None}
    cands_a = _scalars(rc.events_a, rc.tensors_a)
    if cands_a.height:
        src = doc["source"] = _source(cands_a)
        a = _values(cands_a, src)
        b = _values(_scalars(rc.events_b, rc.tensors_b), src)
    else:
        a = backward_losses(runs[0], rc.rank) if runs else None
        if a is None:
            doc["unknown"] = _unknown(rc.events_a)
            return doc
        doc["source"] = {"boundary": "backward", "module_type": None, "idx": 0, "path": None, "dtype": None,
                         "api": True}
        b = backward_losses(runs[1], rc.rank)
        b = a.clear() if b is None else b
    calls = a.join(b, on=["step", "call"], how="full", coalesce=True, suffix="_b")
    per_step = (calls.group_by("step").agg(
        pl.col("value").mean().alias("a"), pl.col("value_b").mean().alias("b"),
        pl.col("xor").count().alias("calls_a"), pl.col("xor_b").count().alias("calls_b"),
        (pl.col("xor").eq_missing(pl.col("xor_b"))).all().alias("equal")).sort("step"))
    for r in per_step.iter_rows(named=True):
        a_v, b_v = r["a"], r["b"]
        if a_v is not None and b_v is not None and math.isnan(a_v) and math.isnan(b_v):
            over = not r["equal"]
        else:
            over = a_v is None or b_v is None or not abs(a_v - b_v) <= threshold  # a NaN on one side is over
        if not r["equal"] and doc["first_differs"] is None:
            doc["first_differs"] = r["step"]
        if over and doc["first_over"] is None:
            doc["first_over"] = r["step"]
        doc["steps"].append({"step": r["step"], "a": _json(a_v), "b": _json(b_v), "calls_a": r["calls_a"],
                             "calls_b": r["calls_b"], "equal": r["equal"]})
    if pivot_step is not None:
        for k in ("differs", "over"):
            if doc[f"first_{k}"] is not None:
                doc[f"lead_{k}"] = doc[f"first_{k}"] - pivot_step
    return doc


def curve_of(result, rank: int | None = None) -> dict:
    """The loss curve of a `timelines.Result` on `rank` (default: the pivot's, else the first), once per result."""
    fd = result.summary.get("first_divergence")
    if rank is None:
        rank = fd["rank"] if fd else (result.ranks[0] if result.ranks else 0)
    result.timeline(rank)  # an unknown rank is NotFound, as for every view
    with _lock:
        per = _cache.setdefault(result, {})
        if rank in per:
            return per[rank]
    with result.lock:
        engine = result.engine
        doc = curve(engine.ranks[rank], fd, runs=(getattr(engine, "run_a", None), getattr(engine, "run_b", None)))
    with _lock:
        per[rank] = doc
    return doc
