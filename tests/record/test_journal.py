"""The rank journal: each batch is durable when journaled, checksummed, folded into DuckDB only when
it checks and the fold is verified, and a journal left by a killed process is read beside the
rank file (never folded by a reader) or folded by the launcher, never twice. A damaged group is
reported with its steps, never dropped silently or misread, and its journal is kept."""

import os
import random
import signal
import struct
import subprocess
import sys
import textwrap

import duckdb
import pyarrow as pa
import pytest

from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors import journal, store
from bitguard.schema import EVENTS, SCHEMA_VERSION, TENSORS


def _tables(first_seq: int, n: int, step: int | None = None) -> dict[str, pa.Table]:
    events = [(s, 0, 1, s if step is None else step, "forward", f"m{s}", "Linear", "module", 0, 1, "MainThread",
               "cpu", None, s, s + 1, 0) for s in range(first_seq, first_seq + n)]
    tensors = [[s, "output", 0, "", [2, 3], "float32", [3, 1], 24, s, s * 7, s, 0] + [None] * (len(TENSORS.columns) - 12)
               for s in range(first_seq, first_seq + n)]
    return {EVENTS.name: store._to_arrow(events, store._SCHEMAS[EVENTS.name]),
            TENSORS.name: store._to_arrow(tensors, store._SCHEMAS[TENSORS.name]),
            "stacks": store._to_arrow([], store._SCHEMAS["stacks"]),
            "dumps": store._to_arrow([], store._SCHEMAS["dumps"])}


def _rows(first_seq: int, n: int, step: int | None = None):
    """`_write`'s arguments for n events with a tensor each."""
    t = _tables(first_seq, n, step)
    return ([tuple(r.values()) for r in t[EVENTS.name].to_pylist()],
            [list(r.values()) for r in t[TENSORS.name].to_pylist()], [], [])


def _numbers(data: bytes) -> list[int]:
    return [g.number for g in journal.decode(data).groups]


def _never_folded(s: store.RankStore) -> None:
    """Stop a store's writer as a SIGKILL would: no fold, no close (the files stay as they are)."""
    s._queue.put(None)
    s._thread.join()


def test_a_group_cut_short_is_reported_and_the_ones_before_it_kept():
    whole = journal.encode_group(1, _tables(0, 3, step=0), ends_step=True) + journal.encode_group(
        2, _tables(3, 2, step=1), ends_step=True)
    last = journal.encode_group(3, _tables(5, 4, step=2))
    assert _numbers(whole + last) == [1, 2, 3]
    assert journal.decode(whole + last).damage(-1, lambda: None) is None
    for cut in range(1, len(last)):  # the process died while writing group 3, at every possible byte
        decoded = journal.decode(whole + last[:cut])
        assert [g.number for g in decoded.groups] == [1, 2]
        damage = decoded.damage(-1, lambda: None)
        assert damage is not None and damage["from_step"] == 2, (cut, damage)  # step 2: after the whole step 1
        assert "cut short" in damage["reason"]
    seqs = [g.tables["events"]["seq"].to_pylist() for g in journal.decode(whole).groups]
    assert seqs == [[0, 1, 2], [3, 4]]


def _three_groups() -> tuple[bytes, list[int]]:
    groups = [journal.encode_group(g, _tables(10 * g, 2, step=g), ends_step=True) for g in (1, 2, 3)]
    return b"".join(groups), [len(g) for g in groups]


def _decoded_rows(data: bytes) -> dict[int, list]:
    return {g.number: g.tables["events"].to_pylist() + g.tables["tensors"].to_pylist()
            for g in journal.decode(data).groups}


