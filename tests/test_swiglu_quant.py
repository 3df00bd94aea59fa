import pytest
import torch

from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.quant.swiglu import swiglu_backward, swiglu_backward_quantize, swiglu_quantize, swiglu_reference
from quant_kernel_cases import FNUZ_OK



def _check(M, I, fmt, pow2, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, 2 * I, generator=g) * 3).to(torch.bfloat16)
    if M > 2:
        h[1] = 0  # all-zero row
        h[2, :I] = 40.0  # large values
    h = h.to(device)
    a, q, scale = swiglu_quantize(h, fmt, pow2=pow2)
    ref_a = swiglu_reference(h.cpu())
    # a: torch's silu and the kernel's may differ in the last bit of bf16.
    assert ((a.cpu().float() - ref_a.float()).abs() <= ref_a.float().abs() * 2**-7 + 1e-6).all()
    # q, scale: exactly the reference quantization of the returned a.
    ref_q, ref_scale = quantize_rowwise(a.cpu(), fmt, pow2=pow2)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), ref_scale)


def _check_backward(M, I, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, 2 * I, generator=g, dtype=torch.float64)
    grad_a = torch.randn(M, I, generator=g, dtype=torch.float64)
    h_ref = h.clone().requires_grad_()
    gate, up = h_ref.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad_a)
    grad_h = swiglu_backward(h.to(torch.bfloat16).to(device), grad_a.to(torch.bfloat16).to(device))
    assert grad_h.dtype == torch.bfloat16 and grad_h.shape == (M, 2 * I)
    err = (grad_h.cpu().double() - h_ref.grad).abs()
    assert (err <= h_ref.grad.abs() * 2**-5 + 0.05).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", [E4M3FN] + ([E4M3FNUZ] if FNUZ_OK else []), ids=lambda f: f.name)
@pytest.mark.parametrize("M, I, pow2", [(7, 48, False), (16, 100, True), (1, 16, False), (0, 32, False)])
def test_swiglu_quantize_cpu(M, I, fmt, pow2):
    _check(M, I, fmt, pow2, "cpu")


@pytest.mark.interpreter
@pytest.mark.parametrize("M, I", [(9, 40), (0, 16)])
def test_swiglu_backward_cpu(M, I):
    _check_backward(M, I, "cpu")


def _check_backward_quantize(M, I, fmt, pow2, device, seed=2):
    """The fused backward's grad_h has the bits of the plain backward's; its FP8 rows and scales are
    exactly the reference quantization of that grad_h (zero, huge and tiny rows planted)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, 2 * I, generator=g) * 3).to(torch.bfloat16)
    grad_a = torch.randn(M, I, generator=g).to(torch.bfloat16)
    if M > 3:
        grad_a[1] = 0  # all-zero gradient row
        grad_a[2] *= 1e4  # large
        grad_a[3] *= 1e-6  # FP8 subnormals after scaling of the large gate entries
        h[3, 0] = 30.0
    h, grad_a = h.to(device), grad_a.to(device)
    torch.full((M + 1, 2 * I + 1), float("nan"), device=device)  # dirty the allocator
    grad_h, q, scale = swiglu_backward_quantize(h, grad_a, fmt, pow2=pow2)
    assert torch.equal(grad_h.view(torch.int16), swiglu_backward(h, grad_a).view(torch.int16))
    ref_q, ref_scale = quantize_rowwise(grad_h.cpu(), fmt, pow2=pow2)
    assert q.dtype == fmt.torch_dtype and q.shape == (M, 2 * I) and scale.shape == (M,)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), ref_scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", [E4M3FN] + ([E4M3FNUZ] if FNUZ_OK else []), ids=lambda f: f.name)
@pytest.mark.parametrize("M, I, pow2", [(7, 48, False), (16, 100, True), (1, 16, False), (0, 32, False)])
def test_swiglu_backward_quantize_cpu(M, I, fmt, pow2):
    _check_backward_quantize(M, I, fmt, pow2, "cpu")


@pytest.mark.interpreter
def test_swiglu_backward_quantize_loops_over_wide_rows(monkeypatch):
    """Rows wider than one block: pass 1 and pass 2 loop over column blocks (block shrunk to 16)."""
    import moe_fp8.quant.swiglu as sw

    monkeypatch.setattr(sw, "_blocks", lambda I: (4, 16))
    _check_backward_quantize(9, 40, E4M3FN, False, "cpu", seed=5)


def test_bad_input():
    with pytest.raises(ValueError, match="h: expected an even last dim"):
        swiglu_quantize(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="h: expected dtype"):
        swiglu_quantize(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="grad_a: expected shape"):
        swiglu_backward(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="grad_a: expected shape"):
        swiglu_backward_quantize(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="h: expected an even last dim"):
        swiglu_backward_quantize(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("M, I", [(4096, 2048), (1000, 768), (513, 8192)])
def test_swiglu_quantize_gpu(M, I):
    _check(M, I, E4M3FN, False, "cuda")
    _check(M, I, E4M3FN, True, "cuda")
    _check_backward(M, I, "cuda")
    _check_backward_quantize(M, I, E4M3FN, False, "cuda")
    _check_backward_quantize(M, I, E4M3FN, True, "cuda")


@pytest.mark.interpreter
def test_autograd_function_matches_torch():
    from moe_fp8.quant.swiglu import SwiGLUQuantize

    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 64, generator=g, dtype=torch.bfloat16, requires_grad=True)
    a, q, scale = SwiGLUQuantize.apply(h, E4M3FN, False)
    assert not q.requires_grad and not scale.requires_grad
    grad = torch.randn(6, 32, generator=g, dtype=torch.bfloat16)
    a.backward(grad)
    h64 = h.detach().double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad.double())
    assert ((h.grad.double() - h64.grad).abs() <= h64.grad.abs() * 2**-6 + 1e-2).all()


def test_torch_fallback_matches_kernel_semantics(monkeypatch):
    """Without a GPU or the interpreter the same math runs in torch (a CPU user's path)."""
    import moe_fp8.quant.swiglu as sw

    monkeypatch.setattr(sw, "use_triton", lambda kernel, t: False)  # read when the op runs
    g = torch.Generator().manual_seed(4)
    h = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    a, q, scale = sw.swiglu_quantize(h, E4M3FN)
    gate64, up64 = h.double().chunk(2, dim=-1)  # SwiGLU in fp64, independent of swiglu_reference
    a64 = torch.nn.functional.silu(gate64) * up64
    assert a.dtype == torch.bfloat16 and ((a.double() - a64).abs() <= a64.abs() * 2**-8 + 1e-30).all()
    ref_q, ref_s = quantize_rowwise(a, E4M3FN)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)
    grad_a = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    h64 = h.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad_a.double())
    grad_h = sw.swiglu_backward(h, grad_a)
    assert ((grad_h.double() - h64.grad).abs() <= h64.grad.abs() * 2**-7 + 1e-3).all()
    grad_h_q, q, scale = sw.swiglu_backward_quantize(h, grad_a, E4M3FN)
    ref_q, ref_s = quantize_rowwise(grad_h, E4M3FN)
    assert torch.equal(grad_h_q, grad_h) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_s)
