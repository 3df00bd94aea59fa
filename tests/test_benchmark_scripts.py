"""The benchmarks still run: ``python -m moe_fp8.bench --quick`` on the CPU writes well-formed JSON,
markdown and a PNG; the GPU-only scripts in ``benchmarks/`` compile; the offline sm90 check runs.

GPU time is scarce; a benchmark that dies of a typo wastes a run. On the CPU the kernels run in the
Triton interpreter on tiny shapes (the whole-model kind: the kernels' pure-torch references), so
these check the code paths, not any number.
"""

import json
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _env() -> dict:
    # ROOT first, then the caller's path (a torch/triton pair run from side folders stays the one tested)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_compiles(script):
    py_compile.compile(str(script), doraise=True)


@pytest.mark.slow(12)
@pytest.mark.interpreter
def test_bench_entry_point_quick(tmp_path):
    """The quantization, grouped-GEMM and dense kinds (the layer and training kinds take minutes in the
    interpreter: their code is the demo's and the layer's, run by other tests)."""
    cmd = [sys.executable, "-m", "moe_fp8.bench", "--preset", "all", "--quick", "--kinds", "quant", "gemm", "dense",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "bench_all_quick.json").read_text())
    assert set(report["results"]) == {"quant", "gemm", "dense"}
    assert {"date", "gpu", "torch", "triton"} <= set(report["meta"])
    kernels = {r["kernel"] for r in report["results"]["quant"]}
    assert kernels == {"rowwise (A)", "expert colwise fwd (W)"}
    gemm = {r["method"]: r for r in report["results"]["gemm"]}
    assert set(gemm) == {"bf16 torch._grouped_mm", "rowwise / emulated"}
    assert 20 < gemm["rowwise / emulated"]["sqnr_out"] < 40  # FP8 against BF16: not equal, not garbage
    dense = {r["recipe"]: r for r in report["results"]["dense"]}
    assert dense["bf16"]["speedup"] == 1.0 and dense["ours rowwise"]["sqnr_vs_bf16"] > 20
    md = (tmp_path / "bench_all_quick.md").read_text()
    for title in ("Quantization kernels", "Grouped GEMM", "Dense MLP"):
        assert f"## {title}" in md
    table_rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table_rows) == 3 + len(report["results"]["quant"]) + len(gemm) + len(dense)  # headers + rows
    assert all(line.count("|") == table_rows[0].count("|") for line in table_rows[:3])
    png = tmp_path / "bench_all_quick_speedups.png"
    if png.exists():  # with matplotlib
        assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_bench_plan_runs_named_kinds_outside_the_preset():
    from moe_fp8.bench import presets

    assert presets.plan("dsv3", ["dense", "layer"], False) == {
        "dense": {}, "layer": presets.PRESETS["dsv3"]["layer"]}
    assert presets.plan("dsv3", ["model"], False) == {"model": {}}
    quick = presets.plan("all", None, True)
    assert list(quick) == list(presets.PRESETS["all"]) and quick["layer"]["layers"] == ["deepseek_v3_e8"]


@pytest.mark.interpreter
def test_bench_headline_and_tables():
    """The speedup bars pick our default FP8 rows, against BF16 (quantization kernels: TorchAO)."""
    from moe_fp8.bench import report

    results = {
        "quant": [dict(model="m", kernel="rowwise (A)", shape="s", ours_us=1.0, ours_frac=0.9, speedup=4.0),
                  dict(model="m", kernel="tensorwise (A)", shape="s", ours_us=1.0, ours_frac=0.9)],
        "gemm": [dict(shape="g", method="rowwise / cuda_auto", fwd_bwd_speedup_vs_bf16=1.4),
                 dict(shape="g", method="rowwise / triton", fwd_bwd_speedup_vs_bf16=1.3)],
        "layer": [dict(layer="l", tokens=8, recipe="bf16", speedup=1.0), dict(layer="l", tokens=8, recipe="rowwise",
                                                                              speedup=1.5)],
    }
    assert report.headline(results) == [("quant m: rowwise (A)", 4.0, "TorchAO"), ("grouped GEMM g", 1.4, "BF16"),
                                        ("layer l T=8 rowwise", 1.5, "BF16")]
    text = report.table("quant", results["quant"])
    assert "4.00x" in text and text.splitlines()[2].split()[-1] == "-"


