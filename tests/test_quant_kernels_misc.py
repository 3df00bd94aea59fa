"""Block-wise and tensor-wise Triton quantizers, dispatch, bad input and torch.compile.

Block/tensor-wise results equal the reference byte for byte; ``moe_fp8.quant.quantize_*`` runs the
kernels under the interpreter or on a GPU and the reference otherwise; bad input raises a
TypeError/ValueError naming the argument; ``torch.compile(fullgraph=True)`` traces the custom ops.
"""

import pytest
import torch
from quant_kernel_cases import FORMAT_IDS, FORMATS, assert_same, hard_input, poison_device_cache

import moe_fp8.quant as quant
from moe_fp8.quant import ops
from moe_fp8.quant import reference as ref
from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ
from moe_fp8.quant.ops import (
    triton_quantize_blockwise,
    triton_quantize_expert_colwise,
    triton_quantize_expert_colwise_dual,
    triton_quantize_expert_colwise_from_amax,
    triton_quantize_expert_rowwise_with_amax,
    triton_quantize_group_colwise_dual,
    triton_quantize_rowwise,
    triton_quantize_rowwise_with_group_amax,
    triton_quantize_expert_tensorwise,
    triton_quantize_tensorwise,
)


def _check_blockwise(x, block, pow2, fmt):
    poison_device_cache(x.device)
    q, s = triton_quantize_blockwise(x, fmt, block, pow2)
    rq, rs = ref.quantize_blockwise(x, fmt, block=block, pow2=pow2)
    assert q.is_contiguous() and s.is_contiguous()
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


def _check_tensorwise(x, pow2, fmt, *, per_expert=False):
    """Tensorwise kernel (one scale, or one per expert of ``(E, N, K)``) against the reference."""
    poison_device_cache(x.device)
    kernel, reference = ((triton_quantize_expert_tensorwise, ref.quantize_expert_tensorwise) if per_expert
                         else (triton_quantize_tensorwise, ref.quantize_tensorwise))
    q, s = kernel(x, fmt, pow2)
    rq, rs = reference(x, fmt, pow2=pow2)
    assert q.is_contiguous()
    assert_same(q, rq, "q")
    assert_same(s, rs, "scale")


# ------------------------------------------------------------------------------ CPU (interpreter)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (150, 300), (2, 130, 200)], ids=str)
def test_blockwise_cpu(shape, block, pow2, fmt):
    _check_blockwise(hard_input(shape, seed=sum(shape)), block, pow2, fmt)


@pytest.mark.interpreter
def test_blockwise_other_blocks_strides_empty_cpu():
    x = hard_input((3, 70, 96), torch.float32, seed=4)
    _check_blockwise(x, (1, 16), False, E4M3FN)
    _check_blockwise(x, (32, 64), True, E4M3FN)
    _check_blockwise(x.transpose(1, 2), (1, 128), False, E4M3FN)
    for shape in [(0, 128), (4, 0), (0, 5, 16)]:
        _check_blockwise(torch.randn(shape).bfloat16(), (1, 128), False, E4M3FN)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(), (1,), (7, 300), (3, 2, 5000)], ids=str)
def test_tensorwise_cpu(shape, pow2, fmt):
    x = hard_input(shape, seed=len(shape)) if len(shape) > 1 else torch.randn(shape).bfloat16() * 3
    _check_tensorwise(x, pow2, fmt)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("pow2", [False, True])
def test_expert_tensorwise_cpu(pow2, fmt):
    """Experts of very different ranges (one all zero), several programs per expert, odd sizes."""
    w = hard_input((5, 48, 352), seed=6) * torch.tensor([1e-3, 1.0, 0.0, 3.0, 1.0]).view(5, 1, 1)
    _check_tensorwise(w.bfloat16(), pow2, fmt, per_expert=True)


@pytest.mark.interpreter
def test_expert_tensorwise_strided_and_empty_cpu():
    w = hard_input((3, 40, 48), torch.float32, seed=8)
    _check_tensorwise(w.transpose(1, 2), False, E4M3FN, per_expert=True)  # copied to contiguous first
    for shape in [(0, 16, 16), (2, 0, 16)]:
        _check_tensorwise(torch.randn(shape).bfloat16(), False, E4M3FN, per_expert=True)


@pytest.mark.interpreter
def test_tensorwise_zeros_strides_empty_cpu():
    _check_tensorwise(torch.zeros(10, 10, dtype=torch.bfloat16), False, E4M3FN)
    _check_tensorwise(hard_input((40, 30), torch.float16, seed=2).t(), True, E4M3FN)
    _check_tensorwise(torch.randn(0, 3).bfloat16(), False, E4M3FN)


