"""Which FP8 dense linears move the loss: the whole-model step's eager training (4 decoder layers, 8 x
1024 tokens, AdamW, 150 steps) of one model, HF BF16 against ``hf.convert`` with its defaults, with
groups of dense linears left in BF16 by ``filter_fn`` (attention, the MLP linears, the first decoder
layer's MLP, the shared experts) or with their weight gradients in BF16 (``rowwise_gw_hp`` on the MLP
linears), with other dense recipes (scales not rounded to powers of two; dgrad / wgrad without fast
accumulation, as TorchAO's rowwise recipe has them), with TorchAO's rowwise ``Float8Linear`` on
exactly the linears the defaults convert (our FP8 experts; needs ``torchao``), and the library's BF16
path (the spread that summation order alone gives). Prints the mean loss of steps 41-50, 91-100 and
141-150 per variant and writes ``dense_loss_<model>[_<name>].json`` / ``.md`` to ``--out``. Loss spread
between two runs of HF BF16 on the GPU: about 2% (its kernels are not deterministic). ``--seeds N``
repeats every variant on N models and data orders (seeds 0..N-1) and reports each variant's gap to
HF BF16 of the same seed, its mean over the seeds and the standard error of that mean.

    python benchmarks/bench_dense_loss.py --model dsv3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_fp8 import hf
from moe_fp8.bench import models as m
from moe_fp8.bench.report import run_env, write_report
from moe_fp8.layers import FP8Linear
from moe_fp8.quant.recipes import get_recipe

#: variant -> (hf.convert keyword arguments, names of dense linears kept in BF16)
ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "k_proj", "v_proj", "o_proj")
MLP = m.DENSE_MLP
VARIANTS = {
    "hf_bf16": None,
    "ours_bf16_experts": (dict(recipe="bf16", min_expert_size=0), ()),
    "ours_fp8_defaults": (dict(recipe="rowwise"), ()),
    "ours_fp8_no_fp8_attention": (dict(recipe="rowwise"), ATTENTION),
    "ours_fp8_no_fp8_dense_mlp": (dict(recipe="rowwise"), MLP),
    "ours_fp8_dense_gw_hp": (dict(recipe="rowwise", dense_recipe="rowwise_gw_hp"), ()),
    "ours_fp8_dense_mlp_gw_hp": (dict(recipe="rowwise"), ()),
    "ours_fp8_first_mlp_bf16": (dict(recipe="rowwise"), ()),
    "ours_fp8_shared_experts_bf16": (dict(recipe="rowwise"), ()),
    "ours_fp8_dense_tensorwise": (dict(recipe="rowwise", dense_recipe="tensorwise"), ()),
    "ours_fp8_no_pow2": (dict(recipe=get_recipe("rowwise", pow2_scales=False)), ()),
    "ours_fp8_dense_no_pow2": (dict(recipe="rowwise", dense_recipe=get_recipe("rowwise", pow2_scales=False)), ()),
    "ours_fp8_dense_precise_grads": (dict(recipe="rowwise", dense_recipe=get_recipe("rowwise").replace(
        fast_accum_grads=False)), ()),
    "torchao_dense_same_linears": (dict(recipe="rowwise", dense=False), ()),
}
#: variant -> names of the converted dense linears whose weight gradient runs in BF16 (``rowwise_gw_hp``)
GW_HP = {"ours_fp8_dense_mlp_gw_hp": MLP}
#: variant -> a part of the names of the dense linears kept in BF16 (the first decoder layer's dense MLP,
#: every MoE block's shared experts)
KEPT_IN = {"ours_fp8_first_mlp_bf16": "model.layers.0.mlp.", "ours_fp8_shared_experts_bf16": ".shared_experts."}
WINDOWS = ((40, 50), (90, 100), (140, 150))


def variant_model(base: torch.nn.Module, variant: str) -> torch.nn.Module:
    model = copy.deepcopy(base)
    spec = VARIANTS[variant]
    if spec is not None:
        kwargs, kept = spec
        part = KEPT_IN.get(variant)
        hf.convert(model, filter_fn=lambda mod, fqn: fqn.rsplit(".", 1)[-1] not in kept
                   and not (part and part in fqn), **kwargs)
    if variant in GW_HP:
        for name, mod in list(model.named_modules()):
            if isinstance(mod, FP8Linear) and name.rsplit(".", 1)[-1] in GW_HP[variant]:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, FP8Linear.from_linear(mod, recipe="rowwise_gw_hp"))
    if variant == "torchao_dense_same_linears":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        names = default_fp8_linears(base)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda mod, fqn: fqn in names)
    return model.train()


def default_fp8_linears(base: torch.nn.Module) -> set[str]:
    """Names of the linears ``hf.convert``'s defaults turn into ``FP8Linear`` in ``base``."""
    probe = hf.convert(copy.deepcopy(base))
    names = {name for name, mod in probe.named_modules() if isinstance(mod, FP8Linear)}
    del probe
    torch.cuda.empty_cache()
    return names