@pytest.mark.slow(10)
@pytest.mark.interpreter
def test_sm90_resources_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sm90_resources.py"), "--smoke", "--out", str(tmp_path)]
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}  # compiles for sm90: no interpreter
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / f"sm90_resources_triton{triton.__version__}.md").stat().st_size > 0


@pytest.mark.interpreter
def test_bench_quant_kernel_filter(monkeypatch):
    """``run(kernels=...)`` times only the rows whose kernel name contains one of its substrings."""
    from moe_fp8.bench import quant

    monkeypatch.setattr(quant, "DEVICE", "cpu")
    table = quant.run(["smoke"], None, kernels=["padded", "tensorwise"])
    kernels = {r["kernel"] for r in table.rows}
    assert kernels == {"tensorwise (A)", "group colwise dual, padded out", "group dual, a from amax, padded",
                       "group dual, both from amax, padded"}


def test_bench_whole_model_kind_cpu(torch_references):
    """The whole-model kind trains every eager variant of a tiny Qwen3-MoE from the same weights:
    the unconverted row is the reference, the converted ones stay close to its loss."""
    pytest.importorskip("transformers")
    from moe_fp8.bench import models, report

    rows = models.collect("cpu", models=["qwen3_h1024"], loss_steps=3)
    by_variant = {r["variant"]: r for r in rows}
    on_cpu = set(models.MODE_VARIANTS["eager"]) - set(models.TORCHAO_VARIANTS)  # TorchAO's variants need a GPU
    assert set(by_variant) == on_cpu and all("error" not in r for r in rows), rows
    assert set(models.VARIANTS) - set(models.MODE_VARIANTS["eager"]) == {"ours_fp8_experts_fp8_wgrad",
                                                                        "ours_fp8_experts_fp8_wgrad_cached",
                                                                        "ours_fp8_cached_all",
                                                                        "ours_fp8_bf16_mlp",
                                                                        "ours_fp8_bf16_mlp_fused_acc",
                                                                        "ours_fp8_unshared",
                                                                        "ours_fp8_every_expert",
                                                                        "ours_fp8_every_expert_fused_acc",
                                                                        "ours_fp8_experts_cached_unfused",
                                                                        "ours_bf16_fused_acc", "ours_fp8_fused_acc",
                                                                        "ours_fp8_cached_fused_acc",
                                                                        "ours_fp8_experts_fused_acc",
                                                                        "ours_fp8_experts_cached_fused_acc"}
    base = models.build(models._spec("qwen3_h1024", "cpu", None), 32, "cpu")
    for variant, recipe in [("ours_fp8_experts", "rowwise_gw_hp"), ("ours_fp8_experts_fp8_wgrad_cached", "rowwise"),
                            ("ours_fp8_experts_cached_unfused", "rowwise_gw_hp")]:
        experts = [m for m in models.convert(base, variant, None).modules() if type(m).__name__ == "FP8GroupedExperts"]
        assert experts and {(m.recipe.name, m.cache_weights, m.fused_grad_quant) for m in experts} == {
            (recipe, "cached" in variant, "unfused" not in variant)}
    # The defaults keep these small experts off FP8; every_expert converts them, the dense linears by
    # the defaults' size rule (each one kept below min_dense_size here, as by the defaults).
    reports = {v: models.convert(base, v, None).fp8_conversion_report for v in ("ours_fp8", "ours_fp8_every_expert")}
    counts = {v: r.counts() for v, r in reports.items()}
    assert "fp8 experts" not in counts["ours_fp8"] and counts["ours_fp8_every_expert"]["fp8 experts"] == 1
    dense = {v: [(e.fqn, e.became, e.reason) for e in r.entries if "self_attn" in e.fqn] for v, r in reports.items()}
    assert len(dense["ours_fp8"]) == 4 and dense["ours_fp8"] == dense["ours_fp8_every_expert"]
    assert {reason for *_, reason in dense["ours_fp8"]} == {"below min_dense_size"}
    assert by_variant["hf_bf16"]["speedup"] == 1.0
    assert set(models.LOSS_VARIANTS) - set(by_variant) == {"ours_fp8_experts_cached_fused_acc"}  # when named
    for name in set(models.LOSS_VARIANTS) & set(by_variant):
        assert 4.0 < by_variant[name]["final_loss"] < 6.5  # a byte-level model after 3 steps: ~ln(272)
    assert abs(by_variant["ours_fp8"]["loss_gap"]) < 0.02
    assert report.table("model", rows).count("\n") == len(rows)
    assert all(0 <= r["empty_experts"] <= 8 - 2 for r in rows)  # 8 experts, top-2: at least 2 get tokens


