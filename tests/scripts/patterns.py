"""Model-code patterns the recorder must live with: each trains a small model of its own for a few
steps, the same way with or without `bitguard record` (tests/record/test_patterns.py).

`python patterns.py OUT [--no-edit] [PATTERN ...]` runs the named patterns (all, in the order
below, by default) one after the other and writes, right after each one ends, OUT/PATTERN.pt:
{"losses": [float.hex], "params": {name: bytes}, "steps": (first, count), "root": class name}.
A recorder that kills the process leaves the results of the patterns before it. `steps` counts
optimizer steps from the first pattern run (bitguard's step numbers); `root` is the class name
of the pattern's model, so its boundary in a recording. `--no-edit` leaves out the in-place edits
at step 2: the reference a recording of the edits is compared against.

Each pattern is written as someone's model code would be, not as bitguard would like it; the
first is the script of issue 12 (a recorded run died of SIGSEGV at its step 2). Nothing here
knows bitguard.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

PATTERNS: dict[str, callable] = {}
EDIT = True  # --no-edit turns every in-place edit below off
STEP = [0]  # the step in progress within the running pattern
EDIT_STEP = 2
TOTAL_STEPS = [0]  # optimizer steps taken so far, all patterns together


def pattern(fn):
    PATTERNS[fn.__name__] = fn
    return fn


def editing() -> bool:
    return EDIT and STEP[0] == EDIT_STEP


def train(model: nn.Module, batch, loss_of=None, steps: int = 4, opt=None):
    """A plain training loop: `batch(step)` is the model's argument, `loss_of(output)` the loss."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of = loss_of or (lambda out: out.float().pow(2).mean())
    losses = []
    for step in range(steps):
        STEP[0] = step
        loss = loss_of(model(batch(step)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        TOTAL_STEPS[0] += 1
        losses.append(loss.item())
    return losses


def randn(*shape, **kw):
    return lambda step: torch.randn(*shape, **kw)


# -- in-place edits of outputs ---------------------------------------------------------------
class MLP(nn.Module):
    """Issue 12's model."""

    def __init__(s):
        super().__init__()
        s.c_fc = nn.Linear(8, 32)
        s.c_proj = nn.Linear(32, 8)

    def forward(s, x):
        return s.c_proj(F.gelu(s.c_fc(x)))


def _replaced_forward(shape, edit):
    """Issue 12's script: c_fc's forward replaced by a function that edits its output at step 2."""
    m = MLP()
    lin = m.c_fc

    def forward(x):
        out = F.linear(x, lin.weight, lin.bias)
        if editing():
            edit(out)
        return out

    lin.forward = forward
    return m, train(m, randn(*shape))


@torch.no_grad()
def _flip(t):
    t[(0,) * t.dim()] += 1e-3  # issue 12's edit: t[0, 0, 0] += 1e-3


@pattern
def edit_nograd_replaced_3d():
    return _replaced_forward((2, 4, 8), _flip)


@pattern
def edit_nograd_replaced_2d():
    return _replaced_forward((8, 8), _flip)


def _grad_mode_edit(t):
    t[0, 0, 0] += 1e-3  # differentiable: the output's history becomes CopySlices


@pattern
def edit_grad_replaced_3d():
    return _replaced_forward((2, 4, 8), _grad_mode_edit)


def _strided_edit(t):
    with torch.no_grad():
        t.transpose(0, 2)[::2].mul_(1.001)  # a strided view of a view
    t[:, ::2] *= 1.001  # and one in grad mode


@pattern
def edit_strided_views():
    return _replaced_forward((2, 4, 8), _strided_edit)


def _dtype_edit(t):
    with torch.no_grad():
        t.view(torch.int32)[0, 0, 0] ^= 1  # one bit of the mantissa, through a dtype view
    t.view(torch.int32)[1, 0, 0] ^= 2  # in grad mode (an int view carries no history, the edit does)


@pattern
def edit_dtype_views():
    return _replaced_forward((2, 4, 8), _dtype_edit)


class EditingLinear(nn.Linear):
    """A module whose own forward edits its result (3-D: a view of the matmul's output)."""

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if editing():
            with torch.no_grad():
                out[0, 0, :2] += 1e-3
            out[1].mul_(1.001)
        return out


class EditsChild(nn.Module):
    """A module editing its child's output after the child returned (the recorder saw it first)."""

    def __init__(self):
        super().__init__()
        self.fc = EditingLinear(8, 16)
        self.inner = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        h = self.inner(self.fc(x))
        if editing():
            with torch.no_grad():
                h[:, 0] += 1e-3
            h.view(torch.int32)[0, 0, 1] ^= 1
        return self.proj(F.relu(h))


@pattern
def edit_in_own_forward():
    m = EditsChild()
    return m, train(m, randn(2, 4, 8))


# -- outputs that alias inputs -----------------------------------------------------------------
class Passthrough(nn.Module):
    def forward(self, x):
        return x  # the input itself


class Aliases(nn.Module):
    def forward(self, x):
        return x.view(-1, x.shape[-1]), x[:, :2], x.t(), x.detach(), x, x  # views, alias, itself twice


class AliasModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.same = Passthrough()
        self.ident = nn.Identity()
        self.alias = Aliases()
        self.act = nn.ReLU(inplace=True)  # returns its input, written

    def forward(self, x):
        h = self.ident(self.same(self.fc(x)))
        flat, part, tr, det, a, b = self.alias(h)
        return self.act(flat * 1.0).sum() + part.sum() + tr.sum() * det.mean() + (a * b).sum()


@pattern
def alias_outputs():
    m = AliasModel()
    return m, train(m, randn(4, 8), loss_of=lambda out: out)


# -- non-tensor outputs ------------------------------------------------------------------------
class Nothing(nn.Module):
    def forward(self, x):
        return None


class Scalars(nn.Module):
    def forward(self, x):
        return 3, "three", 3.0, [x.shape[0], None]


class Lazy(nn.Module):
    def forward(self, x):
        return (x[i] for i in range(x.shape[0]))  # a generator: consumed by the caller, not by us


class NonTensorModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.nothing = Nothing()
        self.scalars = Scalars()
        self.lazy = Lazy()

    def forward(self, x):
        h = self.fc(x)
        assert self.nothing(h) is None
        n, _, f, _ = self.scalars(h)
        return sum(row.sum() for row in self.lazy(h)) * f / n


@pattern
def non_tensor_outputs():
    m = NonTensorModel()
    return m, train(m, randn(4, 8), loss_of=lambda out: out.pow(2))


# -- modules under no_grad and inference_mode ---------------------------------------------------
class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = nn.Linear(8, 8)
        self.teacher = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)

    def forward(self, x):
        with torch.inference_mode():
            target = self.teacher(x)  # an inference tensor: no version counter
        with torch.no_grad():
            mask = self.frozen(x) > 0
        return F.mse_loss(self.student(x) * mask, target.clone() * mask)


@pattern
def no_grad_and_inference_mode():
    m = Teacher()
    return m, train(m, randn(4, 8), loss_of=lambda out: out)


# -- modules called inside hooks ---------------------------------------------------------------
class Probed(nn.Module):
    """A forward hook and a backward hook that call modules of their own."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.probe = nn.Linear(8, 2)  # called from the forward hook
        self.grad_probe = nn.Linear(8, 2)  # called from the backward hooks
        self.seen = []
        self.body.register_forward_hook(lambda mod, args, out: self.seen.append(self.probe(out.detach()).sum().detach()))
        self.body.register_full_backward_hook(
            lambda mod, gin, gout: self.seen.append(self.grad_probe(gout[0]).sum().detach()))

    def forward(self, x):
        h = self.body(x)
        h.register_hook(lambda g: self.seen.append(self.grad_probe(g).sum().detach()))
        return self.head(F.relu(h))


@pattern
def modules_in_hooks():
    m = Probed()
    return m, train(m, randn(4, 8))


class Replaced(nn.Module):
    """Forward pre-hooks and forward hooks that replace inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.a.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        self.b.register_forward_pre_hook(lambda mod, args, kwargs: ((args[0] + 1,), kwargs), with_kwargs=True)
        self.b.register_forward_hook(lambda mod, args, out: out.tanh())
        self.c.register_forward_hook(lambda mod, args, out: (out, out.sum()))  # now a tuple

    def forward(self, x):
        out, total = self.c(self.b(self.a(x)))
        return out.pow(2).mean() + total * 1e-3


@pattern
def replacing_hooks():
    m = Replaced()
    return m, train(m, randn(4, 8), loss_of=lambda out: out)


# -- checkpointing -----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)  # the recomputation must draw the same numbers
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + self.drop(F.gelu(self.fc(x))))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return h


