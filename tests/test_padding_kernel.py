"""The one-launch padded row copy (``gather_rows_padded``): bit for bit equal to the torch reference
(``padded_row_index`` + ``scatter_rows_padded``) for empty groups, one group, no rows, rows past
``offs[-1]``, odd sizes and widths, bf16 / fp32 / FP8 and many groups; bad offsets never address
memory outside the tensors; dispatch, bad arguments and ``torch.compile``; on a GPU, large shapes
and the BF16 wgrad that uses it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8.grouped_gemm import padding
from moe_fp8.grouped_gemm.backends.base import GroupedGemmBackend
from moe_fp8.grouped_gemm.padding import (
    gather_rows_padded,
    gather_rows_padded_reference,
    padded_offsets,
    padded_rows,
)
from moe_fp8.grouped_gemm.padding_kernels import launch_gather_rows_padded
from moe_fp8.testing import OFFSET_KINDS, random_offsets

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def random_rows(M: int, C: int, dtype: torch.dtype, *, seed: int, device="cpu") -> torch.Tensor:
    """Fresh random bits: every byte pattern (NaNs and -0 included) must be copied unchanged."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (M, C * torch.empty((), dtype=dtype).element_size()), generator=g, dtype=torch.uint8)
    return raw.view(dtype).to(device)


def offsets(sizes, device="cpu") -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


@given(m=st.integers(0, 70000), e=st.integers(1, 300), kind=st.sampled_from(OFFSET_KINDS), seed=st.integers(0, 99))
@settings(max_examples=60, deadline=None)
def test_padded_rows_bound(m, e, kind, seed):
    """A multiple of 128 (each column of a column-major FP8 operand starts a 128-byte line), within
    127 rows of the worst case, and never short of the padded groups of any routing."""
    rows = padded_rows(m, e)
    assert rows % 128 == 0 and m + 15 * e <= rows < m + 15 * e + 128
    rows16 = padded_rows(m, e, rows_align=16)  # the alignment the A/B benchmark compares against
    assert rows16 % 16 == 0 and m + 15 * e <= rows16 < m + 15 * e + 16 and rows16 <= rows
    offs = random_offsets(m, e, kind, generator=torch.Generator().manual_seed(seed))
    assert int(padded_offsets(offs)[-1]) <= rows



@pytest.mark.parametrize("kind", ["sorted", "unsorted", "int32 extremes"])
def test_padded_offsets_against_python(kind):
    """End offsets of the groups rounded up to 16 rows, as Python ints wrapped to int32, for any
    offsets: sorted (empty groups included), not monotonic, and sums that overflow int32."""
    g = torch.Generator().manual_seed(len(kind))
    for e in (0, 1, 2, 7, 65):
        if kind == "sorted":
            offs = torch.cumsum(torch.randint(0, 3, (e,), generator=g) * torch.randint(0, 40, (e,), generator=g), 0)
        elif kind == "unsorted":
            offs = torch.randint(-100, 100, (e,), generator=g)
        else:
            offs = torch.randint(-(2**31), 2**31 - 1, (e,), generator=g, dtype=torch.int64)
        offs = offs.to(torch.int32)
        ends, prev, total = [], 0, 0
        for o in offs.tolist():
            total += (o - prev + 15) // 16 * 16
            ends.append((total + 2**31) % 2**32 - 2**31)
            prev = o
        got = padded_offsets(offs)
        assert got.dtype == torch.int32 and got.tolist() == ends, (offs, got)

def check(x: torch.Tensor, offs: torch.Tensor, *, wrapper: bool = True, column_major: bool = False,
          **launch_kw) -> None:
    """The wrapper and/or (with ``launch_kw``) the launcher on a poisoned buffer against the reference,
    row-major or column-major (strides ``(1, R)``)."""
    M, E = x.shape[0], offs.numel()
    p_offs, R = padded_offsets(offs), padded_rows(M, E)
    want = gather_rows_padded_reference(x, offs, p_offs, R, column_major)
    if wrapper:
        got = gather_rows_padded(x, offs, p_offs, R, column_major=column_major)
        assert got.shape == (R, x.shape[1]) and got.dtype == x.dtype
        assert got.stride() == ((1, R) if column_major else (x.shape[1], 1))
        assert torch.equal(bits(got), bits(want))
    if launch_kw:
        shape = (x.shape[1], R) if column_major else (R, x.shape[1])
        poison = torch.full((shape[0], shape[1] * x.element_size()), 0x7F, dtype=torch.uint8, device=x.device)
        out = poison.view(x.dtype).t() if column_major else poison.view(x.dtype)
        launch_gather_rows_padded(x, offs, p_offs, out, **launch_kw)
        assert torch.equal(bits(out), bits(want))


