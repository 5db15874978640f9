"""Numbers the training computes and reads (a loss, a metric, a value read as a condition or an index)
where every tensor is equal are compared, and where they were read is shown."""

import pytest

from incli import run_cli

from .spots import compare_json, sgd_steps, tiny_mlp

pytestmark = pytest.mark.slow


def test_a_loss_that_differs_where_every_tensor_is_equal_is_not_identical(tmp_path):
    """Helper 28: a constant added to the loss (SB3's `F.mse_loss` wrapped) changes no gradient, yet
    the loss backward() started from, and the curve the user watches, differ; it compared identical.
    Nothing recorded differs but that value: inconclusive, naming it (reason `computed`)."""
    import torch

    import bitguard

    def train(name, constant):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                (model(torch.randn(2, 4)).pow(2).mean() + constant).backward()
                opt.step()

    why = _computed_only(tmp_path, train, 0.0, 1.0)
    assert why["message"].startswith("backward (loss): value differs at step 0 (") and why["rank"] == 0, why


def _computed_only(tmp_path, train, same, changed) -> dict:
    """`train(name, value)` twice with `same` (runs a, b) and once with `changed` (c): a and b are
    identical, a and c inconclusive with nothing but a computed value differing; that reason."""
    import bitguard

    for name, value in (("a", same), ("b", same), ("c", changed)):
        train(name, value)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    doc = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()
    assert doc["verdict"] == "inconclusive" and doc["first_divergence"] is None, doc["verdict"]
    (why,) = [r for r in doc["inconclusive"]["reasons"] if r["code"] == "computed"]
    return why


@pytest.mark.parametrize("read", ["item", "float", "format", "numpy", "tolist", "array", "repr"])
def test_an_evaluation_metric_that_differs_where_every_tensor_is_equal_is_not_identical(tmp_path, read):
    """Helper 33 (Lightning): a change only in what an evaluation makes of the model's outputs (a
    metric's scale, predictions post-processed) touches no recorded tensor and no gradient; it
    compared identical with no word. What the training reads out of a tensor is compared."""
    import io

    import numpy as np
    import torch

    import bitguard

    reads = {"item": lambda t: t.mean().item(), "float": lambda t: float(t.mean()), "format": lambda t: f"{t.mean():.6f}",
             "numpy": lambda t: t.numpy().sum(), "tolist": lambda t: sum(t.tolist()),
             "array": lambda t: np.asarray(t).sum(),
             # a metric printed or logged as a tensor (`print(acc)`, logging's %s: helper 44)
             "repr": lambda t: print(t.mean(), file=io.StringIO())}

    def train(name, scale):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            model.eval()
            with torch.no_grad():
                reads[read]((model(torch.randn(3, 4)) * scale).flatten())

    why = _computed_only(tmp_path, train, 1.0, 1.5)
    assert why["message"].startswith(f"a value the training read out of a tensor ({read}(), read 0 of the step, "
                                     f"at {__file__}:"), why


def test_where_a_value_is_read_is_shown_and_never_compared(tmp_path):
    """Helper 48: a read's difference named no place ("read (numpy) call 7"). Its file and line are
    recorded and shown; code moved between two runs (the read on another line) is no difference."""
    import torch

    import bitguard
    from bitguard.backend.report import render_text

    def train(name, moved, shape):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 1)
            out = model(torch.randn(*shape, 4))
            if moved:
                out.detach().numpy()
            else:
                out.detach().numpy()
            sgd_steps(model, opt, 1)

    for name, moved, shape in (("a", False, (2,)), ("b", True, (2,)), ("c", False, (2, 2))):
        train(name, moved, shape)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    (d,) = [d for d in c.to_dict()["first_divergence"]["api_differences"]["differences"] if d["kind"] == "read"]
    assert d["field"] == "shape" and d["at"].startswith(f"{__file__}:"), d
    assert f"read (numpy) at {d['at']}: shape [2, 1] (A) vs [2, 2, 1] (B)" in render_text(c), render_text(c)


def test_a_value_read_after_the_step_window_is_said_to_be_outside_it(tmp_path):
    """Helper 53 (--steps 2:4, a change at step 5): the read that differed was said to be computed
    "outside the recorded boundaries"; it was outside the recorded steps."""
    import torch

    import bitguard

    def train(name, scale):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False, steps="1:2"):
            for step in range(4):
                sgd_steps(model, opt, 1)
                float(model(torch.ones(1, 4)).sum() * (scale if step == 3 else 1.0))

    why = _computed_only(tmp_path, train, 1.0, 2.0)
    assert "what computed it ran outside the recorded steps (1:2), which were all that was compared" \
        in why["message"], why


