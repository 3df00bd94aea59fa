"""Row-wise and per-expert column-wise Triton quantizers equal the reference byte for byte.

CPU tests run the kernels in the Triton interpreter on small, odd shapes; ``-m gpu`` tests run
the same checks on model-sized shapes.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_kernel_cases import FORMAT_IDS, FORMATS, assert_same, hard_input, poison_device_cache

from moe_fp8.grouped_gemm import quant_seam
from moe_fp8.quant import reference as ref
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.kernels.colwise import colwise_config, launch_expert_colwise_t
from moe_fp8.quant.kernels.rowwise import col_amax_fits, launch_expert_rowwise_col_amax, launch_rowwise, rowwise_config
from moe_fp8.quant.ops import (
    triton_quantize_expert_colwise,
    triton_quantize_expert_colwise_dual,
    triton_quantize_expert_colwise_from_amax,
    triton_quantize_expert_rowwise_with_amax,
    triton_quantize_rowwise,
)


def _check_rowwise(x, pow2, fmt):
    poison_device_cache(x.device)
    q, s = triton_quantize_rowwise(x, fmt, pow2)
    rq, rs = ref.quantize_rowwise(x, fmt, pow2=pow2)
    assert q.is_contiguous()
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


def _check_expert(w, pow2, fmt):
    poison_device_cache(w.device)
    for transposed in (False, True):
        q, s = triton_quantize_expert_colwise(w, fmt, pow2, transposed)
        rq, rs = ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=transposed)
        assert q.is_contiguous()
        assert_same(q, rq, f"q transposed={transposed}")
        assert_same(s, rs, f"scale transposed={transposed}")
    q_fwd, s_fwd, q_bwd, s_bwd = triton_quantize_expert_colwise_dual(w, fmt, pow2)
    for got, want, what in zip((q_fwd, s_fwd, q_bwd, s_bwd),
                               (*ref.quantize_expert_colwise(w, fmt, pow2=pow2),
                                *ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=True)),
                               ("q_fwd", "s_fwd", "q_bwd", "s_bwd")):
        assert_same(got, want, f"dual {what}")
    if col_amax_fits(w.shape[2]):
        _check_expert_split(w, pow2, fmt)


def _check_expert_split(w, pow2, fmt):
    """The forward layout with the amax over N from one read, then the dgrad layout from that amax."""
    q, s, col_amax = triton_quantize_expert_rowwise_with_amax(w, fmt, pow2)
    rq, rs = ref.quantize_expert_colwise(w, fmt, pow2=pow2)
    assert q.is_contiguous()
    assert_same(q, rq, "split q_fwd")
    assert_same(s, rs, "split s_fwd")
    assert_same(col_amax, ref.expert_amax(w, transposed=True), "col_amax")
    q_t, s_t = triton_quantize_expert_colwise_from_amax(w, col_amax, fmt, pow2)
    rq_t, rs_t = ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=True)
    assert q_t.is_contiguous()
    assert_same(q_t, rq_t, "split q_bwd")
    assert_same(s_t, rs_t, "split s_bwd")


# ------------------------------------------------------------------------------ CPU (interpreter)

ROW_SHAPES = [(1, 1), (7, 200), (33, 130)]


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_rowwise_cpu(shape, pow2, fmt):
    _check_rowwise(hard_input(shape, seed=shape[0] + shape[1]), pow2, fmt)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
def test_rowwise_long_rows_cpu(long_rows, pow2, fmt):
    """Rows longer than the one-pass limit: the two-pass kernel chosen by the config."""
    assert not rowwise_config(3, long_rows)["SINGLE_PASS"]
    _check_rowwise(hard_input((3, long_rows), seed=long_rows), pow2, fmt)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rowwise_dtypes_and_strides_cpu(dtype):
    x = hard_input((48, 40), dtype, seed=3)
    _check_rowwise(x, False, E4M3FN)
    _check_rowwise(x.t(), True, E4M3FN)  # column-major input
    _check_rowwise(x[::3, 5:], False, E4M3FN)  # strided rows, offset start


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(0, 16), (5, 0), (0, 0)], ids=str)
def test_rowwise_empty_cpu(shape):
    _check_rowwise(torch.randn(shape).bfloat16(), False, E4M3FN)


@pytest.mark.interpreter
@pytest.mark.parametrize("config", [
    dict(BLOCK_M=4, BLOCK_K=256, SINGLE_PASS=True, num_warps=4),
    dict(BLOCK_M=2, BLOCK_K=32, SINGLE_PASS=False, num_warps=4),
], ids=["rows4", "two_pass"])
def test_rowwise_block_configs_cpu(config):
    x = hard_input((11, 100), seed=5)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(11)
    launch_rowwise(x, q, s, E4M3FN, True, M=11, K=100, rows_per_group=11, stride_g=0, stride_r=100, stride_k=1,
                   config=config)
    rq, rs = ref.quantize_rowwise(x, E4M3FN, pow2=True)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


EXPERT_SHAPES = [(1, 1, 1), (3, 40, 72), (2, 17, 33), (4, 5, 300)]


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=str)
def test_expert_colwise_cpu(shape, pow2, fmt):
    _check_expert(hard_input(shape, seed=sum(shape)), pow2, fmt)


@pytest.mark.interpreter
def test_expert_colwise_strided_and_empty_cpu():
    w = hard_input((3, 48, 40), torch.float32, seed=9)
    _check_expert(w.transpose(1, 2), False, E4M3FN)  # (E, 40, 48) with unit stride on dim 1
    _check_expert(w[:, 3:, ::2], True, E4M3FN)
    for shape in [(0, 4, 16), (2, 0, 16), (2, 16, 0)]:
        _check_expert(torch.randn(shape).bfloat16(), False, E4M3FN)


@pytest.mark.interpreter
def test_expert_dual_long_rows_cpu(long_rows):
    """Rows longer than the one-read limit: the dual takes the column-wise kernel for the dgrad
    layout; the one-read op refuses."""
    w = hard_input((2, 3, long_rows), seed=5)
    assert not col_amax_fits(long_rows)
    _check_expert(w, False, E4M3FN)
    with pytest.raises(ValueError, match="do not fit"):
        triton_quantize_expert_rowwise_with_amax(w, E4M3FN)


@pytest.mark.interpreter
@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("long", [False, True], ids=["one_read", "long_rows"])
def test_uncached_weight_layouts_cpu(request, long, fused):
    """What ``fp8_grouped_mm`` runs without a weight cache: the forward layout with the dgrad
    layout's amax, then the dgrad layout from it; equal to the reference's two layouts on every
    path (kernels with whole rows in registers, kernels with long rows plus a torch amax, reference)."""
    K = request.getfixturevalue("long_rows") if long else 40
    w = hard_input((2, 24, K), seed=K)
    q, s, col_amax = quant_seam.quantize_weight_forward_layout(w, E4M3FN, True, fused)
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN, pow2=True)
    assert_same(q, rq, "q_fwd")
    assert_same(s, rs, "s_fwd")
    assert_same(col_amax, ref.expert_amax(w, transposed=True), "col_amax")
    q_t, s_t = quant_seam.quantize_weight_dgrad_layout(w, col_amax, E4M3FN, True, fused)
    rq_t, rs_t = ref.quantize_expert_colwise(w, E4M3FN, pow2=True, transposed=True)
    assert_same(q_t, rq_t, "q_bwd")
    assert_same(s_t, rs_t, "s_bwd")


@pytest.mark.interpreter
@settings(max_examples=20, deadline=None)
@given(E=st.integers(1, 3), N=st.integers(0, 70), K=st.integers(0, 40), rows=st.sampled_from([1, 4, 16, 32]),
       pow2=st.booleans(), seed=st.integers(0, 2**16))
def test_expert_rowwise_col_amax_property_cpu(E, N, K, rows, pow2, seed):
    """Several programs per expert merge their column amaxes (strips of ``rows``, the last partial);
    the outputs start as garbage, the amax buffer as zeros; empty experts and K = 0 included."""
    w = hard_input((E, N, K), seed=seed) if N * K else torch.zeros(E, N, K, dtype=torch.bfloat16)
    q = torch.empty((E, N, K), dtype=torch.float8_e4m3fn)
    s = torch.empty((E, N))
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    amax = torch.zeros(E, K)
    launch_expert_rowwise_col_amax(w, q, s, amax.view(torch.int32), E4M3FN, pow2, rows_per_program=rows, stages=1)
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN, pow2=pow2)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")
    assert_same(amax, ref.expert_amax(w, transposed=True), "col_amax")
    q_t, s_t = triton_quantize_expert_colwise_from_amax(w, amax, E4M3FN, pow2)
    rq_t, rs_t = ref.quantize_expert_colwise(w, E4M3FN, pow2=pow2, transposed=True)
    assert_same(q_t, rq_t, "q_t")
    assert_same(s_t, rs_t, "s_t")


@pytest.mark.interpreter
def test_expert_rowwise_col_amax_default_config_two_rows_per_step_cpu():
    """The launcher's own configuration for rows of 3000 (two rows per loop step), an odd row count
    per expert, outputs starting as garbage: the reference's bytes and column amax."""
    w = hard_input((2, 13, 3000), seed=9)
    q = torch.empty((2, 13, 3000), dtype=torch.float8_e4m3fn)
    s = torch.empty((2, 13))
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    amax = torch.zeros(2, 3000)
    launch_expert_rowwise_col_amax(w, q, s, amax.view(torch.int32), E4M3FN, False)
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")
    assert_same(amax, ref.expert_amax(w, transposed=True), "col_amax")


