"""Faults planted in the tests' own models: an autograd Function whose backward alone computes
differently (its forward is a copy)."""

import torch


class ScaledBackward(torch.autograd.Function):
    """`ScaledBackward.apply(x, scale)`: x as it is; its gradient times `scale` on the way back."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None
