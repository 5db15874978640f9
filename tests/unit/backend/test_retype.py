"""Modules renamed or re-signatured between two runs pair through their position (backend/retype.py):
transformers' LlamaSdpaAttention (4.46: an extra cache output, a cache_position input) became
LlamaAttention (5.x), and its decoder layer's output went from a tuple to a tensor. Made here with
two module classes at the same path; modules at different paths never pair."""

from __future__ import annotations

import polars as pl
import torch
from torch import nn

import bitguard
from bitguard.backend import retype
from faults import ScaledBackward


class SdpaAttention(nn.Module):  # "4.46": returns (out, None, cache), takes cache_position
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states, cache_position=None):
        y = self.proj(hidden_states)
        return y, None, y.detach() * 0


class Attention(nn.Module):  # "5.x": returns (out, weights=None)
    def __init__(self, flip=False):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.flip = flip

    def forward(self, hidden_states, position=None):
        y = self.proj(hidden_states)
        if self.flip:
            y = y.clone()
            y.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 9)
        return y, None


class Layer(nn.Module):
    def __init__(self, attention, as_tuple, position_first=False):
        super().__init__()
        self.self_attn = attention
        self.as_tuple = as_tuple
        self.position_first = position_first

    def forward(self, x):
        if isinstance(self.self_attn, SdpaAttention):
            y = self.self_attn(hidden_states=x, cache_position=torch.arange(x.shape[0]))[0]
        elif self.position_first:  # B's hidden_states is its second input, A's its first
            y = self.self_attn(position=torch.arange(x.shape[0] + 1), hidden_states=x)[0]
        else:
            y = self.self_attn(hidden_states=x)[0]
        return (x + y,) if self.as_tuple else x + y


class Net(nn.Module):
    def __init__(self, old: bool, flip=False, where="layer", position_first=False):
        super().__init__()
        attention = SdpaAttention() if old else Attention(flip)
        setattr(self, where, Layer(attention, as_tuple=old, position_first=position_first))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        out = next(self.children())(x)
        return self.head(out[0] if isinstance(out, tuple) else out).sum()


