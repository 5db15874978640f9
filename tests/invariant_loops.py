"""A training loop simulated as the rows bitguard's tables would hold (api_events, events,
tensors), with knobs for the bug classes of issue 17: the invariants tests' clean and buggy runs
(unit, API, browser), built in microseconds and fed through `facts.step_facts` exactly as
recorded rows are, or written into a real run directory (`write_run`)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from bitguard.backend.invariants.facts import step_facts

M = 2**64 - 1


def mix(*parts) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        for ch in str(p):
            h = ((h ^ ord(ch)) * 0x100000001B3) & M
        h = ((h ^ (h >> 29)) * 0xBF58476D1CE4E5B9) & M
    return h or 1


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@dataclass
class Loop:
    params: tuple = ("wte.weight", "h.0.weight", "h.0.bias", "head.weight")
    frozen: tuple = ()  # requires_grad False
    steps: int = 5
    accum: int = 1
    world_size: int = 1
    scheduler: bool = True
    clip: bool = True
    dropout: tuple = ("h.0.drop",)
    tied: tuple = ()  # names sharing one storage
    seed: str = "a"
    # bugs
    bugs: set = field(default_factory=set)
    bug_step: int = 0  # dtype, left_frozen, untie: from this step on (0: a configuration from the start)

    def rows(self, rank: int = 0):
        """Per step: (api_rows, event_rows, tensor_rows) of `rank`."""
        values = {p: mix(self.seed, "init", p) for p in self.params}
        out, ord_, seq = [], 0, 0
        lr = 0.1
        for k in range(self.steps + 1):  # the last step: the trailing zero_grad/scheduler, no optimizer step
            api, ev, te = [], [], []
            training = k < self.steps

            def a(kind, target, value):
                nonlocal ord_
                api.append({"step": k, "rank": rank, "ord": ord_, "kind": kind, "target": target,
                            "value": json.dumps(value), "t_ns": ord_})
                ord_ += 1

            def e(phase, kind, boundary, tensors, depth=0):
                nonlocal seq
                ev.append({"seq": seq, "rank": rank, "world_size": self.world_size, "step": k, "phase": phase,
                           "kind": kind, "boundary": boundary, "depth": depth})
                for role, idx, xor, pos, dtype, shape in tensors:
                    te.append({"seq": seq, "role": role, "idx": idx, "xor": xor, "pos": pos, "dtype": dtype,
                               "shape": shape, "unobserved": None, "shard": None})
                seq += 1

            if k == 0 and self.scheduler:
                a("scheduler_init", "StepLR#0", {"class": "StepLR"})
            if k > 0 and self.scheduler and "no_scheduler_step" not in self.bugs:
                lr *= 0.9
                a("scheduler_step", "StepLR#0", {"last_lr": [lr], "class": "StepLR"})
            if not training:
                a("zero_grad", "AdamW#0", {"set_to_none": True, "params": list(self.params)})
                out.append((api, ev, te))
                break
            if "in_place_edit" in self.bugs and k == 2:
                values["h.0.weight"] = mix(values["h.0.weight"], "edit")
            if "no_zero_grad" not in self.bugs:
                a("zero_grad", "AdamW#0", {"set_to_none": True, "params": list(self.params)})
            if "replica" in self.bugs and rank == 1 and k == 2:
                values["h.0.bias"] = mix(values["h.0.bias"], "drift")
            storage = {p: i for i, p in enumerate(self.params)}
            for p in self.tied:
                storage[p] = storage[self.tied[0]]
            late = k >= self.bug_step
            if "untie" in self.bugs and self.tied and late:
                storage[self.tied[1]] = 99
            frozen = set(self.frozen)
            if "left_frozen" in self.bugs and late:
                frozen.add("h.0.weight")
            a("params", "Model", {p: {"requires_grad": p not in frozen,
                                      "dtype": "float64" if ("dtype" in self.bugs and p == "h.0.bias" and late) else "float32",
                                      "device": "cpu", "xor": f"{values[p]:016x}", "storage": storage[p],
                                      "model_param": True} for p in self.params})
            modes = {"training": ["Model", *self.dropout], "eval": []}
            if "dropout_eval" in self.bugs:
                modes = {"training": ["Model"], "eval": list(self.dropout)}
            got = {p: None for p in self.params if p not in frozen}
            for m in range(self.accum):
                a("modes", "Model", modes)
                batch = mix(self.seed, "batch", rank, 0 if "repeat_batch" in self.bugs else k, m)
                e("data", "batch", "Model", [("input", 0, batch, mix(batch), "int64", [4, 8])])
                loss = 2.5 - 0.1 * k + 0.01 * m
                e("forward", "module", "Model", [("output", 0, f32_bits(loss), 7, "float32", [])])
                root = loss if "accum_scale" in self.bugs else loss / self.accum
                if "clip_before_backward" in self.bugs and m == 0:
                    a("clip_grad_norm", "clip", {"max_norm": 1.0, "norm_type": 2.0, "total_norm": 0.0,
                                                 "params": list(self.params)})
                a("backward", "loss", {"value": root, "shape": [], "dtype": "float32", "calls_in_step": m + 1})
                for p in reversed(self.params):
                    if p in frozen:
                        continue
                    g = mix(self.seed, "grad", rank if "replica_grad" in self.bugs else 0, k, m, p)
                    stale = got[p] is not None or ("no_zero_grad" in self.bugs and k > 0)
                    acc = mix(g, got[p] or "old") if stale else g
                    got[p] = acc
                    e("backward", "grad", p, [("grad_input", 0, g, mix(g, 1), "float32", [4]),
                                              ("grad", 0, acc, mix(acc, 1), "float32", [4])])
            clipped = []
            if self.clip and "clip_before_backward" not in self.bugs and not ("clip_skipped" in self.bugs and late):
                clipped = list(self.params[:2]) if "clip_wrong_params" in self.bugs else list(self.params)
                a("clip_grad_norm", "clip", {"max_norm": 1.0, "norm_type": 2.0, "total_norm": 3.0 + k,
                                             "params": clipped})
            in_groups = [p for p in self.params if not ("missing_group" in self.bugs and p == "h.0.weight")]
            a("optimizer_step", "AdamW#0", {"groups": [{"lr": lr, "weight_decay": 0.0, "params": in_groups,
                                                        **({"initial_lr": 0.1} if self.scheduler else {})}]})
            for p in in_groups:
                # frozen_updated: a frozen parameter stepped anyway (a zero gradient left by
                # zero_grad(set_to_none=False) that AdamW's momentum still moves it by)
                if got.get(p) is None and not ("frozen_updated" in self.bugs and p in frozen):
                    continue
                # replica_step: rank 1's optimizer step differs (BLOOM's per-rank clipping)
                values[p] = mix(values[p], "step", k, rank if "replica_step" in self.bugs and late else 0)
                used = got.get(p) or 5  # the gradient step() used: scaled by clipping (over max_norm) unless lost
                if p in clipped and "clip_lost" not in self.bugs:
                    used = mix(used, "clipped")
                e("optimizer", "step", p, [("param", 0, values[p], mix(values[p], 2), "float32", [4]),
                                           ("grad", 0, used, mix(used, 1), "float32", [4])])
            out.append((api, ev, te))
        return out

    def facts(self, rank: int = 0):
        return [step_facts(api, ev, te, world_size=self.world_size) for api, ev, te in self.rows(rank)]

    def run(self):
        """facts_from_run's shape: rank -> [StepFacts]."""
        return {r: self.facts(r) for r in range(self.world_size)}