@pytest.mark.interpreter
def test_expert_colwise_from_amax_uses_the_given_amax_cpu():
    """The dgrad layout's scales come from ``col_amax`` as given (doubled amax: the reference's bytes
    for that amax, not ``w``'s own)."""
    w = hard_input((2, 24, 40), seed=6)
    amax = ref.expert_amax(w, transposed=True) * 2
    q_t, s_t = triton_quantize_expert_colwise_from_amax(w, amax, E4M3FN)
    rq_t, rs_t = ref.quantize_expert_colwise(w, E4M3FN, transposed=True, amax=amax)
    assert_same(q_t, rq_t, "q_t")
    assert_same(s_t, rs_t, "s_t")
    assert not torch.equal(s_t, ref.quantize_expert_colwise(w, E4M3FN, transposed=True)[1])


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk,tickets,lag,two_pass", [(16, False, 0, False), (32, True, 1, False),
                                                        (64, False, 3, False), (128, True, 0, False),
                                                        (32, False, 0, True)])
def test_expert_colwise_t_strip_configs_cpu(chunk, tickets, lag, two_pass):
    """Experts of several chunks and chunks straddling experts (70 rows each), partial tiles; workers
    trailing their members by ``lag`` column blocks (3: more than the 3 column blocks there are)."""
    w = hard_input((3, 70, 40), seed=11)
    q = torch.empty((3, 40, 70), dtype=torch.float8_e4m3fn)
    s = torch.empty((3, 40))
    launch_expert_colwise_t(w, q, s, E4M3FN, False,
                            config=dict(CHUNK=chunk, BLOCK_R=16, BLOCK_C=16, num_warps=4, TICKETS=tickets, LAG=lag,
                                        TWO_PASS=two_pass))
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN, transposed=True)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


