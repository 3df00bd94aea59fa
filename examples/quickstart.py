"""Quick start: quantize MoE activations and expert weights to FP8, run the FP8 grouped GEMM
through the exact CPU reference (the ``emulated`` backend) and compare with BF16.

Run with ``make demo`` (CPU is enough). Prints one line per routing pattern: the SQNR of the
FP8 output against the BF16 grouped GEMM and against an fp64 reference.
"""

import torch

from moe_fp8 import detect_format
from moe_fp8.grouped_gemm import emulated_grouped_mm_2d3d
from moe_fp8.quant.reference import quantize_expert_colwise, quantize_rowwise
from moe_fp8.testing import OFFSET_KINDS, group_sizes, random_offsets, reference_grouped_mm, sqnr


def main() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden, expert_hidden, experts = 512, 256, 128, 8
    fmt = detect_format()
    print(f"FP8 format: {fmt.name} (max {fmt.max:g}); {tokens} routed tokens, {experts} experts, "
          f"x ({tokens}, {hidden}) @ W_e^T with W ({experts}, {expert_hidden}, {hidden})")
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(experts, expert_hidden, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16)
    xq, x_scale = quantize_rowwise(x, fmt)  # (M, K) fp8, (M,) fp32
    wq, w_scale = quantize_expert_colwise(w, fmt)  # (E, N, K) fp8, (E, N) fp32
    print(f"{'routing':<9} {'tokens per expert':<40} {'SQNR vs bf16':>13} {'vs fp64':>8}")
    for kind in OFFSET_KINDS:
        offs = random_offsets(tokens, experts, kind, generator=g)
        out_fp8 = emulated_grouped_mm_2d3d(xq, x_scale, wq, w_scale, offs)
        out_bf16 = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        ref = reference_grouped_mm(x, w, offs)
        sizes = str(group_sizes(offs).tolist())
        print(f"{kind:<9} {sizes:<40} {sqnr(out_bf16, out_fp8):>10.1f} dB {sqnr(ref, out_fp8):>5.1f} dB")


if __name__ == "__main__":
    main()
