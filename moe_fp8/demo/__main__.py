"""Command line of the demo: ``python -m moe_fp8.demo [--steps N --hidden H ...]``.

Defaults depend on the device: on CPU a tiny model (one thread; FP8 GEMMs on the ``emulated``
backend) that trains in a few minutes; on CUDA DeepSeek-V3 layer sizes on the real kernels (hidden
7168, 32 experts of 2048, top 8, one shared expert, 2 layers, 8k tokens per step; every dense linear
but the routers and ``lm_head`` in FP8 too), where FP8 pays on one H200. On CPU the FP8 GEMMs are
emulated, so FP8 is slower there: the CPU run shows the loss curves, the GPU run the speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

CPU = dict(steps=200, hidden=128, expert_hidden=128, experts=8, top_k=2, layers=2, heads=4, seq=128, batch=8,
           eval_every=20, val_batches=4, backend="emulated", fp8_dense="none")
GPU = dict(steps=400, hidden=7168, expert_hidden=2048, experts=32, top_k=8, layers=2, heads=56, seq=1024, batch=8,
           eval_every=50, val_batches=8, backend=None, fp8_dense="all")
PROMPTS = ("def ", "import os\n", "class ")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m moe_fp8.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name in ("steps", "hidden", "expert_hidden", "experts", "top_k", "layers", "heads", "seq", "batch",
                 "eval_every", "val_batches"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="default: by device")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default min(3e-3, 1.2 / hidden))")
    ap.add_argument("--backend", default=None, help="grouped-GEMM backend (default: emulated on CPU, auto on CUDA)")
    ap.add_argument("--fp8-dense", choices=["shared", "all", "none"], default=None,
                    help="dense linears of the FP8 model in FP8 too: the shared expert's, all but the routers and "
                         "lm_head (GPU default), or none (CPU default: the routed experts alone)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: tiny ops lose to thread overhead)")
    ap.add_argument("--gen-tokens", type=int, default=80, help="bytes generated per prompt")
    ap.add_argument("--plot", type=Path, default=Path("demo_loss.png"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name, value in (GPU if args.device.startswith("cuda") else CPU).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.lr is None:
        args.lr = min(3e-3, 1.2 / args.hidden)
    for name in ("steps", "eval_every", "val_batches", "batch", "seq"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the demo needs Hugging Face transformers: pip install -e '.[hf]' (or pip install transformers)")
        return 1
    from .corpus import batches, load_split
    from .model import ModelSize, build_pair
    from .report import generate, loss_table, plot, summary
    from .train import train

    args = parse(argv)
    device = "cuda" if args.device.startswith("cuda") else args.device
    if device == "cpu":
        torch.set_num_threads(args.threads)
    size = ModelSize(args.hidden, args.expert_hidden, args.experts, args.top_k, args.layers, args.heads, args.seq)
    tokens_per_step = args.batch * args.seq
    train_stream, val_stream = load_split(max(tokens_per_step * args.steps, 1_000_000), 500_000)
    val_gen = batches(val_stream, args.batch, args.seq, seed=args.seed + 1)
    val = [next(val_gen).to(device) for _ in range(args.val_batches)]
    models = build_pair(size, device, backend=args.backend, fp8_dense=args.fp8_dense, seed=args.seed)
    params = sum(p.numel() for p in models["bf16"].parameters())
    print(f"DeepseekV3ForCausalLM converted with moe_fp8.hf.convert: {args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts of {args.expert_hidden} (top {args.top_k}) + 1 shared, {params / 1e6:.1f}M "
          f"params; {tokens_per_step} tokens/step ({args.batch} x {args.seq}), {args.steps} steps on {device}, "
          f"FP8 dense: {args.fp8_dense}, "
          f"lr {args.lr:.2g}; train {train_stream.numel() / 1e6:.1f}M bytes, val {val_stream.numel() / 1e6:.1f}M "
          f"bytes of {Path(__import__('sysconfig').get_paths()['stdlib'])}")
    bar, progress = _progress(args.steps)
    curves = train(models, batches(train_stream, args.batch, args.seq, seed=args.seed), val, steps=args.steps,
                   lr=args.lr, eval_every=args.eval_every, device=device, progress=progress)
    if bar is not None:
        bar.close()
    print(loss_table(curves))
    print(summary(curves, tokens_per_step))
    for recipe, model in models.items():
        print(f"--- {recipe} samples (greedy) ---")
        for prompt in PROMPTS:
            print(generate(model, prompt, args.gen_tokens, args.seq, device).rstrip())
    if plot(curves, args.plot):
        print(f"loss curves written to {args.plot}")
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib, or pip install -e '.[demo]')")
    return 0


def _progress(steps: int):
    """A tqdm bar with both losses and tokens/s, or a line every 10% without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        every = max(1, steps // 10)

        def show(step, losses, rate):
            if (step + 1) % every == 0:
                print(f"step {step + 1}/{steps}: " + ", ".join(
                    f"{r} loss {losses[r]:.3f} {rate[r]:,.0f} tok/s" for r in losses))
        return None, show
    bar = tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True)

    def show(step, losses, rate):
        bar.update(1)
        bar.set_postfix_str(f"loss bf16 {losses['bf16']:.3f} fp8 {losses['rowwise']:.3f} | tok/s bf16 "
                            f"{rate['bf16']:,.0f} fp8 {rate['rowwise']:,.0f}")
    return bar, show


if __name__ == "__main__":
    sys.exit(main())
