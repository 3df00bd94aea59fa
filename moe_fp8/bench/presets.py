"""What each ``--preset`` runs, per benchmark kind, on a GPU (on the CPU every kind runs its tiny
shapes instead). ``--quick`` keeps the first entry of each list."""

from __future__ import annotations

#: preset -> kind -> arguments of that kind's ``collect``
PRESETS: dict[str, dict[str, dict]] = {
    "dsv3": dict(quant=dict(models=["DeepSeek-V3"]), gemm=dict(shapes=[0, 2, 1]),
                 layer=dict(layers=["deepseek_v3_e8", "deepseek_v3_e32"], tokens=[8192]), train=dict()),
    "llama4": dict(quant=dict(models=["Llama 4"]), gemm=dict(shapes=[4, 5]),
                   layer=dict(layers=["llama4_scout"], tokens=[8192]), dense=dict()),
    "qwen3": dict(quant=dict(models=["Qwen3-30B-A3B"]), gemm=dict(shapes=[6]),
                  layer=dict(layers=["qwen3_30b_a3b"], tokens=[8192, 32768])),
}
PRESETS["models"] = dict(dense_sweep=dict(), model=dict())
PRESETS["all"] = dict(
    quant=dict(models=["DeepSeek-V3", "Llama 4", "Qwen3-30B-A3B"]), gemm=dict(shapes=[0, 2, 1, 3, 4, 5, 6]),
    layer=dict(layers=["deepseek_v3_e8", "deepseek_v3_e32", "llama4_scout", "qwen3_30b_a3b"], tokens=[8192]),
    dense=dict(), train=dict())
KINDS = ("quant", "gemm", "layer", "dense", "train", "dense_sweep", "model")
#: the grouped-GEMM methods a preset times (all of them with ``--gemm-methods all``)
GEMM_METHODS = ["TorchAO fp8 rowwise", "rowwise / cuda_auto", "rowwise / cuda", "rowwise / triton",
                "tensorwise / cuda", "rowwise / cuda, weight cache"]


def plan(preset: str, kinds: list[str] | None, quick_run: bool) -> dict[str, dict]:
    """Kind -> ``collect`` arguments for a run: the preset's kinds, or ``kinds`` in that order (a
    kind the preset lacks takes its arguments from ``all`` / ``models``); ``quick_run`` keeps the
    first shape of each."""
    chosen = PRESETS[preset]
    if kinds is not None:
        defaults = {**PRESETS["all"], **PRESETS["models"]}
        chosen = {k: chosen.get(k, defaults[k]) for k in dict.fromkeys(kinds)}
    return {k: quick(v) if quick_run else v for k, v in chosen.items()}


def quick(args: dict) -> dict:
    """The first entry of every list argument."""
    return {k: v[:1] if isinstance(v, list) else v for k, v in args.items()}