def write_run(root, loop: Loop, name: str = "run", api_events: bool = True, violations=(), meta=None):
    """`root/name`: the loop's rows in a real run directory, written through the RankStore (its
    events, tensors and, unless `api_events` is False, api_events rows; `violations`: rows of the
    violations table, dicts by column; `meta`: more meta facts of every rank)."""
    from pathlib import Path

    from bitguard.collectors import store
    from bitguard.schema import API_EVENTS, EVENTS, RANK_FILE, TENSORS, VIOLATIONS
    from fixtures_runs import write_manifest

    run = Path(root) / name
    run.mkdir(parents=True)
    write_manifest(str(run), loop.world_size)
    for rank in range(loop.world_size):
        s = store.RankStore(str(run / RANK_FILE.format(rank=rank)), {"rank": rank, "world_size": loop.world_size,
                                                                    "mode": "full", **(meta or {})})
        s.add_rows(VIOLATIONS.name, [v for v in violations if v["rank"] == rank])
        for api, ev, te in loop.rows(rank):
            by_seq = {}
            for t in te:
                by_seq.setdefault(t["seq"], []).append(t)
            for e in ev:
                row = {"call": 0, "module_type": "M", "thread": "MainThread", "device": "cpu", "stream": None,
                       "t_start_ns": e["seq"], "t_end_ns": e["seq"] + 1, "stack_id": None, **e}
                tensors = [[{"path": "", "strides": [1], "nbytes": 16, "tid": 0, "storage": 0, **t}.get(n)
                            for n in TENSORS.names] for t in by_seq.get(e["seq"], [])]
                s.add(tuple(row.get(n) for n in EVENTS.names), tensors, [])
            if api_events:
                s.add_rows(API_EVENTS.name, api)
            assert s.step_barrier()
        s.close("complete")
    return run
