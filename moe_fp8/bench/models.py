"""Whole-model training step: Hugging Face models built from configs, trained as the user would
otherwise run them (unconverted BF16, or TorchAO's float8 training) against the same model converted
with the library.

Models (real layer sizes, few layers, byte-level vocabulary, 8 x 1024 tokens per micro-batch):

* ``qwen3_h1024``: Qwen3-MoE, hidden 1024, 64 experts (I = 384), top-8, 4 layers;
* ``qwen3_30b``: Qwen3-30B-A3B layer sizes (hidden 2048, 128 experts, I = 768, top-8), 2 layers;
* ``dsv3``: DeepSeek-V3 layer sizes (hidden 7168, MLA, 32 experts, I = 2048, top-8, one shared
  expert), one dense layer (I = 18432) and one MoE layer;
* ``llama3_8b``: Llama3-8B layer sizes (dense: hidden 4096, I = 14336, 32 heads, 8 KV heads), 4 layers;
* ``llama4_scout``: Llama 4 Scout layer sizes (hidden 5120, 16 experts, I = 8192, top-1, one shared
  expert, 40 heads, 8 KV heads, every layer MoE), 2 layers; run only when named (``OPT_IN``): a layer
  holds 2.2 B parameters, so with AdamW's state 2 layers take ~40 GiB and 4 do not fit an 80 GiB GPU.

``layers`` (``--layers``) gives every model that many decoder layers instead (DeepSeek-V3's first
stays its dense layer).

The loss is the next-byte cross-entropy alone unless ``router_aux_loss`` (``--router-aux-loss COEF``)
turns on the Qwen3-MoE models' load-balancing loss (``output_router_logits``, ``COEF * aux_loss``
added; Qwen3-30B-A3B's released config has 0.001). The routing of these runs concentrates either
way: at Qwen3-30B-A3B sizes, over the last 20 of 41 optimizer steps of 4 micro-batches, 96-112 of a
layer's 128 experts get no token per micro-batch without the loss and 78-97 with 0.001 (eager, one
H100),
so the experts' GEMMs see a few dozen large groups, not 128 groups of about 512 rows.
``routing="balanced"`` (``--routing balanced``) has the routers of every variant score random inputs
instead (``balanced_routing``): the even load of a trained router, in expectation.
Transformers' router-logit recording breaks the compiled graph (8 breaks, 2 graphs per step).

Variants: ``hf_bf16`` (unconverted), ``ours_bf16`` (experts on the library's BF16 grouped path),
``ours_fp8_experts`` (FP8 experts in every MoE block whatever their size, the weight gradient in BF16
where ``min_fp8_wgrad_size`` says, dense linears as built), ``ours_fp8_experts_fp8_wgrad`` (the same
with every expert weight gradient in FP8: ``min_fp8_wgrad_size=0``),
``ours_fp8`` (``moe_fp8.hf.convert`` with its defaults, ``rowwise``: FP8 experts and dense linears
where the size rules say FP8 pays, experts below them on the BF16 grouped path, the rest as built;
no weight cache), ``ours_fp8_small_kept`` (the same, but experts below the size rule left as
built: ``min_bf16_expert_size=min_expert_size``), ``ours_fp8_every_expert`` (``ours_fp8`` with
every expert in FP8 whatever its size: ``min_expert_size=0``; dense linears by the size rule),
``ours_fp8_cached`` and
``ours_fp8_experts_cached`` / ``ours_fp8_experts_fp8_wgrad_cached`` (the same with the expert
weights' FP8 cache on: quantized once per optimizer step, eager or compiled; one more BF16-sized copy
of them held), ``ours_fp8_experts_cached_unfused`` (``ours_fp8_experts_cached`` with the gradients'
row quantization in separate kernels: ``FP8GroupedExperts.fused_grad_quant=False``),
``ours_fp8_cached_all`` (``ours_fp8_cached`` with the dense FP8 linears' weight cache on too:
``cache_dense_weights=True``), ``ours_fp8_bf16_mlp`` (``ours_fp8`` with the dense MLP linears,
``gate_proj`` / ``up_proj`` / ``down_proj``, kept in BF16 by ``filter_fn``: the split that keeps
DeepSeek-V3 sizes' loss at HF's), ``ours_fp8_unshared`` (``ours_fp8`` with every linear on its own:
``share_inputs=False``), ``ours_bf16_fused_acc``, ``ours_fp8_fused_acc``, ``ours_fp8_bf16_mlp_fused_acc``,
``ours_fp8_cached_fused_acc``, ``ours_fp8_experts_fused_acc``, ``ours_fp8_experts_cached_fused_acc`` and
``ours_fp8_every_expert_fused_acc``
(those with the experts' weight-gradient GEMMs adding to ``.grad`` in place:
``fused_grad_accumulation=True``), ``torchao_rowwise`` and
``torchao_rowwise_gw_hp`` (TorchAO's ``convert_to_float8_training`` on the dense linears, its own
size filter; experts as built) and ``torchao_moe`` (``torchao_rowwise`` plus TorchAO's FP8 grouped
GEMM on the experts; run in a child process, since a device assert ends the CUDA context; its error
is the result where it fails). The variants of MoE experts skip the dense model; TorchAO's need a GPU.
Modes: ``eager``, ``compiled`` (``torch.compile(model)``) and ``reduce-overhead`` (CUDA graphs).

An optimizer step is ``accumulate`` micro-batches of forward and backward (the loss divided by
``accumulate``), then gradient clipping and fused AdamW. Reported per optimizer step: the median
step time over the timed steps after warm-up, and its split into forward+backward and optimizer
(clip + AdamW) time; peak memory is ``max_memory_allocated`` over the run, and over the steps after
the first (which compiles); compiled rows count Dynamo's graphs and graph breaks; MoE models whose
router logits transformers returns (Qwen3-MoE) report the experts that one more micro-batch routes no
token to after the run, averaged over layers (``empty_experts``); every run ends by checking that
its FP8 weight caches hold copies of the current weights (``cache_gap``: logits read through them
against freshly quantized ones, 0; a gap fails the row); ``--profile`` adds
one profiled step per row (``step_profile``). The loss is the mean of the last 10 of ``loss_steps``
steps on byte-level text (the standard library's sources), trained in eager mode from the same
initial weights on the same batches (``LOSS_VARIANTS``; the other rows run 40 micro-batches, at
least 12 optimizer steps). ``MODE_VARIANTS`` says which variants each mode runs
by default (the ``_fp8_wgrad``, ``_fused_acc`` ones, ``ours_fp8_cached_all``, ``ours_fp8_bf16_mlp``,
``ours_fp8_unshared`` and
``ours_fp8_every_expert`` only when named); variants named
with ``--variants`` run in every mode named.
"""