@pytest.mark.interpreter
@pytest.mark.parametrize("N,block_r,chunk", [(48, 32, 32), (80, 64, 64), (112, 32, 64)])
def test_expert_colwise_t_half_tiles_cpu(N, block_r, chunk):
    """Experts of 16k rows that end inside ``block_r``-row tiles, in chunks straddling experts: the
    partial tiles store 16-row vectors (``ZERO_FILL``) that write every row of their expert and none
    of the next one's."""
    w = hard_input((3, N, 40), seed=N)
    q = torch.empty((3, 40, N), dtype=torch.float8_e4m3fn)
    s = torch.empty((3, 40))
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    launch_expert_colwise_t(w, q, s, E4M3FN, False, config=colwise_config(chunk=chunk, block_r=block_r, block_c=16))
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN, transposed=True)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


@pytest.mark.slow(11)
@pytest.mark.interpreter
@settings(max_examples=25, deadline=None)
@given(E=st.integers(1, 4), N=st.integers(0, 80), K=st.integers(1, 40), chunk=st.sampled_from([16, 32, 64]),
       pow2=st.booleans(), seed=st.integers(0, 2**16))
def test_expert_colwise_t_property_cpu(E, N, K, chunk, pow2, seed):
    """Dgrad layout for any expert sizes: chunks straddling experts, partial tiles, N = 0."""
    w = hard_input((E, N, K), seed=seed) if N else torch.zeros(E, 0, K, dtype=torch.bfloat16)
    q = torch.empty((E, K, N), dtype=torch.float8_e4m3fn)
    s = torch.empty((E, K))
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    launch_expert_colwise_t(w, q, s, E4M3FN, pow2, config=dict(CHUNK=chunk, BLOCK_R=16, BLOCK_C=16, num_warps=4))
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN, pow2=pow2, transposed=True)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((8192, 7168), torch.bfloat16), ((3000, 5120), torch.float32),
                                         ((513, 20000), torch.bfloat16)], ids=["dsv3", "fp32", "two_pass"])
