"""Per-group column-wise Triton quantizers (the wgrad operands) equal the reference byte for byte.

Covers jagged groups of any size, empty groups (first, middle, last), rows past ``offs[-1]``, the
single-tensor and dual launches, column-major and row-major outputs, and the padded layout.
"""

import itertools
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_kernel_cases import FORMAT_IDS, FORMATS, assert_same, hard_input, poison_device_cache

from moe_fp8.quant import reference as ref
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.kernels.colwise import colwise_config, launch_group_colwise
from moe_fp8.quant.kernels.rowwise import launch_group_rowwise_amax
from moe_fp8.quant.ops import (
    triton_group_amax,
    triton_quantize_group_colwise,
    triton_quantize_group_colwise_dual,
    triton_quantize_rowwise_with_group_amax,
)
from moe_fp8.testing import random_offsets


def _padded(offs: torch.Tensor, align: int = 16, tail: int = 16) -> tuple[torch.Tensor, int]:
    """End offsets of groups whose starts are multiples of ``align`` (each padded group >= its group)
    and a row count ``tail`` rows past the last."""
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    padded_sizes = (sizes + align - 1) // align * align
    return torch.cumsum(padded_sizes, 0).to(torch.int32), int(padded_sizes.sum()) + tail


def _reference_padded(x, offs, padded_offs, rows_out, fmt, pow2):
    """The reference's bytes moved to the padded group starts; every other row 0."""
    rq, rs = ref.quantize_group_colwise(x, offs, fmt, pow2=pow2)
    out = torch.zeros((rows_out, x.shape[1]), dtype=rq.dtype, device=x.device)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    p_starts = torch.cat([padded_offs.new_zeros(1), padded_offs[:-1]]).tolist()
    for s, e, p in zip(starts, offs.tolist(), p_starts):
        out[p : p + e - s] = rq[s:e]
    return out, rs


def _check_dual(a, b, offs, pow2, fmt, padded=False):
    poison_device_cache(a.device)
    kwargs = {}
    if padded:
        padded_offs, rows_out = _padded(offs)
        kwargs = dict(padded_offs=padded_offs.to(a.device), padded_rows=rows_out)
    qa, sa, qb, sb = triton_quantize_group_colwise_dual(a, b, offs, fmt, pow2, **kwargs)
    for q, s, x, name in ((qa, sa, a, "a"), (qb, sb, b, "b")):
        assert q.t().is_contiguous(), f"q{name} must be column-major"
        if padded:
            rq, rs = _reference_padded(x, offs, kwargs["padded_offs"], kwargs["padded_rows"], fmt, pow2)
        else:
            rq, rs = ref.quantize_group_colwise(x, offs, fmt, pow2=pow2)
        assert_same(q, rq, f"q{name}")
        assert_same(s, rs, f"s{name}")
    _check_from_group_amax(a, b, offs, pow2, fmt, kwargs, (qa, sa, qb, sb))


def _check_from_group_amax(a, b, offs, pow2, fmt, kwargs, want):
    """Each operand's row quantization with its per-group column amax (the reference's row bytes
    and amax), then the dual given either amax or both, and each operand alone
    (``triton_quantize_group_colwise``, column-major, with and without its amax): the dual's bytes."""
    amaxes = {}
    for name, x in (("a_amax", a), ("b_amax", b)):
        q, s, amaxes[name] = triton_quantize_rowwise_with_group_amax(x, offs, fmt, pow2)
        rq, rs = ref.quantize_rowwise(x, fmt, pow2=pow2)
        assert_same(q, rq, "rowwise q")
        assert_same(s, rs, "rowwise scale")
        assert_same(amaxes[name], ref.group_amax(x.cpu(), offs.cpu()).to(x.device), name)
    for given in (("a_amax",), ("b_amax",), ("a_amax", "b_amax")):
        got = triton_quantize_group_colwise_dual(a, b, offs, fmt, pow2, **{n: amaxes[n] for n in given}, **kwargs)
        for g, w, name in zip(got, want, ("qa", "sa", "qb", "sb")):
            assert_same(g, w, f"{name} from {given}")
    for x, name, (wq, ws) in ((a, "a_amax", want[:2]), (b, "b_amax", want[2:])):
        for amax in (amaxes[name], None):
            q, s = triton_quantize_group_colwise(x, offs, fmt, pow2, column_major=True, amax=amax, **kwargs)
            assert q.t().is_contiguous()
            assert_same(q, wq, f"{name[0]} alone, amax given: {amax is not None}")
            assert_same(s, ws, f"scale of {name[0]} alone, amax given: {amax is not None}")


