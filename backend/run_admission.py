"""Admission of a run into the explorer's workspace: everything the engine will read, read once first.

`admit(folder, names, shown)` reads a staged run directory the way a comparison will: the engine's
`open_run` (manifest and meta against their models), then `load_rank` for every rank (column
types, call stacks), then the manifest fields the workspace lists (`listing`). A run that
fails any of these never enters the workspace. Every failure is a `BitguardError` in the
user's terms (`PathNames`); an exception the reader did not expect is reported as `CorruptRun`
naming the folder (and logged with its traceback), so an upload never ends in a 500.

`listing(manifest)` is the one reading of the manifest fields a run's listing shows; the
catalogue applies it again to every stored run, so a run admitted by an older version that
does not pass is listed with its problem instead of breaking the list.

This module knows nothing about HTTP or the catalogue; what a readable run is, is the ingest's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bitguard.backend.user_paths import PathNames, with_message
from bitguard.errors import BitguardError, CorruptRun

log = logging.getLogger("bitguard.serve")

INT32_MAX = 2**31 - 1  # the catalogue stores world size and ranks as INTEGER


@dataclass
class Admitted:
    info: object  # the engine's RunInfo
    world_size: int
    ranks: list[int]
    listed: dict  # the listing fields of the manifest (see listing())


def _kind(value) -> str:
    return "an object" if isinstance(value, dict) else "a list" if isinstance(value, list) else type(value).__name__


def listing(manifest) -> tuple[dict, list[str]]:
    """(status, command, mode, start_time) as the listing shows them, and what is wrong with the
    manifest fields the explorer reads (those four, and `determinism` and `versions`, which a
    comparison reads as objects). A listed field of the wrong shape is None and named in the problems."""
    fields = {"status": None, "command": None, "mode": None, "start_time": None}
    if not isinstance(manifest, dict):
        return fields, [f"the manifest is {_kind(manifest)}, not an object"]
    problems = []
    for key in ("status", "mode", "start_time"):
        value = manifest.get(key)
        if value is None or isinstance(value, str):
            fields[key] = value
        else:
            problems.append(f"manifest field {key!r} is {_kind(value)}, not a string")
    command = manifest.get("command")
    if command is None or isinstance(command, str) or (
            isinstance(command, list) and all(isinstance(c, str) for c in command)):
        fields["command"] = command
    else:
        problems.append(f"manifest field 'command' is {_kind(command)}, not a string or a list of strings")
    for key in ("determinism", "versions"):
        value = manifest.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"manifest field {key!r} is {_kind(value)}, not an object")
    return fields, problems


def _unexpected(exc: BaseException, where: str) -> CorruptRun:
    log.warning("reading %s failed unexpectedly", where, exc_info=exc)
    first = (str(exc).splitlines() or [""])[0][:300]
    return CorruptRun(f"{where} cannot be read ({type(exc).__name__}: {first}); the run is damaged or was not "
                      "written by bitguard record: re-record it (if it was, please report this message)")


def admit(folder, names: PathNames, shown: str) -> Admitted:
    """Read the run in `folder` completely; raise a BitguardError in the user's terms if it is unusable."""
    from bitguard.backend.ingest import load_rank, open_run

    where = shown
    try:
        info = open_run(folder)
        world_size = int(info.world_size)
        ranks = sorted(int(r) for r in info.ranks)
        if not 1 <= world_size <= INT32_MAX:
            raise CorruptRun(f"{shown}/manifest.json says world_size {world_size}; a world size is 1 or more: "
                             "the manifest is damaged, re-record the run")
        if any(not 0 <= r <= INT32_MAX for r in ranks):
            raise CorruptRun(f"{shown} holds a rank file numbered out of range; rank files are rank-N.duckdb "
                             "with N from 0 to the world size")
        listed, problems = listing(info.manifest)
        if problems:
            raise CorruptRun(f"{shown}/manifest.json: {'; '.join(problems)}; the manifest is damaged: "
                             "re-record the run")
        for rank in ranks:
            where = f"{shown}/{info.ranks[rank].name}"
            load_rank(info, rank)  # checks column types and call stacks as it reads (ingest.py)
    except BitguardError as exc:
        raise _naming(names.error(exc), shown) from None
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - any reader failure on an upload is bad input
        raise _naming(names.error(_unexpected(exc, names.text(where))), shown) from None
    return Admitted(info, world_size, ranks, listed)


def _naming(exc: BitguardError, shown: str) -> BitguardError:
    """The error, its message opening with the user's folder when it does not name it already."""
    return exc if shown in exc.message else with_message(exc, f"{shown}: {exc.message}")
