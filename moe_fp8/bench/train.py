"""End-to-end training step of the demo's model (a Hugging Face ``DeepseekV3ForCausalLM`` converted
with ``moe_fp8.hf.convert``): tokens/s of the FP8 model against its BF16 twin on the same batches
(forward, backward, clip, AdamW; median step after the first 10%), and both losses at the end."""

from __future__ import annotations

from ..demo.__main__ import CPU, GPU
from ..demo.corpus import batches, load_split
from ..demo.model import ModelSize, build_pair
from ..demo.train import train


def collect(device: str, steps: int | None = None) -> list[dict]:
    """Two rows (bf16, rowwise) for the demo's default model on ``device`` (CPU: the tiny one)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers not installed (pip install -e '.[hf]'): no end-to-end rows")
        return []
    cfg = dict(GPU if device == "cuda" else CPU)
    cfg["steps"] = steps or (60 if device == "cuda" else 2)
    if device != "cuda":
        cfg.update(hidden=64, expert_hidden=32, layers=1, seq=32, batch=2)
    size = ModelSize(*(cfg[k] for k in ("hidden", "expert_hidden", "experts", "top_k", "layers", "heads", "seq")))
    tokens = cfg["batch"] * cfg["seq"]
    train_stream, val_stream = load_split(max(tokens * cfg["steps"], 200_000), 100_000)
    val = [next(batches(val_stream, cfg["batch"], cfg["seq"], seed=1)).to(device)]
    models = build_pair(size, device, backend=cfg["backend"], fp8_dense="shared")
    curves = train(models, batches(train_stream, cfg["batch"], cfg["seq"], seed=0), val, steps=cfg["steps"],
                   lr=min(3e-3, 1.2 / size.hidden), eval_every=cfg["steps"], device=device)
    base = curves.tokens_per_s("bf16", tokens)
    name = (f"DeepseekV3ForCausalLM {size.layers}L H={size.hidden} E={size.experts}x{size.expert_hidden} "
            f"top-{size.top_k}, {tokens} tokens/step")
    return [dict(model=name, recipe=r, steps=cfg["steps"], tokens_per_s=curves.tokens_per_s(r, tokens),
                 speedup=curves.tokens_per_s(r, tokens) / base, final_val_loss=curves.val[r][-1][1])
            for r in models]
