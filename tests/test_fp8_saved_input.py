"""The first GEMM saving its input's FP8 rows (``save_x_fp8`` / ``fp8_saved_input``): the weight
gradient equals the usual one computed on the dequantized rows, bitwise; outputs, input gradients
and the other gradients are unchanged; the BF16 rows are never read (a NaN stand-in changes
nothing) and the layer saves no BF16 copy of its permuted input."""

import pytest
import torch

from moe_fp8 import FP8GroupedExperts, fp8_grouped_mm
from moe_fp8.grouped_gemm.autograd import dequantize_rows
from moe_fp8.quant import quantize_rowwise
from moe_fp8.quant.recipes import get_recipe
from moe_fp8.routing import padded_num_rows

BACKEND = "emulated"


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def _grads(x, w, offs, dy, backend=BACKEND, **kw):
    x = x.detach().clone().requires_grad_(x.stride(0) != 0)
    w = w.detach().clone().requires_grad_()
    out = fp8_grouped_mm(x, w, offs, backend=backend, **kw)
    out.backward(dy)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_wgrad_reads_the_dequantized_rows(recipe, device):
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 3]  # an empty expert, odd sizes
    M, K, N = sum(counts) + 2, 48, 32  # two rows past the groups
    x = (torch.randn(M, K, generator=gen) * 3).to(device, torch.bfloat16)
    w = torch.randn(len(counts), N, K, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(M, N, generator=gen).to(device, torch.bfloat16)
    offs = _offsets(counts).to(device)
    backend = BACKEND if device == "cpu" else None
    q, s = quantize_rowwise(x, torch.float8_e4m3fn)
    out, dx, dw = _grads(x, w, offs, dy, backend, recipe=recipe, x_fp8=(q, s), save_x_fp8=True)
    want_out, want_dx, _ = _grads(x, w, offs, dy, backend, recipe=recipe, x_fp8=(q, s))
    _, _, want_dw = _grads(dequantize_rows(q, s, x.dtype), w, offs, dy, backend, recipe=recipe)
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    assert not dw[1].any()  # the empty expert
    # x is never read: a NaN zero-stride stand-in gives the same output and weight gradient
    stand_in = torch.full((), float("nan"), dtype=torch.bfloat16, device=device).expand(M, K)
    got = _grads(stand_in, w, offs, dy, backend, recipe=recipe, x_fp8=(q, s), save_x_fp8=True)
    assert torch.equal(got[0], out) and torch.equal(got[2], dw)


def test_dequantize_rows_in_chunks(monkeypatch):
    import moe_fp8.grouped_gemm.autograd as autograd

    q, s = quantize_rowwise(torch.randn(37, 64).to(torch.bfloat16), torch.float8_e4m3fn)
    want = (q.float() * s[:, None]).to(torch.bfloat16)
    monkeypatch.setattr(autograd, "_DEQUANTIZE_ELEMENTS", 64 * 5)  # 5 rows per chunk
    assert torch.equal(dequantize_rows(q, s, torch.bfloat16), want)


def _layer_grads(layer, x, ids, w, dy):
    layer.zero_grad(set_to_none=True)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = layer(x, ids, w)
    out.backward(dy)
    return out.detach(), x.grad, w.grad, layer.gate_up_proj.grad, layer.down_proj.grad


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2_scales", "exact_scales"])
def test_layer_saves_fp8_rows_and_changes_only_the_gate_up_gradient(pow2):
    """Saving the FP8 rows changes only the gate_up weight gradient (its input is quantized twice:
    by row, then by expert column); with power-of-two scales the second quantization is exact
    wherever the value stays a normal FP8 number."""
    torch.manual_seed(0)
    E, H, I, T, k = 4, 64, 48, 23, 2
    recipe = get_recipe("rowwise", pow2_scales=pow2)
    plain = FP8GroupedExperts(E, H, I, recipe=recipe, backend=BACKEND).to(torch.bfloat16)
    saving = FP8GroupedExperts(E, H, I, recipe=recipe, backend=BACKEND, fp8_saved_input=True).to(torch.bfloat16)
    saving.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[0, 1] = -1
    w = torch.rand(T, k, generator=gen)
    dy = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    saved = {}
    rows = padded_num_rows(T * k, E, empty_group_rows=True)  # the layer's permuted rows

    def run(layer):
        saved[layer] = []

        def pack(t):
            if t.dtype == torch.bfloat16 and t.shape == (rows, H) and t.stride()[0] != 0:
                saved[layer].append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return _layer_grads(layer, x, ids, w, dy)

    want, got = run(plain), run(saving)
    for name, g, r in zip(("out", "grad x", "grad weights", "grad down_proj"), got[:3] + got[4:], want[:3] + want[4:]):
        assert torch.equal(g, r), name
    d1 = (got[3].float() - want[3].float()).norm() / want[3].float().norm()
    if pow2:  # scaling by powers of two is exact: the column quantization of the FP8 rows loses nothing here
        assert d1 == 0, d1
    else:
        assert 0 < d1 < 0.1, d1  # the input quantized twice: close, not equal
    # (M, H) bf16 saved: the permuted input and the experts' output; with FP8 rows saved, the output only
    assert len(saved[plain]) == 2 and len(saved[saving]) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="fp8_saved_input"):
        FP8GroupedExperts(2, 32, 32, recipe="tensorwise", fp8_saved_input=True)
    x, w = torch.randn(4, 32).to(torch.bfloat16), torch.randn(1, 16, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="save_x_fp8"):
        fp8_grouped_mm(x, w, _offsets([4]), backend=BACKEND, save_x_fp8=True)