def _check_single(x, offs, pow2, fmt):
    poison_device_cache(x.device)
    rq, rs = ref.quantize_group_colwise(x, offs, fmt, pow2=pow2)
    for column_major in (False, True):
        q, s = triton_quantize_group_colwise(x, offs, fmt, pow2, column_major=column_major)
        assert (q.t() if column_major else q).is_contiguous()
        assert_same(q, rq, f"q column_major={column_major}")
        assert_same(s, rs, "scale")


def _offsets(rows, groups, kind, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return random_offsets(rows, groups, kind, generator=g).to(device)


# ------------------------------------------------------------------------------ CPU (interpreter)

CASES = [  # rows, rows used by the groups, cols a, cols b, groups, kind
    (1, 1, 16, 16, 1, "one"),
    (70, 70, 48, 40, 4, "balanced"),
    (100, 90, 33, 17, 5, "skewed"),
    (96, 80, 32, 64, 6, "empty"),
    (50, 0, 16, 16, 3, "balanced"),  # every group empty, every row past offs[-1]
]


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[2]}+{c[3]}_E{c[4]}_{c[5]}_used{c[1]}")
def test_group_colwise_dual_cpu(case, pow2, fmt):
    rows, used, n, k, groups, kind = case
    a = hard_input((rows, n), seed=rows + n)
    b = hard_input((rows, k), torch.float32, seed=rows + k)
    offs = _offsets(used, groups, kind, seed=groups)
    _check_dual(a, b, offs, pow2, fmt)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["balanced", "empty", "skewed"])
def test_group_colwise_padded_cpu(kind):
    a, b = hard_input((90, 32), seed=4), hard_input((90, 48), seed=5)
    offs = _offsets(83, 5, kind, seed=7)
    _check_dual(a, b, offs, True, E4M3FN, padded=True)


