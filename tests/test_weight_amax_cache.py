"""The amax-only weight cache (``Fp8WeightCache(copies=False)``): weight states' amaxes over K
and over N (``triton_expert_amax``, one read), from which both ``rowwise`` GEMMs quantize the BF16
weight's tiles as they read them, where the groups are small.

The forward GEMM then computes the transposed product of the layout + GEMM path (fp32 sums in
another order, one bf16 rounding): outputs agree to one bf16 rounding, the input gradient (the same
in-GEMM dgrad either way) and the weight gradient (the same operands) bit for bit. Fresh random
data, empty experts and skewed routing; the freed blocks are dirtied first.
"""

from __future__ import annotations

import pytest
import torch

from moe_fp8 import FP8MoE, Fp8WeightCache, fp8_grouped_mm
from moe_fp8.grouped_gemm import compiled_weight_cache
from moe_fp8.grouped_gemm.backends.triton_backend import TritonBackend
from moe_fp8.kernel_backend import interpreter_enabled
from moe_fp8.quant import reference as ref
from moe_fp8.quant.ops import triton_expert_amax
from moe_fp8.testing import random_offsets
from moe_fp8.testing.allocator import dirty_allocator
from moe_fp8.testing.launches import count_launches

needs_cpu_kernel = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
IN_GEMM = "triton:_grouped_mm_dgrad_quantize_w_kernel"


@needs_cpu_kernel
@pytest.mark.parametrize(("E", "N", "K", "stored_transposed"), [(3, 48, 32, False), (2, 1, 16, False),
                                                                (4, 40, 64, True), (1, 300, 128, False)])
def test_expert_amax_kernel_is_the_reference(E, N, K, stored_transposed):
    gen = torch.Generator().manual_seed(E * N + K)
    shape = (E, K, N) if stored_transposed else (E, N, K)
    w = torch.randn(shape, generator=gen)
    w = w.transpose(1, 2) if stored_transposed else w
    w = (w * 3).bfloat16()
    w[0].zero_()  # an expert of zeros: amaxes of 0
    dirty_allocator()
    with count_launches() as n:
        row, col = triton_expert_amax(w)
    assert torch.equal(row, ref.expert_amax(w)) and torch.equal(col, ref.expert_amax(w, transposed=True))
    assert n.ops.get("triton:_expert_amax_kernel") == 1


@needs_cpu_kernel
def test_expert_amax_reads_the_storage_rows():
    """A transposed view of ``(E, K, N)`` storage with ``K`` past the one-read limit: the kernel
    reads the storage's rows of ``N``."""
    w = torch.randn(2, 16400, 32).bfloat16().transpose(1, 2)
    row, col = triton_expert_amax(w)
    assert torch.equal(row, ref.expert_amax(w)) and torch.equal(col, ref.expert_amax(w, transposed=True))


def _problem(stored_transposed: bool, kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(60, 48, generator=gen).bfloat16().requires_grad_()
    shape = (4, 48, 32) if stored_transposed else (4, 32, 48)
    param = torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16())
    offs = random_offsets(56, 4, kind, generator=gen)
    dy = torch.randn(60, 32, generator=gen).bfloat16()
    return x, param, offs, dy


def _run(x, param, offs, dy, stored_transposed, cache):
    x.grad = param.grad = None
    w = param.transpose(1, 2) if stored_transposed else param
    dirty_allocator()
    with count_launches() as n:
        out = fp8_grouped_mm(x, w, offs, backend="triton", weight_cache=cache)
        out.backward(dy)
    return out, x.grad, param.grad, n.ops


