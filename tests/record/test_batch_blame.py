"""Where a difference enters as the batch, a target or an argument rather than through a module: what
no recorded module produced is blamed on the data, a changed target on the loss."""

import shutil

import pytest

from .conftest import as_older_schema
from .spots import compare_json, planted_pair, sgd_steps, tiny_mlp

pytestmark = pytest.mark.slow


def test_nothing_paired_is_not_said_to_have_every_recorded_tensor_equal(tmp_path):
    """Helper 33 (Lightning, a resumed run against the tail of an uninterrupted one): no event paired
    (the steps are counted from each process's start), and a bullet still said a loss "differs ...
    while every recorded tensor is equal"."""
    import torch

    import bitguard

    def train(name, steps, window, seed):
        model, opt = tiny_mlp()
        torch.manual_seed(seed)
        with bitguard.record(tmp_path / name, determinism=False, steps=window):
            sgd_steps(model, opt, steps)

    train("a", 4, "2:", 0), train("b", 2, None, 1)
    doc = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()
    assert doc["verdict"] == "inconclusive", doc["verdict"]
    codes = [r["code"] for r in doc["inconclusive"]["reasons"]]
    assert "step_window" in codes and "computed" not in codes, doc["inconclusive"]["reasons"]


def test_inputs_no_recorded_module_produced_are_blamed_on_the_data(tmp_path):
    """Helper 28: SB3 calls its value head, then a parameterless extractor on the observations (no
    batch event: it holds no parameters); a changed observation was blamed on the value head, an
    earlier call that does not enclose it ("its own code"). Inputs that no enclosing call had
    identical and no recorded module produced come from the data."""
    import torch

    import bitguard

    def train(name, shift):
        torch.manual_seed(0)
        flatten, head = torch.nn.Flatten(), torch.nn.Linear(8, 1)
        value = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD([*head.parameters(), *value.parameters()], lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                obs = torch.randn(4, 2, 4)
                if step == 1:
                    obs[0, 0, 0] += shift  # (an observation the replay buffer changed)
                opt.zero_grad()
                loss = value(torch.ones(4, 8)).sum() + head(flatten(obs)).pow(2).mean()
                loss.backward()
                opt.step()

    for name, shift in (("a", 0.0), ("b", 1.0)):
        train(name, shift)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"], fd["fault_class"]) == \
        (1, "forward", "Flatten", "data", "data"), fd
    assert fd["blame_window"]["module"] is None and "training's own code or data" in fd["blame_window"]["detail"], fd


def test_a_number_given_to_a_module_as_an_argument_is_an_input_that_differs(tmp_path):
    """Helper 62: a Python float given to a module (a temperature, `model(x, t)` or `self.s(h, t=t)`)
    was not recorded: its change was blamed on the module's own code ("source"). Numbers given as
    arguments are input rows, as returned ones are output rows; a run of schema 12 has none, and
    they are left out of both sides."""
    import torch

    import bitguard

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            return self.lin(x) / t

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.s, self.b = torch.nn.Linear(4, 4), Scale(), torch.nn.Linear(4, 1)

        def forward(self, x, t):
            return self.b(self.s(self.a(x), t=self.inner))  # (a number the model's own code picks)

    def train(name, t, inner):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                opt.zero_grad()
                model.inner = inner if step == 1 else 1.0
                model(torch.randn(8, 4), t if step == 1 else 1.0).pow(2).mean().backward()
                opt.step()

    for name, t, inner in (("a", 1.0, 1.0), ("b", 1.0, 1.0), ("root", 0.5, 1.0), ("inner", 1.0, 0.5)):
        train(name, t, inner)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    for name, boundary, path in (("root", "Net", "[1] (python float)"), ("inner", "s", "['t'] (python float)")):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["step"], fd["boundary"]) == (1, boundary) and fd["blame"] != "source", fd
        assert [t["path"] for t in fd["tensors"] if t["role"] == "input" and t["a"] != t["b"]] == [path], fd["tensors"]
    shutil.copytree(tmp_path / "inner", tmp_path / "old")
    as_older_schema(tmp_path / "old", 12)  # recorded before number arguments were: left out of both sides
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "old").to_dict()["first_divergence"]
    assert (fd["step"], fd["boundary"], fd["blame"]) == (1, "s", "source"), fd