@pytest.mark.interpreter
def test_group_colwise_empty_first_and_last_cpu():
    a, b = hard_input((40, 16), seed=1), hard_input((40, 32), seed=2)
    offs = torch.tensor([0, 0, 13, 31, 31], dtype=torch.int32)
    _check_dual(a, b, offs, False, E4M3FN)
    _check_dual(a, b, offs, False, E4M3FN, padded=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_group_colwise_single_cpu(fmt):
    x = hard_input((75, 40), torch.float16, seed=8)
    _check_single(x, _offsets(70, 4, "skewed", seed=3), False, fmt)
    _check_single(x[:, 3:], _offsets(75, 3, "empty", seed=4), True, fmt)  # strided input


#: Group ends over 150 rows for 16- to 256-row chunks: an empty first group, groups of 5, 1 and 1 rows
#: inside one chunk, groups ending on chunk edges (32, 64) with an empty group between them, groups
#: spanning several chunks (64-90, 90-141), and an empty last group at the last row.
STRIP_ENDS = torch.tensor([0, 5, 6, 7, 32, 32, 37, 64, 90, 141, 150, 150], dtype=torch.int32)


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk,tickets,lag,two_pass", [(16, False, 0, False), (32, True, 2, False),
                                                        (256, False, 1, False), (16, True, 5, False),
                                                        (16, False, 0, True), (64, True, 3, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_group_colwise_strip_configs_cpu(chunk, tickets, lag, two_pass, padded):
    """Small tiles over ``STRIP_ENDS``: groups of several chunks and chunks of several groups
    (pieces, partial tiles, the last arriver finishing), empty groups first, inside, at chunk edges
    and last; workers trailing their members by ``lag`` column blocks (more than there are: 5 > 4);
    members and workers in two launches (``two_pass``)."""
    a, b = hard_input((150, 40), seed=12), hard_input((150, 24), seed=13)
    config = dict(CHUNK=chunk, BLOCK_R=16, BLOCK_C=16, num_warps=4, TICKETS=tickets, LAG=lag, TWO_PASS=two_pass)
    _check_launch(a, b, STRIP_ENDS, padded, config)


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk,block_c", [(16, 16), (32, 32), (16, 64)])
@pytest.mark.parametrize("padded", [False, True])
def test_group_colwise_from_amax_configs_cpu(chunk, block_c, padded):
    """The workers alone, given the amaxes (``launch_group_colwise(amax_bits=...)``), with tiles small
    enough for groups of several chunks, chunks of several groups and empty groups at their edges
    (``STRIP_ENDS``)."""
    a, b = hard_input((150, 40), seed=14), hard_input((150, 24), seed=15)
    config = colwise_config(chunk=chunk, block_r=16, block_c=block_c)
    _check_launch(a, b, STRIP_ENDS, padded, config, from_amax=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_r,chunk", [(32, 32), (64, 64), (32, 128)])
@pytest.mark.parametrize("tail", [16, 23])
@pytest.mark.parametrize("from_amax", [False, True])
def test_group_colwise_padded_half_tiles_cpu(block_r, chunk, tail, from_amax):
    """Padded groups that start and end inside ``block_r``-row tiles (at odd multiples of 16 rows):
    the partial tiles at group edges store 16-row vectors holding the group's rows and its pad
    zeros, and no row of a neighbour. ``tail`` rows follow the last padded group (23: the row count
    is no multiple of 16, so the launch keeps per-row masks)."""
    a, b = hard_input((200, 24), seed=16), hard_input((200, 16), seed=17)
    ends = torch.tensor([16, 16, 61, 80, 150, 197], dtype=torch.int32)  # padded starts 0, 16, 16, 64, 96, 176
    config = colwise_config(chunk=chunk, block_r=block_r, block_c=16)
    _check_launch(a, b, ends, True, config, from_amax=from_amax, tail=tail)


def _check_launch(a, b, offs, padded, config, from_amax=False, tail=16):
    """``launch_group_colwise`` with ``config`` (``from_amax``: and the reference amaxes as
    ``amax_bits``) into poisoned column-major buffers: the reference's bytes (padded: ``tail`` rows
    past the last padded group)."""
    G, rows = offs.numel(), a.shape[0]
    padded_offs, rows_out = _padded(offs, tail=tail) if padded else (None, rows)
    if padded_offs is not None:
        padded_offs = padded_offs.to(a.device)
    qa = torch.empty_strided((rows_out, a.shape[1]), (1, rows_out), dtype=torch.float8_e4m3fn, device=a.device)
    qb = torch.empty_strided((rows_out, b.shape[1]), (1, rows_out), dtype=torch.float8_e4m3fn, device=a.device)
    sa = torch.empty(G, a.shape[1], device=a.device)
    sb = torch.empty(G, b.shape[1], device=a.device)
    for t in (qa, qb, sa, sb):  # poison: every element must be written
        t.view(torch.uint8).fill_(0x55)
    bits = torch.cat([ref.group_amax(a, offs), ref.group_amax(b, offs)], dim=1).view(torch.int32) if from_amax else None
    launch_group_colwise(a, qa, sa, b, qb, sb, offs, padded_offs, E4M3FN, False, config=config, amax_bits=bits)
    for q, s, x in ((qa, sa, a), (qb, sb, b)):
        if padded:
            rq, rs = _reference_padded(x, offs, padded_offs, rows_out, E4M3FN, False)
        else:
            rq, rs = ref.quantize_group_colwise(x, offs, E4M3FN)
        assert_same(q, rq, "q")
        assert_same(s, rs, "scale")


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
def test_group_colwise_two_pass_gpu(padded):
    """``colwise_config(two_pass=True)`` (not the default) on large shapes over 32 skewed groups."""
    a = hard_input((16384, 2048), seed=7, device="cuda")
    b = hard_input((16384, 1536), seed=8, device="cuda")
    _check_launch(a, b, _offsets(16000, 32, "skewed", seed=9, device="cuda"), padded, colwise_config(two_pass=True))


@pytest.mark.interpreter
def test_group_colwise_no_groups_cpu():
    a, b = hard_input((20, 16), seed=1), hard_input((20, 32), seed=2)
    qa, sa, qb, sb = triton_quantize_group_colwise_dual(a, b, torch.zeros(0, dtype=torch.int32), E4M3FN)
    assert sa.shape == (0, 16) and sb.shape == (0, 32)
    assert_same(qa, (a.float() * 0).to(torch.float8_e4m3fn), "qa")  # every row outside every group


@pytest.mark.slow(12)
@pytest.mark.interpreter
@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    tail=st.integers(0, 20),
    chunk=st.sampled_from([16, 32]),
    padded=st.booleans(),
    pow2=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_group_colwise_property_cpu(sizes, tail, chunk, padded, pow2, seed):
    """Any group sizes (empty ones, at chunk edges, spanning chunks), rows past the groups, both
    output layouts: bytes and scales equal the reference's, every output element written."""
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    a, b = hard_input((M, 16), seed=seed), hard_input((M, 24), torch.float32, seed=seed + 1)
    padded_offs, rows_out = _padded(offs) if padded else (None, M)
    qa = torch.empty_strided((rows_out, 16), (1, rows_out), dtype=torch.float8_e4m3fn)
    qb = torch.empty_strided((rows_out, 24), (1, rows_out), dtype=torch.float8_e4m3fn)
    sa, sb = torch.empty(len(sizes), 16), torch.empty(len(sizes), 24)
    for t in (qa, qb, sa, sb):  # poison: every element must be written
        t.view(torch.uint8).fill_(0x55)
    launch_group_colwise(a, qa, sa, b, qb, sb, offs, padded_offs, E4M3FN, pow2,
                         config=dict(CHUNK=chunk, BLOCK_R=16, BLOCK_C=16, num_warps=4))
    for q, s, x in ((qa, sa, a), (qb, sb, b)):
        if padded:
            rq, rs = _reference_padded(x, offs, padded_offs, rows_out, E4M3FN, pow2)
        else:
            rq, rs = ref.quantize_group_colwise(x, offs, E4M3FN, pow2=pow2)
        assert_same(q, rq, "q")
        assert_same(s, rs, "scale")


@pytest.mark.interpreter
@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    tail=st.integers(0, 20),
    rows=st.sampled_from([1, 4, 16]),
    tile=st.sampled_from([64, 4096]),
    K=st.integers(0, 40),
    pow2=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_group_rowwise_amax_property_cpu(sizes, tail, rows, tile, K, pow2, seed):
    """Row quantization with per-group column amax for any group sizes (empty ones, groups spanning
    programs of ``rows`` rows and programs spanning groups), rows past the groups, K = 0, one row or
    several per loop step (``tile``): the reference's row bytes (every element written) and
    ``reference.group_amax``."""
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    x = hard_input((M, K), seed=seed) if M * K else torch.zeros(M, K, dtype=torch.bfloat16)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn)
    s = torch.empty(M)
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    amax = torch.zeros(len(sizes), K)
    launch_group_rowwise_amax(x, q, s, amax.view(torch.int32), offs, E4M3FN, pow2, rows_per_program=rows, stages=1,
                              tile=tile)
    rq, rs = ref.quantize_rowwise(x, E4M3FN, pow2=pow2)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")
    assert_same(amax, ref.group_amax(x, offs), "amax")
    alone = torch.zeros(len(sizes), K)  # q = scale = None: the amax alone
    launch_group_rowwise_amax(x, None, None, alone.view(torch.int32), offs, E4M3FN, pow2, rows_per_program=rows,
                              stages=1, tile=tile)
    assert_same(alone, ref.group_amax(x, offs), "amax alone")


def _bad_offsets_run(device: str) -> None:
    """Non-monotone, negative and too-large offsets: the kernel returns (no worker waits forever) and
    quantizes as if the offsets were their clamped running maximum."""
    a, b = hard_input((150, 40), seed=3, device=device), hard_input((150, 24), seed=4, device=device)
    offs = torch.tensor([100, 50, -3, 140, 400, 120], dtype=torch.int32, device=device)
    qa, sa, qb, sb = triton_quantize_group_colwise_dual(a, b, offs, E4M3FN)
    fixed = torch.cummax(offs.clamp(0, 150), 0).values.to(torch.int32)
    for q, s, x in ((qa, sa, a), (qb, sb, b)):
        rq, rs = ref.quantize_group_colwise(x, fixed, E4M3FN)
        assert_same(q, rq.to(q.device), "q")
        assert_same(s, rs.to(s.device), "scale")
    _, _, a_amax = triton_quantize_rowwise_with_group_amax(a, offs, E4M3FN)
    assert_same(a_amax, ref.group_amax(a.cpu(), fixed.cpu()).to(device), "a_amax")
    assert_same(triton_group_amax(a, offs), a_amax, "triton_group_amax")


@pytest.mark.interpreter
def test_group_colwise_bad_offsets_cpu():
    _bad_offsets_run("cpu")


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_group_colwise_bad_offsets_gpu():
    _bad_offsets_run("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one"])
def test_group_colwise_dual_gpu(kind):
    a = hard_input((16384, 2048), seed=1, device="cuda")
    b = hard_input((16384, 7168), seed=2, device="cuda")
    offs = _offsets(16000, 8, kind, seed=3, device="cuda")
    _check_dual(a, b, offs, True, E4M3FN)
    _check_dual(a, b, offs, False, E4M3FN, padded=True)


@pytest.mark.gpu
def test_group_colwise_many_groups_gpu():
    a = hard_input((8192, 768), torch.float32, seed=4, device="cuda")
    b = hard_input((8192, 2048), seed=5, device="cuda")
    offs = _offsets(8192, 128, "skewed", seed=6, device="cuda")
    _check_dual(a, b, offs, False, E4M3FN)
    _check_single(b, offs, True, E4M3FN)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [1100, 1536, 2048, 4096, 5120, 7168, 14336])