def test_bench_whole_model_dense_and_accumulation_cpu(torch_references):
    """The dense stand-in (Llama, 3 decoder layers) converts through ``hf.convert`` and trains with 2
    micro-batches per optimizer step; the MoE-only variants skip it; a step's parts add up to no
    more than the step; ``profile`` adds one profiled step per row (CPU operators here) to the
    rows and the markdown."""
    pytest.importorskip("transformers")
    from moe_fp8.bench import models, step_profile

    rows = models.collect("cpu", models=["llama3_8b"], loss_steps=3, accumulate=2, layers=3,
                          variants=["hf_bf16", "ours_bf16", "ours_fp8", "ours_fp8_cached_all"], profile=True)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"hf_bf16", "ours_fp8", "ours_fp8_cached_all"} and all("error" not in r for r in rows), rows
    for r in rows:
        assert r["accumulate"] == 2 and 0 < r["fwd_bwd_ms"] + r["optim_ms"] <= r["step_ms"] * 1.05
        assert r["layers"] == 3
        assert r["profile"]["device"] == "cpu" and r["profile"]["total_ms"] > 0 and "peak_allocations" not in r
    assert "_FP8LinearsFn" in {name for name, *_ in by_variant["ours_fp8"]["profile"]["top"]}
    assert by_variant["ours_fp8_cached_all"]["cache_gap"] == 0 and by_variant["hf_bf16"]["cache_gap"] is None
    lines = step_profile.markdown(rows)
    assert sum(line.startswith("### llama3_8b eager") for line in lines) == 3
    assert 4.0 < by_variant["ours_fp8"]["final_loss"] < 6.5 and abs(by_variant["ours_fp8"]["loss_gap"]) < 0.02
    base = models.build(models._spec("llama3_8b", "cpu", 3), 32, "cpu")
    assert base.config.num_hidden_layers == 3
    linears = [m for m in models.convert(base, "ours_fp8_cached_all", None, size_rules=False).modules()
               if type(m).__name__ == "FP8Linear"]
    assert linears and all(m.cache_weights for m in linears)
    in_fp8 = {n.rsplit(".", 1)[-1] for n, m in models.convert(base, "ours_fp8_bf16_mlp", None, size_rules=False)
              .named_modules() if type(m).__name__ == "FP8Linear"}
    assert in_fp8 == {"q_proj", "k_proj", "v_proj", "o_proj"}, in_fp8  # the MLP's linears stay nn.Linear
    for variant, shared in (("ours_fp8", True), ("ours_fp8_unshared", False)):  # q/k/v and gate/up of 3 layers
        converted = models.convert(base, variant, None, size_rules=False)
        assert len({id(m.shared_input) for m in converted.modules() if getattr(m, "shared_input", None)}) == (
            6 if shared else 0)
    moe = models._spec("qwen3_h1024", "cpu", None)  # named variants run in any mode; the defaults per mode
    assert models._variants_of(moe, "reduce-overhead", True, ["ours_bf16", "hf_bf16"]) == ["ours_bf16", "hf_bf16"]
    assert models._variants_of(moe, "reduce-overhead", True, None) == list(models.MODE_VARIANTS["reduce-overhead"])
    with pytest.raises(ValueError, match="variants: unknown"):
        models.collect("cpu", models=["llama3_8b"], variants=["torchao"])
    with pytest.raises(ValueError, match="layers: expected >= 1"):
        models.collect("cpu", models=["llama3_8b"], layers=0)


