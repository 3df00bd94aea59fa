"""FP8Linear / convert_to_fp8 against fp64 references and the BF16 layer."""

import importlib
import logging

import pytest
import torch
from torch import nn

from moe_fp8 import FP8Linear, convert_to_fp8
from moe_fp8.layers.fp8_linear import fp8_linear
from moe_fp8.layers.scaled_mm import cpu_kernel_takes_row_scales
from moe_fp8.quant.recipes import get_recipe
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.testing import sqnr


def _data(M=40, K=64, N=48, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise"])
@pytest.mark.parametrize("M", [40, 3, 64])  # token counts not multiples of 16 pad for wgrad
def test_fp8_linear_vs_fp64(recipe, M):
    x, w, b, dy = _data(M=M)
    y, gx, gw, gb = _grads(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), x, w, b, dy)
    y64, gx64, gw64, gb64 = _grads(lambda x, w, b: x @ w.T + b, x.double(), w.double(), b.double(), dy.double())
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert sqnr(y64, y) > 25
    assert sqnr(gx64, gx) > 25
    assert sqnr(gw64, gw) > (30 if recipe == "rowwise_gw_hp" else 22)
    assert torch.allclose(gb.double(), gb64, rtol=1e-2, atol=1e-2)


# Bit-equality with torch's own CPU kernel, where it takes row scales (torch 2.11 and older: per-tensor
# only, and FP8Linear then uses its stand-in, checked in test_scaled_mm.py).
_ROW_SCALES_KERNEL = pytest.mark.skipif(not cpu_kernel_takes_row_scales(),
                                        reason="this torch's CPU torch._scaled_mm takes per-tensor scales only")


@_ROW_SCALES_KERNEL
def test_forward_equals_scaled_mm_of_reference_quantization():
    x, w, _, _ = _data()
    pow2 = get_recipe("rowwise").pow2_scales
    xq, xs = quantize_rowwise(x, pow2=pow2)
    wq, ws = quantize_rowwise(w, pow2=pow2)
    ref = torch._scaled_mm(xq, wq.t(), xs[:, None], ws[None, :], out_dtype=torch.bfloat16, use_fast_accum=True)
    assert torch.equal(fp8_linear(x, w, recipe="rowwise"), ref)


def _spec_grads(x, w, dy, recipe, grad_fmt=None):
    """dgrad and wgrad exactly as the recipe defines them: each GEMM operand quantized with the
    reference quantizer in the layout ``torch._scaled_mm`` takes (token rows zero-padded to 16);
    ``grad_fmt``: grad_out's format (default: the forward's)."""
    from moe_fp8.quant import reference as ref

    pow2 = get_recipe(recipe).pow2_scales

    def q(t, fmt=None):  # rows of a 2-D tensor, row-major result and a (rows, 1) or () scale
        if recipe == "tensorwise":
            return ref.quantize_tensorwise(t.contiguous(), fmt, pow2=pow2)
        qt, st = ref.quantize_rowwise(t.contiguous(), fmt, pow2=pow2)
        return qt, st[:, None]

    def mm(a, b_t):  # a (M, K) @ b (K, N), b_t = b.T quantized (N, K)
        (aq, as_), (bq, bs) = a, b_t
        bs = bs if bs.dim() == 0 else bs.reshape(1, -1)
        return torch._scaled_mm(aq, bq.t(), as_, bs, out_dtype=torch.bfloat16, use_fast_accum=True)

    pad = -x.shape[0] % 16
    xp, dyp = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (x, dy))
    return mm(q(dy, grad_fmt), q(w.t())), mm(q(dyp.t(), grad_fmt), q(xp.t()))


@pytest.mark.parametrize("recipe", [pytest.param("rowwise", marks=_ROW_SCALES_KERNEL), "tensorwise"])
@pytest.mark.parametrize("M", [48, 37])
def test_backward_equals_scaled_mm_of_reference_quantization(recipe, M):
    x, w, b, dy = _data(M=M)
    _, gx, gw, _ = _grads(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), x, w, b, dy)
    want_gx, want_gw = _spec_grads(x, w, dy, recipe)
    assert torch.equal(gx, want_gx)
    assert torch.equal(gw, want_gw)


def _record_quantizers(monkeypatch) -> list[str]:
    """The quantizers ``fp8_linear`` calls, in order: the one-read column-amax functions of
    ``quant_seam`` (``wgrad_operands[amax]`` when both wgrad operands come with their amaxes) and
    the standalone ``rowwise`` / ``colwise`` quantizers."""
    module = importlib.import_module("moe_fp8.layers.dense_quant")  # FP8Linear's operand quantizers
    calls = []

    def spy(owner, name, label):
        real = getattr(owner, name)

        def recording(*args, **kwargs):
            both = kwargs.get("a_amax") is not None and kwargs.get("b_amax") is not None
            calls.append(f"{label}[amax]" if label == "wgrad_operands" and both else label)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recording)

    for name, label in (("quantize_activation_group_amax", "rows+amax"), ("quantize_weight_forward_layout", "w+amax"),
                        ("quantize_weight_dgrad_layout", "w_t from amax"), ("quantize_weight_layout", "w_t"),
                        ("quantize_wgrad_operands", "wgrad_operands")):
        spy(module.quant_seam, name, label)
    spy(module, "quantize_rowwise", "rowwise")
    spy(module, "quantize_expert_colwise", "colwise")
    return calls