def test_targets_equal_by_value_to_a_module_output_are_still_the_batch(tmp_path):
    """Helper 45 (torchvision's transform returns the targets): a step's targets, changed in run B,
    held in run A the values a submodule returned a step before, and the batch pivot was said to be
    "another model's output, not the data pipeline": labels repeat by value, and so does a dataset's
    every epoch. Not the same tensor, nor its memory in the same step: the batch."""
    import torch

    import bitguard

    class Prep(torch.nn.Module):
        def forward(self, x, y):
            return x * 2, y.clone()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.prep, self.fc = Prep(), torch.nn.Linear(4, 2)

        def forward(self, x, y):
            x, y = self.prep(x, y)
            if y.is_floating_point():
                return (self.fc(x) - y).pow(2).mean()
            return torch.nn.functional.cross_entropy(self.fc(x), y)

    def train(name, targets):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for y in targets:
                opt.zero_grad()
                model(torch.randn(2, 4), torch.tensor(y)).backward()
                opt.step()

    labels, boxes = [[0, 1], [1, 0], [1, 0]], [[[0., 1.], [2., 3.]], [[1., 1.], [1., 1.]], [[0., 1.], [2., 3.]]]
    for targets, changed in ((labels, [1, 1]), (boxes, [[0., 1.], [2., 4.]])):
        train("a", targets), train("b", targets[:2] + [changed])
        fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
        assert (fd["phase"], fd["step"], fd["blame"]) == ("data", 2, "data"), fd
        assert "another model's output" not in (fd["blame_window"] or {}).get("detail", ""), fd["blame_window"]
        shutil.rmtree(tmp_path / "a"), shutil.rmtree(tmp_path / "b")


def test_a_batch_a_model_returns_as_it_was_given_is_still_the_batch(tmp_path):
    """Helper 47 (tensordict: a TensorDictModule returns its input batch with its outputs added): the
    fixed data tensor edited at step 2 was, in run A, the very tensor the model had returned at step
    1, and the batch pivot was said to be "another model's output". Passed through is not made."""
    import torch

    import bitguard

    class Passing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, batch):
            return {**batch, "p": self.lin(batch["x"])}

    def train(name, edit):
        torch.manual_seed(0)
        model, x = Passing(), torch.randn(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                if edit and step == 2:
                    x[3, 1] += 0.001
                out = model({"x": x})
                opt.zero_grad()
                (out["p"] - out["x"].sum(1, keepdim=True)).pow(2).mean().backward()
                opt.step()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["phase"], fd["step"], fd["blame"]) == ("data", 2, "data"), fd
    assert "another model's output" not in (fd["blame_window"] or {}).get("detail", ""), fd["blame_window"]


@pytest.mark.parametrize("child", [False, True])
def test_a_module_given_two_modules_outputs_swapped_is_said_to_be(tmp_path, child):
    """Helper 48 (lightly's MoCo loss, `crit(k, q)` for `crit(q, k)`): the loss module's inputs were
    said to come "from the training's own code or data, nor did any recorded module produce them";
    with a CrossEntropyLoss child (NTXentLoss has one), the child's inputs, made inside the loss."""
    import torch

    import bitguard

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ce = torch.nn.CrossEntropyLoss() if child else torch.nn.functional.cross_entropy

        def forward(self, q, k):
            return self.ce(q @ k.T / 0.5, torch.arange(4))

    def train(name, swap):
        torch.manual_seed(0)
        enc_q, enc_k, crit = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), Loss()
        with bitguard.record(tmp_path / name, determinism=False):
            x = torch.randn(4, 4)
            q, k = enc_q(x), enc_k(x).detach()
            (crit(k, q) if swap else crit(q, k)).backward()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["phase"], fd["boundary"]) == ("forward", "ce" if child else "Loss"), fd
    detail = fd["blame_window"]["detail"]
    assert "is what Linear (forward at step 0, call 0) returned in run A and what Linear#2" in detail, detail
    assert "not other data" in detail, detail


def test_a_model_fed_another_model_s_output_is_not_said_to_have_a_new_batch(tmp_path):
    """Helper 33 (Lightning's manual optimization): with a GAN's two steps swapped from step 2 on,
    the discriminator's first call takes the generator's output instead of the real batch, and the
    pivot, its batch event, read as "the model's input batch differs" with nothing more: the user
    was sent to the data pipeline. The input is known, by its digests, as what G returned."""
    import torch

    import bitguard

    def train(name, swap_from):
        torch.manual_seed(0)
        g, d = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
        opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)

        def d_step(x, z):
            fake = g(z).detach()
            opt_d.zero_grad()
            (d(x).mean() - d(fake).mean()).backward()
            opt_d.step()

        def g_step(z):
            opt_g.zero_grad()
            d(g(z)).mean().backward()
            opt_g.step()

        with bitguard.record(tmp_path / name, determinism=False):
            for i in range(3):
                x, z = torch.randn(3, 4), torch.randn(3, 2)
                if i >= swap_from:
                    g_step(z), d_step(x, z)
                else:
                    d_step(x, z), g_step(z)

    train("a", 9), train("b", 1)
    doc = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()
    fd = doc["first_divergence"]
    assert (fd["phase"], fd["boundary"], fd["blame"]) == ("data", "Linear#2", "data"), fd
    detail = fd["blame_window"]["detail"]
    assert "in run A it holds no recorded module's output; in run B it holds what Linear (forward" in detail, detail
    assert "not the data pipeline" in detail, detail
    # the backwards paired at their places (the discriminator's input now needs a gradient) are not
    # said to have changed module type or dtype: neither did
    notes = [r["message"] for r in doc["certification"]["reasons"] if r["code"] == "retyped"]
    assert notes and "(Linear in both, with tensors that differ in number, shape or path)" in notes[0], notes