def _check_tensorwise_rows(x, n):
    """The amax over the first ``n`` rows only (the kernel, the reference, and the reference on
    ``x[:n]`` agree on the scale and on those rows' bytes; the other rows share the scale)."""
    rows = torch.tensor([n, 123], dtype=torch.int32, device=x.device)  # only the first element counts
    q, s = triton_quantize_tensorwise(x, E4M3FN, rows=rows)
    rq, rs = ref.quantize_tensorwise(x, E4M3FN, rows=rows)
    assert_same(s, rs, "scale")
    assert_same(q[: max(n, 0)], rq[: max(n, 0)], "q")
    head = x[: max(n, 0)]
    if head.numel():
        hq, hs = ref.quantize_tensorwise(head, E4M3FN)
        assert_same(s, hs, "scale of the head")
        assert_same(q[:n], hq, "q of the head")
    else:  # no row counts: the scale of an all-zero tensor
        assert_same(s, ref.quantize_tensorwise(torch.zeros(1), E4M3FN)[1], "scale")


@pytest.mark.interpreter
@pytest.mark.parametrize("n", [0, 5, 37, 40, 60])
def test_tensorwise_rows_cpu(n):
    # rows past n hold NaN and huge values: with n < 40 they must not reach the scale
    x = hard_input((40, 300), seed=3)
    x[max(n, 0):] = float("nan") if n % 2 else 1e30
    _check_tensorwise_rows(x.bfloat16(), n)


@pytest.mark.interpreter
def test_tensorwise_rows_no_rows_cpu():
    _check_tensorwise_rows(torch.randn(0, 300).bfloat16(), 0)


def test_tensorwise_rows_bad_arguments():
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="rows"):
        triton_quantize_tensorwise(x, E4M3FN, rows=torch.tensor([2]))  # int64
    with pytest.raises(ValueError, match="rows"):
        triton_quantize_tensorwise(x, E4M3FN, rows=torch.zeros(0, dtype=torch.int32))


@pytest.mark.interpreter
def test_dispatch_uses_triton_under_interpreter_and_reference_without(monkeypatch):
    calls = []
    x = hard_input((9, 32), seed=1)

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ops, "triton_quantize_rowwise", spy("triton", ops.triton_quantize_rowwise))
    monkeypatch.setattr(ref, "quantize_rowwise", spy("reference", ref.quantize_rowwise))
    q1, s1 = quant.quantize_rowwise(x, E4M3FN, pow2=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    q2, s2 = quant.quantize_rowwise(x, E4M3FN, pow2=True)
    assert calls[0] == "triton" and calls[-1] == "reference"
    assert_same(q1, q2, "q")
    assert_same(s1, s2, "scale")


@pytest.mark.interpreter
def test_dispatch_matches_reference_for_every_quantizer():
    x, w = hard_input((40, 48), seed=3), hard_input((2, 24, 32), seed=4)
    offs = torch.tensor([10, 10, 33], dtype=torch.int32)
    pairs = [
        (quant.quantize_tensorwise(x, E4M3FN), ref.quantize_tensorwise(x, E4M3FN)),
        (quant.quantize_rowwise(x, E4M3FN, pow2=True), ref.quantize_rowwise(x, E4M3FN, pow2=True)),
        (quant.quantize_expert_tensorwise(w, E4M3FN), ref.quantize_expert_tensorwise(w, E4M3FN)),
        (quant.quantize_expert_colwise(w, E4M3FN, transposed=True), ref.quantize_expert_colwise(w, E4M3FN, transposed=True)),
        (quant.quantize_group_colwise(x, offs, E4M3FN), ref.quantize_group_colwise(x, offs, E4M3FN)),
        (quant.quantize_blockwise(w, E4M3FN, block=(128, 128)), ref.quantize_blockwise(w, E4M3FN, block=(128, 128))),
        (quant.quantize_blockwise(x, E4M3FN, block=(3, 5)), ref.quantize_blockwise(x, E4M3FN, block=(3, 5))),
    ]
    for (q, s), (rq, rs) in pairs:
        assert q.is_contiguous()
        assert_same(q, rq, "q")
        assert_same(s, rs, "scale")


_I = torch.ones(4, 16, dtype=torch.int32)
_X = torch.ones(4, 16, dtype=torch.bfloat16)
_OFFS = torch.tensor([2, 4], dtype=torch.int32)
BAD = [
    (lambda: triton_quantize_rowwise(_I), TypeError, "x"),
    (lambda: triton_quantize_rowwise([[1.0]]), TypeError, "x"),
    (lambda: triton_quantize_rowwise(_X[None]), ValueError, "x"),
    (lambda: triton_quantize_rowwise(_X, "e4m3"), ValueError, "fmt"),
    (lambda: triton_quantize_rowwise(_X, torch.float32), TypeError, "fmt"),
    (lambda: triton_quantize_expert_colwise(_X), ValueError, "w"),
    (lambda: triton_quantize_expert_colwise_dual(_I[None]), TypeError, "w"),
    (lambda: triton_quantize_expert_rowwise_with_amax(_X), ValueError, "w"),
    (lambda: triton_quantize_expert_colwise_from_amax(_X[None], torch.ones(1, 16, dtype=torch.bfloat16)), TypeError,
     "col_amax"),
    (lambda: triton_quantize_expert_colwise_from_amax(_X[None], torch.ones(1, 4)), ValueError, "col_amax"),
    (lambda: triton_quantize_expert_colwise_from_amax(_X[None], torch.ones(16)), ValueError, "col_amax"),
    (lambda: triton_quantize_group_colwise_dual(_I, _X, _OFFS), TypeError, "a"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS, a_amax=torch.ones(2, 16, dtype=torch.float16)),
     TypeError, "a_amax"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS, b_amax=torch.ones(3, 16)), ValueError, "b_amax"),
    (lambda: triton_quantize_rowwise_with_group_amax(_X, _OFFS.long()), TypeError, "offs"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X[:3], _OFFS), ValueError, "b"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS.long()), TypeError, "offs"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS[None]), ValueError, "offs"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, torch.tensor([2, 0, 4, 0], dtype=torch.int32)[::2]),
     ValueError, "offs"),  # not contiguous
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS, padded_offs=_OFFS), ValueError, "padded"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS, padded_offs=_OFFS[:1], padded_rows=32),
     ValueError, "padded_offs"),
    (lambda: triton_quantize_group_colwise_dual(_X, _X, _OFFS, padded_offs=_OFFS, padded_rows=-1),
     ValueError, "padded_rows"),
    (lambda: triton_quantize_blockwise(_X, block=(1, 100)), ValueError, "block"),
    (lambda: triton_quantize_blockwise(_X, block=(1, 128, 1)), ValueError, "block"),
    (lambda: triton_quantize_blockwise(_X[0]), ValueError, "x"),
    (lambda: triton_quantize_tensorwise(_I), TypeError, "x"),
    (lambda: torch.ops.moe_fp8.quantize_rowwise(_I, "e4m3fn", False), TypeError, "x"),
]


