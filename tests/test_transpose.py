"""``transposed_copy``: bit for bit ``t.transpose(-2, -1)`` made contiguous, 2D and 3D, odd sizes,
1/2/4-byte dtypes (every bit pattern), strided inputs, empty tensors; the torch fallback; a GPU check
on the DeepSeek-V3 weight shape."""

from __future__ import annotations

import pytest
import torch

from moe_fp8.grouped_gemm import transpose
from moe_fp8.grouped_gemm.transpose import transposed_copy

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def random_bits(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=g, dtype=torch.uint8)
    return raw.view(dtype).to(device)


def assert_transposed(got: torch.Tensor, t: torch.Tensor) -> None:
    want = t.transpose(-2, -1).contiguous()
    assert got.shape == want.shape and got.dtype == t.dtype and got.is_contiguous()
    assert got.data_ptr() != t.data_ptr() or t.numel() == 0
    assert torch.equal(got.view(_BITS[t.element_size()]), want.view(_BITS[t.element_size()]))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(3, 200, 130), (1, 16, 16), (150, 37), (2, 1, 300)], ids=str)
def test_matches_torch(shape, dtype):
    # 200 x 130 bytes: full and partial 128-byte tiles on both axes (bf16 / fp32: 64 / 32 wide)
    t = random_bits(shape, dtype, seed=sum(shape))
    assert_transposed(transposed_copy(t), t)


@pytest.mark.interpreter
def test_strided_inputs_and_empty():
    big = random_bits((4, 40, 96), torch.float8_e4m3fn, seed=1)
    assert_transposed(transposed_copy(big[1:3, 5:37, 10:90]), big[1:3, 5:37, 10:90])  # row strides 96
    assert_transposed(transposed_copy(big[0].t()), big[0].t())  # column stride 96: copied first
    empty = torch.empty(3, 0, 7, dtype=torch.bfloat16)
    assert transposed_copy(empty).shape == (3, 7, 0)


@pytest.mark.interpreter
def test_fallback_without_triton(monkeypatch):
    t = random_bits((2, 33, 17), torch.float8_e4m3fn, seed=2)
    monkeypatch.setattr(transpose, "use_triton", lambda kernel, x: False)
    assert_transposed(transposed_copy(t), t)


def test_bad_arguments():
    with pytest.raises(ValueError, match="t"):
        transposed_copy(torch.zeros(2, 3, 4, 5))
    with pytest.raises(TypeError, match="t"):
        transposed_copy(torch.zeros(3, 4, dtype=torch.complex64))


@pytest.mark.gpu
def test_gpu_weight_shape():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    t = random_bits((8, 4096, 7168), torch.float8_e4m3fn, seed=3, device="cuda")
    assert_transposed(transposed_copy(t), t)