def _record(path, dump=False, **net):
    torch.manual_seed(0)
    model = Net(**net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    with bitguard.record(path, determinism=False, dump=dump):
        for _ in range(3):
            model(torch.randn(3, 4, generator=data)).backward()
            opt.step()
            opt.zero_grad()
    return path


def test_a_re_signatured_module_pairs_by_position_and_is_never_certified_identical(tmp_path):
    c = bitguard.compare(_record(tmp_path / "old", old=True), _record(tmp_path / "new", old=False))
    rc = c.ranks[0]
    assert rc.gaps.is_empty(), rc.gaps  # every event paired: no structural divergence
    paired = rc.pairs.join(rc.events_a.select(pl.col("seq").alias("a_seq"), "boundary", "phase"), on="a_seq")
    attn = paired.filter((pl.col("boundary") == "layer.self_attn") & (pl.col("phase") == "forward"))
    assert attn.height == 3 and attn["retyped"].all() and attn["resigned"].all()
    layer = paired.filter((pl.col("boundary") == "layer") & (pl.col("phase") == "forward"))
    assert layer.height == 3 and not layer["status"].is_in(["diverged"]).any()  # (x+y,) vs x+y: the same tensor
    # the extra cache output and cache_position input: recorded by one side only, so not certified
    d = c.to_dict()
    assert d["verdict"] == "inconclusive", d["verdict"]
    messages = " ".join(r["message"] for r in d["inconclusive"]["reasons"])
    assert retype.ONLY_A in messages


def test_a_difference_behind_a_re_signatured_module_is_found_there(tmp_path):
    c = bitguard.compare(_record(tmp_path / "old", old=True), _record(tmp_path / "new", old=False, flip=True))
    fd = c.to_dict()["first_divergence"]
    assert c.verdict == "diverged" and (fd["step"], fd["phase"], fd["boundary"]) == (0, "forward", "layer.self_attn")
    assert fd["retyped"] and (fd["module_type"], fd["module_type_b"]) == ("SdpaAttention", "Attention")
    output = [t for t in fd["tensors"] if t["role"] == "output" and t["differs"] and not t["unobserved"]]
    assert [t["path"] for t in output] == ["[0]"], fd["tensors"]
    assert any("signature change" in n for n in fd["notes"]), fd["notes"]
    from bitguard.backend.report import render_text

    text = render_text(c)
    assert "A runs SdpaAttention, B runs Attention" in text and "signature change" in text


def test_a_moved_tensor_is_compared_with_its_own_bytes_under_a_tolerance(tmp_path):
    a = _record(tmp_path / "old", old=True, dump=True)
    for flip in (False, True):
        b = _record(tmp_path / f"new{flip}", old=False, position_first=True, flip=flip, dump=True)
        c = bitguard.compare(a, b, fingerprint="tolerance")
        fd = c.to_dict()["first_divergence"]
        if not flip:  # B's hidden_states (its input 1) is A's input 0: equal, not A's against B's position
            assert c.verdict == "inconclusive", fd
        else:  # a flipped low mantissa bit is within the tolerance: still not identical (one-sided tensors)
            assert c.verdict in ("inconclusive", "diverged"), c.verdict
            assert fd is None or fd["boundary"] == "layer.self_attn", fd


def test_modules_at_different_paths_never_pair(tmp_path):
    c = bitguard.compare(_record(tmp_path / "a", old=False), _record(tmp_path / "b", old=False, where="block"))
    assert c.verdict == "diverged" and c.to_dict()["first_divergence"]["cause"] == "structure"
    paired = c.ranks[0].pairs.join(c.ranks[0].events_a.select(pl.col("seq").alias("a_seq"), "boundary"), on="a_seq")
    assert not paired.filter(pl.col("boundary").cast(pl.String).str.starts_with("layer")).height


def test_tensors_of_a_resigned_pair_match_by_path_then_shape_and_dtype():
    a = [("input", 0, "[0]", (2, 3), "float32"), ("input", 1, "[1]", (2,), "int64"),
         ("output", 0, "[0]", (2, 3), "float32"), ("output", 1, "[2]", (2, 3), "float32")]
    b = [("input", 0, "['x']", (2, 3), "float32"), ("output", 0, "", (2, 3), "float32"),
         ("state", 0, ".extra", (1,), "float32")]
    matched, lone_b = retype._match(a, b)
    # B's ['x'] is A's [0] (shape and dtype), B's bare output A's [0]; .extra is B's alone
    assert sorted(matched) == [("input", 0, 0), ("output", 0, 0)] and lone_b == [("state", 0, 0)]


def _pivot(module_type, module_type_b, dtypes, kind="module"):
    from bitguard.backend.result import DigestPair, FirstDivergence, TensorPair

    none = DigestPair(xor=None, pos=None)
    tensors = [TensorPair(role="output", index=0, path="", shape=[2], dtype=a, dtype_b=b, a=none, b=none,
                          differs=True, ignored=False, rule_id=None) for a, b in dtypes]
    return FirstDivergence.model_construct(module_type=module_type, module_type_b=module_type_b, tensors=tensors,
                                           kind=kind)


def test_the_retype_note_says_what_changed_the_type_or_only_a_dtype():
    from bitguard.backend.report import _retyped

    # under autocast the module is the same and only its dtype changed: say that, not "Linear vs Linear"
    assert _retyped(_pivot("Linear", "Linear", [("float32", "bfloat16")])) == \
        "paired across a dtype change (float32→bfloat16): both runs run Linear"
    assert _retyped(_pivot("LlamaSdpaAttention", "LlamaAttention", [("float32", "float32")])) == \
        "paired across a type change: A runs LlamaSdpaAttention, B runs LlamaAttention"
    # (a save's type is the object it wrote, helper 77)
    assert _retyped(_pivot("OrderedDict", "dict", [("float32", "float32")], kind="saved")) == \
        "paired across a type change: A saves OrderedDict, B saves dict"


class Shaped(nn.Module):
    """Returns the same bytes as (3, 4) or as (2, 6): one run's module reshapes its output."""

    def __init__(self, wide: bool):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.wide = wide

    def forward(self, x):
        y = self.proj(x)
        return y.reshape(2, 6) if self.wide else y


class Reshaping(nn.Module):
    def __init__(self, wide: bool):
        super().__init__()
        self.mod = Shaped(wide)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.mod(x).reshape(-1, 4)).sum()