def test_a_hidden_state_one_run_alone_gives_the_model_is_a_difference_in_the_batch(tmp_path):
    """Helper 71: a GRU language model's hidden state carried from batch to batch, reset to None at one
    step in run B: the batch lost a tensor, and the pivot was the GRU's forward blamed as computing
    differently ("source"), its missing input said to be a signature change. A tensor of the input
    batch one run alone gives is a difference of the data now, at that step."""
    import torch

    import bitguard

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.head = torch.nn.Embedding(10, 8), torch.nn.GRU(8, 8, batch_first=True), \
                torch.nn.Linear(8, 10)

        def forward(self, x, h=None):
            out, h = self.rnn(self.emb(x), h)
            return self.head(out), h

    def train(out, reset):
        torch.manual_seed(0)
        model = LM()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = None
        with bitguard.record(out, determinism=False):
            for step in range(4):
                x = torch.randint(0, 10, (2, 5))
                if step == reset:
                    h = None
                logits, h = model(x, h)
                h = h.detach()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()

    fd = planted_pair(tmp_path, train, -1, 2)
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"]) == (2, "batch", "LM", "data"), fd
    assert any("run A alone gives the model 1 input(s) of this batch" in n for n in fd["notes"]), fd["notes"]


def test_a_target_changed_under_a_functional_loss_is_blamed_on_the_loss_and_reaches_the_whole_backward(tmp_path):
    """Helper 16: a label changed under `F.cross_entropy` (no loss module) made the root's backward the
    pivot, said to be "upstream of every observed boundary (the data pipeline)", and its propagation
    reached 1 node: the root and its last part share their gradient, and nothing linked the two."""
    import torch

    import bitguard

    def train(out, target):
        model, opt = tiny_mlp()
        with bitguard.record(out, determinism=False):
            for step in range(2):
                opt.zero_grad()
                y = torch.zeros(2, 1) + (target if step == 1 else 0.0)
                torch.nn.functional.mse_loss(model(torch.randn(2, 4)), y).backward()
                opt.step()

    for name, target in (("a", 0.0), ("b", 0.5)):
        train(tmp_path / name, target)
    d = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()
    fd = d["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (1, "backward", "Sequential", "consumer"), fd
    assert fd["blame_window"]["detail"].startswith("the gradient reaching Sequential's output already differs: it was "
                                                   "computed outside every observed module, by the loss"), fd
    reached = {n["boundary"] for n in d["propagation"]["nodes"] if n["phase"] == "backward"}
    assert {"Sequential", "2", "0", "0.weight", "2.weight"} <= reached, reached


def test_a_target_changed_behind_a_root_that_returns_its_child_s_output_is_blamed_on_the_loss(tmp_path):
    """Helper 28: DQN's QNetwork returns its Sequential's output, so that child's backward is the
    pivot and no name prefix leads to the root: a changed discount (the target's) was said to be
    "upstream of every observed boundary (e.g. in the data pipeline)" though every input matched."""
    import torch

    import bitguard

    class QNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

        def forward(self, x):
            return self.q_net(x)

    def train(out, gamma):
        torch.manual_seed(0)
        q = QNet()
        opt = torch.optim.SGD(q.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for _ in range(2):
                x = torch.randn(5, 4)
                target = 1.0 + gamma * x.sum(1)
                loss = torch.nn.functional.smooth_l1_loss(q(x).max(1).values, target)
                opt.zero_grad()
                loss.backward()
                opt.step()

    for name, gamma in (("a", 0.99), ("b", 0.98)):
        train(tmp_path / name, gamma)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (0, "backward", "q_net", "consumer"), fd
    assert fd["blame_window"]["detail"].startswith("the gradient reaching QNet's output already differs"), fd


def test_a_weight_read_outside_its_module_with_a_changed_loss_is_blamed_on_the_loss(tmp_path):
    """Helper 24: TRL's fused log-prob reads `lm_head.weight` directly (lm_head is never called),
    and the root's backward event ends only with the pass (an output, `entropy`, gets no gradient).
    A changed DPO beta was then blamed on lm_head's weight gradient, "while the gradient reaching its
    module matched": no backward of lm_head exists to say so. The root's incoming gradient differed."""
    import torch

    import bitguard

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"logits": h @ self.head.weight.t(), "aux": h.sum(-1)}  # (aux: no gradient ever reaches it)

    def train(name, beta):
        torch.manual_seed(0)
        model = Fused()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                (model(torch.randn(2, 4))["logits"].pow(2).mean() * beta).backward()
                opt.step()

    for name, beta in (("a", 0.1), ("b", 0.11)):
        train(name, beta)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["blame"], fd["fault_class"]) == (0, "consumer", "backward"), fd
    detail = fd["blame_window"]["detail"]
    assert "no backward of head was recorded" in detail and "by the loss" in detail, detail
    assert "matched" not in detail, detail
    from bitguard.backend.drill import plan
    from bitguard.backend.ingest import open_run
    from bitguard.errors import NotSupported

    with pytest.raises(NotSupported, match="head, whose parameter is the pivot .* is never called as a module"):
        plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)  # (it told the user to record in full mode)