def test_every_single_bit_flip_is_caught_by_a_checksum_and_costs_only_its_group():
    data, sizes = _three_groups()
    original = _decoded_rows(data)
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    rng = random.Random(12)
    edges = {s + i for s in starts for i in range(-20, 50)}  # every byte of every header and end mark
    for at in sorted(a for a in edges | set(range(0, len(data), 7)) if 0 <= a < len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        hit = max(i for i, s in enumerate(starts) if s <= at) + 1
        decoded = journal.decode(bytes(flipped))
        rows = {g.number: g.tables["events"].to_pylist() + g.tables["tensors"].to_pylist() for g in decoded.groups}
        assert set(rows) == {1, 2, 3} - {hit}, at  # the flipped group goes, the others are kept
        assert all(rows[n] == original[n] for n in rows), at  # and nothing is misread
        damage = decoded.damage(-1, lambda: None)
        # group g holds step g: the damage starts there (None, the whole rank, when group 1's header went)
        assert damage is not None and damage["from_step"] in (hit, None if hit == 1 else hit), (at, damage)


def test_decoding_resumes_after_a_zeroed_or_inserted_range():
    data, sizes = _three_groups()
    zeroed = bytearray(data)
    zeroed[sizes[0] + 5: sizes[0] + 60] = bytes(55)  # group 2's header and the start of its payload
    decoded = journal.decode(bytes(zeroed))
    assert [g.number for g in decoded.groups] == [1, 3]
    damage = decoded.damage(-1, lambda: None)
    assert damage["from_step"] == 2 and "cannot be decoded" in damage["reason"]
    inserted = data[:sizes[0]] + b"\x00garbage BGJ2 not a header" + data[sizes[0]:]
    decoded = journal.decode(inserted)
    assert [g.number for g in decoded.groups] == [1, 2, 3] and decoded.bad  # kept, and the oddity seen
    assert decoded.damage(-1, lambda: None) is None  # no group is missing


def test_a_missing_group_number_is_damage_even_without_a_bad_byte():
    data = journal.encode_group(1, _tables(0, 2, step=0), ends_step=True) + journal.encode_group(
        3, _tables(4, 2, step=2), ends_step=True)
    damage = journal.decode(data).damage(-1, lambda: None)
    assert damage["from_step"] == 1 and "2 missing" in damage["reason"]
    # groups at or below the rank file's journal_folded are not missing: they are in the rank file
    assert journal.decode(data[len(journal.encode_group(1, _tables(0, 2, step=0), ends_step=True)):]).damage(
        2, lambda: 1) is None


def _encode_v1(number: int, tables: dict[str, pa.Table]) -> bytes:
    """A group as bitguard wrote them before checksums (BGJ1)."""
    parts = [(i, journal._ipc(tables[t.name])) for i, t in enumerate(journal.ROW_TABLES) if t.name in tables and tables[t.name].num_rows]
    out = [struct.pack("<4sQI", b"BGJ1", number, len(parts))]
    for i, data in parts:
        out += [struct.pack("<BQ", i, len(data)), data]
    out.append(struct.pack("<4sQ", b"BGJE", number))
    return b"".join(out)


def _v1_tables(first_seq: int, n: int, step: int) -> dict[str, pa.Table]:
    """Schema-1 tables: tensors without `unobserved` (schema 2) and `shard` (schema 3)."""
    t = _tables(first_seq, n, step)
    t[TENSORS.name] = t[TENSORS.name].drop_columns(["unobserved", "shard"])
    return t


def test_journals_from_before_checksums_are_still_read():
    data = _encode_v1(1, _v1_tables(0, 2, 0)) + _encode_v1(2, _v1_tables(2, 3, 1))
    decoded = journal.decode(data)
    assert decoded.version == 1 and [g.number for g in decoded.groups] == [1, 2]
    assert decoded.damage(-1, lambda: None) is None
    cut = journal.decode(data[:-10])
    assert [g.number for g in cut.groups] == [1] and cut.damage(-1, lambda: None)["from_step"] == 0


def test_a_v1_journal_left_beside_a_schema_1_rank_file_is_read_with_unobserved_null(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    path = out / "rank-0.duckdb"
    con = duckdb.connect(str(path))
    for table in store.TABLES:
        columns = [c for c in table.columns if c.name not in ("unobserved", "shard")]
        con.execute(f"CREATE TABLE {table.name} ({', '.join(f'{c.name} {c.sql}' for c in columns)})")
    con.execute("INSERT INTO meta VALUES ('schema_version', '1'), ('status', '\"running\"')")
    con.close()
    (out / "rank-0.journal").write_bytes(_encode_v1(1, _v1_tables(0, 2, 0)) + _encode_v1(2, _v1_tables(2, 3, 1)))
    (out / "manifest.json").write_text('{"tool": "bitguard", "schema_version": 1, "status": "failed", "world_size": 1}')
    events, tensors, _ = load_rank(open_run(out), 0)
    assert events["seq"].to_list() == [0, 1, 2, 3, 4]
    assert tensors["unobserved"].null_count() == 5 and tensors["shard"].null_count() == 5
    assert store.recover(path) == 2 and _seqs(path) == [0, 1, 2, 3, 4]


def _rank_file_with_journal(tmp_path, folded_groups: int, journaled: int):
    """A rank file holding `folded_groups` groups and a journal of groups 1..journaled, as a recorder
    killed between its fold and the journal's truncation leaves them."""
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    _never_folded(s)
    for g in range(1, journaled + 1):
        data = journal.encode_group(g, _tables(10 * g, 2, step=g - 1), ends_step=True)
        os.write(s._journal, data)
        s._group, s._journal_bytes = g, s._journal_bytes + len(data)
        if g == folded_groups:
            # the fold commits; the truncation hits another file, as if the process died in between
            real = s._journal
            s._journal = os.open(tmp_path / "elsewhere", os.O_WRONLY | os.O_CREAT)
            s._fold()
            os.close(s._journal)
            s._journal = real
    os.close(s._journal)
    s._con.close()
    return path


def _seqs(path):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [r[0] for r in con.sql("SELECT seq FROM events ORDER BY seq").fetchall()]
    finally:
        con.close()


def _meta(path, key):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return store._get_meta(con, key)
    finally:
        con.close()


def test_a_fold_whose_truncation_failed_is_not_applied_twice_by_the_writer(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    _never_folded(s)
    for g in (1, 2):
        s._write(*_rows(10 * g, 2))
        if g == 1:  # fold group 1, but the journal cannot be emptied (say, the file went read-only)
            real = s._journal
            s._journal = os.open(tmp_path / "elsewhere", os.O_RDONLY | os.O_CREAT)
            s._fold()
            os.close(s._journal)
            s._journal = real
    assert store.journal_path(path).stat().st_size > 0
    s._fold()  # the journal holds groups 1 and 2; only 2 is new
    assert store.journal_path(path).stat().st_size == 0
    s._con.close()
    os.close(s._journal)
    assert _seqs(path) == [10, 11, 20, 21]


def test_recover_folds_only_the_groups_the_rank_file_lacks(tmp_path):
    path = _rank_file_with_journal(tmp_path, folded_groups=2, journaled=3)
    assert _seqs(path) == [10, 11, 20, 21]
    assert store.recover(path) == 1
    assert _seqs(path) == [10, 11, 20, 21, 30, 31]
    assert not store.journal_path(path).exists()
    assert store.recover(path) == 0  # nothing left: a second reader changes nothing


def _run_dir(tmp_path, folded_groups=0, journaled=3, name="run"):
    out = tmp_path / name
    out.mkdir()
    path = _rank_file_with_journal(out, folded_groups, journaled)
    (out / "elsewhere").unlink(missing_ok=True)
    (out / "manifest.json").write_text(
        f'{{"tool": "bitguard", "schema_version": {SCHEMA_VERSION}, "status": "failed", "world_size": 1}}')
    return out, path


def test_a_bad_group_is_folded_around_recorded_as_damage_and_its_journal_kept(tmp_path):
    out, path = _run_dir(tmp_path, journaled=4)
    j = store.journal_path(path)
    data = bytearray(j.read_bytes())
    second = len(journal.encode_group(1, _tables(10, 2, step=0), ends_step=True))
    data[second + 100] ^= 0x10  # one bit in group 2 (step 1)
    j.write_bytes(bytes(data))
    # the reader reads around it, without folding, and says from which step the rank is damaged
    run = open_run(out)
    assert run.damage == {0: {"from_step": 1, "reason": run.damage[0]["reason"]}}
    assert "rank-0.journal" in run.damage[0]["reason"] and "checksum" in run.damage[0]["reason"]
    events, _, _ = load_rank(run, 0)
    assert events["seq"].to_list() == [10, 11, 30, 31, 40, 41]  # groups 3 and 4 are not lost
    assert run.event_counts == {0: 6}
    assert j.exists() and _seqs(path) == []
    # the launcher's fold takes the good groups, records the damage, and keeps the journal
    assert store.recover(path) == 3
    assert _seqs(path) == [10, 11, 30, 31, 40, 41]
    assert not j.exists() and (out / "rank-0.journal.damaged").read_bytes() == bytes(data)
    recorded = _meta(path, store.DAMAGE_KEY)
    assert recorded["from_step"] == 1 and recorded["kept_as"] == "rank-0.journal.damaged"
    again = open_run(out)
    assert again.damage[0]["from_step"] == 1 and "rank-0.journal.damaged" in again.damage[0]["reason"]
    assert load_rank(again, 0)[0]["seq"].to_list() == [10, 11, 30, 31, 40, 41]


def test_the_writer_keeps_a_journal_that_went_bad_and_goes_on_in_a_new_one(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    _never_folded(s)
    s._write(*_rows(0, 2, step=0), ends_step=True)
    s._write(*_rows(2, 2, step=1), ends_step=True)
    with open(store.journal_path(path), "r+b") as f:  # the disk gives back another byte
        f.seek(-30, os.SEEK_END)
        byte = f.read(1)
        f.seek(-30, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    s._fold()
    s._write(*_rows(4, 2, step=2), ends_step=True)
    s._fold()
    os.close(s._journal)
    s._con.close()
    assert _seqs(path) == [0, 1, 4, 5]
    assert (tmp_path / "rank-0.journal.damaged").exists() and store.journal_path(path).stat().st_size == 0
    assert _meta(path, store.DAMAGE_KEY)["from_step"] == 1
    assert any("fails its checksum" in e for e in s.errors)


def test_a_fold_that_does_not_verify_keeps_the_journal(tmp_path, monkeypatch):
    path = _rank_file_with_journal(tmp_path, folded_groups=0, journaled=2)
    real = store._insert

    def loses_a_row(con, tables):  # what a storage layer that drops rows would do
        added = real(con, {name: [t.slice(1) for t in parts] for name, parts in tables.items()})
        return {name: n + 1 for name, n in added.items()}

    monkeypatch.setattr(store, "_insert", loses_a_row)
    with pytest.raises(store.FoldNotVerified):
        store.recover(path)
    assert store.journal_path(path).exists()
    monkeypatch.undo()


KILLED = textwrap.dedent("""
    import os, signal, sys
    import torch
    import bitguard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(sys.argv[1], determinism=False):
        for step in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # no launcher survives to fold the journal
""")


def _snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_killed_process_leaves_a_journal_that_readers_read_without_writing(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    journal_file = out / "rank-0.journal"
    assert journal_file.stat().st_size > 0  # a run this short is folded only when it ends: all of it is here
    before = _snapshot(out)
    run = open_run(out)
    events, _, _ = load_rank(run, 0)
    assert _snapshot(out) == before  # no fold, no WAL replayed into the file, nothing written
    per_step = events.group_by("step").len().sort("step")
    steps = dict(zip(per_step["step"].to_list(), per_step["len"].to_list()))
    # step 3 had ended when the process died, so steps 0..2 are whole (step 3's own write may be cut)
    assert steps[0] == steps[1] == steps[2] > 0 and steps.get(3, 0) <= steps[0], steps
    assert max(steps) <= 3
    assert run.event_counts[0] == len(events)
    # two other processes read it at once, five times: every one of them gets the same events
    reader = ("import sys; from bitguard.backend.ingest import open_run, load_rank; "
              "print(load_rank(open_run(sys.argv[1]), 0)[0]['seq'].to_list())")
    for _ in range(5):
        procs = [subprocess.Popen([sys.executable, "-c", reader, str(out)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in results]
        assert all(o.strip() == str(events["seq"].to_list()) for o, _ in results)
    assert _snapshot(out) == before
    # the launcher's fold takes it in; the events read are the same
    assert store.recover(out / "rank-0.duckdb") > 0 and not journal_file.exists()
    assert load_rank(open_run(out), 0)[0].equals(events)


def test_a_read_only_copy_with_a_journal_is_read_as_it_is(tmp_path, monkeypatch):
    out, path = _run_dir(tmp_path, folded_groups=1, journaled=2)

    def no_writes(*_args, **_kw):  # what a read-only copy of the run gives (tests run as root)
        raise AssertionError("a reader tried to fold the journal")

    monkeypatch.setattr(store, "recover", no_writes)
    monkeypatch.setattr(store, "fold_journal", no_writes)
    events, _, _ = load_rank(open_run(out), 0)
    assert events["seq"].to_list() == [10, 11, 20, 21]
    assert _seqs(path) == [10, 11]


def test_a_journal_that_cannot_be_written_falls_back_to_committing_each_batch(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    os.close(s._journal)
    s._journal = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT)  # every append fails
    for step in range(3):
        s.add((step, 0, 1, step, "forward", "m", "Linear", "module", 0, 1, "MainThread", "cpu", None, 0, 1, 0), [], [])
        assert s.step_barrier()
    s.step_barrier()
    s.close("complete")
    assert _seqs(path) == [0, 1, 2]  # every event made it, through DuckDB commits
    assert any("cannot append" in e for e in s.errors)


def test_a_fold_that_fails_is_reported_once_and_the_journal_keeps_the_run(tmp_path, monkeypatch, capfd):
    import torch

    import bitguard

    real, failures = store.fold_journal, []

    def broken(*args):  # what a DuckDB connection invalidated by a fatal error does from then on
        failures.append(1)
        raise duckdb.FatalException("database has been invalidated because of a previous fatal error")

    monkeypatch.setattr(store, "FOLD_SECONDS", 0.0)  # fold after every batch
    monkeypatch.setattr(store, "fold_journal", broken)
    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", "0")  # on the writer thread (the fold process's: below)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(5):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    monkeypatch.setattr(store, "fold_journal", real)
    assert len(failures) == 1  # no fold is tried after a failed one
    assert capfd.readouterr().err.count("failed (") == 1
    journal_file = tmp_path / "run" / "rank-0.journal"
    assert journal_file.stat().st_size > 0
    run = open_run(tmp_path / "run")
    events, _, _ = load_rank(run, 0)  # read beside the rank file
    assert sorted(events["step"].unique().to_list()) == [0, 1, 2, 3, 4, 5] and not run.damage
    assert events.filter(events["step"] == 5)["kind"].to_list() == ["final"]  # the weights after step 4
    assert journal_file.exists()
    assert store.recover(tmp_path / "run" / "rank-0.duckdb") > 0 and not journal_file.exists()
    assert load_rank(open_run(tmp_path / "run"), 0)[0]["seq"].to_list() == events["seq"].to_list()


@pytest.mark.parametrize("fold_process", ["0", "1"])
def test_a_dump_whose_step_is_bigger_than_the_rank_file_s_pool_is_folded(tmp_path, monkeypatch, capfd, fold_process):
    """Helper 46: with `--dump` a step's tensors' bytes (here about 20 MB) did not fit the rank file's
    16 MB buffer pool: every fold failed ("failed to pin block", then hidden by a ROLLBACK that had
    nothing to roll back), and identical reruns compared inconclusive."""
    import torch

    import bitguard

    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", fold_process)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.Adam(model.parameters())
    with bitguard.record(tmp_path / "run", determinism=False, dump=True):
        for _ in range(2):
            model(torch.ones(2, 1024)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert "collector error" not in capfd.readouterr().err
    assert not (tmp_path / "run" / "rank-0.journal").exists()  # folded, every group of it
    con = duckdb.connect(str(tmp_path / "run" / "rank-0.duckdb"), read_only=True)
    assert con.execute("SELECT count(*), sum(octet_length(data)) FROM dumps").fetchall()[0][1] > 16 << 20


def test_after_a_failed_fold_a_failed_append_does_not_mark_the_journal_folded(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    _never_folded(s)
    s._write(*_rows(10, 2))  # journaled, not folded
    s._fold_failed = True  # DuckDB gave up earlier
    real = s._journal
    s._journal = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT)  # the next append fails
    with pytest.raises(OSError):
        s._write(*_rows(20, 2))  # reported by the writer loop; nothing may claim group 1 folded
    os.close(s._journal)
    os.close(real)
    s._con.close()
    assert store.recover(path) == 1 and _seqs(path) == [10, 11]


def _mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["flip", "truncate", "zero", "insert", "delete"])
    at = rng.randrange(len(data))
    if kind == "flip":
        out = bytearray(data)
        out[at] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == "truncate":
        return kind, data[:at]
    n = rng.randrange(1, 200)
    if kind == "zero":
        return kind, data[:at] + bytes(min(n, len(data) - at)) + data[at + n:]
    if kind == "insert":
        return kind, data[:at] + rng.randbytes(n) + data[at:]
    return kind, data[:at] + data[at + n:]


def test_no_journal_mutation_loses_events_silently_or_misreads_one(tmp_path):
    """80 mutations of a killed rank's journal: every event read is one that was recorded, and when
    some are lost the rank is damaged from a step no later than the first step that lost one."""
    out, path = _run_dir(tmp_path, journaled=6)
    j = store.journal_path(path)
    pristine = j.read_bytes()
    original = load_rank(open_run(out), 0)
    events = {r["seq"]: r for r in original[0].drop("key", "loose_key").to_dicts()}
    rng = random.Random(2026)
    outcomes = {"whole": 0, "damaged": 0}
    for case in range(80):
        kind, data = _mutate(pristine, rng)
        j.write_bytes(data)
        run = open_run(out)
        got, tensors, _ = load_rank(run, 0)
        rows = got.drop("key", "loose_key").to_dicts()
        assert all(events[r["seq"]] == r for r in rows), (case, kind)  # nothing misread
        lost = sorted(set(events) - {r["seq"] for r in rows})
        if lost:
            first_lost_step = min(events[s]["step"] for s in lost)
            damage = run.damage.get(0)
            assert damage is not None, (case, kind, lost)  # never lost silently
            assert damage["from_step"] is None or damage["from_step"] <= first_lost_step, (case, kind, damage)
            outcomes["damaged"] += 1
        else:
            outcomes["whole"] += 1
        assert run.event_counts[0] == len(rows)
    assert outcomes["damaged"] > 40, outcomes


def test_the_step_barrier_waits_for_the_journal_not_for_a_fold(tmp_path, monkeypatch):
    """A step is durable once its last batch is journaled; a fold after it (and DuckDB's checkpoint,
    hundreds of ms) must not hold the training thread at the next step's barrier."""
    import threading
    import time

    folding, release = threading.Event(), threading.Event()
    real_fold = store.RankStore._fold

    def slow_fold(self):
        folding.set()
        release.wait(10)
        real_fold(self)

    monkeypatch.setattr(store, "FOLD_SECONDS", 0.0)  # fold after every batch
    monkeypatch.setattr(store.RankStore, "_fold", slow_fold)
    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", "0")  # on the writer thread (the fold process: test_folder.py)
    s = store.RankStore(str(tmp_path / "rank-0.duckdb"), {"rank": 0, "world_size": 1})
    try:
        events, tensors, _, _ = _rows(0, 3, step=0)
        for e, t in zip(events, tensors):
            s.add(e, [t], [])
        assert s.step_barrier()  # step 0 ends: nothing before it to wait for
        assert folding.wait(10), "the writer folds after step 0's batch"
        started = time.monotonic()
        assert s.step_barrier(timeout=5)  # step 1 ends: waits for step 0's journal write only
        assert time.monotonic() - started < 2, "the barrier waited for the fold"
        assert _numbers((tmp_path / "rank-0.journal").read_bytes())[:1] == [1], "step 0 is in the journal"
    finally:
        release.set()
        s.close("complete")
    assert not (tmp_path / "rank-0.journal").exists()