def test_the_same_bytes_in_another_shape_are_never_identical(tmp_path):
    # paired by place (same path, other tensor shapes), the output's digests are equal: the shape
    # alone tells the tensors apart, and it must (a fuzz case found the place pairing certifying it)
    runs = []
    for wide in (False, True):
        torch.manual_seed(0)
        model = Reshaping(wide)
        with bitguard.record(tmp_path / str(wide), determinism=False):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).backward()
        runs.append(tmp_path / str(wide))
    d = bitguard.compare(*runs).to_dict()
    assert d["verdict"] == "diverged", d["verdict"]
    fd = d["first_divergence"]
    assert (fd["boundary"], fd["phase"]) == ("mod", "forward"), fd


def test_a_gradient_one_run_alone_sends_back_is_a_difference(tmp_path):
    """Helper 46: a probe head that detaches its input in run B. The head's backward sends a
    gradient to its input in run A alone; that tensor was passed over as a signature change
    (unobserved), and the pivot came later, at the body's missing backward."""
    class Probe(nn.Module):
        def __init__(self, detach):
            super().__init__()
            self.head, self.detach = nn.Linear(4, 2), detach

        def forward(self, h):
            return self.head(h.detach() if self.detach else h)

    for name, detach in (("a", False), ("b", True)):
        torch.manual_seed(0)
        body, probe = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), Probe(detach)
        with bitguard.record(tmp_path / name, determinism=False):
            x = torch.randn(8, 4)
            (body(x).pow(2).mean() + probe(body(x)).pow(2).mean()).backward()
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    fd = c.to_dict()["first_divergence"]
    assert (fd["phase"], fd["boundary"], fd["step"]) == ("backward", "head", 0), fd
    sent = [t for t in fd["tensors"] if t["role"] == "grad_input"]
    assert len(sent) == 1 and sent[0]["differs"] and not sent[0]["unobserved"], fd["tensors"]
    assert any("run A alone sends a gradient back to 1 input(s)" in n for n in fd["notes"]), fd["notes"]


class TwoHeads(nn.Module):
    """Two heads reading one feature tensor (torchvision's RPN and box heads read one feature map);
    `reg_backward`: a factor the regression head's own backward scales its input's gradient by."""

    def __init__(self, reg_backward=1.0):
        super().__init__()
        self.trunk, self.cls, self.reg = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 2)
        self.reg_backward = reg_backward

    def forward(self, xs):
        cls = reg = 0
        for x in xs:  # (two feature levels: the heads are called once on each)
            t = torch.relu(self.trunk(x))
            cls = cls + self.cls(t).pow(2).mean()
            reg = reg + ScaledBackward.apply(self.reg(t), self.reg_backward).abs().mean()
        return {"cls": cls, "reg": reg}


def _two_heads(path, drop=False, reg_backward=1.0):
    torch.manual_seed(0)
    model = TwoHeads(reg_backward)
    with bitguard.record(path, determinism=False):
        losses = model([torch.randn(5, 4), torch.randn(3, 4)])
        if drop:
            losses.pop("reg")
        sum(losses.values()).backward()
    return path


def test_an_output_that_gets_a_gradient_in_one_run_alone_is_a_difference(tmp_path):
    """Helper 45 (torchvision detection): a loss term dropped (`losses.pop(...)`) leaves one output
    of the model without a gradient; the model's backward, paired across that change, passed it
    over, and the pivot was the other head's backward, blamed as computed differently."""
    c = bitguard.compare(_two_heads(tmp_path / "a"), _two_heads(tmp_path / "b", drop=True))
    fd = c.to_dict()["first_divergence"]
    assert (fd["phase"], fd["boundary"], fd["blame"]) == ("backward", "TwoHeads", "consumer"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == ["['reg']"], fd["tensors"]
    assert any("1 output(s) of this module receive a gradient in run A alone" in n for n in fd["notes"]), fd["notes"]


def test_a_gradient_summed_from_several_readers_is_not_blamed_on_one_of_them(tmp_path):
    """The gradient recorded as a call's grad_input is its input's, summed over every call reading
    that input: the classification head's was blamed as computed differently when the regression
    head's backward differed."""
    c = bitguard.compare(_two_heads(tmp_path / "a"), _two_heads(tmp_path / "b", reg_backward=2.0))
    fd = c.to_dict()["first_divergence"]
    assert (fd["phase"], fd["kind"], fd["blame"]) == ("backward", "module", "consumer"), fd
    other = "reg" if fd["boundary"] == "cls" else "cls"
    assert f"which {other} also read in this step" in fd["blame_window"]["detail"], fd["blame_window"]