@pytest.mark.parametrize("read", ["bool", "index", "equal", "allclose", "torch.equal", "torch.allclose"])
def test_a_metric_read_as_a_condition_an_index_or_a_comparison_is_compared(tmp_path, read):
    """Helper 46: an evaluation's accuracy against shifted labels, read only by `if acc > best:`,
    `range(n)`, `torch.equal` or `torch.allclose` (Python bools and ints out of a tensor), compared
    identical although the script printed something else."""
    import torch

    import bitguard

    reads = {"bool": lambda n: bool(n > 5), "index": lambda n: len(range(n)), "equal": lambda n: n.equal(torch.tensor(6)),
             "allclose": lambda n: n.float().allclose(torch.tensor(6.0)),
             "torch.equal": lambda n: torch.equal(n, torch.tensor(6)),
             "torch.allclose": lambda n: torch.allclose(n.float(), torch.tensor(6.0))}

    def train(name, shift):
        model, opt = tiny_mlp()
        labels = torch.tensor([0, 0, 1, 1, 1, 0])
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            correct = (labels == labels.roll(shift)).sum()  # (6 right, or 4: the metric's labels shifted)
            reads[read](correct)

    why = _computed_only(tmp_path, train, 0, 1)
    assert why["message"].startswith(f"a value the training read out of a tensor ({read.split('.')[-1]}()"), why


def test_a_torchmetrics_metric_computed_differently_is_not_identical(tmp_path, monkeypatch):
    """Helper 33 (Lightning + torchmetrics): `self.vacc.update(out, y); self.log("val_acc", self.vacc)`
    with another averaging compared identical: update() and compute() are no module calls, and no
    code of the user's reads the value (Lightning computes and logs it). Each metric's compute() is
    a read. torchmetrics is not a dependency: a stand-in with its Metric's own wrapping of
    `compute` at construction (torchmetrics/metric.py `_wrap_compute`), imported before the
    recording (the real one imported after it was tried by hand: helper 33's script)."""
    import functools
    import sys
    import types

    import torch

    import bitguard

    class Metric(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.compute = self._wrap_compute(self.compute)

        def _wrap_compute(self, compute):
            @functools.wraps(compute)
            def wrapped(*args, **kwargs):
                return compute(*args, **kwargs).clone()
            return wrapped

    class Accuracy(Metric):
        def __init__(self, macro):
            super().__init__()
            self.macro, self.hits = macro, []

        def update(self, out, y):
            self.hits.append((out.argmax(1) == y).float())

        def compute(self):
            hits = torch.cat(self.hits)
            return hits.mean() if not self.macro else (hits[:1].mean() + hits[1:].mean()) / 2

    package, module = types.ModuleType("torchmetrics"), types.ModuleType("torchmetrics.metric")
    module.Metric, package.metric = Metric, module
    monkeypatch.setitem(sys.modules, "torchmetrics", package)
    monkeypatch.setitem(sys.modules, "torchmetrics.metric", module)

    def train(name, macro):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            metric = Accuracy(macro)
            with torch.no_grad():
                metric.update(torch.cat([model(torch.randn(4, 4)), torch.zeros(4, 1)], 1), torch.tensor([0, 1, 1, 0]))
            metric.compute()

    why = _computed_only(tmp_path, train, False, True)
    assert why["message"].startswith("a value the training read out of a tensor (Accuracy.compute(), read 0"), why


def test_a_value_read_in_one_run_only_is_shown_with_what_it_read(tmp_path):
    """Helper 49: a read made in one run alone was listed as "called in B, not called in A" without the value
    it read, which is what tells a user whether it matters."""
    import torch

    import bitguard

    def train(name, extra):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(2):
                opt.zero_grad()
                loss = model(torch.randn(2, 4) * (2.0 if extra and step == 1 else 1.0)).pow(2).mean()
                if extra and step == 0:
                    loss.item()  # (a value only run B reads)
                loss.backward()
                opt.step()

    train("a", False)
    train("b", True)
    fd = compare_json(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    reads = [d for d in fd["api_differences"]["differences"] if d["kind"] == "read"]
    assert reads and reads[0]["b"] == "called" and isinstance(reads[0]["value"], float), reads
    shown = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "not called in A, called in B (it read " in shown, shown


def test_values_read_that_differ_only_in_their_shape_are_not_identical(tmp_path):
    """Helper 88 (torchaudio, a greedy CTC decode read with tolist(): [[], [], []] against [[0], [0], [0]]): values
    read that differ by zeros only ([1.5] and [1.5, 0.0, 0.0]) digest alike, and their shape, which differs, was
    taken for a setting: "identical", with "read (tolist) shape [1] (A) vs [3] (B)" in a note."""
    import torch

    import bitguard

    def train(path, n):
        model, opt = tiny_mlp()
        with bitguard.record(path, determinism=False):
            sgd_steps(model, opt, 2)
            kept = torch.zeros(n)
            kept[0] = 1.5
            kept.tolist()

    for name, n in (("a", 1), ("b", 1), ("c", 3)):
        train(tmp_path / name, n)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    assert code == 3 and [r["code"] for r in d["inconclusive"]["reasons"]] == ["computed"], d["verdict"]
    assert "differs in its shape at step 2 ([1] in A, [3] in B)" in d["inconclusive"]["reasons"][0]["message"]