def test_bench_llama4_is_opt_in_and_converts_whole_blocks_cpu(torch_references):
    """The Llama 4 stand-in (every layer MoE, top-1, a shared expert) runs only when named: its MoE
    blocks become ``FP8Llama4TextMoe`` with FP8 experts and it trains close to the unconverted loss;
    an unknown model name is refused with the names there are."""
    pytest.importorskip("transformers")
    from moe_fp8.bench import models
    from moe_fp8.layers.hf_blocks import FP8Llama4TextMoe

    base = models.build(models._spec("llama4_scout", "cpu", None), 32, "cpu")
    assert type(base).__name__ == "Llama4ForCausalLM" and base.config.moe_layers == [0, 1]
    blocks = [m for m in models.convert(base, "ours_fp8_experts", None).modules() if isinstance(m, FP8Llama4TextMoe)]
    assert len(blocks) == 2 and all(b.experts.recipe.name.startswith("rowwise") for b in blocks)
    rows = models.collect("cpu", models=["llama4_scout"], loss_steps=3, variants=["hf_bf16", "ours_fp8_experts"])
    assert [r["variant"] for r in rows] == ["hf_bf16", "ours_fp8_experts"] and all("error" not in r for r in rows), rows
    assert 4.0 < rows[1]["final_loss"] < 6.5 and abs(rows[1]["loss_gap"]) < 0.02
    assert "llama4_scout" in models.OPT_IN and set(models.MODELS) >= set(models.OPT_IN)
    with pytest.raises(ValueError, match=r"models: unknown \['qwen3_30b'\] on cpu"):
        models.collect("cpu", models=["qwen3_30b"])


def test_torchao_filter_leaves_out_llama4_shared_down_proj_only():
    """TorchAO's dense conversion leaves out the ``shared_expert.down_proj`` of each ``Llama4TextMoe``
    (that block adds to its output in place), by full name, and nothing more in other models."""
    transformers = pytest.importorskip("transformers")
    from moe_fp8.bench import torchao_models

    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    llama4 = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, head_dim=8, **common))
    extra = torchao_models.skipped_fqns(llama4)[len(torchao_models.SKIPPED_FQNS):]
    named = {n for n, _ in llama4.named_modules()}
    assert extra == ["model.layers.1.feed_forward.shared_expert.down_proj"] and set(extra) <= named
    qwen2 = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(  # a shared expert, added out of place
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, **common))
    assert any(n.endswith("shared_expert.down_proj") for n, _ in qwen2.named_modules())
    assert torchao_models.skipped_fqns(qwen2) == torchao_models.SKIPPED_FQNS


