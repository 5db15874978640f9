"""The bytes a digest reads: any strided tensor as a flat uint8 tensor in logical row-major order.

Both kernels start from here. The result is a view of the tensor's own memory when the tensor
is contiguous with no lazy conjugate or negative bit; otherwise it is a fresh copy, made on the
tensor's device (and, on CUDA, on the current stream), costing one extra read and write of the
tensor. Nothing here changes the tensor or records autograd history.

Layouts without one strided buffer (sparse, nested, quantized) and tensors without data (meta)
are refused with a `NotSupported` that says what to digest instead; `quantized_bytes` and
`nested_bytes` are what bitguard digests of a quantized and of a nested tensor.
"""

from __future__ import annotations

import torch

from bitguard.errors import NotSupported


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-d uint8 tensor holding `t`'s logical row-major bytes, on `t`'s device."""
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise NotSupported(
            f"cannot digest a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}: "
            "only dense strided tensors have one byte order; digest its dense form "
            "(to_dense(), int_repr() or unbind()) instead"
        )
    if t.device.type == "meta":
        raise NotSupported("cannot digest a tensor on the meta device: it has no data; digest it once it is materialised")
    t = t.detach()  # Parameters and requires_grad tensors: same memory, and nothing below is recorded
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)  # a subclass's overrides must not see our views
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # lazy bits: the logical value is not the stored bytes
    flat = t.contiguous().reshape(-1)
    if flat.stride(-1) != 1:  # (one element or none, "contiguous" whatever its stride: x[0:1, 2], helper 87's drill)
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def quantized_bytes(t: torch.Tensor) -> torch.Tensor:
    """A quantized tensor's bytes as bitguard digests them (docs/DIGESTS.md): its stored integers
    (`int_repr()`) in logical row-major order, then its scale(s) as float64, its zero point(s) as
    int64, and its axis as int64 (-1: one scale for the whole tensor)."""
    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        scales = torch.tensor([t.q_scale()], dtype=torch.float64)
        zeros = torch.tensor([t.q_zero_point()], dtype=torch.int64)
        axis = -1
    elif scheme in (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams):
        scales = t.q_per_channel_scales().to(torch.float64)
        zeros = t.q_per_channel_zero_points().to(torch.int64)
        axis = t.q_per_channel_axis()
    else:
        raise NotSupported(f"cannot digest a quantized tensor of scheme {scheme}: only per-tensor and per-channel "
                           "quantization is read")
    parts = (t.int_repr(), scales, zeros, torch.tensor([axis], dtype=torch.int64))
    return torch.cat([tensor_bytes(p.cpu()) for p in parts])


def nested_bytes(t: torch.Tensor) -> torch.Tensor:
    """A nested tensor's bytes as bitguard digests them (docs/DIGESTS.md): the shape of each of its
    components as int64 (one row a component), then each component's bytes in logical row-major
    order, one after the other."""
    with torch.no_grad():
        parts = t.detach().unbind()
        sizes = torch.tensor([list(p.shape) for p in parts], dtype=torch.int64)
        return torch.cat([tensor_bytes(sizes)] + [tensor_bytes(p).cpu() for p in parts])