def test_rowwise_gpu(shape, dtype):
    x = hard_input(shape, dtype, seed=1, device="cuda")
    for pow2 in (False, True):
        _check_rowwise(x, pow2, E4M3FN)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 512, 7168), (8, 7168, 512), (16, 1536, 2048), (3, 1000, 1000)], ids=str)
def test_expert_colwise_gpu(shape):
    w = hard_input(shape, seed=2, device="cuda")
    _check_expert(w, True, E4M3FN)
    _check_expert(w[:, :, : shape[2] // 2], False, E4M3FN)  # strided rows


@pytest.mark.gpu
def test_expert_dual_long_rows_gpu():
    """At the real limits: rows of 16400 elements take the column-wise dgrad kernel in the dual."""
    w = hard_input((2, 64, 16400), seed=5, device="cuda")
    assert not col_amax_fits(16400)
    _check_expert(w, True, E4M3FN)


@pytest.mark.gpu
@pytest.mark.parametrize("hw_cast", [False, True], ids=["preround", "hw_cast"])
def test_both_cast_paths_gpu(hw_cast):
    """The fp32 pre-rounding path and the direct hardware cast give the reference's bytes on the GPU."""
    x = hard_input((4096, 5120), seed=3, device="cuda")
    q, s = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(4096, device="cuda")
    launch_rowwise(x, q, s, E4M3FN, False, M=4096, K=5120, rows_per_group=4096, stride_g=0, stride_r=5120,
                   stride_k=1, hw_cast=hw_cast)
    rq, rs = ref.quantize_rowwise(x, E4M3FN)
    assert_same(q, rq, "rowwise q")
    assert_same(s, rs, "rowwise scale")
    w = x.view(4, 1024, 5120)
    q = torch.empty((4, 5120, 1024), dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty((4, 5120), device="cuda")
    launch_expert_colwise_t(w, q, s, E4M3FN, True, hw_cast=hw_cast)
    rq, rs = ref.quantize_expert_colwise(w, E4M3FN, pow2=True, transposed=True)
    assert_same(q, rq, "dgrad q")
    assert_same(s, rs, "dgrad scale")