class CheckpointReentrant(Checkpointed):
    pass


class CheckpointNonReentrant(Checkpointed):
    pass


@pattern
def checkpoint_reentrant():
    m = CheckpointReentrant(True)
    return m, train(m, randn(4, 8))


@pattern
def checkpoint_non_reentrant():
    m = CheckpointNonReentrant(False)
    return m, train(m, randn(4, 8))


# -- parametrizations --------------------------------------------------------------------------
class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations, parametrize

        self.wn = parametrizations.weight_norm(nn.Linear(8, 8))
        self.sn = parametrizations.spectral_norm(nn.Linear(8, 8))  # power iteration: buffers edited in place
        self.sym = nn.Linear(8, 8)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the old API warns that it is old
            self.old_wn = torch.nn.utils.weight_norm(nn.Linear(8, 8))  # a forward pre-hook

    def forward(self, x):
        return self.old_wn(self.sym(self.sn(self.wn(x))))


@pattern
def parametrizations():
    m = Parametrized()
    return m, train(m, randn(4, 8))


# -- tied and shared parameters ----------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)
        self.other.weight = self.mid.weight  # one parameter, two modules
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied embedding

    def forward(self, idx):
        h = self.emb(idx)
        h = self.mid(self.mid(h))  # one module called twice
        return self.head(self.other(h))


