"""What no optimizer step or module output shows, as other people's code does it.

    python blind_spots.py bn MOMENTUM        BatchNorm1d whose running statistics use MOMENTUM
    python blind_spots.py manual LR_LAST     parameters updated by hand (no torch.optim), the last update with LR_LAST
    python blind_spots.py manual1 LR         the same, the second update (after step 1) with LR
    python blind_spots.py init SCALE         one initial weight scaled by SCALE before training (torch.optim)
    python blind_spots.py lbfgs LR           LBFGS (its closure called several times a step), at step 2 with LR
    python blind_spots.py validate SCALE     an evaluation before step 2's training (Lightning's), then one weight
                                             scaled by SCALE through .data
    python blind_spots.py zero LR            SGD with LR on a loss whose gradients are all zero (LR changes nothing)
    python blind_spots.py swa SKIP           an AveragedModel updated after each step but step SKIP, never called
    python blind_spots.py functional LR_LAST torch.func.functional_call on a dict of weights updated by hand (no
                                             torch.optim), the last update with LR_LAST
    python blind_spots.py shadow DECAY       an object (not a module) keeping shadow weights, updated in place
                                             after each step with DECAY (diffusers' EMAModel)
    python blind_spots.py ema DECAY          a hand-written EMA copy (deepcopy, updated in place), kept by a
                                             trainer object, never called, with DECAY
    python blind_spots.py ema_attr DECAY     diffusers' EMAModel kept as an attribute of the model (`m.ema`), beside
                                             a weak proxy of the model and a batch list that an object holds (Lightning)
    python blind_spots.py ema_dict DECAY     a dict of shadow tensors by parameter name, replaced (not updated in
                                             place) after each step, with DECAY
    python blind_spots.py ema_late DECAY     a list of shadow weights made after the fifth of seven steps, a global
                                             updated in place (torch._foreach_lerp_), only printed
    python blind_spots.py ema_callback DECAY a dict of shadow weights a callback keeps, the callback in a list of
                                             (name, callback) pairs a trainer object holds (skorch)
    python blind_spots.py ema_hook DECAY     a list of shadow weights only an optimizer step post-hook's closure holds
    python blind_spots.py scaler INF_AT      a GradScaler that skips step INF_AT (an inf put in a gradient; -1: none)
    python blind_spots.py shuffle VIEW       nn.PixelShuffle, or (VIEW 1) a subclass of it that computes the same
    python blind_spots.py saved DECAY        an average of the weights made once training is done, in a function,
                                             saved with torch.save beside the time and its path, DECAY its weight
    python blind_spots.py safetensors DECAY  the same, written by safetensors' save_file
    python blind_spots.py worker_save V      a DataLoader worker saving each sample it loads, scaled by V
    python blind_spots.py clamp C            weights clamped through .data after each step() (a WGAN critic),
                                             after step 1 to [-C, C]

Each trains four steps of a tiny model and prints a number that tells the runs apart.
"""

import sys

import torch
import torch.nn as nn



def train(m, opt, steps=4, after=None):
    for _ in range(steps):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after is not None:
            after()


class ShadowEMA:  # (as diffusers' EMAModel: no module; its list of tensors updated in place, by DECAY)
    def __init__(self, params):
        self.shadow_params = [p.clone().detach() for p in params]

    def step(self, params):
        for s, p in zip(self.shadow_params, params):
            s.sub_((1 - value) * (s - p.detach()))


torch.manual_seed(0)
what, value = sys.argv[1], float(sys.argv[2])
if what == "bn":
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=value), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    train(m, opt)
    print(m[1].running_mean.sum().item())