def _assert_one_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 results of fp32 sums in two orders: at most one bf16 step apart."""
    assert not torch.isnan(a).any()
    gap = (a.float() - b.float()).abs()
    assert bool((gap <= b.float().abs() * 2**-7 + 1e-30).all())


@needs_cpu_kernel
@pytest.mark.parametrize("stored_transposed", [False, True])
@pytest.mark.parametrize("kind", ["skewed", "empty"])
def test_gemms_read_the_weight_with_kept_amaxes(stored_transposed, kind):
    """Small groups, forwards with gradients: the first forward of a weight state keeps nothing and
    runs as without a cache; the second reads the weight once for its amaxes, and from then on no
    layout kernel runs, the in-GEMM kernel twice (forward, dgrad); a new state after a state that
    served two forwards keeps its amaxes at once. Results equal the uncached path's."""
    x, param, offs, dy = _problem(stored_transposed, kind, seed=5)
    cache = Fp8WeightCache(copies=False)
    E, N, K = 4, 32, 48

    def compare(amax_reads: int | None):
        out0, dx0, dw0, ops0 = _run(x, param, offs, dy, stored_transposed, None)
        out1, dx1, dw1, ops = _run(x, param, offs, dy, stored_transposed, cache)
        if amax_reads is None:  # kept nothing: the uncached path itself
            assert ops == ops0 and torch.equal(out1, out0)
        else:
            assert ops.get("triton:_expert_amax_kernel", 0) == amax_reads and ops.get(IN_GEMM) == 2, sorted(ops)
            # no weight layout, nor the FP8 GEMM that reads it; the wgrad's operands as before. The
            # uncached forward layout: one kernel, or for (E, K, N) storage the amaxes, then the
            # storage's column-wise layout
            if stored_transposed:
                assert ops0["triton:_expert_amax_kernel"] == 1
            else:
                assert ops0["triton:_expert_rowwise_col_amax_kernel"] == 1
            assert ops0["triton:_colwise_kernel"] == ops["triton:_colwise_kernel"] + stored_transposed
            assert ops0["triton:_grouped_mm_2d3d_kernel"] == 1 and "triton:_grouped_mm_2d3d_kernel" not in ops
            assert "triton:_expert_rowwise_col_amax_kernel" not in ops
            _assert_one_rounding(out1, out0)
        assert torch.equal(dx1, dx0) and torch.equal(dw1, dw0)

    compare(None)
    assert cache.nbytes == 0 and (cache.misses, cache.hits) == (1, 0)
    compare(1)
    assert cache.nbytes == 4 * (E * N + E * K) and (cache.misses, cache.hits) == (2, 0)
    compare(0)
    assert (cache.misses, cache.hits) == (2, 1)
    with torch.no_grad():
        param.mul_(-2.5)
    compare(1)
    assert (cache.misses, cache.hits) == (3, 1)


@needs_cpu_kernel
def test_large_groups_run_as_without_a_cache(monkeypatch):
    x, param, offs, dy = _problem(False, "skewed", seed=6)
    monkeypatch.setattr(TritonBackend, "quantize_w_max_rows_per_group", 0)
    cache = Fp8WeightCache(copies=False)
    want = _run(x, param, offs, dy, False, None)
    for _ in range(3):
        got = _run(x, param, offs, dy, False, cache)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])) and got[3] == want[3]
    assert len(cache) == 0


@needs_cpu_kernel
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_gw_hp"])
def test_other_recipes(recipe):
    """Only row scales read the amaxes (``rowwise_gw_hp`` too: its wgrad is BF16 either way)."""
    x, param, offs, dy = _problem(False, "skewed", seed=7)
    cache = Fp8WeightCache(copies=False)
    outs = []
    for c in (None, cache, cache):
        x.grad = param.grad = None
        out = fp8_grouped_mm(x, param, offs, recipe=recipe, backend="triton", weight_cache=c)
        out.backward(dy)
        outs.append((out, x.grad, param.grad))
    assert cache.nbytes == (4 * 4 * (32 + 48) if recipe == "rowwise_gw_hp" else 0)
    outs.pop(1)
    _assert_one_rounding(outs[1][0], outs[0][0])
    assert torch.equal(outs[1][1], outs[0][1]) and torch.equal(outs[1][2], outs[0][2])


def _moe(cache_weights: bool, seed: int) -> FP8MoE:
    torch.manual_seed(seed)
    return FP8MoE(64, 32, 8, 2, backend="triton", cache_weights=cache_weights, dtype=torch.bfloat16)


@needs_cpu_kernel
@pytest.mark.slow(5)
@pytest.mark.parametrize("compiled", [False, True])
def test_uncached_module_keeps_amaxes_only(compiled):
    """``cache_weights=False``: eager and compiled (aot_eager), three micro-batches of one weight
    state: the amaxes are the only bytes held, kept from the second, and every output matches the
    module that keeps FP8 copies to one rounding."""
    amax_only, copies = _moe(False, 3), _moe(True, 3)
    copies.load_state_dict(amax_only.state_dict())
    torch._dynamo.reset()
    run = torch.compile(amax_only, fullgraph=True, backend="aot_eager") if compiled else amax_only
    before = compiled_weight_cache().hits
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(24, 64, generator=gen).bfloat16().requires_grad_()
        a, b = run(x), copies(x)
        _assert_one_rounding(a, b)
        a.float().square().sum().backward()
    E, H, I = 8, 64, 32
    held = amax_only.experts.weight_cache_nbytes
    assert held == 4 * E * (2 * I + H) + 4 * E * (H + I)
    # per weight: the third forward; compiled, the last two dgrads too (the eager dgrad takes the saved amax)
    if compiled:
        assert compiled_weight_cache().hits - before == 2 * 3
    else:
        assert [(c.misses, c.hits) for c in amax_only.experts._caches] == [(2, 1), (2, 1)]