def test_bench_router_aux_loss_is_added_to_the_step_loss(torch_references):
    """``router_aux_loss``: the Qwen3-MoE stand-in returns its load-balancing loss and the step's loss
    is the cross-entropy plus the coefficient times it; other families ignore the coefficient; a
    negative one is refused. ``empty_experts`` counts, per layer, the experts outside every token's
    top-k of the router logits (``None`` for a dense model)."""
    pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    from moe_fp8.bench import models

    assert models._spec("qwen3_h1024", "cpu", None).router_aux_loss == 0.0
    assert models._spec("llama3_8b", "cpu", None, 0.5).router_aux_loss == 0.0
    spec = models._spec("qwen3_h1024", "cpu", None, 0.5)
    model = models.build(spec, 32, "cpu")
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.5
    batch = torch.randint(0, model.config.vocab_size, (2, 33))
    with torch.no_grad():
        out = model(input_ids=batch[:, :-1])
    want = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten()) + 0.5 * out.aux_loss
    assert out.aux_loss > 0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss, *_ = models._step_fn(model, opt, "eager", lambda: 0.0)([batch])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    # the experts no token of the batch is routed to, per layer, from the router logits
    chosen = [set(layer.topk(model.config.num_experts_per_tok, dim=-1).indices.flatten().tolist())
              for layer in out.router_logits]
    want_empty = sum(model.config.num_experts - len(c) for c in chosen) / len(chosen)
    assert models.empty_experts(model, batch[:, :-1]) == want_empty
    dense = models.build(models._spec("llama3_8b", "cpu", 1), 32, "cpu")
    assert models.empty_experts(dense, batch[:, :-1]) is None
    with pytest.raises(ValueError, match="router_aux_loss: expected >= 0"):
        models.collect("cpu", models=["qwen3_h1024"], router_aux_loss=-1.0)


@pytest.mark.slow(11)
def test_bench_whole_model_isolated_variant_cpu(torch_references):
    """A variant run in its own process (TorchAO's MoE path there, since a device assert ends the CUDA
    context) returns the same kind of result, and a child that fails returns its cause as the error."""
    pytest.importorskip("transformers")
    from moe_fp8.bench import models

    job = models._Job("llama3_8b", "eager", "hf_bf16", "cpu", steps=2, timed=1, accumulate=1, backend=None,
                      loss_steps=2)
    result = models._run_isolated(job)
    assert result["step_ms"] > 0 and len(result["losses"]) == 2 and 4.0 < result["losses"][-1] < 6.5
    with pytest.raises(RuntimeError, match="KeyError: 'no_such_model'"):
        models._run_isolated(models._Job("no_such_model", "eager", "hf_bf16", "cpu", 2, 1, 1, None, 2))


