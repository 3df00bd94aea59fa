"""FP8 all-gather pieces in one process: ``QuantizedExpertWeight`` through ``fp8_grouped_mm``
(bitwise the GEMM of the weights it quantizes), its errors, ``parallelize(fp8_all_gather=True)``'s
refusals (before it changes the model), and the byte counts that docs/distributed.md quotes.
The 4-rank training comparison is ``fsdp_workers.fp8_all_gather_exact`` (``test_parallelize.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import fsdp_workers
from moe_fp8 import FP8GroupedExperts, fp8_grouped_mm
from moe_fp8.grouped_gemm import QuantizedExpertWeight, WeightOperands
from moe_fp8.grouped_gemm import library as lib
from moe_fp8.parallel import parallelize
from moe_fp8.parallel.fp8_all_gather import check_experts, gathered_bytes
from moe_fp8.quant.recipes import get_recipe
from moe_fp8.testing import random_offsets

E, N, K, M = 4, 32, 48, 40
POW2 = get_recipe("rowwise").pow2_scales  # the operands of the GEMMs' own recipe


def _operands(w_gemm: torch.Tensor) -> tuple[tuple, tuple]:
    """The forward and dgrad layouts of ``w_gemm (E, N, K)``, quantized as the FP8 all-gather does."""
    q_fwd, s_fwd, col_amax = lib.quantize_weight_forward_layout(w_gemm, "e4m3fn", POW2, False)
    return (q_fwd, s_fwd), lib.quantize_weight_dgrad_layout(w_gemm, col_amax, "e4m3fn", POW2, False)


@pytest.mark.parametrize("in_out", [False, True], ids=["nn_linear", "in_out_layout"])
def test_quantized_weight_is_the_gemm_of_its_weights(in_out):
    """Forward layout in forward, dgrad layout put in its place before backward (as FSDP's gathers
    do): output and both gradients bitwise those of ``fp8_grouped_mm`` on the weights themselves."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn((E, K, N) if in_out else (E, N, K), generator=gen).requires_grad_()
    x = torch.randn(M, K, generator=gen).requires_grad_()
    g = torch.randn(M, N, generator=gen)
    offs = random_offsets(M - 3, E, "empty", generator=gen)

    def gemm_weight(p):
        return p.transpose(1, 2) if in_out else p

    y = fp8_grouped_mm(x, gemm_weight(param), offs, backend="emulated")
    want = (y, *torch.autograd.grad(y, (x, param), g))

    forward, dgrad = _operands(gemm_weight(param.detach()))
    operands = WeightOperands(torch.float32, "e4m3fn", POW2, forward=forward)
    weight = QuantizedExpertWeight(operands, param.shape, param.stride(), param.dtype, param.device,
                                   gemm_orientation=not in_out, requires_grad=True)
    y = fp8_grouped_mm(x, gemm_weight(weight), offs, backend="emulated")
    operands.forward, operands.dgrad = None, dgrad  # gathered anew for the backward
    got = (y, *torch.autograd.grad(y, (x, weight), g))
    for name, a, b in zip(("out", "dx", "dw"), got, want):
        assert type(a) is torch.Tensor and torch.equal(a, b), name


def test_quantized_weight_errors_and_no_rows():
    w = torch.randn(E, N, K)
    forward, _ = _operands(w)
    operands = WeightOperands(torch.float32, "e4m3fn", POW2, forward=forward)
    weight = QuantizedExpertWeight(operands, w.shape, w.stride(), w.dtype, w.device, True, requires_grad=True)
    x, offs = torch.randn(M, K, requires_grad=True), torch.tensor([10, 20, 30, M], dtype=torch.int32)
    assert "layouts held=['forward']" in repr(weight)
    with pytest.raises(NotImplementedError, match="holds no values"):
        weight + 1
    with pytest.raises(ValueError, match="float32 weights"):  # quantized from fp32, the GEMM runs in bf16
        fp8_grouped_mm(x.bfloat16(), weight.to(torch.bfloat16), offs, backend="emulated")
    with pytest.raises(ValueError, match="row-scaled"):
        fp8_grouped_mm(x, weight, offs, recipe="tensorwise", backend="emulated")
    with pytest.raises(ValueError, match="storage orientation"):
        fp8_grouped_mm(x[:, :N], weight.transpose(1, 2), offs, backend="emulated")
    y = fp8_grouped_mm(x[:0], weight, torch.zeros(E, dtype=torch.int32), backend="emulated")  # no rows: dw = 0
    assert torch.equal(torch.autograd.grad(y.sum(), weight)[0], torch.zeros(E, N, K))
    y = fp8_grouped_mm(x, weight, offs, backend="emulated")
    with pytest.raises(RuntimeError, match="dgrad layout of its FP8 operands is not held"):  # not gathered again
        y.sum().backward()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "ep"))
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe, options, error, match", [
    ("rowwise", dict(reshard_after_forward=False), ValueError, "reshard_after_forward=True"),
    ("rowwise", dict(compile=True), NotImplementedError, "compile"),
    ("rowwise", dict(cache_weights=True), ValueError, "cache_weights"),
    ("rowwise", dict(blocks=[]), ValueError, "root FSDP unit"),
    ("bf16", {}, ValueError, "nothing to quantize"),
    ("tensorwise", {}, NotImplementedError, "row scales"),
])
def test_parallelize_refuses_what_it_cannot_do_exactly(mesh, recipe, options, error, match):
    model = fsdp_workers.tiny_lm(recipe)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(error, match=match):
        parallelize(model, mesh, fp8_all_gather=True, **options)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert all(type(p) is torch.nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_shards_of_whole_experts_only():
    experts = FP8GroupedExperts(8, 32, 32, backend="emulated")
    check_experts(experts, ep=2, shards=2)  # 4 experts per ep rank, 2 per shard
    with pytest.raises(ValueError, match="whole experts"):
        check_experts(experts, ep=2, shards=3)


def test_gathered_bytes_of_docs():
    """The per-gather numbers docs/distributed.md quotes (one ep rank's experts of a layer)."""
    for E_, H, I, fp8_up, fp8_down, bf16_up, bf16_down in (
        (32, 7168, 2048, 940_441_600, 470_679_552, 1_879_048_192, 939_524_096),  # DeepSeek-V3
        (128, 2048, 768, 403_701_760, 202_375_168, 805_306_368, 402_653_184),  # Qwen3-30B-A3B
    ):
        assert gathered_bytes(E_, 2 * I, H) == fp8_up and gathered_bytes(E_, H, I) == fp8_down
        assert gathered_bytes(E_, 2 * I, H, fp8=False) == bf16_up and gathered_bytes(E_, H, I, fp8=False) == bf16_down