_ONE_READ = ["rows+amax", "w+amax", "rows+amax", "w_t from amax", "wgrad_operands[amax]"]


# Which quantizers run, and that the result is the recipe's exactly in every case: the column amaxes
# taken from the row quantizations (the default), rows too long for the one-read kernels (K, then N;
# the long_rows fixture lowers the limit to 256), a gradient format of its own, x without a gradient.
@pytest.mark.parametrize("case, M, K, N, want", [
    ("default", 37, 64, 48, _ONE_READ),
    ("default", 48, 64, 48, _ONE_READ),
    ("long K", 37, 304, 48, ["rowwise", "rowwise", "rowwise", "w_t", "colwise", "colwise"]),
    ("long N", 37, 64, 304, ["rowwise", "w+amax", "rowwise", "w_t from amax", "colwise", "colwise"]),
    ("e5m2 grads", 37, 64, 48, ["rowwise", "w+amax", "rowwise", "w_t from amax", "colwise", "colwise"]),
    ("x frozen", 37, 64, 48, ["rowwise", "rowwise", "colwise", "colwise"]),  # no dgrad: no amax of W
])
def test_rowwise_quantizers_and_bytes(monkeypatch, request, case, M, K, N, want):
    if not cpu_kernel_takes_row_scales():
        pytest.skip("this torch's CPU torch._scaled_mm takes per-tensor scales only")
    if case.startswith("long"):
        request.getfixturevalue("long_rows")
    recipe = get_recipe("rowwise")
    grad_fmt = None
    if case == "e5m2 grads":
        recipe, grad_fmt = recipe.replace(grad_format="e5m2"), "e5m2"
    x, w, b, dy = _data(M=M, K=K, N=N, seed=M + K + N)
    calls = _record_quantizers(monkeypatch)
    x = x.requires_grad_(case != "x frozen")
    w = w.clone().requires_grad_()
    fp8_linear(x, w, recipe=recipe).backward(dy)
    assert calls == want
    want_gx, want_gw = _spec_grads(x.detach(), w.detach(), dy, "rowwise", grad_fmt)
    assert torch.equal(w.grad, want_gw)
    if case != "x frozen":
        assert torch.equal(x.grad, want_gx)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise"])
def test_column_major_input_equals_contiguous(recipe):
    """The quantizers read x through its strides: a column-major x gives the contiguous x's results."""
    x, w, b, dy = _data(M=37)
    column_major = x.t().contiguous().t()
    want = _grads(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), x, w, b, dy)
    got = _grads(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), column_major, w, b, dy)
    assert not column_major.is_contiguous()
    for g, e in zip(got, want):
        assert torch.equal(g, e)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise"])
def test_empty_batch(recipe):
    """No token rows: an empty output and input gradient, a zero weight gradient (never the memory a
    GEMM with an empty reduction leaves)."""
    torch.full((1 << 16,), float("nan")).sum()  # the allocator's next blocks held NaN
    _, w, b, _ = _data(K=64, N=48)
    x = torch.randn(0, 64, dtype=torch.bfloat16, requires_grad=True)
    w.requires_grad_()
    y = fp8_linear(x, w, b, recipe=recipe)
    y.backward(torch.randn(0, 48, dtype=torch.bfloat16))
    assert y.shape == (0, 48) and x.grad.shape == (0, 64)
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("fast_accum_grads", [True, False])
def test_fast_accum_of_the_gradient_gemms(monkeypatch, fast_accum_grads):
    """The forward GEMM always asks ``torch._scaled_mm`` for fast accumulation; dgrad and wgrad as the
    recipe's ``fast_accum_grads`` says (tensorwise: ``torch._scaled_mm`` on every CPU torch)."""
    asked = []
    real = torch._scaled_mm

    def recording(*args, **kwargs):
        asked.append(kwargs["use_fast_accum"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    recipe = get_recipe("tensorwise").replace(fast_accum_grads=fast_accum_grads)
    x, w, b, dy = _data()
    _grads(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), x, w, b, dy)
    assert asked == [True, fast_accum_grads, fast_accum_grads]


def test_bf16_recipe_is_plain_linear():
    x, w, b, _ = _data()
    assert torch.equal(fp8_linear(x, w, b, recipe="bf16"), nn.functional.linear(x, w, b))


def test_module_matches_functional_and_state_dict_roundtrip():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    fp8 = FP8Linear.from_linear(lin, recipe="rowwise")
    assert fp8.weight is lin.weight and "recipe=rowwise" in repr(fp8)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    out = fp8(x)
    assert out.shape == (2, 5, 32)
    assert torch.equal(out, fp8_linear(x, lin.weight, lin.bias))
    fresh = FP8Linear(64, 32, dtype=torch.bfloat16)
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh(x), out)
    assert set(fresh.state_dict()) == {"weight", "bias"}