@needs_cpu_kernel
def test_fsdp_managed_module_keeps_amaxes_under_a_stamp():
    """Experts that FSDP gathers read the amax-only caches only once ``parallelize``'s pre-hook keys
    them on the sharded state (``_stamp_caches``): unkeyed, nothing is kept; keyed, the amaxes are
    kept from a state's second forward, and an in-place update (a new stamp) is never served the
    old state's amaxes. Outputs match the same module without caches to one rounding."""
    from moe_fp8.parallel.fsdp import _stamp_caches

    stamped, plain = _moe(False, 5), _moe(False, 5)
    for m in (stamped, plain):
        m.experts._is_fsdp_managed_module = True
    gen = torch.Generator().manual_seed(6)

    def forwards(n: int, stamp: bool) -> None:
        for _ in range(n):
            if stamp:
                _stamp_caches([stamped.experts], stamped, ())
            x = torch.randn(24, 64, generator=gen).bfloat16()
            with torch.no_grad():
                _assert_one_rounding(stamped(x), plain(x))

    forwards(3, stamp=False)
    assert [(c.misses, c.hits, len(c)) for c in stamped.experts._caches] == [(0, 0, 0)] * 2
    forwards(3, stamp=True)
    assert [(c.misses, c.hits) for c in stamped.experts._caches] == [(2, 1)] * 2
    with torch.no_grad():
        for m in (stamped, plain):
            m.experts.gate_up_proj.mul_(4.0)
            m.experts.down_proj.mul_(0.25)
    forwards(2, stamp=True)
    assert [(c.misses, c.hits) for c in stamped.experts._caches] == [(4, 1)] * 2
    assert all(len(c) == 0 for c in plain.experts._caches)


# ---- GPU: the sizes it runs at ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("stored_transposed", [False, True])
def test_gpu_expert_amax_kernel(stored_transposed):
    """Qwen3-30B-A3B's gate_up weight (128 x 1536 x 2048), and Llama 4's transposed storage."""
    E, N, K = 128, 1536, 2048
    gen = torch.Generator(device="cuda").manual_seed(1)
    shape = (E, K, N) if stored_transposed else (E, N, K)
    w = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = w.transpose(1, 2) if stored_transposed else w
    w[3].zero_()
    dirty_allocator("cuda")
    row, col = triton_expert_amax(w)
    assert torch.equal(row, ref.expert_amax(w)) and torch.equal(col, ref.expert_amax(w, transposed=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["cuda_auto", "triton"])
@pytest.mark.parametrize("kind", ["skewed", "empty"])
def test_gpu_gemms_with_kept_amaxes(backend, kind):
    """Qwen3-30B-A3B's down GEMM at a quarter of its rows (16384 over 128 experts): the amax-only
    cache against no cache, outputs to one rounding, both gradients bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    M, E, N, K = 16400, 128, 2048, 768
    x = torch.randn(M, K, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    param = torch.nn.Parameter(torch.randn(E, N, K, generator=gen, device="cuda", dtype=torch.bfloat16) / K**0.5)
    offs = random_offsets(16384, E, kind, generator=torch.Generator().manual_seed(3)).cuda()
    dy = torch.randn(M, N, generator=gen, device="cuda", dtype=torch.bfloat16)
    cache = Fp8WeightCache(copies=False)
    got = []
    for c in (None, cache, cache):
        x.grad = param.grad = None
        dirty_allocator("cuda")
        out = fp8_grouped_mm(x, param, offs, backend=backend, weight_cache=c)
        out.backward(dy)
        got.append((out, x.grad, param.grad))
    assert cache.nbytes == 4 * E * (N + K)  # kept by the second forward, which read the weight through them
    _assert_one_rounding(got[2][0], got[0][0])
    assert torch.equal(got[2][1], got[0][1]) and torch.equal(got[2][2], got[0][2])
