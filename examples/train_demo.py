"""Training demo: the same MoE block trained in FP8 (rowwise recipe) and in BF16, side by side.

A student ``FP8MoE`` learns to imitate a fixed random teacher MoE (regression on random tokens),
from the same initial weights and the same data for both recipes; the script prints both loss
curves. Runs on a CPU in well under a minute (FP8 GEMMs through the exact ``emulated`` backend);
on a GPU it uses the platform's FP8 backend.

Usage: ``python examples/train_demo.py [--steps 40]``
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8 import FP8MoE

H, I, E, K, T = 64, 64, 8, 2, 256


def make(recipe: str, device: str, seed: int) -> FP8MoE:
    torch.manual_seed(seed)
    return FP8MoE(H, I, E, K, recipe=recipe, device=device, dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher = make("bf16", device, seed=1).requires_grad_(False)
    students = {recipe: make(recipe, device, seed=0) for recipe in ("bf16", "rowwise")}
    opts = {r: torch.optim.AdamW(m.parameters(), lr=3e-3) for r, m in students.items()}
    g = torch.Generator(device=device).manual_seed(2)
    print(f"student FP8MoE(H={H}, I={I}, E={E}, top_k={K}) imitating a random teacher, {T} tokens/step, {device}")
    print(f"{'step':>5} {'loss bf16':>11} {'loss fp8':>11}")
    for step in range(args.steps + 1):
        x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
        target = teacher(x).float()
        losses = {}
        for recipe, model in students.items():
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
            opts[recipe].zero_grad(set_to_none=True)
            loss.backward()
            opts[recipe].step()
            losses[recipe] = loss.item()
        if step % 5 == 0:
            print(f"{step:>5} {losses['bf16']:>11.5f} {losses['rowwise']:>11.5f}")
    ratio = losses["rowwise"] / losses["bf16"]
    print(f"final loss: FP8 / BF16 = {ratio:.3f} (the routing of the two students drifts apart, the losses do not)")


if __name__ == "__main__":
    main()
