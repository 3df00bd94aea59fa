"""fp8_grouped_mm on a CUDA GPU (``pytest -m gpu``): cuda and triton backends against the exact
emulated reference on large ragged shapes, no host syncs, CUDA-graph capture and replay,
torch.compile(fullgraph=True), argument errors before any launch, and degenerate routings (each
in its own process: a device-side assert would poison the CUDA context of the others)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from moe_fp8 import fp8_grouped_mm
from moe_fp8.grouped_gemm import available_backends
from moe_fp8.testing import random_offsets, sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP8_RECIPES = ("rowwise", "rowwise_gw_hp", "tensorwise", "blockwise")
RECIPES = (*FP8_RECIPES, "bf16")
GPU_BACKENDS = ("cuda", "cuda_auto", "hybrid", "triton")


def need(backend: str) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"the {backend} backend cannot run on this GPU")


def inputs(M, K, N, E, used, kind="skewed", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(E, N, K, generator=gen) * 0.02).to("cuda", torch.bfloat16).requires_grad_()
    g = torch.randn(M, N, generator=gen).to("cuda", torch.bfloat16)
    offs = random_offsets(used, E, kind, generator=gen, device="cuda")  # ragged, empty experts too
    return x, w, g, offs


def fwd_bwd(x, w, g, offs, **kw):
    y = fp8_grouped_mm(x, w, offs, **kw)
    return (y, *torch.autograd.grad(y, (x, w), g))


LARGE = dict(M=4096, K=1536, N=1024, E=16, used=4000)  # 96 tail rows, groups not multiples of 16


@pytest.fixture(scope="module")
def large_case():
    x, w, g, offs = inputs(**LARGE, kind="skewed", seed=1)
    offs[3] = offs[2]  # one empty expert for sure
    offs[7] = offs[6]
    return x, w, g, offs


# N and K multiples of 16 but not of 128: the last column tile, the last K slice (1104 = 8*128 + 80,
# 1040 = 8*128 + 16 for dgrad) and the last 128x128 scale block of every GEMM are partial.
ODD = dict(M=2000, K=1104, N=1040, E=8, used=1900)


@pytest.fixture(scope="module")
def odd_case():
    return inputs(**ODD, kind="empty", seed=8)  # 2 empty experts


@pytest.fixture(scope="module")
def emulated_results(large_case, odd_case):
    """The emulated backend's ``(out, dgrad, wgrad)`` per case and FP8 recipe (computed once)."""
    return {(case, r): fwd_bwd(*data, recipe=r, backend="emulated")
            for case, data in (("large", large_case), ("odd", odd_case)) for r in FP8_RECIPES}