def test_col_amax_launchers_at_model_sizes_gpu(K):
    """Both column-amax launchers with their own configurations on model-sized inputs (two to four
    rows per loop step up to K = 4096, one above; 128 or 256 programs), skewed groups with empty
    ones, outputs starting as garbage: the reference's bytes and amaxes."""
    from moe_fp8.quant.kernels.rowwise import launch_expert_rowwise_col_amax

    x = hard_input((8192, K), seed=K, device="cuda")
    offs = _offsets(8000, 16, "skewed", seed=K, device="cuda")
    q = torch.empty((8192, K), dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(8192, device="cuda")
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    amax = torch.zeros(16, K, device="cuda")
    launch_group_rowwise_amax(x, q, s, amax.view(torch.int32), offs, E4M3FN, True)
    rq, rs = ref.quantize_rowwise(x, E4M3FN, pow2=True)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")
    assert_same(amax, ref.group_amax(x, offs), "amax")
    w = x[: 4 * 1000].view(4, 1000, K)
    qw = torch.empty((4, 1000, K), dtype=torch.float8_e4m3fn, device="cuda")
    sw = torch.empty((4, 1000), device="cuda")
    for t in (qw, sw):
        t.view(torch.uint8).fill_(0x55)
    col = torch.zeros(4, K, device="cuda")
    launch_expert_rowwise_col_amax(w, qw, sw, col.view(torch.int32), E4M3FN, False)
    rqw, rsw = ref.quantize_expert_colwise(w, E4M3FN)
    assert_same(qw, rqw, "q_w")
    assert_same(sw, rsw, "scale_w")
    assert_same(col, ref.expert_amax(w, transposed=True), "col_amax")


def test_col_amax_rows_per_program_keeps_the_gpu_busy():
    """128 rows per program down to the count that still makes MIN_COL_AMAX_PROGRAMS programs over
    E groups of N rows (a dense linear's 8192 token rows: 64 rows, 128 programs; a dense 4096 x 4096
    weight: 32 rows), a power of two, at least 1."""
    from moe_fp8.quant.kernels.rowwise import MIN_COL_AMAX_PROGRAMS, ROWS_PER_PROGRAM, col_amax_rows_per_program

    assert [col_amax_rows_per_program(m) for m in (0, 1, 255, 256, 8192, 16384, 1 << 20)] == [1, 1, 1, 2, 64, 128,
                                                                                               128]
    assert [col_amax_rows_per_program(n, e) for n, e in ((4096, 1), (14336, 1), (4096, 8), (1536, 128))] == [
        32, 64, 128, 128]
    for n, e in itertools.product([*range(1, 70000, 997), 16383, 16384, 32767], (1, 3, 8)):
        rows = col_amax_rows_per_program(n, e)
        assert rows & (rows - 1) == 0 and rows <= ROWS_PER_PROGRAM
        assert rows == 1 or e * n >= rows * MIN_COL_AMAX_PROGRAMS  # enough programs of whole row blocks
        assert rows == ROWS_PER_PROGRAM or e * n < 2 * rows * MIN_COL_AMAX_PROGRAMS  # the largest such


def test_col_amax_tile_and_programs_follow_the_bytes_per_step():
    """Rows of 1025 to 4096 elements step WIDE_STEP_ELEMENTS (two to four rows), others
    TILE_ELEMENTS; launches whose steps read less than FULL_STEP_BYTES keep twice the programs
    (bf16 rows of 7168: 32 rows per program over 8192 tokens; of 4096, two per step: 64)."""
    from moe_fp8.quant.kernels.rowwise import (FULL_STEP_BYTES, MIN_COL_AMAX_PROGRAMS, TILE_ELEMENTS,
                                               WIDE_STEP_ELEMENTS, col_amax_defaults, col_amax_min_programs,
                                               col_amax_tile, rowwise_config)

    wide, base = WIDE_STEP_ELEMENTS, TILE_ELEMENTS
    assert [col_amax_tile(k) for k in (0, 16, 1024, 1025, 2048, 4096, 4097, 7168, 16384)] == [
        base, base, base, wide, wide, wide, base, base, base]
    for k in range(1, 16385, 97):
        assert rowwise_config(1 << 20, k, tile=col_amax_tile(k))["BLOCK_M"] >= (2 if 1024 < k <= 4096 else 1)
    assert col_amax_min_programs(2, 4096, 2) == col_amax_min_programs(1, 8192, 2) == MIN_COL_AMAX_PROGRAMS
    assert col_amax_min_programs(1, FULL_STEP_BYTES // 2 - 1, 2) == 2 * MIN_COL_AMAX_PROGRAMS
    assert [col_amax_defaults(8192, k) for k in (4096, 5120, 7168, 14336, 1536)] == [
        (64, wide), (32, base), (32, base), (64, base), (32, wide)]
    assert col_amax_defaults(1536, 2048, 128) == (128, wide)  # 128 experts: whole strips of 128 rows


@pytest.mark.interpreter
@pytest.mark.parametrize("K", [1100, 2500, 4096])
def test_group_rowwise_amax_default_config_two_rows_per_step_cpu(K):
    """The launcher's own configuration where it steps four (K = 1100) or two rows at a time: odd row
    and group counts, an empty group, outputs starting as garbage; the reference's bytes and amaxes."""
    x = hard_input((37, K), seed=K)
    offs = torch.tensor([10, 10, 29], dtype=torch.int32)
    q = torch.empty((37, K), dtype=torch.float8_e4m3fn)
    s = torch.empty(37)
    for t in (q, s):
        t.view(torch.uint8).fill_(0x55)
    amax = torch.zeros(3, K)
    launch_group_rowwise_amax(x, q, s, amax.view(torch.int32), offs, E4M3FN, True)
    rq, rs = ref.quantize_rowwise(x, E4M3FN, pow2=True)
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")
    assert_same(amax, ref.group_amax(x, offs), "amax")
