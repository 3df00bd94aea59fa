"""``NoGradient``: an identity Function whose backward gives no gradient, so the op before it receives
an undefined one (what a Function sees when nothing downstream differentiates its output)."""

import torch


class NoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        return None