def test_model_rows_count_dynamo_graphs_and_breaks(tmp_path):
    """Compiled rows report the graphs Dynamo made and its graph breaks with their reasons, as the
    difference of the process-wide counters around the run; the markdown lists the reasons."""
    import torch

    from moe_fp8.bench import models, report

    graphs_before, breaks_before = models._dynamo_counts()

    def f(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    torch._dynamo.reset()
    torch.compile(f, backend="eager")(torch.ones(3))
    graphs, breaks = models._dynamo_counts()
    breaks.subtract(breaks_before)
    assert graphs - graphs_before == 2 and sum(breaks.values()) == 1
    reason = next(r for r, n in breaks.items() if n == 1)
    assert "\n" not in reason and reason
    row = dict(model="m", mode="compiled", variant="v", step_ms=1.0, graphs=2, graph_breaks=1,
               break_reasons=[f"1 x {reason}"])
    meta = dict(args="", date="d", gpu="g", torch="t", triton="t", torchao=None, seconds=0.0)
    report.write(tmp_path, "r", meta, {"model": [row]})
    md = (tmp_path / "r.md").read_text()
    assert f"- m compiled v: 1 x {reason}" in md and "| 2 | 1 |" in md


@pytest.mark.parametrize("bumped", [True, False])
def test_bench_stale_cache_gap_finds_copies_of_old_weights(bumped, monkeypatch):
    """The check every benchmarked run ends with: after two optimizer steps of two micro-batches under
    a fused AdamW, the dense weight caches hold copies of the current weights (gap 0); with the step
    pre-hook's version bump stubbed out they hold the old weights' copies and the gap shows them."""
    pytest.importorskip("transformers")
    import moe_fp8.optimizer_steps as optimizer_steps
    from moe_fp8.bench import models

    if not bumped:
        monkeypatch.setattr(optimizer_steps, "increment_version", lambda params: None)
    model = models.convert(models.build(models._spec("llama3_8b", "cpu", 2), 32, "cpu"), "ours_fp8_cached_all",
                           None, size_rules=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = models._step_fn(model, opt, "eager", time.perf_counter)
    data = torch.randint(0, 256, (6, 2, 33), generator=torch.Generator().manual_seed(0))
    for i in range(2):
        step([data[2 * i], data[2 * i + 1]])
    gap = models.stale_cache_gap(model, step.forward, data[4, :, :-1], graphs=False)
    assert gap == 0 if bumped else gap > 0


@pytest.mark.interpreter
def test_bench_grad_accumulation_quick(tmp_path):
    """The fused-accumulation benchmark runs its CPU smoke shapes, BF16 and FP8 operands (checking each
    fused sum against autograd's, under every swept tile configuration too) and writes its report."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_grad_accumulation.py"), "--quick", "--steps", "1",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "grad_accumulation_quick.json").read_text())["rows"]
    paths = [r for r in rows if "config" not in r]
    assert {(r["gradient"], r["active"]) for r in paths} == {("gate_up", 8), ("down", 8), ("gate_up", 1), ("down", 1)}
    assert {(r["model"], r["operands"]) for r in paths} == {("qwen3_30b", "bf16"), ("dsv3", "fp8")}
    swept = [r for r in rows if "config" in r]
    assert {r["gradient"] for r in swept} == {"gate_up", "down"} and len({r["config"] for r in swept}) > 1


@pytest.mark.interpreter
def test_bench_dgrad_quantize_w_quick(tmp_path):
    """The in-GEMM dgrad benchmark runs its CPU smoke shapes and writes its report, each row's fp32
    output equal to the layout + GEMM one within fp32 summation order."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_dgrad_quantize_w.py"), "--quick", "--steps", "1",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "dgrad_quantize_w_quick.json").read_text())["rows"]
    assert {(r["model"], r["weight"], r["active"]) for r in rows if "config" not in r} == {
        ("qwen3_30b", "gate_up", 8), ("qwen3_30b", "down", 8), ("qwen3_30b", "gate_up", 1), ("qwen3_30b", "down", 1),
        ("llama4", "gate_up", 8), ("llama4", "gate_up", 1)}
    assert all(r["max_gap"] <= 1e-5 for r in rows)


@pytest.mark.interpreter
def test_bench_forward_quantize_w_quick(tmp_path):
    """The in-GEMM forward benchmark runs its CPU smoke shapes (both weight layouts) and writes its
    report, each row's fp32 output equal to the forward layout + GEMM one within fp32 summation order."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_forward_quantize_w.py"), "--quick", "--steps", "1",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "forward_quantize_w_quick.json").read_text())["rows"]
    assert {(r["model"], r["weight"], r["active"]) for r in rows} == {
        ("qwen3_30b", "gate_up", 8), ("qwen3_30b", "down", 8), ("qwen3_30b", "gate_up", 1), ("qwen3_30b", "down", 1),
        ("llama4", "gate_up", 8), ("llama4", "gate_up", 1)}
    assert all(r["max_gap"] <= 1e-5 for r in rows)


@pytest.mark.interpreter
def test_bench_dense_mlp_unit_quick(tmp_path):
    """The dense MLP unit benchmark runs its CPU smoke shape and writes its report: every variant timed,
    and both units' outputs and gradients (gate and up split back from the one weight's) as close to
    fp64 as the three FP8Linears' (the same FP8 bytes in their GEMMs: only summation order and the
    dgrad's one GEMM over gate and up differ)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_dense_mlp_unit.py"), "--quick", "--steps", "1",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "dense_mlp_unit_quick.json").read_text())["rows"]
    assert {r["variant"] for r in rows if "ms" in r} == {"bf16", "linears", "unit", "unit_one_weight"}
    sqnr = {r["variant"]: r for r in rows if "sqnr_y" in r}
    keys = ("sqnr_y", "sqnr_dx", "sqnr_dw_gate", "sqnr_dw_up", "sqnr_dw_down")
    assert all(sqnr["linears"][k] > 20 and abs(sqnr[v][k] - sqnr["linears"][k]) < 0.5
               for k in keys for v in ("unit", "unit_one_weight")), sqnr