elif what in ("init", "clamp"):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if what == "init":
        with torch.no_grad():
            m[2].weight[0, 3] *= value
    opt = torch.optim.RMSprop(m.parameters(), lr=5e-3)
    for step in range(4):
        loss = m(torch.randn(4, 8)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if what == "clamp":
            c = value if step == 1 else 0.05
            for p in m.parameters():
                p.data.clamp_(-c, c)
    print(sum(p.double().sum().item() for p in m.parameters()))
elif what == "validate":
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:
            m.eval()
            with torch.no_grad():
                m(torch.randn(4, 8))
            m[2].weight.data[0, 3] *= value  # (a callback's edit, after the evaluation)
            m.train()
        loss = m(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(sum(p.double().sum().item() for p in m.parameters()))
elif what == "swa":
    def train():  # (the usual layout: models local to a function)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        averaged = torch.optim.swa_utils.AveragedModel(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(4):
            loss = m(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step != value:
                averaged.update_parameters(m)
        return sum(p.double().sum().item() for p in averaged.parameters())

    print(train())
elif what == "functional":
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    weights = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    for step in range(4):
        loss = torch.func.functional_call(m, weights, (torch.randn(4, 8),)).pow(2).mean()
        grads = torch.autograd.grad(loss, list(weights.values()))
        lr = value if step == 3 else 0.1
        weights = {k: (w - lr * g).detach().requires_grad_() for (k, w), g in zip(weights.items(), grads)}
    print(sum(w.double().sum().item() for w in weights.values()))
elif what == "shadow":
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ema = ShadowEMA(m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    train(m, opt, after=lambda: ema.step(m.parameters()))
    print(sum(s.double().sum().item() for s in ema.shadow_params))
elif what in ("ema_attr", "ema_dict"):
    import types
    import weakref

    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    # what a trainer's objects hold (Lightning's profiler: a weak proxy of the model; its loop: the batch)
    holder = types.SimpleNamespace(model=weakref.proxy(m), batch=[x])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if what == "ema_attr":
        m.ema = ShadowEMA(m.parameters())
        train(m, opt, after=lambda: m.ema.step(m.parameters()))
        print(sum(s.double().sum().item() for s in m.ema.shadow_params))
    else:
        shadow = {n: p.detach().clone() for n, p in m.named_parameters()}

        def update():
            for n, p in m.named_parameters():
                shadow[n] = value * shadow[n] + (1 - value) * p.detach()  # a new tensor each time
        train(m, opt, after=update)
        print(sum(s.double().sum().item() for s in shadow.values()))
elif what == "ema":
    import copy

    class Trainer:  # (the EMA an attribute of the object whose method trains)
        def __init__(self):
            self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.ema = copy.deepcopy(self.model).requires_grad_(False)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def fit(self):
            for _ in range(4):
                loss = self.model(torch.randn(4, 8)).pow(2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                with torch.no_grad():
                    for e, p in zip(self.ema.parameters(), self.model.parameters()):
                        e.mul_(value).add_(p, alpha=1 - value)
            return sum(p.double().sum().item() for p in self.ema.parameters())

    print(Trainer().fit())
elif what == "ema_late":
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    late = None

    def update():  # (a list of shadow weights made after the fifth of seven steps, only printed)
        global late
        with torch.no_grad():
            if update.steps == 5:
                late = [p.detach().clone() for p in m.parameters()]
            elif late is not None:
                torch._foreach_lerp_(late, [p.detach() for p in m.parameters()], 1 - value)
        update.steps += 1
    update.steps = 1
    train(m, opt, steps=7, after=update)
    print(sum(s.double().sum().item() for s in late))
elif what == "ema_callback":
    class Ema:  # (skorch's callbacks: a trainer holds [(name, callback)], the callback the shadow weights)
        def begin(self, model):
            self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

        def batch_end(self, model):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    self.shadow[n].mul_(value).add_(p, alpha=1 - value)

    class Net:
        def __init__(self):
            self.module_ = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.callbacks_ = [("ema", Ema())]

    def fit(net):  # (the library's own code calls step(): a frame of the user's holds `net` alone)
        opt = torch.optim.SGD(net.module_.parameters(), lr=0.1)
        net.callbacks_[0][1].begin(net.module_)
        train(net.module_, opt, after=lambda: net.callbacks_[0][1].batch_end(net.module_))

    net = Net()
    fit(net)
    print(sum(s.double().sum().item() for s in net.callbacks_[0][1].shadow.values()))
elif what == "ema_hook":
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def ema_hook(model):  # (the shadow weights only the hook's closure holds)
        shadow = [p.detach().clone() for p in model.parameters()]

        def update(optimizer, args, kwargs):
            with torch.no_grad():
                torch._foreach_lerp_(shadow, [p.detach() for p in model.parameters()], 1 - value)
        return update

    opt.register_step_post_hook(ema_hook(m))
    train(m, opt)
    (hook,) = opt._optimizer_step_post_hooks.values()
    shadow = next(c.cell_contents for c in hook.__closure__ if type(c.cell_contents) is list)
    print(sum(s.double().sum().item() for s in shadow))
elif what == "scaler":
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for step in range(4):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == value:
            m[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    print(sum(p.double().sum().item() for p in m.parameters()))
elif what == "shuffle":
    class PixelShuffleView(nn.PixelShuffle):
        pass

    m = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), PixelShuffleView(2) if value else nn.PixelShuffle(2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(2):
        loss = m(torch.randn(2, 1, 4, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(sum(p.double().sum().item() for p in m.parameters()))
elif what == "zero":
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=value)
    for step in range(3):
        loss = (m(torch.randn(4, 8)) * 0).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(sum(p.double().sum().item() for p in m.parameters()))
elif what in ("saved", "safetensors"):
    import copy
    import os
    import tempfile
    import time

    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    train(m, opt)

    def averaged(model):  # made after the last step, gone when it returns: only what is saved holds it
        ema = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(value)
        return {k: v.clone() for k, v in ema.state_dict().items()}

    where = tempfile.mkdtemp()  # (another folder and file name in each run)
    state = averaged(m)
    if what == "saved":
        torch.save({"ema": state, "saved_at": time.time(), "where": where}, os.path.join(where, f"{os.getpid()}.pt"))
    else:
        import safetensors.torch

        safetensors.torch.save_file(state, os.path.join(where, "ema.safetensors"), metadata={"at": str(time.time())})
    print(sum(v.double().sum().item() for v in state.values()))
elif what == "worker_save":
    import io

    class Saving(torch.utils.data.Dataset):  # (caching what it prepares: the worker's save is not observed)
        def __len__(self):
            return 8

        def __getitem__(self, i):
            x = torch.full((8,), float(i))
            torch.save(x * value, io.BytesIO())
            return x

    m = nn.Sequential(nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for x in torch.utils.data.DataLoader(Saving(), batch_size=4, num_workers=1, multiprocessing_context="fork"):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    print(sum(p.double().sum().item() for p in m.parameters()))
elif what == "lbfgs":
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for step in range(4):
        opt.param_groups[0]["lr"] = value if step == 2 else 0.5

        def closure():
            opt.zero_grad()
            loss = (m(x) - y).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
    print(sum(p.double().sum().item() for p in m.parameters()))
else:
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    at = 1 if what == "manual1" else 3
    for step in range(4):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        m.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= (value if step == at else 1e-2) * p.grad
    print(sum(p.double().sum().item() for p in m.parameters()))
