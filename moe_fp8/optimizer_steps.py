"""A process-wide ``torch.optim`` step pre-hook: each step first bumps the version counter of every
parameter it is about to update (those with a gradient). Registered when this module is first
imported (the weight caches import it).

PyTorch's fused and foreach optimizer kernels (``AdamW(fused=True)``, a foreach step on ``DTensor``
shards) write parameters without bumping their version counters, on which the FP8 weight caches
(and the FSDP caches' stamps) key their entries. Every ``torch.optim.Optimizer`` subclass runs the
hook. An optimizer outside ``torch.optim`` that writes parameters without bumping their versions
must be followed by ``Fp8WeightCache.invalidate``.
"""

from __future__ import annotations

from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = []


def _bump_updated(optimizer, args, kwargs) -> None:
    increment_version([p for group in optimizer.param_groups for p in group["params"] if p.grad is not None])


_HOOK = register_optimizer_step_pre_hook(_bump_updated)