def test_a_changed_loss_in_trusted_mode_is_not_blamed_on_the_last_observed_module(tmp_path):
    """Helper 23: in trusted mode (the root is not observed) a label-smoothing change was blamed on
    the window `fc`, the last Linear, which computed correctly: the gradient reaching its output
    already differed, and nothing observed after it says where it arose. The window is now none."""
    import torch

    import bitguard

    def train(name, smoothing):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, mode="trusted", determinism=False):
            for _ in range(2):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]),
                                                         label_smoothing=smoothing)
                loss.backward()
                opt.step()

    for name, smoothing in (("a", 0.1), ("b", 0.11)):
        train(name, smoothing)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["blame"]) == (0, "backward", "consumer"), fd
    window = fd["blame_window"]
    assert window["module"] is None and "already differed" in window["detail"] and "trusted mode" in window["detail"], \
        window


@pytest.mark.parametrize("how", ["in place", "out of place"])
def test_a_model_output_edited_in_place_before_the_loss_is_said_to_be_edited_not_swapped(tmp_path, how):
    """Helper 56 (MONAI): `out[:, 1].mul_(1.01)` between a model and its loss module in one run was said
    to give the loss "other modules' outputs (arguments swapped or passed from elsewhere)", blamed on the
    data: the loss's input is the very tensor the model returned, edited after it returned. Helper 75
    (fastai's `after_pred` callback): `out = out * 1.1` was said the same; that run's code made it."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = tiny_mlp()
        loss_fn = torch.nn.MSELoss()
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                opt.zero_grad()
                out = model(x)
                if edit and step == 1 and how == "in place":
                    out[:, 0].mul_(1.01)
                elif edit and step == 1:
                    out = out * 1.01
                loss_fn(out, y).backward()
                opt.step()

    for name, edit in (("a", False), ("b", True)):
        train(name, edit)
    for a, b, run in (("a", "b", "B"), ("b", "a", "A")):
        code, d = compare_json(tmp_path / a, tmp_path / b)
        fd = d["first_divergence"]
        assert (code, fd["step"], fd["boundary"], fd["blame"]) == (1, 1, "MSELoss", "consumer"), fd
        detail = fd["blame_window"]["detail"]
        said = (f"in run {run} it was changed in place after it returned" if how == "in place" else
                f"what no recorded module returned in run {run}: that run's code between the calls made it")
        assert said in detail and "swapped" not in detail, detail


def test_a_changed_loss_over_two_roots_names_the_root_that_holds_the_pivot(tmp_path):
    """Helper 79 (torchsde's drift and diffusion networks, called in turn): a loss weight changed outside
    every module was said to reach the output of the root whose backward came first, not of the one whose
    part is the pivot (their parts share paths: `1` in each, a Tanh in one and a Sigmoid in the other)."""
    import torch

    import bitguard

    class Drift(torch.nn.Sequential):
        pass

    class Diffusion(torch.nn.Sequential):
        pass

    def train(out, weight):
        torch.manual_seed(0)
        f = Drift(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        g = Diffusion(torch.nn.Linear(3, 3), torch.nn.Sigmoid())
        opt = torch.optim.SGD([*f.parameters(), *g.parameters()], lr=0.05)
        y = torch.randn(8, 3)
        with bitguard.record(out, determinism=False):
            opt.zero_grad()
            for _ in range(2):
                y = y + 0.1 * f(y) + 0.1 * g(y)
            ((y ** 2).mean() * weight).backward()
            opt.step()

    fd = planted_pair(tmp_path, train, 0.1, 0.2)
    assert (fd["phase"], fd["boundary"], fd["module_type"]) == ("backward", "1", "Sigmoid"), fd
    assert fd["blame_window"]["detail"].startswith("the gradient reaching Diffusion's output already differs"), fd
