"""Every GEMM with an empty reduction gives exact zeros, whatever the memory it lands in held.

Empty reductions: the weight gradient over zero tokens (``FP8Linear``) or over an expert with no
rows (the grouped wgrad), and a grouped GEMM whose contracted dimension is 0 (``K = 0`` forward,
``N = 0`` dgrad). Before each such call the allocator is dirtied with NaN blocks of the result's
size (``moe_fp8.testing.allocator``), so a path that returns unwritten memory fails here instead of passing
by luck. CPU tests run in CI (the triton backend in the interpreter); ``gpu`` tests on the H200.
"""

from __future__ import annotations

import pytest
import torch

from moe_fp8 import fp8_grouped_mm
from moe_fp8.grouped_gemm import library as lib
from moe_fp8.grouped_gemm.backends import available_backends
from moe_fp8.grouped_gemm.backends.cuda import CudaBackend
from moe_fp8.grouped_gemm.tail import launch_zero_empty_groups_kernel, zero_empty_groups
from moe_fp8.layers.fp8_linear import fp8_linear
from moe_fp8.layers.scaled_mm import scaled_mm
from moe_fp8.testing.allocator import dirty_allocator

RECIPES = ("rowwise", "rowwise_gw_hp", "tensorwise", "blockwise", "bf16")
CPU_BACKENDS = ("emulated", pytest.param("triton", marks=pytest.mark.interpreter))
GPU_BACKENDS = ("cuda", "cuda_auto", "hybrid", "triton")


def _need_gpu(backend: str) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"the {backend} backend cannot run on this GPU")


