"""Forward+backward of a dense Llama3-8B SwiGLU MLP (4096 -> 14336 -> 4096, T=8192): ``FP8Linear``
(``convert_to_fp8``) per recipe against BF16 and TorchAO's ``Float8Linear`` (compiled), peak memory
and SQNR against BF16, timed as the MoE layers are (``layer.measure``)."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import convert_to_fp8
from ..testing import sqnr
from . import layer


class _MLP(nn.Module):
    def __init__(self, dim: int = 4096, hidden: int = 14336):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def collect(device: str, tokens: int = 8192, dim: int = 4096, hidden: int = 14336) -> list[dict]:
    """One row per variant (on the CPU: 32 tokens, 64 -> 96 -> 64)."""
    layer.DEVICE = device
    if device != "cuda":
        tokens, dim, hidden = 32, 64, 96
    rows = []
    torch.manual_seed(1)  # the same data in every run: SQNRs compare across runs and commits
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    flops = 6 * tokens * 3 * dim * hidden
    variants = [("bf16", None), ("ours rowwise", "rowwise"), ("ours rowwise_gw_hp", "rowwise_gw_hp"),
                ("ours tensorwise", "tensorwise")]
    try:
        if device != "cuda":
            raise ImportError("TorchAO's Float8Linear needs a GPU")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for r in ("rowwise", "rowwise_with_gw_hp", "tensorwise"):
            variants.append((f"torchao {r} (compiled)", ("torchao", r)))
    except ImportError:
        print("torchao not installed: no TorchAO rows")
    base = ref_out = ao_ms = None
    for label, how in variants:
        torch.manual_seed(0)
        mlp = _MLP(dim, hidden).to(device, torch.bfloat16)
        if isinstance(how, str):
            convert_to_fp8(mlp, recipe=how)
        elif isinstance(how, tuple):
            convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe_name(how[1]))
            mlp = torch.compile(mlp)
        step = layer.fwd_bwd(mlp, x, dy)
        out = step().detach()
        ms, peak = layer.measure(step)
        if how is None:
            base, ref_out = ms, out
        rows.append(dict(layer=f"llama3_8b_mlp {dim}x{hidden}", tokens=tokens, recipe=label, ms=ms,
                         tflops=flops / ms / 1e9, speedup=base / ms, peak_gib=peak, sqnr_vs_bf16=sqnr(ref_out, out)))
        if label == "torchao rowwise (compiled)":
            ao_ms = ms
        print(f"{'llama3_8b_mlp':16s} {label:28s} {ms:8.2f} ms {base / ms:5.2f}x  peak {peak:6.2f} GiB", flush=True)
    for r in rows:
        r["speedup_vs_torchao"] = ao_ms / r["ms"] if ao_ms else None
    return rows
