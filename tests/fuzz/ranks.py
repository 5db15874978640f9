"""The fuzz family of rank files that do not add up: a two-rank run with a rank missing (on one side
or on both sides), ranks swapped, a rank taken from another run, an extra rank, an empty rank file.

The runs are synthetic (tests/fixtures_runs.py writes them straight from bitguard.schema: a toy
network, two ranks, two steps), so the family costs no recording. Four of the cases are also
compared with `--jobs 2` (each rank on a worker process), which must answer as one process does. A case is judged as a mutated
run is (families.judge_damage against what the ingest reads, with the ranks present counted as
part of what is read); "identical" for a side whose ranks do not add up is a false verdict.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .families import judge_damage, named
from .harness import TESTS, Context, Result, first_line

if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import fixtures_runs  # noqa: E402


def _spec(**kw):
    return fixtures_runs.RunSpec(layers=2, steps=2, world_size=2, **kw)


def ranks(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    d = ctx.scratch("ranks")
    pristine = Path(fixtures_runs.write_run(str(d / "pristine"), _spec()))
    other = Path(fixtures_runs.write_run(str(d / "other"), _spec(taints=(fixtures_runs.Taint(1, "model.layers.1", 1),))))
    orig = ctx.read(pristine)
    if not isinstance(orig, dict) or not orig.get("ok"):
        raise RuntimeError(f"the ingest cannot read the synthetic two-rank run: {orig}")

    def swap(run: Path) -> None:
        (run / "rank-0.duckdb").rename(run / "tmp")
        (run / "rank-1.duckdb").rename(run / "rank-0.duckdb")
        (run / "tmp").rename(run / "rank-1.duckdb")

    edits = {
        "rank-1-missing": lambda run: (run / "rank-1.duckdb").unlink(),
        "rank-0-missing": lambda run: (run / "rank-0.duckdb").unlink(),
        "ranks-swapped": swap,
        "rank-1-of-another-run": lambda run: shutil.copy(other / "rank-1.duckdb", run / "rank-1.duckdb"),
        "extra-rank-2": lambda run: shutil.copy(run / "rank-1.duckdb", run / "rank-2.duckdb"),
        "rank-1-empty": lambda run: (run / "rank-1.duckdb").write_bytes(b""),
    }
    results = []
    for i, (case, edit) in enumerate(edits.items()):
        # on both sides only where the run stays incomplete: two equal swaps or equal foreign ranks are
        # runs that may well compare identical
        for both in (False, True) if case not in ("ranks-swapped", "rank-1-of-another-run") else (False,):
            name = f"{case}/{'both-sides' if both else 'one-side'}"
            if only is not None and only not in name:
                continue
            c = ctx.scratch("ranks")
            a, b = c / "a", c / "b"
            shutil.copytree(pristine, a)
            shutil.copytree(pristine, b)
            edit(b)
            if both:
                edit(a)
            shutil.copytree(b, c / "oracle")
            read = ctx.read(c / "oracle")
            if isinstance(read, dict) and read.get("ok") and read["ranks"] != orig["ranks"]:
                read = {**read, "facts": {**read["facts"], "ranks": read["ranks"]}}  # a rank less is damage
            argv = ["compare", str(b), str(a)] if i % 2 else ["compare", str(a), str(b)]
            answer = ctx.cli(argv)
            results.append(named(name, judge_damage(answer, read, orig, False, ctx.root, count_lost=False)))
            if not both and case in POOLED:
                results.append(named(f"{name}/jobs-2", _pooled(ctx, argv, answer, read, orig)))
    return results


# the cases also compared on two worker processes (`--jobs 2`, backend/rank_pool.py): the pool must
# give the one-process answer (a spawned pool costs seconds, so not every case)
POOLED = ("rank-1-missing", "ranks-swapped", "rank-1-of-another-run", "extra-rank-2")


def _pooled(ctx: Context, argv: list[str], serial, read, orig) -> Result:
    pooled = ctx.cli([*argv, "--jobs", "2"], timeout=ctx.process_timeout)
    judged = judge_damage(pooled, read, orig, False, ctx.root, count_lost=False)
    if judged.outcome not in ("ok", "clean_error") or not isinstance(serial, dict):
        return judged
    said = [(x["rc"], first_line(x["stderr"] if x["rc"] == 2 else x["stdout"])) for x in (serial, pooled)]
    if said[0] != said[1]:
        return Result("", "", "wrong_answer", f"--jobs 2 answered exit {said[1][0]}: {said[1][1]}; one process "
                                              f"exit {said[0][0]}: {said[0][1]}")
    return judged