SIZES = {
    "empty_first_middle_last": ([0, 5, 0, 17, 0], 22),
    "one_group": ([37], 37),
    "no_groups": ([], 20),  # every row past offs[-1]
    "no_rows": ([0, 0, 0], 0),
    "tail_past_end": ([3, 20, 9], 50),  # offs[-1] = 32 < M
    "multiples_of_16": ([16, 32, 0, 16], 64),
    "odd": ([1, 15, 17, 31, 2], 70),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SIZES))
def test_matches_reference(case, dtype):
    sizes, M = SIZES[case]
    seed = len(case) + dtype.itemsize
    # C = 300: full and partial column blocks at the default 512-byte width (bf16, fp32) and at the
    # launcher's 128 bytes (every dtype); 8-row blocks inside the 16-row padded groups
    check(random_rows(M, 300, dtype, seed=seed), offsets(sizes), block_r=8, block_bytes=128)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SIZES))
def test_column_major_matches_reference(case, dtype):
    # C = 70 with 32-byte chunks: full and partial column chunks, one program per tile (the
    # row-major launch above has one program per row block looping over all chunks); 32-row tiles
    # across the 16-row padded groups' edges
    sizes, M = SIZES[case]
    check(random_rows(M, 70, dtype, seed=len(case)), offsets(sizes), column_major=True, block_r=32, block_bytes=32)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_random_offsets_many_groups(kind):
    gen = torch.Generator().manual_seed(7)
    M, E = 333, 300
    # 10 programs of 512 rows: the interpreter runs each program's offset scans element by element
    offs = random_offsets(M - 5, E, kind, generator=gen)
    check(random_rows(M, 24, torch.bfloat16, seed=1), offs, wrapper=False, block_r=512)


@pytest.mark.interpreter
def test_row_stride_and_non_contiguous_columns():
    big = random_rows(40, 64, torch.float32, seed=3)
    offs = offsets([9, 0, 20])
    check(big[:, 8:43], offs, block_r=8, block_bytes=64)  # row stride 64, 35 columns
    check(big[:, :24].t(), offsets([10, 14]))  # column stride 64: copied to contiguous first


def _clamped_model(x: torch.Tensor, offs: torch.Tensor, p_offs: torch.Tensor, R: int) -> torch.Tensor:
    """The kernel's semantics for any offsets ``(E >= 1,)``: running maxima of the clamped offsets."""
    M = x.shape[0]
    end = offs.long().clamp(0, M).cummax(0).values
    pend = p_offs.long().clamp(0, R).cummax(0).values
    r = torch.arange(R)
    before = pend[None, :] <= r[:, None]
    pstart = torch.where(before, pend[None, :], 0).amax(1)
    start = torch.where(before, end[None, :], 0).amax(1)
    stop = torch.where(before, M, end[None, :]).amin(1)
    src = start + r - pstart
    out = torch.zeros(R, x.shape[1], dtype=x.dtype)
    live = src < stop
    out[live] = x[src[live]]
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "offs, p_offs",
    [
        ([5, 3, 20, 12], None),  # not monotonic
        ([-4, 10, 90, 95], None),  # negative, past M
        ([10, 20, 30, 40], [999, -50, 16, 2**31 - 1]),  # padded offsets inconsistent and out of range
    ],
    ids=["non_monotonic", "out_of_range", "bad_padded"],
)
def test_bad_offsets_stay_in_bounds(offs, p_offs):
    M, C = 40, 48
    guard = torch.full((M + 64, C), -7.0)  # rows around x: a read outside x would show as -7
    x = guard[32 : 32 + M]
    x.copy_(torch.arange(M * C, dtype=torch.float32).view(M, C))
    offs = torch.tensor(offs, dtype=torch.int32)
    p_offs = padded_offsets(offs) if p_offs is None else torch.tensor(p_offs, dtype=torch.int32)
    R = padded_rows(M, offs.numel())
    wide = torch.full((R + 32, C), 5.0)
    out = wide[:R]
    launch_gather_rows_padded(x, offs, p_offs, out, block_r=8, group_block=2)  # running maxima over chunks
    assert torch.equal(out, _clamped_model(x, offs, p_offs, R))
    assert torch.all(wide[R:] == 5.0)  # nothing written past the output
    assert torch.all(guard[:32] == -7.0) and torch.all(guard[32 + M :] == -7.0)


