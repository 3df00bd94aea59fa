"""``auto_lag``: how many column blocks the column-wise quantizer's workers trail their members by.

The rule (``(lag + 1)`` column blocks of all rows within half the L2, at most ``MAX_LAG``) against
the H200 sweep it was fitted to, its bounds, and that a launch without an explicit lag uses it.
"""

import pytest
import torch

from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.kernels import colwise
from moe_fp8.quant.kernels.colwise import MAX_LAG, auto_lag, colwise_config

L2_H200 = 50 << 20


@pytest.mark.parametrize("rows,lag", [
    (8 * 4096, 4),    # DeepSeek-V3 dgrad W1 (8x4096x7168): lag 4 won in the sweep
    (8 * 7168, 2),    # DeepSeek-V3 dgrad W2 (8x7168x2048): lag 2 won, 4 lost to it
    (16 * 8192, 0),   # Llama 4 dgrad: every lag lost
    (128 * 1536, 0),  # Qwen3 dgrad: every lag lost
    (32768, 4),       # DeepSeek-V3 wgrad operands: lag 4 won
    (65536, 2),       # Qwen3 wgrad operands: lags 1-4 level
])
def test_auto_lag_matches_the_h200_sweep(rows, lag):
    assert auto_lag(rows, 64, 2, L2_H200) == lag


def test_auto_lag_bounds():
    assert auto_lag(0, 64, 2, L2_H200) == MAX_LAG
    assert auto_lag(16, 64, 2, L2_H200) == MAX_LAG
    assert auto_lag(1 << 24, 64, 2, L2_H200) == 0
    assert auto_lag(32768, 64, 4, L2_H200) == 2  # fp32 input: twice the bytes per block
    assert auto_lag(32768, 64, 2, 4 << 20) == 0  # a small L2 (e.g. an MI300 XCD's 4 MiB)
    lags = [auto_lag(rows, 64, 2, L2_H200) for rows in range(0, 1 << 18, 997)]
    assert lags == sorted(lags, reverse=True)  # more rows never get a longer lag
    with pytest.raises(ValueError, match="lag"):
        colwise_config(lag=-1)


class _RecordingKernel:
    """Stands in for ``_colwise_kernel``: records each launch's grid and LAG, launches nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid[0], kw["LAG"]))


@pytest.mark.parametrize("rows,explicit", [(150, None), (70000, None), (300000, None), (70000, 1)])
def test_launch_resolves_the_lag(monkeypatch, rows, explicit):
    """Without an explicit lag the launch passes ``auto_lag(rows, BLOCK_C, element size, L2)`` and sizes
    its grid with it; an explicit lag wins."""
    rec = _RecordingKernel()
    monkeypatch.setattr(colwise, "_colwise_kernel", rec)
    a = torch.zeros(rows, 40, dtype=torch.bfloat16)
    qa = torch.empty(rows, 40, dtype=torch.float8_e4m3fn)
    sa = torch.empty(2, 40)
    offs = torch.tensor([rows // 2, rows], dtype=torch.int32)
    config = colwise_config(chunk=256, block_c=16, lag=explicit)
    colwise.launch_group_colwise(a, qa, sa, None, None, None, offs, None, E4M3FN, False, config=config)
    lag = auto_lag(rows, 16, 2, colwise.l2_cache_bytes(a.device)) if explicit is None else explicit
    n_chunks, n_blocks = -(-rows // 256), -(-40 // 16)
    assert rec.launches == [((n_blocks + lag) * 2 * n_chunks, lag)]
