"""What the demo prints and draws: the loss table, the gap and speed lines, samples, the PNG."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .corpus import decode
from .train import Curves

LABELS = {"bf16": "BF16", "rowwise": "FP8 rowwise"}


def loss_table(curves: Curves) -> str:
    """One row per evaluation: mean train loss since the previous one, and the validation loss."""
    recipes = list(curves.train)
    head = f"{'step':>6} " + " ".join(f"{'train ' + LABELS[r]:>17}" for r in recipes)
    head += " " + " ".join(f"{'val ' + LABELS[r]:>15}" for r in recipes) + f" {'val gap':>8}"
    lines, prev = [head], 0
    for i, (step, _) in enumerate(curves.val[recipes[0]]):
        train = [sum(curves.train[r][prev:step]) / (step - prev) for r in recipes]
        val = [curves.val[r][i][1] for r in recipes]
        lines.append(f"{step:>6} " + " ".join(f"{t:>17.4f}" for t in train) + " "
                     + " ".join(f"{v:>15.4f}" for v in val) + f" {100 * (val[-1] - val[0]) / val[0]:>+7.2f}%")
        prev = step
    return "\n".join(lines)


def summary(curves: Curves, tokens_per_step: int) -> str:
    """Final relative gaps (FP8 vs BF16: last validation loss, mean train loss of the last 10%) and speeds."""
    bf, fp = curves.val["bf16"][-1][1], curves.val["rowwise"][-1][1]
    tail = max(1, len(curves.train["bf16"]) // 10)
    tbf, tfp = (sum(curves.train[r][-tail:]) / tail for r in ("bf16", "rowwise"))
    sbf, sfp = (curves.tokens_per_s(r, tokens_per_step) for r in ("bf16", "rowwise"))
    return (f"final val loss: BF16 {bf:.4f}, FP8 {fp:.4f}: FP8 is {100 * (fp - bf) / bf:+.2f}% off BF16\n"
            f"final train loss (mean of the last {tail} steps): BF16 {tbf:.4f}, FP8 {tfp:.4f}: "
            f"{100 * (tfp - tbf) / tbf:+.2f}%\n"
            f"tokens/s (median step): BF16 {sbf:,.0f}, FP8 {sfp:,.0f}: FP8 / BF16 = {sfp / sbf:.2f}x")


@torch.no_grad()
def generate(model: nn.Module, prompt: str, new_tokens: int, context: int, device: str) -> str:
    """Greedy continuation of ``prompt`` (bytes), ``context`` tokens of history at most."""
    model.eval()
    ids = list(prompt.encode())
    for _ in range(new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        ids.append(int(model(input_ids=x).logits[0, -1].argmax()))
    model.train()
    return decode(ids)


def plot(curves: Curves, path: Path) -> bool:
    """Write the train and validation curves of both recipes to ``path`` (PNG); ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for recipe, color in zip(curves.train, ("tab:blue", "tab:orange")):
        train = torch.tensor(curves.train[recipe])
        k = max(1, len(train) // 50)  # running mean over ~2% of the run
        smooth = train.unfold(0, k, 1).mean(1) if len(train) >= k else train
        ax.plot(range(k, k + len(smooth)), smooth, color=color, alpha=0.6, label=f"train {LABELS[recipe]}")
        steps, val = zip(*curves.val[recipe])
        ax.plot(steps, val, "o-", color=color, label=f"val {LABELS[recipe]}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("DeepSeek-V3-style MoE on stdlib Python bytes: FP8 vs BF16")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
