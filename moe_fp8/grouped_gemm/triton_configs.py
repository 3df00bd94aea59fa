"""Tile configurations of the Triton FP8 grouped GEMM (:mod:`.triton_kernel`).

A small heuristic table keyed on the stable problem dims (``N``, ``K``, number of groups, scale
granularity) and the device: no autotuning, so the first call compiles one kernel and later calls
with a different token count reuse it. Under the CPU interpreter (``TRITON_INTERPRET=1``) tiny tiles
keep CI fast while still exercising multi-tile, masking and group-boundary paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernel_backend import launch_target

__all__ = ["GemmConfig", "config_2d3d", "config_2d2d", "config_dgrad_quantize_w"]

SCALE_TENSORWISE, SCALE_ROWWISE, SCALE_BLOCKWISE, SCALE_NONE = 0, 1, 2, 3  # SCALE_NONE: bf16 / fp16 operands
BLOCKWISE_BLOCK = 128  # 1x128 activation blocks, 128x128 weight blocks


@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration.

    2D x 3D: output tile ``block_m x block_n`` of ``(M, N)``, reduction tile ``block_k`` over K;
    ``group_m`` output row tiles share a column sweep (L2 reuse of the weight tiles).
    2D x 2D: output tile ``block_m x block_n`` of one group's ``(N, K)``, reduction tile
    ``block_k`` over that group's rows; ``group_m`` as above within a group.

    ``fast_accum``: on sm90 let the FP8 tensor-core accumulator run over the whole reduction
    (Triton's default there, ``use_fast_accum=True`` in ``torch._scaled_mm`` terms); ``False``
    promotes the partial sum into the fp32 accumulator after every ``block_k`` slice (CUTLASS's
    default: more registers, so smaller tiles). Ignored off sm90 and in the interpreter.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    fast_accum: bool = True


def config_2d3d(n: int, k: int, num_groups: int, scale_mode: int, device: torch.device) -> GemmConfig:
    """Configuration of the 2D x 3D kernel (forward / dgrad) for weights ``(num_groups, n, k)``."""
    target = launch_target(device)
    if target.kind == "interpreter":
        return GemmConfig(16, 16, BLOCKWISE_BLOCK if scale_mode == SCALE_BLOCKWISE else 32, 2, 1, 1)
    if scale_mode == SCALE_BLOCKWISE:
        # Two fp32 tiles live at once (running sum + the current 128-deep slice): 128x128.
        return GemmConfig(128, 128, BLOCKWISE_BLOCK, 8, 3 if target.is_sm90() else 2, 8)
    if target.kind == "hip":
        return GemmConfig(128, 128, 64, 8, 2, 8)
    if not target.is_sm90():
        # sm89 / sm120: ~100 KB of shared memory per block.
        return GemmConfig(128, 128, 64, 8, 3, 8)
    wide = n >= 256 and n % 256 == 0
    return GemmConfig(128, 256 if wide else 128, 128, 8, 3 if wide else 4, 8)


def config_2d2d(n: int, k: int, num_groups: int, scale_mode: int, device: torch.device,
                accumulate: bool = False) -> GemmConfig:
    """Configuration of the 2D x 2D kernel (wgrad) producing ``(num_groups, n, k)``; ``accumulate``:
    adding to an existing output, whose tile the epilogue holds beside the accumulator."""
    target = launch_target(device)
    if target.kind == "interpreter":
        return GemmConfig(16, 16, 16, 2, 1, 1)
    if target.kind == "hip":
        return GemmConfig(128, 128, 64, 8, 2, 8)
    if not target.is_sm90():
        return GemmConfig(128, 128, 64, 8, 3, 8)
    bf16 = scale_mode == SCALE_NONE
    block_k = 64 if bf16 else 128  # 2-byte operands: half the depth in the same shared memory
    if accumulate:  # the fastest of benchmarks/bench_grad_accumulation.py's sweep on an H100
        # BF16: 96 KiB of operand stages, two programs per SM, one's read-add-write epilogue under the
        # other's main loop (0.74-0.76x the 4-stage 8-warp tile's time); FP8: 256 x 128, half the
        # re-reads of the K-side operand (0.84-0.95x).
        return GemmConfig(128, 128, block_k, 8, 3, 4) if bf16 else GemmConfig(256, 128, block_k, 8, 3, 8)
    wide = k >= 256 and k % 256 == 0
    return GemmConfig(128, 256 if wide else 128, block_k, 8, 3 if wide else 4, 8)


def config_dgrad_quantize_w(device: torch.device) -> GemmConfig:
    """Configuration of the dgrad kernel that quantizes the high-precision weight in registers
    (computed transposed: ``block_n`` output columns are the MMA's M side, ``block_m`` rows its N
    side)."""
    target = launch_target(device)
    if target.kind == "interpreter":
        return GemmConfig(16, 16, 32, 2, 1, 1)
    if target.kind == "hip":  # 128 rows spilled registers on gfx950 in the offline compile (not run on AMD)
        return GemmConfig(64, 128, 64, 8, 2, 8)
    if not target.is_sm90():
        return GemmConfig(128, 128, 64, 8, 2, 8)
    # the fastest of benchmarks/bench_dgrad_quantize_w.py's sweep on an H100, every shape: 256 rows
    # per tile halve the conversions of each weight tile (one per row tile of its expert)
    return GemmConfig(256, 128, 64, 8, 4, 8)
