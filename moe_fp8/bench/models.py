"""Whole-model training step: Hugging Face MoE models built from configs, trained as the user would
otherwise run them (unconverted BF16) against the same model converted with the library.

Models (real layer sizes, few layers, byte-level vocabulary, 8 x 1024 tokens per step):

* ``qwen3_h1024``: Qwen3-MoE, hidden 1024, 64 experts (I = 384), top-8, 4 layers;
* ``qwen3_30b``: Qwen3-30B-A3B layer sizes (hidden 2048, 128 experts, I = 768, top-8), 2 layers;
* ``dsv3``: DeepSeek-V3 layer sizes (hidden 7168, MLA, 32 experts, I = 2048, top-8, one shared
  expert), one dense layer (I = 18432) and one MoE layer.

Variants: ``hf_bf16`` (unconverted), ``ours_bf16`` (experts on the library's BF16 grouped path),
``ours_fp8_experts`` (FP8 experts in every MoE block whatever their size, dense linears as built)
and ``ours_fp8`` (``moe_fp8.hf.convert`` with its defaults, ``rowwise``: FP8 experts and dense
linears where the size rules say FP8 pays, the rest as built). Modes:
``eager``, ``compiled`` (``torch.compile(model)``) and ``reduce-overhead`` (CUDA graphs).

A step is forward, backward, gradient clipping and fused AdamW. Step time is the median over the
timed steps after warm-up; peak memory is ``max_memory_allocated`` over the run; the loss is the
mean of the last 10 of ``loss_steps`` steps on byte-level text (the standard library's sources),
trained in eager mode from the same initial weights on the same batches (``LOSS_VARIANTS``; the
other rows time 40 steps). ``MODE_VARIANTS`` says which variants each mode runs.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..demo.corpus import VOCAB, batches, load_split
from ..layers.convert import MIN_DENSE_SIZE
from ..layers.hf_convert import MIN_EXPERT_SIZE

MODES = ("eager", "compiled", "reduce-overhead")
VARIANTS = ("hf_bf16", "ours_bf16", "ours_fp8_experts", "ours_fp8")
#: the variants each mode runs (the others in eager only), and those trained for ``loss_steps``
MODE_VARIANTS = {"eager": VARIANTS, "compiled": ("hf_bf16", "ours_fp8"),
                 "reduce-overhead": ("hf_bf16", "ours_fp8")}
LOSS_VARIANTS = ("hf_bf16", "ours_fp8_experts", "ours_fp8")


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one benchmark model (``family``: ``"qwen3"`` or ``"deepseek_v3"``)."""

    family: str
    hidden: int
    experts: int
    expert_hidden: int
    top_k: int
    layers: int
    heads: int
    dense_layers: int = 0
    dense_hidden: int = 0


MODELS = {
    "qwen3_h1024": ModelSpec("qwen3", 1024, 64, 384, 8, 4, 16),
    "qwen3_30b": ModelSpec("qwen3", 2048, 128, 768, 8, 2, 32),
    "dsv3": ModelSpec("deepseek_v3", 7168, 32, 2048, 8, 2, 128, dense_layers=1, dense_hidden=18432),
}
#: the CPU smoke run's stand-ins (same families, tiny)
CPU_MODELS = {
    "qwen3_h1024": ModelSpec("qwen3", 64, 8, 32, 2, 1, 4),
    "dsv3": ModelSpec("deepseek_v3", 64, 8, 32, 2, 2, 4, dense_layers=1, dense_hidden=64),
}


