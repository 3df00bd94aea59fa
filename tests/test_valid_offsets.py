"""A dispatch plan's offsets are registered as valid (``moe_fp8.valid_offsets``): ``fp8_grouped_mm``
takes them without its clamp (or, on CPU, its value check), and the weight gradient's 16-row padded
offsets are made once for the two GEMMs of an MoE layer. The layer computes the same bits as with
unregistered offsets, with fewer kernels."""

import pytest
import torch

from moe_fp8 import FP8MoE, fp8_grouped_mm, valid_offsets
from moe_fp8.grouped_gemm.padding import padded_offsets
from moe_fp8.routing import make_dispatch_plan
from moe_fp8.testing.launches import count_launches


def test_registration_holds_while_unchanged():
    ids = torch.tensor([[0, 2], [2, 1], [9, 2]])  # a dropped pair (9 >= E)
    plan = make_dispatch_plan(ids, 3)
    offs = plan.offsets
    assert valid_offsets.is_valid(offs, plan.num_rows) and not valid_offsets.is_valid(offs, plan.num_rows - 1)
    assert not valid_offsets.is_valid(offs.clone(), plan.num_rows)  # another tensor, not registered
    calls = []

    def pad(o):
        calls.append(o)
        return padded_offsets(o)

    first = valid_offsets.padded_once(offs, pad)
    assert valid_offsets.padded_once(offs, pad) is first and len(calls) == 1
    assert torch.equal(first, padded_offsets(offs))
    offs.add_(0)  # written in place: no longer taken on trust
    assert not valid_offsets.is_valid(offs, plan.num_rows)
    assert valid_offsets.padded_once(offs, pad) is not first and len(calls) == 2


def test_inference_tensors_are_not_registered():
    """Under ``torch.inference_mode`` the plan's offsets are inference tensors, without a version
    counter: not registered, so the layer takes the checks, and runs (it raised before)."""
    ids = torch.tensor([[0, 2], [2, 1]])
    with torch.inference_mode():
        plan = make_dispatch_plan(ids, 3)
        assert plan.offsets.is_inference() and not valid_offsets.is_valid(plan.offsets, plan.num_rows)
        assert torch.equal(valid_offsets.padded_once(plan.offsets, padded_offsets), padded_offsets(plan.offsets))
        torch.manual_seed(0)
        moe = FP8MoE(32, 32, 4, 2, dtype=torch.bfloat16)
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        assert torch.equal(moe(x), moe(x.clone()))


def test_unregistered_offsets_are_still_checked():
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 16).bfloat16()
    with pytest.raises(ValueError, match="offs: expected non-decreasing"):
        fp8_grouped_mm(x, w, torch.tensor([5, 3], dtype=torch.int32), backend="emulated")
    with pytest.raises(ValueError, match=r"offs\[-1\] <= 8"):
        fp8_grouped_mm(x, w, torch.tensor([3, 9], dtype=torch.int32), backend="emulated")


def _layer_step(recipe: str, register: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not register:
            m.setattr(valid_offsets, "mark_valid", lambda offs, num_rows: offs)
        torch.manual_seed(0)
        moe = FP8MoE(32, 32, 4, 2, recipe=recipe, backend="triton").to(torch.bfloat16)
        x = torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True)
        with count_launches() as n:
            out = moe(x)
            out.float().square().sum().backward()
    return n, [out, x.grad, *(p.grad for p in moe.parameters())]


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["rowwise", "bf16"])
def test_layer_equal_with_fewer_kernels(recipe, monkeypatch):
    got_n, got = _layer_step(recipe, True, monkeypatch)
    want_n, want = _layer_step(recipe, False, monkeypatch)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # on CPU unregistered offsets are checked on the host: three reads per offsets tensor (the
    # forward's and the weight gradient's) per forward GEMM call
    assert want_n.ops["aten._local_scalar_dense"] == 12 and "aten._local_scalar_dense" not in got_n.ops
    padded = 1 if recipe == "rowwise" else 0  # the FP8 weight gradient's padded groups, once for both GEMMs
    assert got_n.ops["aten.cumsum"] == padded and want_n.ops["aten.cumsum"] == 2 * padded
