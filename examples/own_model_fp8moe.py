"""``FP8MoE`` in your own model: a small stack of pre-norm MoE blocks whose expert matmuls run in
FP8, trained next to the same model in BF16 (``recipe="bf16"``) from the same initial weights on the
same data (regression onto a fixed random teacher).

    python examples/own_model_fp8moe.py [--steps 30] [--tokens 256]

Prints both loss curves; on a CPU the FP8 GEMMs run on the ``emulated`` backend.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from moe_fp8 import FP8MoE
from moe_fp8.routing import RouterConfig

H, I, E, K = 64, 64, 8, 2


class Block(nn.Module):
    """``x + moe(norm(x))``: the MoE half of a transformer layer (attention left out)."""

    def __init__(self, recipe: str, backend: str | None, device: str) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H, device=device, dtype=torch.bfloat16)
        self.moe = FP8MoE(H, I, E, K, router_config=RouterConfig(E, K, "softmax", renormalize=True), recipe=recipe,
                          backend=backend, device=device, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) bf16
        return x + self.moe(self.norm(x))


def model(recipe: str, backend: str | None, device: str, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Block(recipe, backend, device), Block(recipe, backend, device))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per step")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = None if device == "cuda" else "emulated"
    teacher = model("bf16", backend, device, seed=1).requires_grad_(False)
    students = {recipe: model(recipe, backend, device, seed=0) for recipe in ("bf16", "rowwise")}
    opts = {r: torch.optim.AdamW(m.parameters(), lr=3e-3) for r, m in students.items()}
    g = torch.Generator(device=device).manual_seed(2)
    print(f"{'step':>5} {'loss bf16':>11} {'loss fp8':>11}")
    for step in range(args.steps + 1):
        x = torch.randn(args.tokens, H, device=device, generator=g).to(torch.bfloat16)
        target = teacher(x).float()
        losses = {}
        for recipe, m in students.items():
            loss = nn.functional.mse_loss(m(x).float(), target)
            opts[recipe].zero_grad(set_to_none=True)
            loss.backward()
            opts[recipe].step()
            losses[recipe] = loss.item()
        if step % 5 == 0:
            print(f"{step:>5} {losses['bf16']:>11.5f} {losses['rowwise']:>11.5f}")
    print(f"final loss: FP8 / BF16 = {losses['rowwise'] / losses['bf16']:.3f}")


if __name__ == "__main__":
    main()
