"""``fp8_grouped_mm`` directly: the MoE expert matmul on tokens already permuted by expert, checked
against BF16 and an fp64 reference (``moe_fp8.testing``) on every routing pattern, forward and backward.

    python examples/grouped_mm.py

On a CPU the FP8 GEMMs run on the ``emulated`` backend (exact reference arithmetic); on a GPU on the
platform's FP8 kernels. Prints one line per routing pattern: SQNR of the output and of both gradients.
"""

import torch

from moe_fp8 import detect_format, fp8_grouped_mm
from moe_fp8.testing import OFFSET_KINDS, group_sizes, random_offsets, reference_grouped_mm, sqnr


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = None if device == "cuda" else "emulated"
    g = torch.Generator().manual_seed(0)
    tokens, hidden, expert_hidden, experts = 512, 256, 128, 8
    print(f"FP8 format: {detect_format().name}; x ({tokens}, {hidden}) @ W_e^T, W ({experts}, {expert_hidden}, "
          f"{hidden}), on {device}")
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(experts, expert_hidden, hidden, generator=g) * hidden**-0.5).to(device, torch.bfloat16)
    w.requires_grad_()
    dy = torch.randn(tokens, expert_hidden, generator=g).to(device, torch.bfloat16)
    print(f"{'routing':<9} {'rows per expert':<38} {'out vs fp64':>11} {'out vs bf16':>11} {'dx':>7} {'dw':>7}")
    for kind in OFFSET_KINDS:  # balanced, skewed, some experts empty, all tokens on one expert
        offs = random_offsets(tokens, experts, kind, generator=g).to(device)  # (E,) int32 cumulative END offsets
        out = fp8_grouped_mm(x, w, offs, recipe="rowwise", backend=backend)  # (M, N) bf16
        dx, dw = torch.autograd.grad(out, (x, w), dy)
        bf16 = fp8_grouped_mm(x, w, offs, recipe="bf16", backend=backend)
        dx_ref, dw_ref = torch.autograd.grad(bf16, (x, w), dy)
        ref = reference_grouped_mm(x.detach(), w.detach(), offs)  # fp64
        print(f"{kind:<9} {str(group_sizes(offs).tolist()):<38} {sqnr(ref, out):>8.1f} dB {sqnr(bf16, out):>8.1f} dB "
              f"{sqnr(dx_ref, dx):>4.1f} dB {sqnr(dw_ref, dw):>4.1f} dB")


if __name__ == "__main__":
    main()