def _zero(t: torch.Tensor) -> bool:
    return bool((t == 0).all()) and not t.isnan().any()  # NaN != 0 already; said for the reader


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", [(48, 64), (4, 16, 32), (4, 32, 48), (2, 48, 32)])
def test_dirty_allocator_leaves_garbage(device, shape):
    """The precondition of every test below: after dirtying, a fresh tensor of that size is not all
    zeros (NaN from the dirtier, or glibc's fill byte under ``MALLOC_PERTURB_``, as ``make test`` runs)."""
    dirty_allocator(device)
    assert (torch.empty(shape, dtype=torch.bfloat16, device=device) != 0).any()


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_linear_wgrad_over_no_tokens(recipe, device):
    x = torch.randn(0, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = torch.randn(48, dtype=torch.bfloat16, device=device, requires_grad=True)
    y = fp8_linear(x, w, b, recipe=recipe)
    dirty_allocator(device)
    y.backward(torch.randn_like(y))
    assert y.shape == (0, 48) and x.grad.shape == (0, 64) and _zero(w.grad) and _zero(b.grad)


def test_scaled_mm_empty_reduction():
    """The dense FP8 GEMM itself, ``(48, 0) @ (0, 64)``: the case torch 2.13's CPU kernel leaves unwritten."""
    a = torch.zeros(48, 0, dtype=torch.float8_e4m3fn)
    b = torch.zeros(64, 0, dtype=torch.float8_e4m3fn)
    for a_s, b_s in ((torch.ones(48, 1), torch.ones(64, 1)), (torch.ones(()), torch.ones(()))):
        dirty_allocator()
        out = scaled_mm(a, a_s, b, b_s, torch.bfloat16)
        assert out.shape == (48, 64) and _zero(out)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_does_not_trust_the_library_with_no_tokens(recipe, monkeypatch):
    """``torch._scaled_mm`` replaced by a GEMM that writes NaN everywhere (what an unwritten output
    holds): the wgrad over zero tokens is still zeros, made by ``scaled_mm`` itself."""
    def garbage(a, b, *args, out_dtype=torch.bfloat16, **kwargs):
        return torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", garbage)
    x = torch.randn(0, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    fp8_linear(x, w, recipe=recipe).backward(torch.randn(0, 48, dtype=torch.bfloat16))
    assert _zero(w.grad)


def _grouped(M, K, N, offs, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(len(offs), N, K, generator=gen) * 0.1).to(device, torch.bfloat16).requires_grad_()
    return x, w, torch.tensor(offs, dtype=torch.int32, device=device)


def _check_grouped_empty_reductions(recipe: str, backend: str, device: str) -> None:
    # wgrad of empty experts (first, middle, last) with rows past offs[-1]
    x, w, offs = _grouped(40, 32, 48, [0, 12, 12, 33], device)
    y = fp8_grouped_mm(x, w, offs, recipe=recipe, backend=backend)
    dirty_allocator(device)
    (dw,) = torch.autograd.grad(y, (w,), torch.randn_like(y))
    assert _zero(dw[0]) and _zero(dw[2]), "empty experts' weight gradients"
    assert dw[1].abs().sum() > 0 and dw[3].abs().sum() > 0
    # no rows at all
    x, w, offs = _grouped(0, 32, 48, [0, 0, 0, 0], device)
    y = fp8_grouped_mm(x, w, offs, recipe=recipe, backend=backend)
    dirty_allocator(device)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert y.shape == (0, 48) and dx.shape == (0, 32) and _zero(dw)
    # every expert empty, rows present
    x, w, offs = _grouped(32, 32, 48, [0, 0, 0, 0], device)
    y = fp8_grouped_mm(x, w, offs, recipe=recipe, backend=backend)
    dirty_allocator(device)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert _zero(y) and _zero(dx) and _zero(dw)
    # K = 0: the forward contracts over nothing
    x, w, offs = _grouped(24, 0, 32, [10, 24], device)
    dirty_allocator(device)
    y = fp8_grouped_mm(x, w, offs, recipe=recipe, backend=backend)
    assert y.shape == (24, 32) and _zero(y)
    # N = 0: the dgrad contracts over nothing
    x, w, offs = _grouped(24, 32, 0, [10, 24], device)
    y = fp8_grouped_mm(x, w, offs, recipe=recipe, backend=backend)
    dirty_allocator(device)
    (dx,) = torch.autograd.grad(y, (x,), torch.randn_like(y))
    assert dx.shape == (24, 32) and _zero(dx)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_mm_empty_reductions_cpu(recipe, backend):
    _check_grouped_empty_reductions(recipe, backend, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_mm_empty_reductions_gpu(recipe, backend):
    _need_gpu(backend)
    _check_grouped_empty_reductions(recipe, backend, "cuda")


def _garbage_groups(E=5, N=16, K=48, device="cpu"):
    out = torch.full((E, N, K), float("nan"), dtype=torch.bfloat16, device=device)
    out[1] = 1.0
    out[3] = 2.0
    offs = torch.tensor([0, 7, 7, 20, 20], dtype=torch.int32, device=device)  # groups 0, 2, 4 empty
    return out, offs


def _check_zeroed_empty_groups(out: torch.Tensor) -> None:
    assert _zero(out[0]) and _zero(out[2]) and _zero(out[4])
    assert bool((out[1] == 1).all()) and bool((out[3] == 2).all())


@pytest.mark.parametrize("launch", [zero_empty_groups, pytest.param(launch_zero_empty_groups_kernel,
                                                                     marks=pytest.mark.interpreter)])
def test_zero_empty_groups(launch):
    out, offs = _garbage_groups()
    _check_zeroed_empty_groups(launch(out, offs))


@pytest.mark.gpu
def test_zero_empty_groups_gpu():
    out, offs = _garbage_groups(N=1000, K=1024, device="cuda")  # more elements than the grid covers at once
    _check_zeroed_empty_groups(zero_empty_groups(out, offs))


def test_library_grouped_gemms_are_not_trusted_with_empty_groups(monkeypatch):
    """The cuda backend's wgrad and the BF16 wgrad zero empty groups themselves: here the library
    GEMM is replaced by one that writes NaN everywhere (what an unwritten output may hold)."""
    def garbage(*args, **kwargs):
        E, N, K = 5, 16, 48
        return torch.full((E, N, K), float("nan"), dtype=torch.bfloat16)

    offs = torch.tensor([0, 7, 7, 20, 20], dtype=torch.int32)
    monkeypatch.setattr(CudaBackend, "_call", garbage)
    q = torch.zeros(20, 16, dtype=torch.float8_e4m3fn)
    out = CudaBackend().mm_2d2d(q, torch.ones(5, 16), q[:, :0].new_zeros(20, 48), torch.ones(5, 48), offs,
                                torch.bfloat16)
    assert _zero(out[0]) and _zero(out[2]) and _zero(out[4]) and out[1].isnan().all()
    monkeypatch.setattr(torch, "_grouped_mm", garbage)
    out = lib.bf16_mm_2d2d("emulated", torch.zeros(20, 16, dtype=torch.bfloat16),
                           torch.zeros(20, 48, dtype=torch.bfloat16), offs)
    assert _zero(out[0]) and _zero(out[2]) and _zero(out[4]) and out[1].isnan().all()