def test_autocast_and_frozen_weight():
    torch.manual_seed(1)
    lin = FP8Linear(32, 16)  # fp32 parameters
    lin.weight.requires_grad_(False)
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and lin.weight.grad is None
    assert sqnr(x @ lin.weight.T + lin.bias, y.float()) > 20


def test_convert_to_fp8(caplog):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 20), nn.Linear(20, 16)))
    model.add_module("head", nn.Linear(16, 16))
    with caplog.at_level(logging.INFO, logger="moe_fp8"):
        convert_to_fp8(model, recipe="tensorwise", filter_fn=lambda m, fqn: fqn != "head")
    assert isinstance(model[0], FP8Linear) and model[0].recipe.name == "tensorwise"
    assert type(model[2][0]) is nn.Linear and type(model[2][1]) is nn.Linear  # 20 is not a multiple of 16
    assert type(model.head) is nn.Linear  # filtered out
    assert "2.0 stays in BF16 (not a multiple of 16): 64->20: out_features=20" in caplog.text
    assert "2.1 stays in BF16 (not a multiple of 16): 20->16: in_features=20" in caplog.text
    assert model.fp8_conversion_report["head"].reason == "filter_fn"
    single = convert_to_fp8(nn.Linear(16, 32))
    assert isinstance(single, FP8Linear)


def test_bad_input():
    with pytest.raises(ValueError, match="in_features: expected a multiple of 16"):
        FP8Linear(20, 16)
    with pytest.raises(ValueError, match="out_features: expected a multiple of 16"):
        FP8Linear.from_linear(nn.Linear(16, 20))
    with pytest.raises(ValueError, match="recipe: expected one of"):
        FP8Linear(16, 16, recipe="blockwise")
    with pytest.raises(ValueError, match="x: expected last dim 16"):
        fp8_linear(torch.randn(4, 32), torch.randn(16, 16))


def test_meta_weights_and_device_mismatch():
    meta = FP8Linear(32, 16, device="meta")
    for x in (torch.randn(4, 32), torch.randn(4, 32, device="meta")):
        with pytest.raises(ValueError, match=r"weight: the weights are on the meta device .*to_empty"):
            meta(x)
    with pytest.raises(ValueError, match=r"x: expected device cpu \(that of parameter weight\), got meta"):
        FP8Linear(32, 16)(torch.randn(4, 32, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise"])
def test_fp8_linear_gpu(recipe):
    x, w, b, dy = (t.cuda() for t in _data(M=1000, K=1024, N=512))
    y, gx, gw, _ = _grads(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), x, w, b, dy)
    y64, gx64, gw64, _ = _grads(lambda x, w, b: x @ w.T + b, x.double(), w.double(), b.double(), dy.double())
    assert sqnr(y64, y) > 25 and sqnr(gx64, gx) > 25 and sqnr(gw64, gw) > 22
    torch._dynamo.reset()
    cy, cgx, cgw, cgb = _grads(torch.compile(lambda x, w, b: fp8_linear(x, w, b, recipe=recipe), fullgraph=True),
                               x, w, b, dy)
    assert sqnr(y, cy) > 40 and sqnr(gx, cgx) > 40 and sqnr(gw, cgw) > 40  # Inductor's gradients, not only its output


@pytest.mark.gpu
@pytest.mark.parametrize("M, K, N", [(1000, 1024, 512), (1000, 16400, 512), (1000, 1024, 16400), (8192, 4096, 14336)])
def test_rowwise_gradients_equal_the_recipe_gpu(M, K, N):
    """On the GPU the dgrad and wgrad equal ``torch._scaled_mm`` of the reference quantizations bit
    for bit: the column amaxes from the row quantizations (rows of 16384 or fewer elements) and
    the column-wise kernels (longer rows: K, then N)."""
    x, w, b, dy = (t.cuda() for t in _data(M=M, K=K, N=N))
    _, gx, gw, _ = _grads(lambda x, w, b: fp8_linear(x, w, b, recipe="rowwise"), x, w, b, dy)
    want_gx, want_gw = _spec_grads(x, w, dy, "rowwise")
    assert torch.equal(gx, want_gx)
    assert torch.equal(gw, want_gw)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_gw_hp"])
def test_compile_fullgraph_forward_backward_cpu(recipe):
    """FP8Linear traces with torch.compile(fullgraph=True) (aot_eager on CPU) and equals eager."""
    torch.manual_seed(0)
    lin = FP8Linear(64, 32, recipe=recipe).to(torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16)

    def run(module):
        xr = x.clone().requires_grad_()
        lin.weight.grad = None
        out = module(xr)
        out.backward(torch.ones_like(out))
        return out, xr.grad, lin.weight.grad

    eager = run(lin)
    torch._dynamo.reset()
    compiled = run(torch.compile(lin, fullgraph=True, backend="aot_eager"))
    for want, got in zip(eager, compiled):
        assert torch.equal(got, want)