def train(model: torch.nn.Module, data, steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    losses = []
    for _ in range(steps):
        batch = next(data)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dsv3", choices=sorted(m.MODELS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", help="suffix of the result files")
    ap.add_argument("--seeds", type=int, default=1, help="models and data orders per variant (seeds 0..N-1)")
    args = ap.parse_args()
    if args.variants[0] != "hf_bf16":
        ap.error("the first variant is the reference of the gaps: hf_bf16")
    spec = m._spec(args.model, "cuda", args.layers)
    batch, seq = m._shapes("cuda")
    train_data = m._corpus("cuda", args.steps, 1)
    lr = min(3e-3, 1.2 / spec.hidden)
    rows = []
    for seed in range(args.seeds):
        base = m.build(spec, seq, "cuda", seed=seed)
        for variant in args.variants:
            model = variant_model(base, variant)
            data = (b.to("cuda") for b in m.batches(train_data, batch, seq, seed=seed))
            losses = train(model, data, args.steps, lr)
            del model
            torch.cuda.empty_cache()
            row = dict(variant=variant, seed=seed,
                       **{f"loss_{a + 1}_{b}": statistics.fmean(losses[a:b]) for a, b in WINDOWS if b <= args.steps},
                       curve=[round(statistics.fmean(losses[i:i + 10]), 4) for i in range(0, len(losses), 10)])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del base
        body = report_table(rows, seed + 1)  # rewritten after every seed: a time limit keeps the seeds done
        write_report(args.out, f"dense_loss_{args.model}" + (f"_{args.name}" if args.name else ""), run_env("cuda"),
                     rows, f"Loss of FP8 dense linears: `python benchmarks/bench_dense_loss.py --model {args.model}`",
                     f"{args.layers} decoder layers, {args.steps} eager steps of {batch} x {seq} tokens, "
                     f"{seed + 1} seed(s)", body)
    print("\n".join(body))


def report_table(rows: list[dict], seeds: int) -> list[str]:
    """Markdown rows: per variant the mean loss of each window over the seeds, and the gap of the last
    window to HF BF16 of the same seed (mean over the seeds, with its standard error for 2+ seeds)."""
    keys = [k for k in rows[0] if k.startswith("loss_")]
    last = keys[-1]
    ref = {r["seed"]: r[last] for r in rows if r["variant"] == "hf_bf16"}
    body = ["| variant | " + " | ".join(f"mean loss, steps {k[5:].replace('_', '-')}" for k in keys)
            + " | gap at the last, per seed | mean gap |", "|---|" + "---:|" * (len(keys) + 2)]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        gaps = [(r[last] / ref[r["seed"]] - 1) * 100 for r in mine]
        spread = f" ± {statistics.stdev(gaps) / len(gaps) ** 0.5:.2f}" if seeds > 1 else ""
        body.append(f"| {variant} | " + " | ".join(f"{statistics.fmean(r[k] for r in mine):.4f}" for k in keys)
                    + " | " + ", ".join(f"{g:+.2f}%" for g in gaps) + f" | {statistics.fmean(gaps):+.2f}%{spread} |")
    return body

if __name__ == "__main__":
    main()