from __future__ import annotations

import collections
import copy
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..demo.corpus import VOCAB, batches, load_split
from ..grouped_gemm.compiled_cache import compiled_weight_cache
from ..layers.convert import MIN_DENSE_SIZE
from ..layers.experts import FP8GroupedExperts
from ..layers.hf_convert import MIN_BF16_EXPERT_SIZE, MIN_EXPERT_SIZE
from . import balanced_routing, step_profile, torchao_models

MODES = ("eager", "compiled", "reduce-overhead")
FUSED_ACC = "_fused_acc"  # variant suffix: hf.convert(..., fused_grad_accumulation=True)
VARIANTS = ("hf_bf16", "ours_bf16", "ours_fp8_experts", "ours_fp8", "ours_fp8_small_kept", "ours_fp8_every_expert",
            "ours_fp8_experts_cached", "ours_fp8_cached", "ours_fp8_experts_fp8_wgrad",
            "ours_fp8_experts_fp8_wgrad_cached", "ours_fp8_cached_all", "ours_fp8_bf16_mlp", "ours_fp8_unshared",
            "ours_fp8_experts_cached_unfused", "ours_bf16_fused_acc", "ours_fp8_fused_acc", "ours_fp8_cached_fused_acc",
            "ours_fp8_experts_fused_acc", "ours_fp8_experts_cached_fused_acc", "ours_fp8_every_expert_fused_acc",
            "ours_fp8_bf16_mlp_fused_acc", "torchao_rowwise", "torchao_rowwise_gw_hp", "torchao_moe")
