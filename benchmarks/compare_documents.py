"""Dump what a comparison shows, for a set of pairs, so that two engines can be diffed field for field.

For each pair and each rules file (none, and each of the sample rule files) this writes one JSON
file holding the `bitguard.compare/1` document and what the explorer reads from the comparison:
a hash of the events table (`Comparison.events()`) and of its divergent rows, the event details
of the first events and of the first ones that are not identical on every rank, and the
neighbours of the first propagation nodes. The pairs are the fixtures_runs scenarios (written
once into `--data`), a 4-rank pair, a scalar-loss pair, the demo pair, and the bench_compare
pairs found in `--bench` (`--big`: its 1M pair too).

    python benchmarks/compare_documents.py /tmp/after
    PYTHONPATH=/tmp/old python benchmarks/compare_documents.py /tmp/before   # an older bitguard
    diff -r /tmp/before /tmp/after

(PYTHONPATH puts an export of an older commit first, as bench_compare.py --before does; run it
from outside the checkout so that the checkout's own package is not found first.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fixtures_runs as runs  # noqa: E402

from bitguard.backend.compare import compare  # noqa: E402

SCENARIOS = ("benign_probe_then_real", "identical", "gap_then_divergence", "nested_propagation")
RULES = {"none": None, "probe": ROOT / "sample_traces" / "rules-benign-probe.json",
         "dropout": ROOT / "sample_traces" / "rules-benign-dropout.json"}
BENCH_STEPS = {"bench10k": 102, "bench100k": 1011, "bench1m": 10102}  # bench_compare.plan's steps


def scenario_pairs(data: Path) -> dict[str, tuple[str, str]]:
    """The scenario pairs, written into `data` the first time."""
    done = data / "written"
    if not done.exists():
        for name in SCENARIOS:
            getattr(runs, name)(str(data))
        runs.write_pair(str(data), "ranks4", runs.RunSpec(
            layers=6, steps=5, world_size=4, jitter_ns=5000, drop=frozenset({(4, "model.probe", "forward")}),
            taints=(runs.Taint(2, "model.layers.3", rank=1), runs.Taint(3, "model.probe", rank=2))))
        runs.write_pair(str(data), "scalar", runs.RunSpec(layers=4, steps=6, scalar_loss=True,
                                                          taints=(runs.Taint(2, "model.layers.1"),)))
        done.touch()
    return {p.name: (str(p / "reference"), str(p / "suspect")) for p in sorted(data.iterdir()) if p.is_dir()}


def _hash(frame) -> str:
    return hashlib.sha256(frame.write_ipc(None).getvalue()).hexdigest() if frame.height else "empty"


def shown(c) -> dict:
    """What the explorer reads from comparison `c`, beside its document."""
    details = []
    for rank in sorted(c.ranks):
        ev = c.events(rank)
        picked = [ev.head(3), ev.filter(ev["is_pivot"] | (ev["status"] != "identical")).head(5)]
        for part in picked:
            for row in part.iter_rows(named=True):
                details += [c.event_detail(rank, side, row[f"{side}_seq"]) for side in ("a", "b")
                            if row[f"{side}_seq"] is not None]
    nodes = c.to_dict()["propagation"]["nodes"][:3]
    return {"events": _hash(c.events()), "divergent": _hash(c.divergent()), "details": details,
            "neighbours": [c.neighbours(n["id"]) for n in nodes]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder the JSON files are written into")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bitguard-compare-documents"),
                   help="where the scenario pairs are written once and kept")
    p.add_argument("--bench", default=os.path.join(tempfile.gettempdir(), "bitguard-bench-compare"),
                   help="bench_compare.py's --data folder (its pairs are used when present)")
    p.add_argument("--big", action="store_true", help="also the 1M bench pair (a minute or more)")
    p.add_argument("--jobs", type=int, default=None, help="compare's --jobs")
    args = p.parse_args(argv)
    data, out, bench = Path(args.data), Path(args.out), Path(args.bench)
    data.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    pairs = scenario_pairs(data)
    demo = ROOT / "sample_traces" / "demo"
    pairs["demo"] = (str(demo / "reference"), str(demo / "suspect"))
    for name, steps in BENCH_STEPS.items():
        a, b = bench / f"reference-{steps}", bench / f"suspect-{steps}"
        if a.is_dir() and b.is_dir() and (args.big or name != "bench1m"):
            pairs[name] = (str(a), str(b))
    for name, (a, b) in pairs.items():
        for label, rules in RULES.items():
            c = compare(a, b, rules=None if rules is None else str(rules), jobs=args.jobs)
            with open(out / f"{name}-{label}.json", "w") as f:
                json.dump({"doc": c.to_dict(), "extra": shown(c)}, f, indent=1, sort_keys=True, default=str)
    print(f"{len(pairs) * len(RULES)} documents in {out}")


if __name__ == "__main__":
    main()
