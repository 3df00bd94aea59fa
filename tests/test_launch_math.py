"""Launch arithmetic in plain Python equals Triton's constexpr functions on the ints launches pass."""

from __future__ import annotations

import triton

from moe_fp8.launch_math import cdiv, next_power_of_2


def test_cdiv_matches_triton():
    for a in list(range(0, 600)) + [2**31 - 1, 2**31, 7 * 2**40 + 3]:
        for b in (1, 2, 3, 7, 16, 64, 100, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton():
    for n in list(range(1, 5000)) + [2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(0) == next_power_of_2(-3) == 1  # the launches' max(n, 1) built in



def test_next_power_of_2_cap():
    """With ``cap`` the result is ``min(power, cap)``. (Traced sizes take the comparison path:
    ``test_compile_visibility.test_token_counts_that_vary``.)"""
    for n in range(-2, 300):
        for cap in (1, 2, 16, 64):
            assert next_power_of_2(n, cap=cap) == min(next_power_of_2(n), cap), (n, cap)
