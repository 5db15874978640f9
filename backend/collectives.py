"""Reading a collective's event back: the function and group its boundary names, and its issue
order on the group (collectors/comm.py writes them: `comm.<function>#<group>`, rows' paths ending
in `@N`). For backend/pivot.py and backend/crossrank.py; knows nothing else of a run.
"""

from __future__ import annotations


def function_of(boundary: str) -> str | None:
    """`all_reduce` of `comm.all_reduce#0-1` (`ddp_bucket3` of a DDP bucket); None for another boundary."""
    if not boundary.startswith("comm.") or "#" not in boundary:
        return None
    return boundary[len("comm."):].rpartition("#")[0]


def group_of(boundary: str) -> list[int] | None:
    """The global ranks of a comm boundary's group (`#0-3` or `#0,2`); None when it names none."""
    if function_of(boundary) is None:
        return None
    label = boundary.rpartition("#")[2]
    try:
        if "-" in label:
            first, last = label.split("-")
            return list(range(int(first), int(last) + 1))
        return [int(r) for r in label.split(",")]
    except ValueError:
        return None


def issue_of(path: str | None) -> str | None:
    """The issue order `N` at the end of a comm row's path (`[1]@N`), None without one."""
    if not path or "@" not in path:
        return None
    n = path.rpartition("@")[2]
    return n if n.isdigit() else None
