"""``auto_lag``: how many column blocks the column-wise quantizer's workers trail their members by.

The rule (the largest lag, at most ``MAX_LAG``, with ``(lag + 1) * n_chunks <= 3.5 * multiprocessors``,
at least 1 in jagged launches) against the H200 A/B it was fitted to (``benchmarks/results/
colwise_default_ab.md``: the default 256-row chunks of 32 x 128 tiles, lags 0, 1, 2 and 4), its
bounds, and that a launch without an explicit lag uses it.
"""

import pytest
import torch

from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.kernels import colwise
from moe_fp8.quant.kernels.colwise import MAX_LAG, auto_lag, colwise_config
from moe_fp8.quant.kernels.common import multiprocessor_count

H200_SMS = 132


@pytest.mark.parametrize("n_chunks,jagged,lag", [
    (128, False, 2),   # DeepSeek-V3 dgrad W1 (8x4096x7168): lag 2 won (lag 1 +1%, lag 4 +5%)
    (224, False, 1),   # DeepSeek-V3 dgrad W2 (8x7168x2048): lag 1 won, by 13% over lag 0
    (512, False, 0),   # Llama 4 dgrad: lag 0 won (lag 1 +3%)
    (768, False, 0),   # Qwen3 dgrad W1: lag 0 won (lag 1 +5%)
    (1024, False, 0),  # Qwen3 dgrad W2: lag 0 won (lag 1 +2%)
    (64, True, 4),     # Llama 4 wgrad operands (16384 rows): lag 4 won
    (128, True, 2),    # DeepSeek-V3 wgrad operands (32768 rows, 8 or 32 groups): lag 2 won or within 1.3%
    (256, True, 1),    # Qwen3 wgrad operands (65536 rows): lag 1 won (lag 0 +4%)
])
def test_auto_lag_matches_the_h200_sweep(n_chunks, jagged, lag):
    assert auto_lag(n_chunks, H200_SMS, jagged) == lag


def test_auto_lag_bounds():
    for jagged in (False, True):
        assert auto_lag(0, H200_SMS, jagged) == MAX_LAG
        assert auto_lag(1, H200_SMS, jagged) == MAX_LAG
        assert auto_lag(1 << 20, H200_SMS, jagged) == int(jagged)
        assert auto_lag(64, 16, jagged) == int(jagged)  # a small GPU
        lags = [auto_lag(n, H200_SMS, jagged) for n in range(0, 2000, 7)]
        assert lags == sorted(lags, reverse=True)  # more chunks never get a longer lag
    with pytest.raises(ValueError, match="lag"):
        colwise_config(lag=-1)


class _RecordingKernel:
    """Stands in for ``_colwise_kernel``: records each launch's grid and LAG, launches nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid[0], kw["LAG"]))


def _expected(n_chunks: int, jagged: bool, explicit: int | None = None) -> int:
    """The lag a launch must pass: the explicit one, else ``auto_lag`` with the device's multiprocessor
    count (on the CPU, the interpreter's small constant)."""
    if explicit is not None:
        return explicit
    return auto_lag(n_chunks, multiprocessor_count(torch.device("cpu")), jagged)


@pytest.mark.parametrize("rows,explicit", [(150, None), (1000, None), (3500, None), (1000, 3)])
def test_group_launch_resolves_the_lag(monkeypatch, rows, explicit):
    """Without an explicit lag the jagged launch passes ``auto_lag(chunks, multiprocessors, True)``
    and sizes its grid with it; an explicit lag wins. (On the CPU's count the three row counts give
    lags 4, 2 and 1, the last from the jagged floor.)"""
    rec = _RecordingKernel()
    monkeypatch.setattr(colwise, "_colwise_kernel", rec)
    a = torch.zeros(rows, 40, dtype=torch.bfloat16)
    qa = torch.empty(rows, 40, dtype=torch.float8_e4m3fn)
    sa = torch.empty(2, 40)
    offs = torch.tensor([rows // 2, rows], dtype=torch.int32)
    config = colwise_config(chunk=256, block_c=16, lag=explicit)
    colwise.launch_group_colwise(a, qa, sa, None, None, None, offs, None, E4M3FN, False, config=config)
    n_chunks, n_blocks = -(-rows // 256), -(-40 // 16)
    lag = _expected(n_chunks, True, explicit)
    assert rec.launches == [((n_blocks + lag) * 2 * n_chunks, lag)]


@pytest.mark.parametrize("experts,rows", [(2, 300), (1, 1024), (2, 1750)])
def test_expert_launch_resolves_the_lag(monkeypatch, experts, rows):
    """The expert (dgrad) launch: uniform groups, so no floor of 1 (lags 3, 2 and 0 on the CPU's
    count, where a jagged launch of 3500 rows gets 1)."""
    rec = _RecordingKernel()
    monkeypatch.setattr(colwise, "_colwise_kernel", rec)
    w = torch.zeros(experts, rows, 40, dtype=torch.bfloat16)
    q = torch.empty(experts, 40, rows, dtype=torch.float8_e4m3fn)
    s = torch.empty(experts, 40)
    colwise.launch_expert_colwise_t(w, q, s, E4M3FN, False, config=colwise_config(chunk=256, block_c=16))
    n_chunks, n_blocks = -(-experts * rows // 256), -(-40 // 16)
    lag = _expected(n_chunks, False)
    assert rec.launches == [((n_blocks + lag) * 2 * n_chunks, lag)]


def test_launch_lags_cover_both_floors():
    """The parameters above reach distinct lags, the jagged floor among them (so the tests can fail)."""
    cpu = multiprocessor_count(torch.device("cpu"))
    assert {auto_lag(-(-r // 256), cpu, True) for r in (150, 1000, 3500)} == {4, 2, 1}
    assert auto_lag(-(-3500 // 256), cpu, False) == 0
