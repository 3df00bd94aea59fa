"""Training both recipes side by side: the same batches, one optimizer step each, timed apart."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Curves:
    """Per recipe: train loss per step, ``(step, val loss)`` per evaluation, seconds per step."""

    train: dict[str, list[float]] = field(default_factory=dict)
    val: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    step_s: dict[str, list[float]] = field(default_factory=dict)

    def tokens_per_s(self, recipe: str, tokens_per_step: int) -> float:
        """Tokens/s from the median step time, the first 10% of steps (compilation, warm-up) left out."""
        times = self.step_s[recipe]
        return tokens_per_step / statistics.median(times[len(times) // 10:])


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``batch (B, S + 1)``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def val_loss(model: nn.Module, val_batches: list[torch.Tensor]) -> float:
    model.eval()
    loss = sum(lm_loss(model, b).item() for b in val_batches) / len(val_batches)
    model.train()
    return loss


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def train(models: dict[str, nn.Module], train_batches, val_batches: list[torch.Tensor], *, steps: int,
          lr: float, eval_every: int, device: str, progress=None) -> Curves:
    """Train every model in ``models`` for ``steps`` steps on the same batches (AdamW, clip 1.0).

    ``progress(step, losses, tokens_per_s)`` is called after each step (the progress bar)."""
    opts = {r: torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                 fused=device == "cuda") for r, m in models.items()}
    curves = Curves({r: [] for r in models}, {r: [] for r in models}, {r: [] for r in models})
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warmup = max(1, steps // 20)
    for step in range(steps):
        batch = next(train_batches).to(device, non_blocking=True)
        rate = {}
        for recipe, model in models.items():
            for group in opts[recipe].param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup)
            sync()
            t0 = time.perf_counter()
            loss = lm_loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[recipe].step()
            opts[recipe].zero_grad(set_to_none=True)
            value = loss.item()  # syncs
            curves.step_s[recipe].append(time.perf_counter() - t0)
            curves.train[recipe].append(value)
            rate[recipe] = batch[:, 1:].numel() / curves.step_s[recipe][-1]
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            for recipe, model in models.items():
                curves.val[recipe].append((step + 1, val_loss(model, val_batches)))
        if progress is not None:
            progress(step, {r: c[-1] for r, c in curves.train.items()}, rate)
    return curves