@pytest.mark.parametrize("call,error,name", BAD, ids=[f"{i}_{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=rf"^{name}"):
        call()


def _compiled_pipeline(x, w, a, b, offs):
    """Every custom op in one graph; returns dequantized results to compare with eager."""
    qx, sx = triton_quantize_rowwise(x, E4M3FN, True)
    qf, sf, qb, sb = triton_quantize_expert_colwise_dual(w, E4M3FN)
    qt, st = triton_quantize_expert_colwise(w, E4M3FN, False, True)
    qr, sr, col_amax = triton_quantize_expert_rowwise_with_amax(w, E4M3FN)
    qc, sc = triton_quantize_expert_colwise_from_amax(w, col_amax, E4M3FN)
    qa, sa, qg, sg = triton_quantize_group_colwise_dual(a, b, offs, E4M3FN)
    qk, sk = triton_quantize_blockwise(x, E4M3FN, (1, 128))
    qz, sz = triton_quantize_tensorwise(x, E4M3FN)
    return [qx.float() * sx[:, None], qf.float() * sf[..., None], qb.float() * sb[..., None],
            qt.float() * st[..., None], qr.float() * sr[..., None], col_amax, qc.float() * sc[..., None],
            qa.t().float(), sa, qg.t().float(), sg, qk.float(), sk, qz.float() * sz]


def _check_compile(device, backend):
    torch._dynamo.reset()
    x, w = hard_input((24, 256), seed=1, device=device), hard_input((2, 32, 48), seed=2, device=device)
    a, b = hard_input((40, 32), seed=3, device=device), hard_input((40, 16), seed=4, device=device)
    offs = torch.tensor([10, 10, 33], dtype=torch.int32, device=device)
    eager = _compiled_pipeline(x, w, a, b, offs)
    compiled = torch.compile(_compiled_pipeline, fullgraph=True, backend=backend)(x, w, a, b, offs)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.interpreter
def test_compile_fullgraph_cpu():
    _check_compile("cpu", "aot_eager")


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    _check_compile("cuda", "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 7168), (4, 1000, 2050)], ids=str)
def test_blockwise_gpu(shape):
    x = hard_input(shape, seed=5, device="cuda")
    for block in ((1, 128), (128, 128)):
        _check_blockwise(x, block, True, E4M3FN)


@pytest.mark.gpu
def test_tensorwise_gpu():
    x = hard_input((8192, 7168), seed=6, device="cuda")
    _check_tensorwise(x, False, E4M3FN)
    x[5000:] = float("nan")
    _check_tensorwise_rows(x, 5000)
    _check_tensorwise(hard_input((1000, 999), torch.float32, seed=7, device="cuda"), True, E4M3FN)
    _check_tensorwise(hard_input((8, 2048, 7168), seed=8, device="cuda"), False, E4M3FN, per_expert=True)
    _check_tensorwise(hard_input((128, 1536, 2048), seed=9, device="cuda"), True, E4M3FN, per_expert=True)


@pytest.mark.gpu
def test_fnuz_on_nvidia_is_refused_gpu():
    if torch.version.hip is not None:
        pytest.skip("ROCm writes fnuz")
    with pytest.raises(ValueError, match="^fmt"):
        triton_quantize_rowwise(torch.ones(4, 16, device="cuda"), E4M3FNUZ)
