import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from bitguard.schema import JSON_FILE, NAMES_PATH, NUMBER_PATH, STRING_PATH

import warm

ROOT = Path(__file__).resolve().parents[2]
TINYGPT = ROOT / "sample_traces" / "tinygpt.py"
SCRIPTS = ROOT / "tests" / "scripts"
BITGUARD = [sys.executable, "-m", "bitguard"]


def run(cmd, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 300)
    return subprocess.run([str(c) for c in cmd], **kw)


def record(out, *script_args, options=(), script=TINYGPT, check=True, cli=False):
    """`bitguard record --out OUT OPTIONS -- python SCRIPT ARGS`: through the CLI in a subprocess
    (`cli=True`: the launcher, its interpreter check and the manifest fields it writes are under
    test), else the recording alone, forked from a warm recorder (tests/warm.py: no 4-s start)."""
    if not cli:
        return warm.record(out, script, *script_args, options=options, check=check)
    proc = run([*BITGUARD, "record", "--out", out, *options, "--", sys.executable, script, *script_args])
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def record_together(*calls: dict) -> list:
    """Several `record(**call)`s two at a time (the machine's two cores: about half the wall time)."""
    if not any(call.get("cli") for call in calls):
        return warm.record_all(*(dict(out=c["out"], script=c.get("script", TINYGPT), args=c.get("script_args", ()),
                                      options=c.get("options", ())) for c in calls),
                               check=all(c.get("check", True) for c in calls))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: record(call["out"], *call.get("script_args", ()),
                                                 **{k: v for k, v in call.items() if k not in ("out", "script_args")}),
                             calls))


@pytest.fixture
def record_run():
    return record


def as_schema_5(run_dir: Path) -> None:
    """Make a single-rank run as bitguard wrote it at schema version 5: without `params` events."""
    as_older_schema(run_dir, 5)


def as_older_schema(run_dir: Path, version: int) -> None:
    """Make a single-rank run as bitguard wrote it at schema `version` (5 to 12): without the Python
    numbers given to module calls as arguments (before 13), the names and
    dict keys of saves (before 12), the strings of saves other than JSON files (before 11), the JSON files
    beside the saves and the params events of what only an optimizer holds (before 10), a save's
    numbers but an optimizer's and a scheduler's (before 9: here none), without `saved` events and the final state of
    what only an optimizer held (before 8), the rows of the Python numbers modules returned and of a
    root's keyword arguments in its batch event (before 7), and `params` events (before 6)."""
    con = duckdb.connect(str(Path(run_dir) / "rank-0.duckdb"))
    try:
        con.execute(f"DELETE FROM tensors WHERE role = 'input' AND regexp_matches(path, '{NUMBER_PATH}')")
        if version < 12:
            con.execute(f"DELETE FROM tensors WHERE regexp_matches(path, '{NAMES_PATH}') "
                        "AND seq IN (SELECT seq FROM events WHERE kind = 'saved')")
        if version < 11:
            con.execute(f"DELETE FROM tensors WHERE regexp_matches(path, '{STRING_PATH}') "
                        f"AND seq IN (SELECT seq FROM events WHERE kind = 'saved' AND module_type != '{JSON_FILE}')")
        newer = f"(kind = 'saved' AND module_type = '{JSON_FILE}') OR (kind = 'params' AND module_type = 'optimizer')"
        if version < 10:
            con.execute(f"DELETE FROM tensors WHERE seq IN (SELECT seq FROM events WHERE {newer})")
            con.execute(f"DELETE FROM events WHERE {newer}")
        if version < 9:
            con.execute(f"DELETE FROM tensors WHERE regexp_matches(path, '{NUMBER_PATH}') "
                        "AND seq IN (SELECT seq FROM events WHERE kind = 'saved')")
        if version < 8:
            newer = "kind = 'saved' OR (kind = 'final' AND module_type = 'optimizer')"
            con.execute(f"DELETE FROM tensors WHERE seq IN (SELECT seq FROM events WHERE {newer})")
            con.execute(f"DELETE FROM events WHERE {newer}")
        if version < 7:
            con.execute(f"DELETE FROM tensors WHERE regexp_matches(path, '{NUMBER_PATH}')")
            con.execute("DELETE FROM tensors WHERE role = 'input' AND starts_with(path, ?) "
                        "AND seq IN (SELECT seq FROM events WHERE kind = 'batch')", ["['"])  # a root's keyword arguments
        if version < 6:
            assert con.execute("SELECT count(*) FROM events WHERE kind = 'params'").fetchone()[0]
            con.execute("DELETE FROM tensors WHERE seq IN (SELECT seq FROM events WHERE kind = 'params')")
            con.execute("DELETE FROM events WHERE kind = 'params'")
        con.execute(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
    finally:
        con.close()
    manifest = Path(run_dir) / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "schema_version": version}))