def hf_config(spec: ModelSpec, seq: int):
    """The transformers config of ``spec`` (byte-level vocabulary, untied embeddings)."""
    if spec.family == "qwen3":
        from transformers import Qwen3MoeConfig

        head = 128 if spec.hidden >= 2048 else 64
        return Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=spec.expert_hidden * 4,
            moe_intermediate_size=spec.expert_hidden, num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads, num_key_value_heads=max(1, spec.heads // 8), head_dim=head,
            num_experts=spec.experts, num_experts_per_tok=spec.top_k, norm_topk_prob=True,
            max_position_embeddings=max(seq, 256), tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    from transformers import DeepseekV3Config

    big = spec.hidden >= 4096
    groups = 8 if spec.experts % 8 == 0 and spec.experts >= 16 else 1
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=spec.dense_hidden or spec.expert_hidden,
        moe_intermediate_size=spec.expert_hidden, num_hidden_layers=spec.layers,
        first_k_dense_replace=spec.dense_layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        n_shared_experts=1, n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k, n_group=groups,
        topk_group=max(1, groups // 2), q_lora_rank=1536 if big else None, kv_lora_rank=512 if big else 32,
        qk_rope_head_dim=64 if big else 8, qk_nope_head_dim=128 if big else 8, v_head_dim=128 if big else 16,
        max_position_embeddings=max(seq, 256), routed_scaling_factor=2.5 if big else 1.0, norm_topk_prob=True,
        tie_word_embeddings=False, rope_scaling=None, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build(spec: ModelSpec, seq: int, device: str, seed: int = 0) -> nn.Module:
    """The unconverted BF16 model, initialised on ``device`` from ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(spec, seq)).to(torch.bfloat16)


def convert(base: nn.Module, variant: str, backend: str | None, *, size_rules: bool = True) -> nn.Module:
    """A converted copy of ``base`` (``hf_bf16``: an unconverted copy). ``size_rules=False`` converts
    every expert and dense linear whatever its size (the CPU stand-ins are tiny)."""
    from .. import hf

    model = copy.deepcopy(base)
    min_dense_size, min_expert_size = (MIN_DENSE_SIZE, MIN_EXPERT_SIZE) if size_rules else (0, 0)
    if variant == "ours_bf16":
        hf.convert(model, recipe="bf16", backend=backend, cache_weights=False)
    elif variant == "ours_fp8_experts":
        hf.convert(model, recipe="rowwise", backend=backend, cache_weights=False, dense=False, min_expert_size=0)
    elif variant == "ours_fp8":
        hf.convert(model, recipe="rowwise", backend=backend, cache_weights=False, min_dense_size=min_dense_size,
                   min_expert_size=min_expert_size)
    elif variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    return model.train()


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer, mode: str):
    torch._dynamo.reset()  # a new model's frames would count against the recompile limit of the last one's
    fwd = model if mode == "eager" else torch.compile(model, mode=None if mode == "compiled" else mode)
    graphs = mode == "reduce-overhead"

    def step(batch: torch.Tensor) -> torch.Tensor:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = fwd(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_variant(base: nn.Module, variant: str, mode: str, data, *, steps: int, timed: int, lr: float,
                device: str, backend: str | None, size_rules: bool = True) -> dict:
    """Train a fresh copy of ``base`` for ``steps`` steps; step times, peak memory and losses."""
    model = convert(base, variant, backend, size_rules=size_rules)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    step = _step_fn(model, opt, mode)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i, batch in zip(range(steps), data):
        t0 = time.perf_counter()
        loss = step(batch)
        losses.append(loss.item())  # syncs
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del model, opt, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return dict(step_ms=statistics.median(times[-timed:]) * 1e3, peak_gib=peak, losses=losses)


def collect(device: str, models: list[str] | None = None, modes: list[str] | None = None,
            loss_steps: int | None = None, backend: str | None = None) -> list[dict]:
    """One row per (model, mode, variant): step ms, tokens/s, speedup over ``hf_bf16`` in the same
    mode, peak GiB, and (eager rows) the final loss and its gap to ``hf_bf16``."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers not installed (pip install -e '.[hf]'): no whole-model rows")
        return []
    gpu = device == "cuda"
    table = MODELS if gpu else CPU_MODELS
    names = models or list(table)
    modes = modes or (list(MODES) if gpu else ["eager"])
    batch, seq = (8, 1024) if gpu else (2, 32)
    loss_steps = loss_steps or (150 if gpu else 3)
    timed_steps = 40 if gpu else 3
    train, _ = load_split(batch * (seq + 1) * loss_steps + seq + 2, 1000)
    rows = []
    for name in names:
        spec = table[name]
        base = build(spec, seq, device)
        lr = min(3e-3, 1.2 / spec.hidden)
        for mode in modes:
            for variant in MODE_VARIANTS[mode]:
                loss_run = mode == "eager" and variant in LOSS_VARIANTS
                steps = loss_steps if loss_run else timed_steps
                data = (b.to(device) for b in batches(train, batch, seq, seed=0))
                try:
                    r = run_variant(base, variant, mode, data, steps=steps, timed=min(20, steps - steps // 3),
                                    lr=lr, device=device, backend=backend,
                                    size_rules=gpu)  # the CPU stand-ins are below every size rule
                except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                    rows.append(dict(model=name, mode=mode, variant=variant, error=f"{type(e).__name__}: {e}"))
                    continue
                row = dict(model=name, mode=mode, variant=variant, step_ms=r["step_ms"],
                           tokens_per_s=batch * seq / r["step_ms"] * 1e3, peak_gib=r["peak_gib"])
                if loss_run:
                    row["final_loss"] = statistics.fmean(r["losses"][-10:])
                rows.append(row)
                print(f"{name} {mode} {variant}: {row['step_ms']:.1f} ms, peak {row['peak_gib']} GiB, "
                      f"loss {row.get('final_loss')}", flush=True)
        del base
        gc.collect()
    _relative(rows)
    return rows


def _relative(rows: list[dict]) -> None:
    """Adds ``speedup`` (over ``hf_bf16`` in the same mode) and ``loss_gap`` (relative, eager)."""
    ref = {(r["model"], r["mode"]): r for r in rows if r["variant"] == "hf_bf16" and "error" not in r}
    for r in rows:
        base = ref.get((r["model"], r["mode"]))
        if base is None or "error" in r:
            continue
        r["speedup"] = base["step_ms"] / r["step_ms"]
        if "final_loss" in r:
            r["loss_gap"] = r["final_loss"] / base["final_loss"] - 1