@pattern
def tied_and_shared():
    m = Tied()
    g = torch.Generator().manual_seed(1)
    batch = lambda step: torch.randint(0, 16, (2, 5), generator=g)
    return m, train(m, batch, loss_of=lambda out: F.cross_entropy(out.view(-1, 16), torch.arange(10) % 16))


# -- dtypes and layouts ------------------------------------------------------------------------
class Conj(nn.Module):
    def forward(self, z):
        return z.conj(), torch.view_as_real(z)  # a lazy-conjugate view and a real view


class ComplexModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=torch.cfloat)
        self.conj = Conj()

    def forward(self, z):
        c, r = self.conj(self.fc(z))
        return (c * self.fc.weight[0]).abs().pow(2).mean() + r.pow(2).mean()


@pattern
def complex_tensors():
    m = ComplexModel()
    return m, train(m, randn(4, 8, dtype=torch.cfloat), loss_of=lambda out: out,
                    opt=torch.optim.SGD(m.parameters(), lr=1e-2))


class ToSparse(nn.Module):
    def forward(self, x):
        return x.to_sparse()  # a sparse COO output


class ToCsr(nn.Module):
    def forward(self, x):
        return x.detach().to_sparse_csr()  # a compressed layout


class SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, sparse=True)  # sparse gradients
        self.fc = nn.Linear(8, 8)
        self.to_sparse = ToSparse()
        self.to_csr = ToCsr()

    def forward(self, idx):
        h = self.fc(self.emb(idx))
        s = self.to_sparse(h.relu())
        self.to_csr(h)
        return torch.sparse.sum(s) + h.pow(2).mean()


@pattern
def sparse_tensors():
    m = SparseModel()
    g = torch.Generator().manual_seed(2)
    return m, train(m, lambda step: torch.randint(0, 16, (6,), generator=g), loss_of=lambda out: out,
                    opt=torch.optim.SGD(m.parameters(), lr=1e-2))


