"""Permute, fused permute + rowwise FP8 quantization, and both from one launch: bit-exact against
reference permute + quantizer."""

from __future__ import annotations

import pytest
import torch

import moe_fp8.routing.permute_ops as permute_mod
from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ, E5M2
from moe_fp8.quant.formats import FORMATS as ALL_FORMATS
from moe_fp8.quant.reference import amax_to_scales, quantize_rowwise
from moe_fp8.routing import make_dispatch_plan, padding_scale, permute, permute_quantize, permute_with_fp8
from moe_fp8.testing.allocator import dirty_allocator
from moe_fp8.kernel_backend import use_triton
from moe_fp8.routing.permute_kernels import permute_rows_kernel
from moe_fp8.routing.reference import permute_reference

from quant_kernel_cases import FNUZ_OK
from test_routing_plan import random_topk_ids

# Against the references: with CPU tensors the kernels run only in the interpreter (elsewhere the
# module would fall back to the reference itself and the comparison would prove nothing).
pytestmark = pytest.mark.interpreter

FORMATS = [E4M3FN, E5M2, pytest.param(E4M3FNUZ, marks=pytest.mark.skipif(not FNUZ_OK, reason="fnuz needs triton >= 3.8 in the interpreter"))]


def test_kernels_run_in_this_session():
    if not use_triton(permute_rows_kernel, torch.empty(0)):
        pytest.skip("CPU without TRITON_INTERPRET=1: the torch fallback runs instead of the kernels")


def activations(T, H, seed, dtype=torch.bfloat16):
    """Rows spanning many magnitudes (incl. subnormal-range values after scaling), one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-12, 12, (T, 1), generator=g).float())
    x[:, ::7] *= 1e-4
    if T > 2:
        x[1] = 0
    return x.to(dtype)


def assert_same_fp8(q, s, q_ref, s_ref):
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "fp8 bytes differ"
    assert torch.equal(s, s_ref), "scales differ"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", str(f)))
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("P", [1, 16])
def test_permute_quantize_bit_exact(fmt, pow2, P):
    T, E, k, H = 21, 8, 3, 96
    ids = random_topk_ids(T, E, k, "skewed", seed=P)
    plan = make_dispatch_plan(ids, E, pad_multiple=P)
    x = activations(T, H, seed=int(pow2))
    q, s = permute_quantize(x, plan, fmt, pow2=pow2)
    src = torch.where(plan.row_to_pair < 0, T, plan.row_to_pair.long() // k)
    x_rows = torch.cat([x, x.new_zeros(1, H)])[src]  # reference permute: padding rows are zero
    assert_same_fp8(q, s, *quantize_rowwise(x_rows, fmt, pow2=pow2))
    pad = plan.pad_rows.long()
    # through float: torch 2.9 has no FP8 indexing on CPU
    assert (q.float()[pad] == 0).all() and (s[pad] == padding_scale(fmt, pow2)).all()


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("name", sorted(ALL_FORMATS))
def test_padding_scale_is_the_scale_of_a_zero_amax_without_tensor_ops(name, pow2):
    """Bitwise the reference's scale of a zero amax, and computed on the host alone: under a fake
    tensor mode (what torch.compile traces in) a tensor op would make it data-dependent."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fmt = ALL_FORMATS[name]
    want = amax_to_scales(torch.zeros(()), fmt, pow2)[1]
    padding_scale.cache_clear()
    with FakeTensorMode():
        got = padding_scale(fmt, pow2)
    assert torch.equal(torch.tensor(got, dtype=torch.float32), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_permute_quantize_other_input_dtypes_and_odd_width(dtype):
    T, E, k, H = 13, 5, 2, 37
    ids = random_topk_ids(T, E, k, "empty", seed=4)
    plan = make_dispatch_plan(ids, E, pad_multiple=4)
    x = activations(T, H, seed=5, dtype=dtype)
    assert_same_fp8(*permute_quantize(x, plan, E4M3FN), *quantize_rowwise(permute_reference(x, plan.row_to_pair, k), E4M3FN))


def test_two_pass_path_for_wide_rows(monkeypatch):
    """Rows wider than one register block take an amax pass first: same bytes."""
    monkeypatch.setattr(permute_mod, "_MAX_SINGLE_BLOCK", 64)
    monkeypatch.setattr(permute_mod, "_CHUNK", 64)
    T, E, k, H = 9, 4, 2, 200
    plan = make_dispatch_plan(random_topk_ids(T, E, k, "balanced", seed=6), E, pad_multiple=16)
    x = activations(T, H, seed=7)
    assert_same_fp8(*permute_quantize(x, plan, E4M3FN), *quantize_rowwise(permute_reference(x, plan.row_to_pair, k), E4M3FN))
    assert torch.equal(permute(x, plan), permute_reference(x, plan.row_to_pair, k))


@pytest.mark.parametrize("kind", ["balanced", "one", "empty"])
@pytest.mark.parametrize("P", [1, 16])
def test_bf16_permute_matches_reference(kind, P):
    T, E, k, H = 30, 6, 2, 48
    plan = make_dispatch_plan(random_topk_ids(T, E, k, kind, seed=8), E, pad_multiple=P)
    x = activations(T, H, seed=9)
    out = permute(x, plan)
    assert torch.equal(out, permute_reference(x, plan.row_to_pair, k))
    assert (out[plan.pad_rows.long()] == 0).all()


def test_bf16_permute_gradient_sums_the_copies():
    T, E, k, H = 11, 4, 3, 16
    plan = make_dispatch_plan(random_topk_ids(T, E, k, "balanced", seed=10), E, pad_multiple=8)
    x = torch.randn(T, H, dtype=torch.float32, requires_grad=True)
    g = torch.randn(plan.num_rows, H)
    (grad,) = torch.autograd.grad(permute(x, plan), x, g)
    x64 = x.detach().double().requires_grad_()
    (grad64,) = torch.autograd.grad(permute_reference(x64, plan.row_to_pair, k), x64, g.double())
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [0, 1])
def test_zero_and_one_token(T):
    E, k, H = 4, 2, 32
    plan = make_dispatch_plan(random_topk_ids(T, E, k, "balanced", seed=T), E, pad_multiple=16)
    x = activations(T, H, seed=11)
    q, s = permute_quantize(x, plan, E4M3FN)
    assert q.shape == (plan.num_rows, H) and s.shape == (plan.num_rows,)
    assert_same_fp8(q, s, *quantize_rowwise(permute_reference(x, plan.row_to_pair, k), E4M3FN))
    assert torch.equal(permute(x, plan), permute_reference(x, plan.row_to_pair, k))


