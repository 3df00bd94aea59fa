"""same_or_cast: the tensor itself when no cast is needed (no aliasing `.to` in a traced forward)."""

from __future__ import annotations

import torch

from moe_fp8.autograd_outputs import same_or_cast


def test_same_object_or_a_cast():
    t = torch.randn(4, 8, dtype=torch.bfloat16)
    assert same_or_cast(t, torch.bfloat16) is t
    f = same_or_cast(t, torch.float32)
    assert f.dtype == torch.float32 and torch.equal(f, t.float())
