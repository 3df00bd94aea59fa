import math

import pytest
import torch

from moe_fp8.testing import (
    OFFSET_KINDS,
    group_sizes,
    random_offsets,
    reference_grouped_mm,
    reference_moe_forward,
    sqnr,
    ulp,
)


def test_sqnr():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert sqnr(x, x) == math.inf
    assert sqnr(x, x * 1.1) == pytest.approx(20.0, abs=1e-6)  # noise = 0.1 * signal
    assert math.isnan(sqnr(x, torch.full_like(x, float("nan"))))
    with pytest.raises(ValueError, match="x: expected shape"):
        sqnr(x, x[:3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp_is_the_gap_to_the_next_value(dtype):
    """``ulp`` at a value of ``dtype``'s grid is the gap to the next larger one, normals and
    subnormals alike, on random bit patterns."""
    largest = 0x7BFF if dtype == torch.float16 else 0x7F7F  # the largest finite value's bits
    bits = torch.randint(0, largest, (4096,), generator=torch.Generator().manual_seed(3), dtype=torch.int16)
    x = bits.view(dtype)
    following = (bits + 1).view(dtype)
    assert torch.equal(ulp(x, dtype), following.float() - x.float())


@pytest.mark.parametrize("kind", OFFSET_KINDS)
@pytest.mark.parametrize("multiple_of", [1, 16])
def test_random_offsets(kind, multiple_of):
    g = torch.Generator().manual_seed(1)
    offs = random_offsets(160, 7, kind, multiple_of=multiple_of, generator=g)
    sizes = group_sizes(offs)
    assert offs.dtype == torch.int32 and offs.shape == (7,)
    assert offs[-1] == 160 and (sizes >= 0).all() and (sizes % multiple_of == 0).all()
    if kind == "empty":
        assert (sizes == 0).sum() >= 2
    if kind == "one":
        assert (sizes > 0).sum() == 1


def test_random_offsets_bad():
    with pytest.raises(ValueError, match="kind"):
        random_offsets(10, 2, "weird")
    with pytest.raises(ValueError, match="num_rows"):
        random_offsets(10, 2, multiple_of=16)


def test_reference_moe_forward_matches_dense_loop():
    g = torch.Generator().manual_seed(2)
    T, H, I, E, k = 6, 8, 4, 3, 2
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    out = reference_moe_forward(x, ids, wts, w1, w2)
    for t in range(T):
        want = torch.zeros(H, dtype=torch.float64)
        for j in range(k):
            e = int(ids[t, j])
            gate, up = (w1[e].double() @ x[t].double()).chunk(2)
            want += wts[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(out[t], want, rtol=1e-12, atol=1e-12)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    ref = reference_grouped_mm(x, w2.transpose(1, 2).contiguous()[:, :, :H], offs)
    assert ref.shape == (T, I)