def test_deterministic_and_non_contiguous_input():
    T, E, k, H = 17, 8, 4, 64
    plan = make_dispatch_plan(random_topk_ids(T, E, k, "skewed", seed=12), E, pad_multiple=16)
    x = activations(T, 2 * H, seed=13)[:, ::2]  # strided rows
    a, b = permute_quantize(x, plan, E4M3FN), permute_quantize(x, plan, E4M3FN)
    assert_same_fp8(*a, *b)
    assert_same_fp8(*a, *quantize_rowwise(permute_reference(x.contiguous(), plan.row_to_pair, k), E4M3FN))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", str(f)))
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("T, kind, P, wide, dtype", [(21, "skewed", 1, False, torch.bfloat16),
                                                     (21, "empty", 16, False, torch.bfloat16),
                                                     (9, "balanced", 16, True, torch.bfloat16),
                                                     (13, "one", 4, False, torch.float32),
                                                     (0, "balanced", 16, False, torch.bfloat16)])
def test_permute_with_fp8_equals_the_two_calls(fmt, pow2, T, kind, P, wide, dtype, monkeypatch):
    """One launch writes what ``permute`` and ``permute_quantize`` write (padding rows included, on a
    dirtied allocator), and the rows' gradient is ``permute``'s."""
    if wide:  # rows wider than one register block: the amax pass first
        monkeypatch.setattr(permute_mod, "_MAX_SINGLE_BLOCK", 64)
        monkeypatch.setattr(permute_mod, "_CHUNK", 64)
    E, k, H = 6, 3, 200 if wide else 48
    plan = make_dispatch_plan(random_topk_ids(T, E, k, kind, seed=15), E, pad_multiple=P)
    x = activations(T, H, seed=16, dtype=dtype).requires_grad_()
    dirty_allocator()
    rows, (q, s) = permute_with_fp8(x, plan, fmt, pow2=pow2)
    assert rows.dtype == dtype and torch.equal(rows, permute(x, plan))
    assert_same_fp8(q, s, *permute_quantize(x.detach(), plan, fmt, pow2=pow2))
    assert not q.requires_grad and not s.requires_grad
    g = torch.randn(plan.num_rows, H, dtype=dtype)
    (got,) = torch.autograd.grad(rows, x, g)
    (want,) = torch.autograd.grad(permute(x, plan), x, g)
    assert torch.equal(got, want)


def test_custom_ops_pass_opcheck():
    T, E, k, H = 6, 4, 2, 16
    plan = make_dispatch_plan(random_topk_ids(T, E, k, "balanced", seed=14), E, pad_multiple=4)
    x = torch.randn(T, H, requires_grad=True)
    tensors = (plan.pair_to_row, plan.row_to_pair, plan.pad_rows)
    torch.library.opcheck(torch.ops.moe_fp8.routing_permute.default, (x, *tensors, k))
    torch.library.opcheck(torch.ops.moe_fp8.routing_permute_quantize.default, (x.detach(), *tensors, k, "e4m3fn", False))
    both = torch.ops.moe_fp8.routing_permute_both.default
    torch.library.opcheck(both, (x.detach(), *tensors, k, "e4m3fn", True))
    # with a gradient: its AOT check would sum the FP8 outputs, which CPU torch cannot
    torch.library.opcheck(both, (x, *tensors, k, "e4m3fn", True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_bad_input():
    plan = make_dispatch_plan(random_topk_ids(5, 4, 2, "balanced"), 4)
    with pytest.raises(ValueError, match="x: expected 5 tokens"):
        permute_quantize(torch.randn(6, 8), plan)
    with pytest.raises(TypeError, match="x"):
        permute(torch.zeros(5, 8, dtype=torch.int32), plan)
    with pytest.raises(ValueError, match="x"):
        permute(torch.zeros(5, 8, 2), plan)
    with pytest.raises(TypeError, match="plan"):
        permute(torch.zeros(5, 8), tuple(plan))
    with pytest.raises(ValueError, match="fmt"):
        permute_quantize(torch.zeros(5, 8), plan, "e4m3")
