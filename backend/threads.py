"""Module calls made on threads other than the recording's: not recorded (collectors/hooks.py
`_called_elsewhere`: they interleave with the training's steps by timing), counted by thread in each
rank's meta (`threads_not_recorded`).

What such a call computes reaches the training as its inputs, which are recorded and compared. But
one that draws from the CPU generator (an augmentation's random flip on a prefetching thread: helper
84, kornia in MONAI's ThreadDataLoader) moves the generator's state between the training's draws by
timing, so the CPU RNG state a step or a call began from (role `rng`) is no fact of the training
there: where either run's rank made such calls and one of them moved a generator's state
(`threads_drew_rng`; a recording made before that was counted is taken to have drawn), a built-in
rule (`RULE`) accepts differences of `rng` tensors, counted in `rules_fired` like a user's, and
`reason` says why (informational: what the training computed is still compared). Calls that drew
nothing leave the generators' states compared: a reseed nothing drew from after is a difference.
Knows nothing of alignment or pivots.
"""

from __future__ import annotations

from bitguard.backend.certification import reason as make_reason
from bitguard.backend.rules import Rule, RuleSet

RULE = Rule(id="bitguard:rng-drawn-on-other-threads", action="ignore", match={"role": "rng"},
            note="module calls on another thread than the recording's may draw from the CPU generator by timing",
            author="bitguard")


def _counts(run, rank: int, field: str) -> dict[str, int] | None:
    found = (run.rank_meta.get(rank) or {}).get(field)
    return {str(k): v for k, v in found.items() if isinstance(v, int)} if isinstance(found, dict) else None


def elsewhere(run, rank: int) -> dict[str, int]:
    """Thread name -> module calls made there, not recorded, in `run`'s rank `rank`."""
    return _counts(run, rank, "threads_not_recorded") or {}


def drew(run, rank: int) -> bool:
    """Whether a module call on another thread moved a generator's state in `run`'s rank `rank` (a recording
    that counted calls but not draws, made before they were: taken to have drawn)."""
    if not elsewhere(run, rank):
        return False
    moved = _counts(run, rank, "threads_drew_rng")
    return moved is None or any(moved.values())


def rules_for(rules: RuleSet, run_a, run_b, rank: int) -> RuleSet:
    """`rules`, with `RULE` where either run's calls on other threads drew from a generator at this rank."""
    if not (drew(run_a, rank) or drew(run_b, rank)) or any(r.id == RULE.id for r in rules.rules):
        return rules
    return RuleSet(rules.rules + (RULE,))


def reason(run_a, run_b, rank: int) -> list[dict]:
    """The informational reason (code `threads`) where either run made module calls on other threads."""
    sides = [(label, elsewhere(run, rank)) for label, run in (("A", run_a), ("B", run_b))]
    if not any(calls for _, calls in sides):
        return []
    said = "; ".join(f"run {label}: " + ", ".join(f"{n} on {name}" for name, n in sorted(calls.items()))
                     for label, calls in sides if calls)
    return [make_reason("threads", (
        f"module calls made on threads other than the recording's were not recorded ({said}): they interleave with "
        f"the training's steps by timing; what they computed is compared where it reaches the training (its "
        f"inputs), and " + (
            f"the generators' states (rng) are not compared (rule {RULE.id}: those calls drew from them)"
            if drew(run_a, rank) or drew(run_b, rank) else
            "the generators' states (rng) are compared (those calls did not draw from them)")),
        rank=rank)]