def test_bench_dense_loss_variants_convert_the_linears_they_name(torch_references, monkeypatch):
    """``bench_dense_loss``'s variants of the MLP linears (the dense rule lowered to the CPU sizes):
    BF16 weight gradients on exactly the MLP linears, the first decoder layer's MLP or the shared
    experts left in BF16, the weights shared with the converted model, and the model still trains."""
    pytest.importorskip("transformers")
    from moe_fp8.bench import models
    from moe_fp8.layers import FP8Linear

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_dense_loss

    variants = ("ours_fp8_dense_mlp_gw_hp", "ours_fp8_first_mlp_bf16", "ours_fp8_shared_experts_bf16")
    for variant in variants:
        monkeypatch.setitem(bench_dense_loss.VARIANTS, variant, (dict(recipe="rowwise", min_dense_size=0), ()))
    base = models.build(models._spec("dsv3", "cpu", 2), 32, "cpu")
    recipes = {}
    for variant in variants:
        model = bench_dense_loss.variant_model(base, variant)
        recipes[variant] = {n: m.recipe.name for n, m in model.named_modules() if isinstance(m, FP8Linear)}
        params = dict(model.named_parameters())
        assert all(m.weight is params[n + ".weight"] for n, m in model.named_modules() if isinstance(m, FP8Linear))
        loss = model(input_ids=torch.randint(0, 256, (2, 32))).logits.float().square().mean()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for n, p in params.items() if "mlp" in n)
    gw_hp = recipes["ours_fp8_dense_mlp_gw_hp"]
    mlp = {n for n in gw_hp if n.rsplit(".", 1)[-1] in bench_dense_loss.MLP}
    assert mlp and {n for n, r in gw_hp.items() if r == "rowwise_gw_hp"} == mlp
    for variant, kept in (("ours_fp8_first_mlp_bf16", {n for n in mlp if n.startswith("model.layers.0.mlp.")}),
                          ("ours_fp8_shared_experts_bf16", {n for n in mlp if ".mlp.shared_experts." in n})):
        assert kept and set(recipes[variant]) == set(gw_hp) - kept, variant
        assert set(recipes[variant].values()) == {"rowwise"}


def test_bench_fused_accumulation_variant_cpu(torch_references):
    """``ours_fp8_experts_cached_fused_acc`` converts with ``fused_grad_accumulation`` and, with 2
    micro-batches per step, trains to the loss of the same experts without it (its caches current)."""
    pytest.importorskip("transformers")
    from moe_fp8.bench import models

    variants = ["hf_bf16", "ours_fp8_experts", "ours_fp8_experts_cached_fused_acc"]
    rows = models.collect("cpu", models=["qwen3_h1024"], loss_steps=3, accumulate=2, variants=variants)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == set(variants) and all("error" not in r for r in rows), rows
    fused = by_variant["ours_fp8_experts_cached_fused_acc"]
    assert fused["cache_gap"] == 0
    assert abs(fused["final_loss"] / by_variant["ours_fp8_experts"]["final_loss"] - 1) < 0.01
    base = models.build(models._spec("qwen3_h1024", "cpu", None), 32, "cpu")
    experts = [m for m in models.convert(base, "ours_fp8_experts_cached_fused_acc", None).modules()
               if type(m).__name__ == "FP8GroupedExperts"]
    assert experts and all(m.fused_grad_accumulation and m.cache_weights for m in experts)