#: variants that differ from another only in the MoE experts (skipped for a dense model) and TorchAO's (GPU only)
EXPERT_VARIANTS = ("ours_bf16", "ours_fp8_experts", "ours_fp8_small_kept", "ours_fp8_every_expert",
                   "ours_fp8_experts_cached", "ours_fp8_experts_fp8_wgrad", "ours_fp8_experts_fp8_wgrad_cached",
                   "ours_fp8_experts_cached_unfused", "ours_bf16_fused_acc", "ours_fp8_experts_fused_acc",
                   "ours_fp8_experts_cached_fused_acc", "ours_fp8_every_expert_fused_acc", "torchao_moe")
TORCHAO_VARIANTS = ("torchao_rowwise", "torchao_rowwise_gw_hp", "torchao_moe")
#: the variants each mode runs by default (the others in eager only), and those trained for ``loss_steps``
MODE_VARIANTS = {"eager": tuple(v for v in VARIANTS if "_fp8_wgrad" not in v and "_unfused" not in v
                                 and v not in ("ours_fp8_cached_all", "ours_fp8_bf16_mlp", "ours_fp8_unshared",
                                               "ours_fp8_every_expert")
                                 and not v.endswith(FUSED_ACC)),
                 "compiled": ("hf_bf16", "ours_fp8", "ours_fp8_experts", "ours_fp8_cached", "ours_fp8_experts_cached",
                              "torchao_rowwise", "torchao_rowwise_gw_hp", "torchao_moe"),
                 "reduce-overhead": ("hf_bf16", "ours_fp8")}