class Ints(nn.Module):
    def forward(self, logits):
        return logits.argmax(-1), logits > 0, (logits * 10).to(torch.uint8), logits.to(torch.int16)


class IntegerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.ints = Ints()

    def forward(self, idx):
        h = self.fc(self.emb(idx).bfloat16())
        top, mask, _, _ = self.ints(h)
        return (h.float() * mask).mean() + top.float().mean() * 0


@pattern
def integer_tensors():
    m = IntegerModel()
    g = torch.Generator().manual_seed(3)
    return m, train(m, lambda step: torch.randint(0, 16, (2, 5), generator=g), loss_of=lambda out: out)


class Padded(nn.Module):
    def forward(self, nt):
        return nt.to_padded_tensor(0.0)


class NestedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)  # takes and returns nested tensors
        self.jagged_fc = nn.Linear(8, 8)
        self.pad = Padded()

    def forward(self, rows):
        nt = torch.nested.nested_tensor(rows)
        nj = torch.nested.nested_tensor(rows, layout=torch.jagged)
        return self.pad(self.fc(nt)).pow(2).mean() + self.jagged_fc(nj).values().pow(2).mean()


@pattern
def nested_tensors():
    m = NestedModel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout is "prototype"
        return m, train(m, lambda step: [torch.randn(3, 8), torch.randn(5, 8)], loss_of=lambda out: out)


class Tagged(torch.Tensor):
    """A `__torch_function__` subclass (results stay Tagged), as metadata-carrying tensors are."""


class SubclassModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.pair = nn.Linear(8, 8)
        self.meta = nn.Linear(8, 8, device="meta")  # shape inference on the meta device

    def forward(self, x):
        from torch.testing._internal.two_tensor import TwoTensor  # a `__torch_dispatch__` wrapper

        self.meta(torch.empty(x.shape, device="meta"))
        h = self.fc(x.view(2, -1, x.shape[-1]).as_subclass(Tagged))  # 3-D: the output is a view
        if editing():
            with torch.no_grad():
                h[0, 0, 0] += 1e-3  # issue 12's edit, on a subclass (gradient hooks: the public way)
        two = self.pair(TwoTensor(h.as_subclass(torch.Tensor), h.as_subclass(torch.Tensor) * 2))
        return h.as_subclass(torch.Tensor).pow(2).mean() + two.a.pow(2).mean() + two.b.mean()


@pattern
def tensor_subclasses():
    m = SubclassModel()
    return m, train(m, randn(4, 8), loss_of=lambda out: out)


class Sharded(nn.Module):
    """DTensor parameters and activations on a one-rank mesh (gloo), as FSDP2/TP models hold them."""

    def __init__(self):
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

        self.mesh = init_device_mesh("cpu", (1,))
        self.fc = nn.Linear(8, 8)
        distribute_module(self.fc, self.mesh, lambda name, mod, mesh: [
            mod.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))
            for n, p in list(mod.named_parameters(recurse=False))])

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate

        return self.fc(DTensor.from_local(x, self.mesh, [Replicate()])).to_local()


@pattern
def dtensor():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    m = Sharded()
    return m, train(m, randn(4, 8), opt=torch.optim.SGD(m.parameters(), lr=1e-2))


# -- containers --------------------------------------------------------------------------------
class NoKeysOutput(collections.OrderedDict):
    """A model output registered with pytree without key paths (as transformers 4.46's ModelOutput)."""


pytree.register_pytree_node(
    NoKeysOutput,
    lambda out: (list(out.values()), list(out.keys())),
    lambda values, keys: NoKeysOutput(zip(keys, values)),
)


class NoKeysInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, extra=None):
        h = self.fc(x)
        return NoKeysOutput(hidden=h, pooled=h.mean(0), extra=extra)


class NoKeysModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = NoKeysInner()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        out = self.inner(x, extra=NoKeysOutput(mask=x > 0))  # and one as an input
        logits = self.head(out["hidden"])
        return NoKeysOutput(loss=logits.pow(2).mean() + out["pooled"].sum() * 1e-3, logits=logits)


@pattern
def pytree_without_keys():
    m = NoKeysModel()
    return m, train(m, randn(4, 8), loss_of=lambda out: out["loss"])


class Pair(NamedTuple):
    value: torch.Tensor
    weight: torch.Tensor


class Keyed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, inputs):
        h = self.fc(inputs[0])
        return Pair(h, inputs[(1, "w")]), {1: h.sum(), 2.5: h.mean(), ("a", 1): h, None: h.max()}


class ContainerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.keyed = Keyed()

    def forward(self, x):
        pair, by_key = self.keyed({0: x, (1, "w"): torch.ones(8)})
        return (pair.value * pair.weight).pow(2).mean() + by_key[1] * 1e-3 + by_key[None] + by_key[("a", 1)].mean()


@pattern
def namedtuples_and_keys():
    m = ContainerModel()
    return m, train(m, randn(4, 8), loss_of=lambda out: out)


class OldSignatureLoss(nn.Module):
    """torchrl's LossModule: `named_parameters(prefix, recurse)` overridden with the signature from
    before `remove_duplicate`, leaving out its target network; saved with torch.save (helper 47:
    the recorder's own calls with remove_duplicate raised, and every such run was inconclusive)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self._target_net = nn.Linear(8, 1).requires_grad_(False)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        for name, p in super().named_parameters(prefix=prefix, recurse=recurse):
            if not name.startswith("_target"):
                yield name, p

    def forward(self, x):
        return (self.net(x) - self._target_net(x)).pow(2).mean()


@pattern
def old_signature_named_parameters():
    m = OldSignatureLoss()
    losses = train(m, randn(4, 8), loss_of=lambda out: out)
    torch.save({"loss_module": m}, io.BytesIO())
    return m, losses


class _Queue(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(6, 8))

    def forward(self, k):
        past = self.keys.clone()
        self.keys[:4] = k.detach()
        return past


class _QueueHolder(nn.Module):  # (no call of its own in trusted mode)
    def __init__(self):
        super().__init__()
        self.queue = _Queue()

    def forward(self, k):
        return self.queue.forward(k)  # (as lightly's losses run their memory bank)


class QueueAttention(nn.Module):
    """Attention over a queue of past keys held by a part run through its `.forward()` (helper 48):
    the part's buffers are reported by the innermost recorded call around it, another call in each
    mode (the holder in full mode, this module in trusted mode)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.holder = _QueueHolder()

    def forward(self, x):
        k = self.proj(x)
        return (k @ self.holder(k).T).softmax(-1)


@pattern
def queue_run_through_forward():
    m = QueueAttention()
    return m, train(m, randn(4, 8))


# -- running -----------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> bytes:
    """A parameter's exact bytes (DTensor: its local shard)."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def main() -> None:
    global EDIT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("patterns", nargs="*", help=f"default: all ({', '.join(PATTERNS)})")
    p.add_argument("--no-edit", action="store_true", help="leave out the in-place edits at step 2")
    args = p.parse_args()
    EDIT = not args.no_edit
    torch.use_deterministic_algorithms(True)  # as `bitguard record` runs it, so that plain runs match
    os.makedirs(args.out, exist_ok=True)
    for name in args.patterns or PATTERNS:
        print(f"pattern {name}", flush=True)
        torch.manual_seed(0)
        first = TOTAL_STEPS[0]
        model, losses = PATTERNS[name]()
        result = {"losses": [float(x).hex() for x in losses],
                  "params": {k: _bytes(v) for k, v in model.state_dict().items() if v.device.type != "meta"},
                  "steps": (first, TOTAL_STEPS[0] - first), "root": type(model).__name__}
        torch.save(result, os.path.join(args.out, f"{name}.pt"))
    print("done", flush=True)


if __name__ == "__main__":
    main()