@pytest.mark.parametrize("case", ["large", "odd"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_matches_emulated(backend, recipe, case, large_case, odd_case, emulated_results):
    """Every GPU backend against the emulated one (same FP8 operands: only accumulation, fast on
    cuda, and summation order differ): >= 40 dB on out, dgrad and wgrad; rows past the groups 0;
    empty experts' dw 0. Cases: large ragged shapes, and partial tiles (``ODD``)."""
    need(backend)
    data, used = (large_case, LARGE["used"]) if case == "large" else (odd_case, ODD["used"])
    got = fwd_bwd(*data, recipe=recipe, backend=backend)
    for name, a, b in zip(("out", "dgrad", "wgrad"), got, emulated_results[case, recipe]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert sqnr(b, a) >= 40, f"{name}: {sqnr(b, a):.1f} dB against the emulated reference"
    assert torch.all(got[0][used:] == 0) and torch.all(got[1][used:] == 0)
    offs = data[3]
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    assert bool(empty.any()) and bool((got[2][empty] == 0).all())


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_rowwise_against_fp64(backend, large_case):
    need(backend)
    x, w, g, offs = large_case
    y, dx, dw = fwd_bwd(x, w, g, offs, recipe="rowwise", backend=backend)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    parts, start = [], 0
    for e, end in enumerate(offs.tolist()):
        parts.append(x64[start:end] @ w64[e].T)
        start = end
    ref = torch.cat([*parts, x64.new_zeros(x.shape[0] - start, w.shape[1])])
    rdx, rdw = torch.autograd.grad(ref, (x64, w64), g.double())
    assert sqnr(ref, y) >= 28 and sqnr(rdx, dx) >= 28 and sqnr(rdw, dw) >= 25


@pytest.mark.parametrize("case", ["large", "odd"])
def test_bf16_recipe_matches_torch(case, large_case, odd_case):
    """The bf16 recipe on skewed groups of any size (no padding) gives torch's own ``_grouped_mm``
    forward and autograd gradients bit for bit, and its gradients match fp64."""
    (x, w, g, offs), used = (large_case, LARGE["used"]) if case == "large" else (odd_case, ODD["used"])
    xt, wt = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = torch._grouped_mm(xt, wt.transpose(-2, -1), offs=offs)
    dx, dw = torch.autograd.grad(y, (xt, wt), g)
    xo, wo = x.detach().requires_grad_(), w.detach().requires_grad_()
    y2 = fp8_grouped_mm(xo, wo, offs, recipe="bf16", backend="cuda")
    dx2, dw2 = torch.autograd.grad(y2, (xo, wo), g)
    assert torch.equal(y[:used], y2[:used]) and torch.all(y2[used:] == 0)
    assert torch.equal(dx[:used], dx2[:used]) and torch.equal(dw, dw2)
    x64, w64 = x.detach().double(), w.detach().double()
    bounds = [0, *offs.tolist()]
    rdw = torch.stack([g[s:e].double().T @ x64[s:e] for s, e in zip(bounds[:-1], bounds[1:])])
    assert sqnr(rdw, dw2) >= 40 and w64.shape == dw2.shape


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_host_sync(backend, recipe):
    need(backend)
    x, w, g, offs = inputs(1024, 512, 256, 8, 1000, seed=2)
    fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)  # compile / autotune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_capture_and_replay(backend, recipe):
    need(backend)
    x, w, g, offs = inputs(1024, 512, 256, 8, 1000, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)
    # New data and a new routing in the same buffers, then replay.
    x2, w2, g2, offs2 = inputs(1024, 512, 256, 8, 990, kind="empty", seed=4)
    with torch.no_grad():
        x.copy_(x2)
        w.copy_(w2)
        g.copy_(g2)
        offs.copy_(offs2)
    graph.replay()
    torch.cuda.synchronize()
    want = fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)
    for a, b in zip(static, want):
        assert torch.equal(a, b)


# Inductor compiles take ~10 s each: the recipes' paths are traced on the CPU (aot_eager) for all.
@pytest.mark.parametrize(
    "backend, recipe",
    [("cuda", "rowwise"), ("hybrid", "rowwise"), ("triton", "rowwise"), ("cuda", "bf16")],
)
def test_compile_fullgraph(backend, recipe):
    need(backend)
    x, w, g, offs = inputs(512, 256, 128, 4, 500, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_grouped_mm, fullgraph=True)
    y = compiled(x, w, offs, recipe=recipe, backend=backend)
    got = (y, *torch.autograd.grad(y, (x, w), g))
    want = fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_errors_before_launch():
    x, w, _, offs = inputs(64, 32, 32, 2, 64)
    with pytest.raises(ValueError, match="offs"):
        fp8_grouped_mm(x, w, offs.cpu())
    with pytest.raises(ValueError, match="device"):
        fp8_grouped_mm(x, w.cpu(), offs)
    with pytest.raises(ValueError, match="K"):
        fp8_grouped_mm(x[:, :24], w[:, :, :24], offs)
    with pytest.raises(ValueError, match="cuda"):
        fp8_grouped_mm(x.cpu(), w.cpu(), offs.cpu(), backend="cuda")
    if "cuda" in available_backends("cuda"):
        big = torch.zeros(1024, 16, 32, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="1023"):
            fp8_grouped_mm(x, big, torch.zeros(1024, device="cuda", dtype=torch.int32), backend="cuda")
    torch.cuda.synchronize()


_DEGENERATE = textwrap.dedent(
    """
    import sys
    import torch
    from moe_fp8 import fp8_grouped_mm
    from moe_fp8.testing import sqnr
    backend = sys.argv[1]
    cases = {
        "no_rows": (0, [0, 0, 0, 0]),
        "all_experts_empty": (48, [0, 0, 0, 0]),
        "one_expert": (77, [0, 77, 77, 77]),
        "bad_offsets_clamped": (64, [40, 20, 100, 64]),
    }

    def fwd_bwd(x, w, o, recipe, backend):
        y = fp8_grouped_mm(x, w, o, recipe=recipe, backend=backend)
        return (y, *torch.autograd.grad(y, (x, w), torch.ones_like(y)))

    torch.manual_seed(0)
    for recipe in sys.argv[2:]:
        for name, (M, offs) in cases.items():
            x = torch.randn(M, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            o = torch.tensor(offs, device="cuda", dtype=torch.int32)
            got = fwd_bwd(x, w, o, recipe, backend)
            torch.cuda.synchronize()
            # The op clamps GPU offsets it does not check into [0, M], then takes a running max:
            # the emulated backend runs on those groups.
            ref_offs = torch.cummax(o.clamp(0, M), 0).values
            want = fwd_bwd(x, w, ref_offs, recipe, "emulated")
            assert got[0].shape == (M, 32), name
            ends = ref_offs.tolist()
            rows = [slice(s, e) for s, e in zip([0] + ends[:-1], ends)] + [slice(ends[-1], M)]
            # Per group (rows of out and dx, experts of dw) and the tail rows: an empty reference
            # slice must be exactly zero (sqnr is -inf otherwise), the others >= 40 dB.
            for what, a, b in zip(("out", "dgrad", "wgrad"), got, want):
                assert a.shape == b.shape and a.dtype == b.dtype, (name, what)
                assert torch.isfinite(a).all(), (name, what)
                for i, part in enumerate(rows if what != "wgrad" else range(4)):
                    db = sqnr(b[part], a[part])
                    assert db >= 40, f"{name} {what} part {i}: {db:.1f} dB against the emulated reference"
            if name == "all_experts_empty":
                assert all(bool((t == 0).all()) for t in got), name
            print("ok", recipe, name, flush=True)
    """
)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_degenerate_routings_in_subprocess(backend):
    """No rows, all experts empty, one expert, out-of-order offsets (clamped on device): values
    against the emulated backend on the clamped offsets (N = 32, K = 64: partial kernel tiles)."""
    need(backend)
    proc = subprocess.run(
        [sys.executable, "-c", _DEGENERATE, backend, *RECIPES], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 4 * len(RECIPES)




@pytest.mark.parametrize(
    "backend, recipe", [("cuda", "bf16"), ("cuda", "rowwise"), ("hybrid", "rowwise"), ("triton", "rowwise")]
)
def test_transposed_view_weights_gpu(backend, recipe):
    """Weights stored (E, K, N) (Llama 4) and passed as a transposed view: the FP8 recipe quantizes
    to the same bytes (same bits out); bf16 runs torch._grouped_mm with the other B layout (close)."""
    need(backend)
    x, w, g, offs = inputs(2048, 512, 384, 8, 2000, seed=7)
    want = fwd_bwd(x, w, g, offs, recipe=recipe, backend=backend)
    storage = w.detach().transpose(1, 2).contiguous().requires_grad_()
    y = fp8_grouped_mm(x, storage.transpose(1, 2), offs, recipe=recipe, backend=backend)
    y.backward(g)
    tol = {} if recipe == "bf16" else dict(rtol=0, atol=0)
    torch.testing.assert_close(y, want[0], **tol)
    torch.testing.assert_close(storage.grad.transpose(1, 2), want[2], **tol)
    (dw,) = torch.autograd.grad(fp8_grouped_mm(x, storage.transpose(1, 2), offs, recipe=recipe, backend=backend),
                                (storage,), g)
    assert dw.is_contiguous()  # made in the storage's own layout, before autograd accumulates it


@pytest.mark.parametrize("limit, same_as", [(256, "hybrid"), (255, "cuda")])
def test_cuda_auto_is_hybrid_for_small_groups_and_cuda_for_large(monkeypatch, large_case, limit, same_as):
    """``large_case`` averages 4096 / 16 = 256 rows per group: at a limit of 256 ``cuda_auto`` runs
    the forward and dgrad GEMMs on Triton (``hybrid``), at 255 on ``torch._scaled_grouped_mm``
    (``cuda``); wgrad on the op either way. Same kernels, so the same bits."""
    from moe_fp8.grouped_gemm.backends.cuda_auto import CudaAutoBackend

    need("cuda_auto")
    monkeypatch.setattr(CudaAutoBackend, "triton_max_rows_per_group", limit)
    got = fwd_bwd(*large_case, recipe="rowwise", backend="cuda_auto")
    want = fwd_bwd(*large_case, recipe="rowwise", backend=same_as)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
