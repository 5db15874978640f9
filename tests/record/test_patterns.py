"""The pattern corpus (tests/scripts/patterns.py): model code written as others write it records in
every mode without a crash, its losses and final parameters bitwise those of the plain run, and
the recording holds what it should (an edit seen where it happened, the loss of a model whose
output pytree has no key paths, tensors it cannot read marked with the reason, never dropped).

The whole corpus runs in one process per run (the plain one, one recording per mode, and one
recording without the edits), launched once for the module: each pattern trains its own small
model, and the per-pattern results name the step range it covered.
"""

import ast
import json
import sys

import duckdb
import pytest
import torch

import bitguard
from bitguard.cuda.fingerprint import digest
from bitguard.schema import EVENTS, TENSORS
from incli import run_cli

from .conftest import SCRIPTS, record, run

pytestmark = pytest.mark.slow

PATTERNS_SCRIPT = SCRIPTS / "patterns.py"
MODES = ("full", "trusted")
# the patterns, in the script's order, read from its source (importing it would register its pytree node here)
PATTERNS = [f.name for f in ast.parse(PATTERNS_SCRIPT.read_text()).body
            if isinstance(f, ast.FunctionDef) and any(getattr(d, "id", None) == "pattern" for d in f.decorator_list)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{run: (process, results folder, run directory)}: the plain run, a recording in each mode and
    a full recording with the step-2 edits left out."""
    root = tmp_path_factory.mktemp("patterns")
    runs = {"plain": (run([sys.executable, PATTERNS_SCRIPT, root / "plain"]), root / "plain", None)}
    for name, options, extra in [*((mode, ["--mode", mode], []) for mode in MODES), ("rerun", [], []),
                                 ("no-edit", [], ["--no-edit"])]:
        proc = record(root / name, root / f"{name}-results", *extra, options=options, script=PATTERNS_SCRIPT,
                      check=False)
        runs[name] = (proc, root / f"{name}-results", root / name)
    return runs


def _results(folder, name):
    path = folder / f"{name}.pt"
    assert path.exists(), f"{path.name} missing: the run died at or before pattern {name}"
    return torch.load(path, weights_only=True)


def _rank0(run_dir):
    """(events, tensor rows) of rank 0 as dicts, read straight from the file the recorder left."""
    con = duckdb.connect(str(run_dir / "rank-0.duckdb"), read_only=True)
    try:
        events = con.sql(f"SELECT * FROM {EVENTS.name} ORDER BY seq").fetchall()
        tensors = con.sql(f"SELECT * FROM {TENSORS.name} ORDER BY seq, role, idx").fetchall()
    finally:
        con.close()
    return [dict(zip(EVENTS.names, e)) for e in events], [dict(zip(TENSORS.names, t)) for t in tensors]


@pytest.fixture(scope="module")
def full(corpus):
    """The full-mode recording's events and tensor rows (dicts)."""
    return _rank0(corpus["full"][2])


def _pattern_events(events, corpus, name, boundary=None, phase="forward"):
    """The events of one pattern (its step range), of one boundary and phase."""
    first, count = _results(corpus["plain"][1], name)["steps"]
    return [e for e in events if first <= e["step"] < first + count and e["phase"] == phase
            and (boundary is None or e["boundary"] == boundary)]


def _rows(tensors, event, role=None):
    return [t for t in tensors if t["seq"] == event["seq"] and (role is None or t["role"] == role)]


def test_the_corpus_lists_every_pattern():
    assert len(PATTERNS) >= 20 and PATTERNS[0] == "edit_nograd_replaced_3d", PATTERNS


@pytest.mark.parametrize("name", ["plain", *MODES, "rerun", "no-edit"])
def test_every_run_exits_0_without_collector_errors(corpus, name):
    proc, _, run_dir = corpus[name]
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    if run_dir is not None:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["status"] == "complete", manifest["status"]
        assert manifest.get("collector_errors", []) == [], manifest["collector_errors"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_recording_does_not_change_the_numbers(corpus, pattern, mode):
    plain, recorded = _results(corpus["plain"][1], pattern), _results(corpus[mode][1], pattern)
    assert plain["losses"] == recorded["losses"], f"losses differ: plain {plain['losses']} recorded {recorded['losses']}"
    assert plain["params"].keys() == recorded["params"].keys()
    differing = [k for k, v in plain["params"].items() if recorded["params"][k] != v]
    assert not differing, f"parameters differ after recording ({mode}): {differing}"


def test_every_parameter_of_every_pattern_is_named_and_has_its_gradients(corpus, full):
    """The patterns build model after model in one process, so a new parameter often gets the id
    of a freed one: it must still be named and hooked (its gradient events, every step)."""
    events, _ = full
    for name in PATTERNS:
        # (kind "final": a model the corpus dropped, its final state taken when the next one steps)
        steps = [e for e in _pattern_events(events, corpus, name, phase="optimizer") if e["kind"] == "step"]
        assert steps and not [e["boundary"] for e in steps if e["boundary"].startswith("<")], name
        grads = {(e["boundary"], e["step"]) for e in _pattern_events(events, corpus, name, phase="backward")
                 if e["kind"] == "grad"}
        missing = {(e["boundary"], e["step"]) for e in steps} - grads
        assert not missing, f"{name}: optimizer steps without a gradient event: {sorted(missing)}"


def test_every_module_backward_event_starts_from_its_outputs_gradients(corpus, full):
    """A call's backward event holds the gradients of its outputs: a parameter given to a call as an
    argument (a parametrization's check as it is registered) had its gradient in a later, unrelated
    backward taken for that call's, a backward event of a call no gradient went through."""
    events, tensors = full
    outputs = {t["seq"] for t in tensors if t["role"] == "grad_output"}
    # (but one: `inner`'s output edited in place outside autograd loses its hook, not the gradient
    # that goes through `inner` to its input, a non-leaf: that backward event is kept)
    edited = {e["seq"] for e in _pattern_events(events, corpus, "edit_in_own_forward", "inner", "backward")}
    lone = [(e["step"], e["boundary"], e["module_type"]) for e in events
            if e["phase"] == "backward" and e["kind"] == "module" and e["seq"] not in outputs | edited]
    assert not lone, f"backward events without an output's gradient: {lone}"


def test_an_edit_of_a_view_under_no_grad_is_seen_at_its_step(corpus, full):
    """Issue 12's script (the first pattern): the edited module's step-2 event exists, and against
    the recording without the edit the first divergence is that event."""
    events, _ = full
    steps = {e["step"] for e in _pattern_events(events, corpus, "edit_nograd_replaced_3d", "c_fc")}
    assert steps == {0, 1, 2, 3}, steps
    proc = run_cli("compare", "--json", corpus["no-edit"][2], corpus["full"][2])
    assert proc.returncode == 1, f"exit {proc.returncode} (1: diverged)\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    fd = json.loads(proc.stdout)["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"]) == (2, "forward", "c_fc"), fd


def test_the_loss_in_an_output_without_key_paths_is_recorded(corpus, full):
    """A root module returning a pytree node registered without key paths (as transformers 4.46's
    ModelOutput): its event is recorded, paths named by the mapping's keys, and the loss row is
    the loss's own digest at every step."""
    events, tensors = full
    roots = _pattern_events(events, corpus, "pytree_without_keys", "NoKeysModel")
    losses = [float.fromhex(h) for h in _results(corpus["plain"][1], "pytree_without_keys")["losses"]]
    assert len(roots) == len(losses) == 4
    for event, loss in zip(roots, losses):
        outputs = {t["path"]: t for t in _rows(tensors, event, "output")}
        assert set(outputs) == {"['loss']", "['logits']"}, outputs
        assert (outputs["['loss']"]["xor"], outputs["['loss']"]["pos"]) == digest(torch.tensor(loss)), event
        assert outputs["['loss']"]["unobserved"] is None
    inner = _pattern_events(events, corpus, "pytree_without_keys", "inner")[0]
    assert {t["path"] for t in _rows(tensors, inner, "input")} == {"[0]", "['extra']['mask']"}


def test_non_string_keys_and_namedtuples_keep_their_paths(corpus, full):
    events, tensors = full
    keyed = _pattern_events(events, corpus, "namedtuples_and_keys", "keyed")[0]
    assert [t["path"] for t in _rows(tensors, keyed, "input")] == ["[0][0]", "[0][(1, 'w')]"]
    assert [t["path"] for t in _rows(tensors, keyed, "output")] == [
        "[0].value", "[0].weight", "[1][1]", "[1][2.5]", "[1][('a', 1)]", "[1][None]"]


def _marks(events, tensors, corpus, pattern, boundary, role, phase="forward"):
    """The `unobserved` column of one boundary's rows of a role, per step (None: digested)."""
    found = _pattern_events(events, corpus, pattern, boundary, phase)
    assert found, f"no {phase} event of {boundary} in {pattern}"
    return [[t["unobserved"] for t in _rows(tensors, e, role)] for e in found]


def test_tensors_it_cannot_read_are_marked_and_their_events_kept(corpus, full):
    events, tensors = full
    marks = lambda *args, **kw: _marks(events, tensors, corpus, *args, **kw)  # noqa: E731
    # sparse: COO digested (output, and the sparse gradient of Embedding(sparse=True)); CSR marked
    assert marks("sparse_tensors", "to_sparse", "output") == [[None]] * 4
    assert marks("sparse_tensors", "emb.weight", "grad", phase="backward") == [[None]] * 4
    assert all("sparse_csr" in m for step in marks("sparse_tensors", "to_csr", "output") for m in step)
    # nested tensors, strided and jagged, in and out: digested as their components (nested_bytes)
    for boundary in ("fc", "jagged_fc"):
        for role in ("input", "output"):
            assert marks("nested_tensors", boundary, role) == [[None]] * 4, (boundary, role)
    # subclasses: one keeping its values (digested), one with its own dispatch that says what it holds (digested
    # by its inner tensors, `__tensor_flatten__`); meta: no values to read nor to differ, so observed as the digest
    # of no bytes (it was marked, and every run inconclusive)
    assert marks("tensor_subclasses", "fc", "input") == [[None]] * 4
    assert marks("tensor_subclasses", "pair", "input") == [[None]] * 4
    assert marks("tensor_subclasses", "meta", "input") == [[None]] * 4
    meta = [t for e in _pattern_events(events, corpus, "tensor_subclasses", "meta", "forward")
            for t in _rows(tensors, e, "input")]
    assert meta and all((t["xor"], t["pos"]) == (0, 0) for t in meta)
    # DTensor parameters: their local shard, the bytes the optimizer holds
    step_events = _pattern_events(events, corpus, "dtensor", "fc.weight", "optimizer")
    param = [t for e in step_events for t in _rows(tensors, e, "param")]
    assert len(param) == 4 and all(t["unobserved"] is None and t["nbytes"] == 8 * 8 * 4 for t in param)
    final = _results(corpus["plain"][1], "dtensor")["params"]["fc.weight"]
    assert (param[-1]["xor"], param[-1]["pos"]) == digest(torch.frombuffer(bytearray(final), dtype=torch.uint8))


def test_a_digest_that_raises_marks_the_row_and_keeps_the_event(tmp_path, monkeypatch):
    from bitguard.collectors import hooks

    real = hooks.digest_async

    def failing(t):
        if t.shape == (3, 5):  # the hidden activation only
            raise RuntimeError("simulated unreadable tensor")
        return real(t)

    monkeypatch.setattr(hooks, "digest_async", failing)
    monkeypatch.setattr(hooks, "in_place_on_host", lambda t: False)  # every row's digest through it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    with bitguard.record(tmp_path / "run", determinism=False, digest_cache=False):
        model(torch.randn(3, 4)).sum().backward()
    events, tensors = _rank0(tmp_path / "run")
    forward = {e["boundary"]: e for e in events if e["phase"] == "forward"}
    assert set(forward) == {"0", "1", "Sequential"}
    out0 = _rows(tensors, forward["0"], "output")[0]
    in1 = _rows(tensors, forward["1"], "input")[0]
    for row in (out0, in1):
        assert row["unobserved"] == "RuntimeError: simulated unreadable tensor" and (row["xor"], row["pos"]) == (0, 0)
    assert _rows(tensors, forward["1"], "output")[0]["unobserved"] is None
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert any("simulated unreadable tensor" in e for e in manifest["collector_errors"])


class _Opaque:
    """A pytree node whose flatten function fails: nothing of it can be read."""

    def __init__(self, t):
        self.t = t


def _refuse(node):
    raise TypeError("opaque by design")


class _Shapes(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.cfloat).conj(), x.to_sparse(), _Opaque(x)


def test_dump_holds_what_was_digested_and_an_unflattenable_output_is_one_marked_row(tmp_path):
    from torch.utils import _pytree as pytree

    pytree.register_pytree_node(_Opaque, _refuse, lambda values, context: _Opaque(*values))
    with bitguard.record(tmp_path / "run", determinism=False, dump=True):
        _Shapes()(torch.tensor([[0.0, 1.5], [-2.0, 0.0]]))
    events, tensors = _rank0(tmp_path / "run")
    con = duckdb.connect(str(tmp_path / "run" / "rank-0.duckdb"), read_only=True)
    dumps = {(s, r, i): bytes(d) for s, r, i, d in con.sql("SELECT seq, role, idx, data FROM dumps").fetchall()}
    con.close()
    (forward,) = [e for e in events if e["phase"] == "forward"]
    conj, sparse, opaque = _rows(tensors, forward, "output")
    for row in (conj, sparse):  # a lazy conjugate (resolved) and a sparse COO tensor (indices, values)
        data = dumps[(row["seq"], row["role"], row["idx"])]
        assert row["unobserved"] is None and len(data) == row["nbytes"]
        assert digest(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == (row["xor"], row["pos"]), row
    assert sparse["strides"] == [] and sparse["nbytes"] == 2 * 2 * 8 + 2 * 4  # 2x2 int64 indices, 2 values
    assert opaque["path"] == "[2]" and opaque["unobserved"].startswith("could not flatten _Opaque: TypeError")
    assert dumps[(opaque["seq"], "output", 2)] == b""


def test_a_parameter_or_module_on_a_freed_ones_id_is_named_and_hooked_afresh():
    """What the corpus meets by chance (a model built after another was freed, its objects on the
    freed ones' ids), made certain: the collector's entries for the ids point at dead objects."""
    import weakref

    from bitguard.collectors.hooks import Collector

    class Store:
        errors: list = []

    class Gone:
        pass

    gone = Gone()
    dead = weakref.ref(gone)
    del gone
    collector = Collector(Store())
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    collector._names[id(model[0])] = (dead, "old.module")
    collector._params[id(model[0].weight)] = (dead, "old.weight", "Old", -1)
    collector._accumulating.add(id(model[0].weight))
    collector._next_param_tid = -1
    collector._register_root(model)
    assert collector._names[id(model[0])][1] == "0"
    ref, name, owner, tid = collector._params[id(model[0].weight)]
    assert (ref() is model[0].weight, name, owner) == (True, "0.weight", "Linear") and tid < -1
    assert id(model[0].weight) not in collector._accumulating  # its post-accumulate hook is added when needed
    assert len(model[0].weight._backward_hooks) == 1  # the gradient hook


def test_two_recordings_of_the_corpus_never_diverge(corpus):
    """A rerun of the same code is not a divergence (a parametrization's stale backward listener once
    made one), and a full recording against a trusted one compares what trusted mode observes."""
    for a, b in (("full", "rerun"), ("full", "trusted")):
        c = bitguard.compare(corpus[a][2], corpus[b][2])
        codes = {r["code"] for r in c.certification_reasons()} - {"modes"}
        assert c.verdict != "diverged", (a, b, c.first_divergence)
        # the corpus holds tensors the recorder cannot read (CSR, a subclass with its own dispatch): those only
        assert codes <= {"unobserved"}, (a, b, codes)
