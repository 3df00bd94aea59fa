"""Where a dense FP8 linear pays: ``FP8Linear`` (rowwise, cached weights off) against ``nn.Linear``,
forward+backward of one ``(T, K) @ (N, K).T`` at the projection sizes of the benchmark models
(Qwen3-MoE hidden 1024 and 2048, DeepSeek-V3 MLA and dense MLP), timed eagerly (what a host-bound
step sees) and as CUDA-graph replays (GPU time alone). The rule ``moe_fp8.hf.convert`` applies to
dense linears is read off this table."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import FP8Linear
from . import layer

#: (K, N): in_features, out_features
SHAPES = [(1024, 256), (1024, 1024), (1024, 2048), (2048, 512), (2048, 4096), (4096, 2048),
          (7168, 576), (7168, 1536), (1536, 24576), (512, 32768), (16384, 7168), (7168, 18432), (18432, 7168)]


def collect(device: str, tokens: int = 8192) -> list[dict]:
    """One row per shape: BF16 and FP8 ms (eager and graph), FP8 speedups."""
    layer.DEVICE = device
    shapes = SHAPES if device == "cuda" else [(64, 32)]
    tokens = tokens if device == "cuda" else 32
    rows = []
    for K, N in shapes:
        x = torch.randn(tokens, K, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, N, device=device, dtype=torch.bfloat16)
        torch.manual_seed(0)
        lin = nn.Linear(K, N, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(nn.Linear(K, N, bias=False, device=device, dtype=torch.bfloat16))
        row = dict(layer=f"{K}->{N}", tokens=tokens)
        for name, mod in (("bf16", lin), ("fp8", fp8)):
            step = layer.fwd_bwd(mod, x, dy)
            row[f"{name}_ms"] = layer.measure(step)[0]
            row[f"{name}_graph_ms"] = layer.graph_ms(step)
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        if row["fp8_graph_ms"]:
            row["graph_speedup"] = row["bf16_graph_ms"] / row["fp8_graph_ms"]
        rows.append(row)
        print(f"dense {K:6d} -> {N:6d}: bf16 {row['bf16_ms']:.3f} fp8 {row['fp8_ms']:.3f} ms "
              f"({row['speedup']:.2f}x; graph {row.get('graph_speedup', 0):.2f}x)", flush=True)
    return rows