@pytest.mark.interpreter
def test_dispatch_kernel_or_reference(monkeypatch):
    x, offs = random_rows(30, 20, torch.float8_e4m3fn, seed=5), offsets([4, 0, 19])
    p_offs, R = padded_offsets(offs), padded_rows(30, 3)
    want = bits(gather_rows_padded_reference(x, offs, p_offs, R))
    calls = []
    monkeypatch.setattr(padding, "launch_gather_rows_padded",
                        lambda *a, **k: calls.append(1) or launch_gather_rows_padded(*a, **k))
    assert torch.equal(bits(gather_rows_padded(x, offs, p_offs, R)), want) and calls == [1]
    monkeypatch.setattr(padding, "use_triton", lambda kernel, t: False)  # CPU without the interpreter
    assert torch.equal(bits(gather_rows_padded(x, offs, p_offs, R)), want) and calls == [1]


def test_bad_arguments():
    x, offs = torch.zeros(20, 8), offsets([5, 15])
    p_offs, R = padded_offsets(offs), padded_rows(20, 2)
    with pytest.raises(ValueError, match="x"):
        gather_rows_padded(x[0], offs, p_offs, R)
    with pytest.raises(TypeError, match="x"):
        gather_rows_padded(x.to(torch.complex64), offs, p_offs, R)
    with pytest.raises(TypeError, match="offs"):
        gather_rows_padded(x, offs.long(), p_offs, R)
    with pytest.raises(ValueError, match="padded_offs"):
        gather_rows_padded(x, offs, p_offs[:1], R)
    with pytest.raises(ValueError, match="num_padded_rows"):
        gather_rows_padded(x, offs, p_offs, R - 16)


@pytest.mark.interpreter
def test_compile_fullgraph_cpu():
    torch._dynamo.reset()
    x, offs = random_rows(50, 24, torch.bfloat16, seed=9), offsets([7, 0, 30])

    def fn(x, offs):
        p_offs = padded_offsets(offs)
        return gather_rows_padded(x, offs, p_offs, padded_rows(x.shape[0], offs.numel()))

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, offs)
    assert torch.equal(bits(got), bits(fn(x, offs)))


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("E", [8, 128])
def test_large_gpu(E):
    M, C = 65536, 7168
    gen = torch.Generator().manual_seed(E)
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    offs = random_offsets(M - 1000, E, "skewed", generator=gen).cuda()  # 1000 tail rows
    check(x, offs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_many_groups_gpu(kind, dtype):
    gen = torch.Generator().manual_seed(11)
    M = 5000
    x = random_rows(M, 520, dtype, seed=2, device="cuda")
    check(x, random_offsets(M, 1023, kind, generator=gen).cuda(), block_r=32, block_bytes=1024)


@pytest.mark.gpu
def test_bf16_wgrad_gpu():
    """``bf16_mm_2d2d`` (rows padded by the kernel, then torch._grouped_mm) against per-group matmuls."""
    M, N, K = 3000, 256, 384
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(M, N, generator=gen).bfloat16().cuda()
    b = torch.randn(M, K, generator=gen).bfloat16().cuda()
    offs = offsets([0, 700, 33, 0, 1200, 17, 0], device="cuda")  # empty groups, odd sizes, 1050 tail rows
    got = GroupedGemmBackend().bf16_mm_2d2d(a, b, offs)
    ends = offs.tolist()
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        want = a[s:e].float().t() @ b[s:e].float()
        torch.testing.assert_close(got[g].float(), want, rtol=1e-2, atol=1e-1)
