"""Bandwidth of the Triton FP8 quantization kernels, against device copy and TorchAO.

For every kernel: median GPU time (``triton.testing.do_bench_cudagraph``: calls replayed from a CUDA
graph, so Python and launch overhead are not counted, for TorchAO alike), GB/s over the bytes it
must move (each input read once, each output and scale written once), and that as a fraction of
the device-to-device copy bandwidth measured in the same run; TorchAO's counterpart beside it when
``torchao`` imports. Inputs are random normal bf16 (never zeros). On the CPU (``--quick``): tiny
shapes, kernels in the Triton interpreter, wall-clock times that mean nothing.

Shapes: DeepSeek-V3 (A 32768x7168, W 8x4096x7168 and 8x7168x2048), Llama 4 (A 16384x5120, W
16x8192x5120), Qwen3-30B-A3B (A 65536x2048, W 128x1536x2048 and 128x2048x768); the wgrad operands
of W (E, N, K) are grad_out (M, N) and the activations (M, K) over E balanced groups (multiples of
16 tokens), and as the FP8MoE wgrad calls it ("padded out": groups of any size, written into 16-row
aligned groups of a padded buffer).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from ..grouped_gemm.padding import padded_offsets, padded_rows
from ..quant import ops
from ..quant.formats import E4M3FN
from ..testing import random_offsets
from .timing import wall_median_ms

MODELS = {
    # more_groups: wgrad operands also timed over that many groups (DeepSeek-V3 with 32 local experts)
    "DeepSeek-V3": dict(tokens=32768, hidden=7168, weights=[(8, 4096, 7168), (8, 7168, 2048)], more_groups=(32,)),
    "Llama 4": dict(tokens=16384, hidden=5120, weights=[(16, 8192, 5120)]),
    "Qwen3-30B-A3B": dict(tokens=65536, hidden=2048, weights=[(128, 1536, 2048), (128, 2048, 768)]),
}
SMOKE_MODELS = {"smoke": dict(tokens=64, hidden=48, weights=[(2, 32, 48)], more_groups=(3,))}
FP8 = torch.float8_e4m3fn
DEVICE = "cuda"


def _torchao():
    try:
        import torchao
        from torchao.prototype.moe_training import kernels
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        print(f"torchao not available: {e!r}", file=sys.stderr)
        return None, None
    return kernels, torchao.__version__


def kernel_us(fn: Callable[[], object]) -> float:
    """Median µs of ``fn``'s GPU work, replayed from a CUDA graph (the host's launch time not
    counted); eager calls where capture fails; a wall-clock call on the CPU (smoke runs)."""
    if DEVICE != "cuda":  # smoke run
        return wall_median_ms(fn, calls=1) * 1e3
    try:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 - report and fall back to event timing of eager calls
        print(f"CUDA-graph timing failed ({e!r:.200}); timing eager calls instead", file=sys.stderr)
        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def copy_gbps() -> float:
    """Device-to-device copy of 1 GiB, timed eagerly: captured in a CUDA graph the copy becomes a
    memcpy node that ran at 2.7 TB/s instead of 4.2 on one H200 (2026-11)."""
    src = torch.randn(1 << (29 if DEVICE == "cuda" else 16), device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median") * 1e3 if DEVICE == "cuda" else (
        kernel_us(lambda: dst.copy_(src)))
    return 2 * src.numel() * 2 / us / 1e3


class Table:
    """Rows of the bandwidth table; ``kernels``: substrings of the kernel names to time (None: all)."""

    def __init__(self, copy_gbps: float, kernels: list[str] | None = None):
        self.copy = copy_gbps
        self.kernels = kernels
        self.rows: list[dict] = []

    def wants(self, kernel: str) -> bool:
        return self.kernels is None or any(k in kernel for k in self.kernels)

    def time(self, model, kernel, shape, nbytes, ours_fn, ao_fns=(), **extra) -> None:
        """Times ``ours_fn`` and the TorchAO callables ``ao_fns`` (their medians summed: TorchAO's
        counterpart may be two kernels) and adds the row, if ``kernel`` is wanted."""
        if self.wants(kernel):
            ao_us = sum(kernel_us(f) for f in ao_fns) if ao_fns else None
            self.add(model, kernel, shape, nbytes, kernel_us(ours_fn), ao_us, **extra)

    def add(self, model, kernel, shape, nbytes, ours_us, ao_us=None, **extra):
        row = dict(model=model, kernel=kernel, shape=shape, bytes=nbytes, ours_us=round(ours_us, 2),
                   ours_gbps=round(nbytes / ours_us / 1e3, 1), ours_frac=round(nbytes / ours_us / 1e3 / self.copy, 3))
        if ao_us is not None:
            row.update(torchao_us=round(ao_us, 2), torchao_gbps=round(nbytes / ao_us / 1e3, 1),
                       torchao_frac=round(nbytes / ao_us / 1e3 / self.copy, 3), speedup=round(ao_us / ours_us, 2))
        row.update(extra)
        self.rows.append(row)
        ao = f"  torchao {ao_us:8.1f} us {row['torchao_frac']:5.1%}  x{row['speedup']:.2f}" if ao_us else ""
        print(f"{model:14s} {kernel:28s} {shape:22s} {ours_us:8.1f} us {row['ours_frac']:5.1%}{ao}", flush=True)


def run(models, ao, kernels: list[str] | None = None) -> Table:
    """Times every kernel (or those whose names contain one of ``kernels``) on each model in turn."""
    table = Table(copy_gbps(), kernels)
    print(f"device-to-device copy: {table.copy:.0f} GB/s (read + write)", flush=True)
    gen = torch.Generator().manual_seed(0)

    for model in models:
        spec = MODELS.get(model) or SMOKE_MODELS[model]
        M, H = spec["tokens"], spec["hidden"]
        x = torch.randn(M, H, device=DEVICE, dtype=torch.bfloat16)
        shape = f"{M}x{H}"
        nbytes = M * H * 3 + M * 4
        table.time(model, "rowwise (A)", shape, nbytes, lambda: ops.triton_quantize_rowwise(x, E4M3FN, True),
                   [lambda: ao.triton_fp8_rowwise_2d_scale_and_cast(x, FP8, True)] if ao else ())
        table.time(model, "blockwise 1x128 (A)", shape, M * H * 3 + M * triton.cdiv(H, 128) * 4,
                   lambda: ops.triton_quantize_blockwise(x, E4M3FN, (1, 128), True))
        table.time(model, "tensorwise (A)", shape, nbytes - M * 4 + 4,
                   lambda: ops.triton_quantize_tensorwise(x, E4M3FN, True))
        del x

        for E, N, K in spec["weights"]:
            w = torch.randn(E, N, K, device=DEVICE, dtype=torch.bfloat16) * 0.02
            w_t = w.transpose(-2, -1)  # TorchAO's B_t: (E, K, N) column-major
            shape = f"{E}x{N}x{K}"
            base = E * N * K * 3
            ao_fwd = (lambda: ao.triton_fp8_colwise_3d_scale_and_cast(w_t, FP8, True)) if ao else None
            ao_dgrad = (lambda: ao.triton_fp8_rowwise_3d_transpose_rhs(w_t, FP8, True)) if ao else None
            table.time(model, "expert colwise fwd (W)", shape, base + E * N * 4,
                       lambda: ops.triton_quantize_expert_colwise(w, E4M3FN, True, False), [ao_fwd] if ao else ())
            table.time(model, "expert colwise dgrad (W)", shape, base + E * K * 4,
                       lambda: ops.triton_quantize_expert_colwise(w, E4M3FN, True, True), [ao_dgrad] if ao else ())
            table.time(model, "expert dual fwd+dgrad (W)", shape, E * N * K * 4 + (E * N + E * K) * 4,
                       lambda: ops.triton_quantize_expert_colwise_dual(w, E4M3FN, True),
                       [ao_fwd, ao_dgrad] if ao else (),
                       **({"torchao_note": "sum of TorchAO's two kernels"} if ao else {}))
            table.time(model, "expert fwd + col amax (W)", shape, base + E * N * 4 + E * K * 4,
                       lambda: ops.triton_quantize_expert_rowwise_with_amax(w, E4M3FN, True))
            if table.wants("expert dgrad from amax (W)"):
                _, _, col_amax = ops.triton_quantize_expert_rowwise_with_amax(w, E4M3FN, True)
                table.time(model, "expert dgrad from amax (W)", shape, base + E * K * 8,
                           lambda: ops.triton_quantize_expert_colwise_from_amax(w, col_amax, E4M3FN, True))
            table.time(model, "blockwise 128x128 (W)", shape, base + E * triton.cdiv(N, 128) * triton.cdiv(K, 128) * 4,
                       lambda: ops.triton_quantize_blockwise(w, E4M3FN, (128, 128), True))
            del w, w_t

            a = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
            b = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            for G in (E, *spec.get("more_groups", ())):
                offs = random_offsets(M, G, "balanced", multiple_of=16, generator=gen).to(DEVICE)
                shape = f"{M}x({N}+{K}) E={G}"
                nbytes = M * (N + K) * 3 + G * (N + K) * 4
                table.time(model, "group colwise dual (wgrad)", shape, nbytes,
                           lambda: ops.triton_quantize_group_colwise_dual(a, b, offs, E4M3FN, True),
                           [lambda: ao.triton_fp8_per_group_colwise_scales_dual(a, b, offs, FP8, True)] if ao else ())
                if G == E:
                    skew = random_offsets(M, E, "skewed", multiple_of=16, generator=gen).to(DEVICE)
                    table.time(model, "group colwise dual, skewed", shape, nbytes,
                               lambda: ops.triton_quantize_group_colwise_dual(a, b, skew, E4M3FN, True),
                               group_sizes=torch.diff(skew, prepend=skew.new_zeros(1)).tolist())
                # as the FP8MoE wgrad calls it: routed (unaligned) groups, written 16-row padded
                routed = random_offsets(M, G, "balanced", generator=gen).to(DEVICE)
                p_offs, p_rows = padded_offsets(routed), padded_rows(M, G)
                p_bytes = nbytes + (p_rows - M) * (N + K)
                table.time(model, "group colwise dual, padded out", shape, p_bytes,
                           lambda: ops.triton_quantize_group_colwise_dual(
                               a, b, routed, E4M3FN, True, padded_offs=p_offs, padded_rows=p_rows))
                # the backward since the dgrad's row quantization of grad_out (a) returns its group amax
                if table.wants("group dual, a from amax, padded") or table.wants("group dual, both from amax, padded"):
                    _, _, a_amax = ops.triton_quantize_rowwise_with_group_amax(a, routed, E4M3FN, True)
                    table.time(model, "group dual, a from amax, padded", shape, p_bytes,
                               lambda: ops.triton_quantize_group_colwise_dual(
                                   a, b, routed, E4M3FN, True, padded_offs=p_offs, padded_rows=p_rows, a_amax=a_amax))
                if table.wants("group dual, both from amax, padded"):
                    _, _, b_amax = ops.triton_quantize_rowwise_with_group_amax(b, routed, E4M3FN, True)
                    table.time(model, "group dual, both from amax, padded", shape, p_bytes,
                               lambda: ops.triton_quantize_group_colwise_dual(
                                   a, b, routed, E4M3FN, True, padded_offs=p_offs, padded_rows=p_rows, a_amax=a_amax,
                                   b_amax=b_amax))
                if G == E:
                    table.time(model, "rowwise + group amax (a)", f"{M}x{N} E={G}", M * N * 3 + M * 4 + G * N * 4,
                               lambda: ops.triton_quantize_rowwise_with_group_amax(a, routed, E4M3FN, True))
                    table.time(model, "rowwise (a)", f"{M}x{N}", M * N * 3 + M * 4,
                               lambda: ops.triton_quantize_rowwise(a, E4M3FN, True))
            del a, b
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return table


def collect(models: list[str], device: str) -> tuple[list[dict], dict]:
    """Rows of every kernel on ``models`` (names of ``MODELS``; on the CPU two kernels on the ``smoke`` shape),
    and what the run measured besides (copy bandwidth, TorchAO version)."""
    global DEVICE
    DEVICE = device
    ao, ao_version = _torchao() if device == "cuda" else (None, None)
    if device != "cuda":  # a check of the code paths: two kernels in the interpreter
        return run(list(SMOKE_MODELS), None, ["rowwise (A)", "expert colwise fwd"]).rows, {}
    table = run(models, ao)
    return table.rows, dict(copy_gbps=round(table.copy, 1), torchao=ao_version)
