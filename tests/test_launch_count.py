"""How many device kernels one forward+backward of a small FP8MoE enqueues (Triton launches through
moe_fp8.launch plus kernel-launching torch ops, counted by moe_fp8.testing.launches), pinned exactly.

On the CPU the layer runs the Triton backend in the interpreter, whose BF16 grouped GEMMs and zeroing
of what they leave undefined are plain torch ops (a GPU runs other kernels there), so the numbers are
the CPU's, and they move with any change of the launches on the hot path. If a change adds or removes launches on purpose, run
    TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_launch_count.py
and put the printed counts into EXPECTED (with the reason in the commit message)."""

import pytest
import torch

from moe_fp8 import FP8MoE
from moe_fp8.testing.launches import count_launches

T, H, I, E, K = 24, 32, 32, 4, 2

# (recipe, weight cache) -> (total, triton) kernels of one forward+backward, the third of the same
# weights. Without FP8 copies (cache_weights=False) these small groups read the weights' kept amaxes:
# both GEMMs of each weight quantize it inside, no layout kernel.
EXPECTED = {("rowwise", True): (68, 15), ("bf16", True): (83, 5), ("rowwise", False): (68, 15)}


def _count(recipe: str, cache: bool):
    torch.manual_seed(0)
    moe = FP8MoE(H, I, E, K, recipe=recipe, backend="triton", cache_weights=cache).to(torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the weight caches keep copies (or amaxes) from the second forward of these weights
        moe(x).float().sum().backward()
    moe.zero_grad()
    with count_launches() as n:
        moe(x).float().sum().backward()
    return n


@pytest.mark.slow(8)
@pytest.mark.parametrize("recipe,cache", sorted(EXPECTED))
def test_launch_count_of_a_forward_backward(recipe, cache):
    n = _count(recipe, cache)
    assert (n.total, n.triton) == EXPECTED[recipe, cache], (
        f"{recipe}, cache_weights={cache}: one FP8MoE forward+backward now enqueues {n.total} kernels "
        f"({n.triton} Triton launches), "
        f"EXPECTED says {EXPECTED[recipe, cache]}. If the change is meant, update EXPECTED in {__file__} "
        f"(`TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_launch_count.py` prints the counts). "
        f"By name: {sorted(n.ops.items())}"
    )


def _dense_count(cache_weights: bool):
    from moe_fp8 import FP8Linear

    torch.manual_seed(0)
    lin = FP8Linear(64, 48, dtype=torch.bfloat16, cache_weights=cache_weights)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the cache keeps the layouts from the second forward of this weight
        lin(x).float().sum().backward()
    with count_launches() as n:
        lin(x).float().sum().backward()
    return n


def test_dense_weight_cache_saves_three_kernels():
    """An FP8Linear (rowwise, 40 x 64 -> 48) forward+backward after two steps: with its weight cache
    hitting, the weight's two quantization launches (5 -> 3 Triton launches) and the zeroing of its
    column amax are gone (23 -> 20 kernels with torch 2.13's CPU ``_scaled_mm``; the stand-in GEMM of
    older torch launches more torch ops, as many either way)."""
    plain, cached = _dense_count(False), _dense_count(True)
    assert (plain.triton, cached.triton) == (5, 3), (sorted(plain.ops.items()), sorted(cached.ops.items()))
    assert plain.total - cached.total == 3, (sorted(plain.ops.items()), sorted(cached.ops.items()))


def test_counter_counts_kernels_not_views_or_allocations():
    x = torch.randn(8, 8)
    with count_launches() as n:
        y = torch.empty(4)
        x.reshape(-1)[:4].view(2, 2).t().unsqueeze(0).expand(3, 2, 2)  # views
        (x + 1).sum()  # two kernels
        y.zero_()  # one
    assert (n.total, n.torch, n.triton) == (3, 3, 0), n.ops


def _accumulating_count(recipe: str, fused: bool):
    torch.manual_seed(0)
    moe = FP8MoE(H, I, E, K, recipe=recipe, backend="triton").to(torch.bfloat16)
    moe.experts.fused_grad_accumulation = fused
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the weights hold a .grad from here on
        moe(x).float().sum().backward()
    with count_launches() as n:
        moe(x).float().sum().backward()
    return n


@pytest.mark.slow(8)
def test_fused_grad_accumulation_drops_autograds_adds():
    """A micro-batch that accumulates: with ``fused_grad_accumulation`` the two expert weights'
    gradients are added by their weight-gradient GEMMs (one Triton launch each, the BF16 ones too,
    which otherwise run ``torch._grouped_mm`` and the zeroing of empty groups), and autograd's two
    adds into ``.grad`` are gone."""
    plain, fused = _accumulating_count("rowwise", False), _accumulating_count("rowwise", True)
    assert fused.total == plain.total - 2 and fused.triton == plain.triton
    assert fused.ops["aten.add_"] == plain.ops["aten.add_"] - 2
    plain, fused = _accumulating_count("bf16", False), _accumulating_count("bf16", True)
    assert fused.ops["aten.add_"] == plain.ops["aten.add_"] - 2
    assert fused.ops["aten._grouped_mm"] == plain.ops["aten._grouped_mm"] - 2
    assert fused.ops["triton:_grouped_mm_2d2d_kernel"] == 2 and fused.triton == plain.triton + 2


if __name__ == "__main__":
    for r, cache in sorted(EXPECTED):
        c = _count(r, cache)
        print(f'("{r}", {cache}): ({c.total}, {c.triton}),', sorted(c.ops.items()))
