"""``auto_lag``: how many column blocks the column-wise quantizer's workers trail their members by.

The rule (``(lag + 1)`` column blocks of all rows within 2/5 of the L2, at most ``MAX_LAG``, at
least 1 in jagged launches) against the H200 sweep it was fitted to
(``benchmarks/results/colwise_lag.md``), its bounds, and that a launch without an explicit lag
uses it.
"""

import pytest
import torch

from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.kernels import colwise
from moe_fp8.quant.kernels.colwise import MAX_LAG, auto_lag, colwise_config

L2_H200 = 60 << 20  # as the H200 reports it


@pytest.mark.parametrize("rows,jagged,lag", [
    (8 * 4096, False, 4),    # DeepSeek-V3 dgrad W1 (8x4096x7168): lags 3 and 4 won (within 1%)
    (8 * 7168, False, 2),    # DeepSeek-V3 dgrad W2 (8x7168x2048): lag 2 won, 3 lost 3% to it
    (32 * 4096, False, 0),   # DeepSeek-V3 E=32 and Llama 4 dgrad (16 MiB blocks): every lag lost
    (128 * 1536, False, 0),  # Qwen3 dgrad: every lag lost
    (32768, True, 4),        # DeepSeek-V3 wgrad operands: lag 4 won
    (65536, True, 2),        # DeepSeek-V3 / Qwen3 wgrad, 65536 rows: lags 1 and 2 level, best
    (131072, True, 1),       # DeepSeek-V3 wgrad, 131072 rows: lag 1 won, lag 0 slowest
])
def test_auto_lag_matches_the_h200_sweep(rows, jagged, lag):
    assert auto_lag(rows, 64, 2, L2_H200, jagged) == lag


def test_auto_lag_bounds():
    for jagged in (False, True):
        assert auto_lag(0, 64, 2, L2_H200, jagged) == MAX_LAG
        assert auto_lag(16, 64, 2, L2_H200, jagged) == MAX_LAG
        assert auto_lag(1 << 24, 64, 2, L2_H200, jagged) == int(jagged)
        assert auto_lag(32768, 64, 2, 4 << 20, jagged) == int(jagged)  # a small L2 (an MI300 XCD's 4 MiB)
        lags = [auto_lag(rows, 64, 2, L2_H200, jagged) for rows in range(0, 1 << 18, 997)]
        assert lags == sorted(lags, reverse=True)  # more rows never get a longer lag
    assert auto_lag(32768, 64, 4, L2_H200, True) == 2  # fp32 input: twice the bytes per block
    with pytest.raises(ValueError, match="lag"):
        colwise_config(lag=-1)


class _RecordingKernel:
    """Stands in for ``_colwise_kernel``: records each launch's grid and LAG, launches nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid[0], kw["LAG"]))


@pytest.mark.parametrize("rows,explicit", [(150, None), (70000, None), (450000, None), (70000, 1)])
def test_launch_resolves_the_lag(monkeypatch, rows, explicit):
    """Without an explicit lag the launch passes ``auto_lag(rows, BLOCK_C, element size, L2, jagged)`` and sizes
    its grid with it; an explicit lag wins."""
    rec = _RecordingKernel()
    monkeypatch.setattr(colwise, "_colwise_kernel", rec)
    a = torch.zeros(rows, 40, dtype=torch.bfloat16)
    qa = torch.empty(rows, 40, dtype=torch.float8_e4m3fn)
    sa = torch.empty(2, 40)
    offs = torch.tensor([rows // 2, rows], dtype=torch.int32)
    config = colwise_config(chunk=256, block_c=16, lag=explicit)
    colwise.launch_group_colwise(a, qa, sa, None, None, None, offs, None, E4M3FN, False, config=config)
    lag = auto_lag(rows, 16, 2, colwise.l2_cache_bytes(a.device), True) if explicit is None else explicit
    n_chunks, n_blocks = -(-rows // 256), -(-40 // 16)
    assert rec.launches == [((n_blocks + lag) * 2 * n_chunks, lag)]


@pytest.mark.parametrize("experts,rows", [(2, 300), (1, 450000)])
def test_uniform_launch_resolves_the_lag(monkeypatch, experts, rows):
    """The expert (dgrad) launch: uniform groups, so no lower bound of 1 (450000 rows of 16 columns
    take more than 1/5 of the L2: lag 0 here, where a jagged launch would get 1)."""
    rec = _RecordingKernel()
    monkeypatch.setattr(colwise, "_colwise_kernel", rec)
    w = torch.zeros(experts, rows, 40, dtype=torch.bfloat16)
    q = torch.empty(experts, 40, rows, dtype=torch.float8_e4m3fn)
    s = torch.empty(experts, 40)
    config = colwise_config(chunk=256, block_c=16)
    colwise.launch_expert_colwise_t(w, q, s, E4M3FN, False, config=config)
    lag = auto_lag(experts * rows, 16, 2, colwise.l2_cache_bytes(w.device), False)
    assert lag == (4 if rows == 300 else 0)
    n_chunks, n_blocks = -(-experts * rows // 256), -(-40 // 16)
    assert rec.launches == [((n_blocks + lag) * 2 * n_chunks, lag)]