#: names of the dense MLP linears (a dense MLP's, the shared experts')
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
LOSS_VARIANTS = ("hf_bf16", "ours_fp8_experts", "ours_fp8", "ours_fp8_experts_cached_fused_acc")


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one benchmark model (``family``: ``"qwen3"``, ``"deepseek_v3"``, ``"llama"`` or
    ``"llama4"``; ``expert_hidden`` is the MLP's intermediate size of a dense model)."""

    family: str
    hidden: int
    experts: int
    expert_hidden: int
    top_k: int
    layers: int
    heads: int
    dense_layers: int = 0
    dense_hidden: int = 0
    router_aux_loss: float = 0.0  # load-balancing loss coefficient (Qwen3-MoE), 0: none
    routing: str = "learned"  # "balanced": the routers score random inputs (balanced_routing)

    @property
    def moe(self) -> bool:
        return self.experts > 0


MODELS = {
    "qwen3_h1024": ModelSpec("qwen3", 1024, 64, 384, 8, 4, 16),
    "qwen3_30b": ModelSpec("qwen3", 2048, 128, 768, 8, 2, 32),
    "dsv3": ModelSpec("deepseek_v3", 7168, 32, 2048, 8, 2, 128, dense_layers=1, dense_hidden=18432),
    "llama3_8b": ModelSpec("llama", 4096, 0, 14336, 0, 4, 32),
    "llama4_scout": ModelSpec("llama4", 5120, 16, 8192, 1, 2, 40, dense_hidden=16384),
}
#: the CPU smoke run's stand-ins (same families, tiny)
CPU_MODELS = {
    "qwen3_h1024": ModelSpec("qwen3", 64, 8, 32, 2, 1, 4),
    "dsv3": ModelSpec("deepseek_v3", 64, 8, 32, 2, 2, 4, dense_layers=1, dense_hidden=64),
    "llama3_8b": ModelSpec("llama", 64, 0, 128, 0, 2, 4),
    "llama4_scout": ModelSpec("llama4", 64, 4, 32, 1, 2, 4, dense_hidden=64),
}
#: models that run only when named (``collect(models=...)``, ``--models``)
OPT_IN = ("llama4_scout",)


def hf_config(spec: ModelSpec, seq: int):
    """The transformers config of ``spec`` (byte-level vocabulary, untied embeddings)."""
    common = dict(vocab_size=VOCAB, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, max_position_embeddings=max(seq, 256), tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if spec.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=spec.expert_hidden, num_key_value_heads=max(1, spec.heads // 4),
                           **common)
    if spec.family == "llama4":
        from transformers import Llama4TextConfig

        return Llama4TextConfig(intermediate_size=spec.expert_hidden, intermediate_size_mlp=spec.dense_hidden,
                                num_local_experts=spec.experts, num_experts_per_tok=spec.top_k,
                                num_key_value_heads=max(1, spec.heads // 5), head_dim=spec.hidden // spec.heads,
                                interleave_moe_layer_step=1, **common)
    if spec.family == "qwen3":
        from transformers import Qwen3MoeConfig

        head = 128 if spec.hidden >= 2048 else 64
        return Qwen3MoeConfig(
            intermediate_size=spec.expert_hidden * 4, moe_intermediate_size=spec.expert_hidden,
            num_key_value_heads=max(1, spec.heads // 8), head_dim=head, num_experts=spec.experts,
            num_experts_per_tok=spec.top_k, norm_topk_prob=True, output_router_logits=spec.router_aux_loss > 0,
            router_aux_loss_coef=spec.router_aux_loss, **common)
    from transformers import DeepseekV3Config

    big = spec.hidden >= 4096
    groups = 8 if spec.experts % 8 == 0 and spec.experts >= 16 else 1
    return DeepseekV3Config(
        intermediate_size=spec.dense_hidden or spec.expert_hidden, moe_intermediate_size=spec.expert_hidden,
        first_k_dense_replace=spec.dense_layers, num_key_value_heads=spec.heads,
        n_shared_experts=1, n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k, n_group=groups,
        topk_group=max(1, groups // 2), q_lora_rank=1536 if big else None, kv_lora_rank=512 if big else 32,
        qk_rope_head_dim=64 if big else 8, qk_nope_head_dim=128 if big else 8, v_head_dim=128 if big else 16,
        routed_scaling_factor=2.5 if big else 1.0, norm_topk_prob=True, rope_scaling=None, **common)


def build(spec: ModelSpec, seq: int, device: str, seed: int = 0) -> nn.Module:
    """The unconverted BF16 model, initialised on ``device`` from ``seed``; with ``spec.routing ==
    "balanced"`` its routers score random inputs (``balanced_routing``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(spec, seq)).to(torch.bfloat16)
    if spec.routing == "balanced":
        balanced_routing.route_on_random_inputs(model)
    return model


def convert(base: nn.Module, variant: str, backend: str | None, *, size_rules: bool = True) -> nn.Module:
    """A converted copy of ``base`` (``hf_bf16``: an unconverted copy). ``size_rules=False`` converts
    every expert and dense linear whatever its size (the CPU stand-ins are tiny)."""
    from .. import hf

    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    model = copy.deepcopy(base)
    min_dense_size, min_expert_size = (MIN_DENSE_SIZE, MIN_EXPERT_SIZE) if size_rules else (0, 0)
    fused_acc = variant.endswith(FUSED_ACC)
    variant = variant.removesuffix(FUSED_ACC)
    if variant == "ours_bf16":
        hf.convert(model, recipe="bf16", backend=backend, cache_weights=False, fused_grad_accumulation=fused_acc)
    elif variant.startswith("ours_fp8_experts"):
        hf.convert(model, recipe="rowwise", backend=backend, cache_weights="_cached" in variant, dense=False,
                   min_expert_size=0, fused_grad_accumulation=fused_acc,
                   **({"min_fp8_wgrad_size": 0} if "_fp8_wgrad" in variant else {}))
        for module in model.modules() if variant.endswith("_unfused") else ():
            if isinstance(module, FP8GroupedExperts):
                module.fused_grad_quant = False
    elif variant.startswith("ours_fp8"):
        cache_all = variant == "ours_fp8_cached_all"
        every_expert = variant == "ours_fp8_every_expert"
        hf.convert(model, recipe="rowwise", backend=backend, cache_weights=variant.endswith("_cached") or cache_all,
                   cache_dense_weights=cache_all, min_dense_size=min_dense_size,
                   min_expert_size=0 if every_expert else min_expert_size,
                   min_bf16_expert_size=min_expert_size if variant == "ours_fp8_small_kept" else MIN_BF16_EXPERT_SIZE,
                   fused_grad_accumulation=fused_acc, share_inputs=variant != "ours_fp8_unshared",
                   filter_fn=_outside_mlp if variant == "ours_fp8_bf16_mlp" else None)
    elif variant in TORCHAO_VARIANTS:
        recipe = "rowwise_with_gw_hp" if variant == "torchao_rowwise_gw_hp" else "rowwise"
        torchao_models.convert(model, recipe, experts=variant == "torchao_moe")
    if balanced_routing.routers_on_random_inputs(base):  # a router module the conversion replaced gets the hook too
        balanced_routing.route_on_random_inputs(model)
    return model.train()


def _outside_mlp(module: nn.Module, fqn: str) -> bool:
    """``filter_fn`` keeping the dense MLP linears (dense MLPs, shared experts) in BF16."""
    return not fqn.endswith(DENSE_MLP)


def empty_experts(model: nn.Module, batch: torch.Tensor) -> float | None:
    """Experts no token of ``batch (B, S)`` is routed to, averaged over the MoE layers: the top
    ``num_experts_per_tok`` of each layer's router logits from one forward without gradients
    (``output_router_logits``). ``None`` for a model that returns no router logits (dense models;
    DeepSeek-V3 in transformers)."""
    config = model.config
    experts, k = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    if not experts or not k or not hasattr(config, "output_router_logits"):
        return None
    with torch.no_grad():
        logits = model(input_ids=batch, output_router_logits=True).router_logits
    used = [torch.zeros(experts, dtype=torch.bool, device=batch.device).index_fill_(
        0, layer.topk(k, dim=-1).indices.flatten(), True) for layer in logits]
    return experts - torch.stack(used).sum(1).float().mean().item()


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer, mode: str, clock):
    """``step(micro_batches) -> (loss, fwd+bwd seconds, optimizer seconds)`` of one optimizer step; the
    loss is the next-byte cross-entropy, plus the router's load-balancing loss times the config's
    ``router_aux_loss_coef`` where the model returns one (``output_router_logits``)."""
    torch._dynamo.reset()  # a new model's frames would count against the recompile limit of the last one's
    fwd = model if mode == "eager" else torch.compile(model, mode=None if mode == "compiled" else mode)
    graphs = mode == "reduce-overhead"
    config = model.config
    aux_coef = config.router_aux_loss_coef if getattr(config, "output_router_logits", False) else 0.0

    def step(micro_batches: list[torch.Tensor]):
        t0 = clock()
        total = 0.0
        for batch in micro_batches:
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = fwd(input_ids=batch[:, :-1])
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
            if aux_coef:
                loss = loss + aux_coef * out.aux_loss
            loss = loss / len(micro_batches)
            loss.backward()
            total = total + loss.detach()
        t1 = clock()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = clock()
        return total, t0, t1, t2

    step.forward = fwd
    return step


def stale_cache_gap(model: nn.Module, forward, batch: torch.Tensor, graphs: bool) -> float | None:
    """Largest absolute difference between the logits of one more training forward of ``batch
    (B, S)`` through ``forward`` (``model`` or its compiled form) reading the FP8 weight caches as
    the run left them, and one after every cache is emptied: 0 where the caches hold copies of the
    current weights. ``None`` for a model without weight caches."""
    caches = [c for m in model.modules() for c in (*(getattr(m, "_caches", None) or ()),
                                                   getattr(m, "_cache", None)) if c is not None]
    if not caches:
        return None
    logits = []
    for _ in range(2):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.random.fork_rng(devices=[batch.device.index or 0] if batch.is_cuda else []):
            torch.manual_seed(0)  # the same random router inputs in both forwards (balanced routing)
            logits.append(forward(input_ids=batch).logits.detach().float().clone())
        for cache in (*caches, compiled_weight_cache()):
            cache.invalidate()
    return (logits[0] - logits[1]).abs().max().item()


class _Clock:
    """CUDA events on a GPU (read after the step's sync), ``perf_counter`` on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _dynamo_counts() -> tuple[int, collections.Counter]:
    """``(graphs compiled, graph breaks by their reason's first line)`` so far in this process."""
    from torch._dynamo.utils import counters

    breaks = collections.Counter()
    for reason, count in counters["graph_break"].items():
        breaks[reason.strip().splitlines()[0][:160]] += count
    return counters["stats"]["unique_graphs"], breaks


def run_variant(base: nn.Module, variant: str, mode: str, data, *, steps: int, timed: int, lr: float,
                device: str, backend: str | None, size_rules: bool = True, accumulate: int = 1,
                profile: bool = False) -> dict:
    """Train a fresh copy of ``base`` for ``steps`` optimizer steps of ``accumulate`` micro-batches
    from ``data``; step, forward+backward and optimizer times, peak memory over the run and over
    the steps after the first (which compiles), losses, and (compiled modes) the graphs Dynamo
    compiled and its graph breaks with their reasons. ``profile``: then one more step under
    ``torch.profiler`` (``"profile"``: ``step_profile.kernel_time``) and, on CUDA, one with the
    allocator's history recorded (``"peak_allocations"``: ``step_profile.peak_allocations``)."""
    model = convert(base, variant, backend, size_rules=size_rules)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    cuda = device == "cuda"
    clock = _Clock(cuda)
    step = _step_fn(model, opt, mode, clock)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times, fwd_bwd, optim = [], [], [], []
    first_peak = None
    graphs_before, breaks_before = _dynamo_counts()
    for i in range(steps):
        micro = [next(data) for _ in range(accumulate)]
        start = time.perf_counter()
        loss, t0, t1, t2 = step(micro)
        losses.append(float(loss))  # syncs
        times.append(time.perf_counter() - start)
        fwd_bwd.append(clock.seconds(t0, t1))
        optim.append(clock.seconds(t1, t2))
        if cuda and i == 0:
            first_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
    steady = torch.cuda.max_memory_allocated() if cuda and steps > 1 else None
    ms = lambda xs: statistics.median(xs[-timed:]) * 1e3  # noqa: E731
    result = dict(step_ms=ms(times), fwd_bwd_ms=ms(fwd_bwd), optim_ms=ms(optim),
                  peak_gib=max(first_peak, steady or 0) / 2**30 if cuda else None,
                  steady_peak_gib=steady / 2**30 if steady is not None else None, losses=losses)
    if mode != "eager":
        graphs, breaks = _dynamo_counts()
        breaks.subtract(breaks_before)
        result.update(graphs=graphs - graphs_before, graph_breaks=sum(breaks.values()),
                      break_reasons=[f"{n} x {reason}" for reason, n in breaks.most_common(3) if n > 0])
    result["empty_experts"] = empty_experts(model, next(data)[:, :-1])
    if profile:
        micro = [next(data) for _ in range(accumulate)]
        result["profile"] = step_profile.kernel_time(lambda: step(micro), cuda)
        if cuda:
            result["peak_allocations"] = step_profile.peak_allocations(lambda: step(micro))
    result["cache_gap"] = stale_cache_gap(model, step.forward, next(data)[:, :-1], mode == "reduce-overhead")
    if result["cache_gap"]:  # a cache served copies of other weights: the run measured something else
        raise RuntimeError(f"{variant}: the FP8 weight caches served copies of old weights after the run "
                           f"(logits differ by up to {result['cache_gap']:.3g} from freshly quantized ones)")
    del model, opt, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


@dataclass(frozen=True)
class _Job:
    """One (model, mode, variant) run, as the child process of an isolated variant receives it."""

    model: str
    mode: str
    variant: str
    device: str
    steps: int
    timed: int
    accumulate: int
    backend: str | None
    loss_steps: int
    layers: int | None = None
    profile: bool = False
    router_aux_loss: float | None = None
    routing: str = "learned"


def _spec(model: str, device: str, layers: int | None, router_aux_loss: float | None = None,
          routing: str = "learned") -> ModelSpec:
    """The sizes of ``model`` on ``device`` (the CPU stand-in off CUDA), with ``layers`` decoder
    layers, the load-balancing loss coefficient ``router_aux_loss`` (Qwen3-MoE) when given, and
    ``routing`` for its MoE layers (a dense model ignores it)."""
    spec = (MODELS if device == "cuda" else CPU_MODELS)[model]
    if layers is not None:
        spec = replace(spec, layers=layers)
    if router_aux_loss is not None and spec.family == "qwen3":
        spec = replace(spec, router_aux_loss=router_aux_loss)
    if spec.moe:
        spec = replace(spec, routing=routing)
    return spec


def _data(job: _Job, train: torch.Tensor, batch: int, seq: int):
    return (b.to(job.device) for b in batches(train, batch, seq, seed=0))


def _shapes(device: str) -> tuple[int, int]:
    return (8, 1024) if device == "cuda" else (2, 32)


def _corpus(device: str, loss_steps: int, accumulate: int) -> torch.Tensor:
    batch, seq = _shapes(device)
    return load_split(batch * (seq + 1) * loss_steps * accumulate + seq + 2, 1000)[0]


def _run_job(job: _Job, base: nn.Module, train: torch.Tensor) -> dict:
    gpu = job.device == "cuda"
    spec = _spec(job.model, job.device, job.layers, job.router_aux_loss, job.routing)
    batch, seq = _shapes(job.device)
    return run_variant(base, job.variant, job.mode, _data(job, train, batch, seq), steps=job.steps, timed=job.timed,
                       lr=min(3e-3, 1.2 / spec.hidden), device=job.device, backend=job.backend,
                       size_rules=gpu, accumulate=job.accumulate,  # the CPU stand-ins are below every size rule
                       profile=job.profile)


def _run_isolated(job: _Job) -> dict:
    """``_run_job`` in a child process (``python -m moe_fp8.bench.models JOB``); its error where it fails."""
    proc = subprocess.run([sys.executable, "-m", "moe_fp8.bench.models", json.dumps(asdict(job))],
                          capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    cause = next((ln for ln in lines if "Assertion" in ln and "failed" in ln),  # a device assert: its first line
                 next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else ""))
    raise RuntimeError(f"child exited with {proc.returncode}: {cause[:300]}")


def _child(arg: str) -> None:
    job = _Job(**json.loads(arg))
    base = build(_spec(job.model, job.device, job.layers, job.router_aux_loss, job.routing), _shapes(job.device)[1], job.device)
    result = _run_job(job, base, _corpus(job.device, job.loss_steps, job.accumulate))
    print("RESULT " + json.dumps(result), flush=True)


def _variants_of(spec: ModelSpec, mode: str, gpu: bool, chosen: list[str] | None) -> list[str]:
    out = []
    for v in MODE_VARIANTS[mode] if chosen is None else chosen:
        if v in EXPERT_VARIANTS and not spec.moe:
            continue
        if v in TORCHAO_VARIANTS and not (gpu and torchao_models.available()):
            continue
        out.append(v)
    return out


def collect(device: str, models: list[str] | None = None, modes: list[str] | None = None,
            loss_steps: int | None = None, backend: str | None = None, variants: list[str] | None = None,
            accumulate: int = 1, layers: int | None = None, profile: bool = False,
            router_aux_loss: float | None = None, routing: str = "learned") -> list[dict]:
    """One row per (model, mode, variant): optimizer-step ms (and its forward+backward and optimizer
    parts), tokens/s, speedup over ``hf_bf16`` in the same mode, peak GiB (over the run, and over the
    steps after the first), and (eager rows) the final loss and its gap to ``hf_bf16``. ``layers``:
    decoder layers of every model (default: each model's own; DeepSeek-V3's first is its dense
    layer). ``profile``: each row also gets ``profile`` (device time by kernel category of one more
    step) and on CUDA ``peak_allocations`` (what is alive at that step's peak), see ``run_variant``.
    ``router_aux_loss``: the Qwen3-MoE models' load-balancing loss coefficient (default 0: none).
    ``routing``: ``"learned"`` (the routers score the hidden states) or ``"balanced"`` (they score
    random inputs: a trained router's balanced load, which an untrained model does not have)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers not installed (pip install -e '.[hf]'): no whole-model rows")
        return []
    if accumulate < 1:
        raise ValueError(f"accumulate: expected >= 1, got {accumulate}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers: expected >= 1, got {layers}")
    if router_aux_loss is not None and not router_aux_loss >= 0:
        raise ValueError(f"router_aux_loss: expected >= 0, got {router_aux_loss}")
    if routing not in balanced_routing.ROUTINGS:
        raise ValueError(f"routing: expected one of {balanced_routing.ROUTINGS}, got {routing!r}")
    unknown = set(variants or ()) - set(VARIANTS)
    if unknown:
        raise ValueError(f"variants: unknown {sorted(unknown)}; expected some of {VARIANTS}")
    gpu = device == "cuda"
    table = MODELS if gpu else CPU_MODELS
    unknown = [name for name in models or () if name not in table]
    if unknown:
        raise ValueError(f"models: unknown {unknown} on {device}; expected some of {sorted(table)}")
    names = models or [name for name in table if name not in OPT_IN]
    modes = modes or (list(MODES) if gpu else ["eager"])
    batch, seq = _shapes(device)
    loss_steps = loss_steps or (150 if gpu else 3)
    timed_steps = max(12, 40 // accumulate) if gpu else 3  # 40 micro-batches at least
    train = _corpus(device, loss_steps, accumulate)
    rows = []
    for name in names:
        spec = _spec(name, device, layers, router_aux_loss, routing)
        base = build(spec, seq, device)
        for mode in modes:
            for variant in _variants_of(spec, mode, gpu, variants):
                loss_run = mode == "eager" and variant in LOSS_VARIANTS
                steps = loss_steps if loss_run else timed_steps
                job = _Job(name, mode, variant, device, steps, min(20, steps - steps // 3), accumulate, backend,
                           loss_steps, layers, profile, router_aux_loss, routing)
                try:
                    r = _run_isolated(job) if variant == "torchao_moe" else _run_job(job, base, train)
                except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                    rows.append(dict(model=name, mode=mode, variant=variant, accumulate=accumulate,
                                     error=f"{type(e).__name__}: {e}"))
                    print(f"{name} {mode} {variant}: failed: {rows[-1]['error'][:300]}", flush=True)
                    continue
                row = dict(model=name, mode=mode, variant=variant, layers=spec.layers, accumulate=accumulate,
                           routing=spec.routing,
                           step_ms=r["step_ms"],
                           fwd_bwd_ms=r["fwd_bwd_ms"], optim_ms=r["optim_ms"],
                           tokens_per_s=accumulate * batch * seq / r["step_ms"] * 1e3, peak_gib=r["peak_gib"],
                           steady_peak_gib=r["steady_peak_gib"])
                row.update({k: r[k] for k in ("graphs", "graph_breaks", "break_reasons", "profile", "peak_allocations",
                                              "empty_experts", "cache_gap") if k in r})
                if loss_run:
                    row["final_loss"] = statistics.fmean(r["losses"][-10:])
                rows.append(row)
                print(f"{name} {mode} {variant}: {row['step_ms']:.1f} ms (fwd+bwd {row['fwd_bwd_ms']:.1f}, "
                      f"optimizer {row['optim_ms']:.1f}), peak {row['peak_gib']} GiB, loss {row.get('final_loss')}",
                      flush=True)
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


if __name__ == "__main__":
    _child(sys.argv[1])
