"""What ``torch.compile`` sees of the library: our Triton kernels as ``triton_kernel_wrapper`` nodes
in the AOT graphs (forward and backward), not opaque ``moe_fp8::*`` calls (except the GEMMs that read
a weight cache: FP8 copies, or amaxes for small groups), and compiled results equal to eager ones.
CPU: tiny shapes, Triton interpreter, a graph-capturing AOT backend. GPU:
Inductor on converted Hugging Face decoder layers, ``mode="reduce-overhead"`` on a whole model."""

import logging

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

from moe_fp8 import FP8Linear, FP8MoE, hf
from moe_fp8.grouped_gemm.backends.triton_backend import TritonBackend
from moe_fp8.testing import sqnr

transformers = pytest.importorskip("transformers")

from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig  # noqa: E402

H, I, E, K, T = 32, 32, 4, 2, 16

# Without a GPU target Triton cannot analyse which arguments a kernel writes; torch then logs a
# warning per kernel and treats every argument as written (correct, only more copies).
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)


class _Capture:
    """An AOT backend (eager execution) that keeps the forward and backward FX graphs."""

    def __init__(self):
        self.graphs = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

    def _keep(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm

    def kernels(self, graph) -> list[str]:
        """Names of the Triton kernels launched by ``graph``'s ``triton_kernel_wrapper`` nodes."""
        return [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in graph.graph.nodes
                if "triton_kernel_wrapper" in str(n.target)]

    def library_ops(self, graph) -> set[str]:
        return {str(n.target) for n in graph.graph.nodes if str(n.target).startswith("moe_fp8.")}


def _run(module, x, dy, call=None):
    """Output, x's gradient and the parameters' gradients of ``call(x)`` (default ``module(x)``)."""
    module.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = (module if call is None else call)(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return out, x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _compiled_vs_eager(module, x, dy):
    torch._dynamo.reset()
    cap = _Capture()
    want = _run(module, x, dy)
    got = _run(module, x, dy, torch.compile(module, fullgraph=True, backend=cap.backend))
    assert len(cap.graphs) == 2, "one forward and one backward graph (fullgraph)"
    return want, got, cap


_CACHED_GEMM = "moe_fp8.gg_mm_2d3d_cached_weight.default"


@pytest.mark.slow(10)
@pytest.mark.interpreter
@pytest.mark.parametrize("small_groups", [False, True])
def test_fp8_moe_graph_holds_the_triton_kernels(small_groups, monkeypatch):
    """Forward+backward of FP8MoE (Triton grouped GEMM backend, rowwise, ``cache_weights=False``)
    compiled: every kernel of routing, quantization and GEMM is a node of the graph, and the results
    are bit for bit eager's. Groups small enough for the GEMMs to quantize the weights themselves
    read the amax-only cache: the GEMMs are then the opaque cached-weight op, nothing else is."""
    if not small_groups:
        monkeypatch.setattr(TritonBackend, "quantize_w_max_rows_per_group", 0)
    torch.manual_seed(0)
    moe = FP8MoE(H, I, E, K, recipe="rowwise", backend="triton", cache_weights=False).to(torch.bfloat16)
    x, dy = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    want, got, cap = _compiled_vs_eager(moe, x, dy)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert want[2].keys() == got[2].keys() and all(torch.equal(want[2][n], got[2][n]) for n in want[2])
    fw, bw = (set(cap.kernels(g)) for g in cap.graphs)
    assert {"plan_kernel", "permute_rows_kernel", "combine_kernel"} <= fw
    assert "combine_backward_kernel" in bw
    # the SwiGLU and combine backwards write the dgrads' FP8 rows: no row quantization of its own
    assert {"_swiglu_quant_kernel"} <= fw and {"_swiglu_bwd_quant_kernel", "_grouped_mm_2d2d_kernel"} <= bw
    assert "_rowwise_kernel" not in bw, sorted(bw)
    if small_groups:  # tests/test_weight_amax_cache.py: what the op runs
        assert [cap.library_ops(g) for g in cap.graphs] == [{_CACHED_GEMM}] * 2
        assert not {"_grouped_mm_2d3d_kernel", "_expert_rowwise_col_amax_kernel"} & (fw | bw)
    else:  # the weights' layouts, the dgrad's from the forward's amax over N
        assert {"_grouped_mm_2d3d_kernel", "_expert_rowwise_col_amax_kernel"} <= fw
        assert {"_colwise_kernel", "_grouped_mm_2d3d_kernel"} <= bw
        assert not any(cap.library_ops(g) for g in cap.graphs)  # nothing opaque left


_VIEW_OPS = ("aten.slice.Tensor", "aten.as_strided.default", "aten.view.default", "aten.view.dtype",
             "aten.select.int", "aten.alias.default", "aten.t.default", "aten.transpose.int")
_FILLS = ("aten.zeros.default", "aten.full.default", "aten.ones.default", "aten.new_zeros.default",
          "aten.new_full.default")


def _part_of_a_filled_buffer(node) -> bool:
    """Is ``node`` a view of part of a buffer the graph fills (zeros, ones, full)?"""
    val = node.meta["val"]
    while str(node.target) in _VIEW_OPS:
        node = node.args[0]
    base = node.meta.get("val") if str(node.target) in _FILLS else None
    return base is not None and (val.storage_offset() != 0 or val.numel() < base.numel())


@pytest.mark.slow(10)
@pytest.mark.interpreter
def test_traced_kernels_take_whole_filled_buffers():
    """No traced launch takes part of a zeroed buffer (the colwise kernel's amaxes and counters):
    a traced launch clones what a kernel writes through that tensor's base, and Inductor may lay the
    slice out on its own, so the clone would read past it (counters of garbage, wrong gradients)."""
    torch.manual_seed(5)
    moe = FP8MoE(H, I, E, K, recipe="rowwise", backend="triton").to(torch.bfloat16)
    x, dy = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    _, _, cap = _compiled_vs_eager(moe, x, dy)
    launches = [n for g in cap.graphs for n in g.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    assert "_colwise_kernel" in {kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in launches}
    for n in launches:
        parts = [name for name, arg in n.kwargs["kwargs"].items()
                 if isinstance(arg, torch.fx.Node) and _part_of_a_filled_buffer(arg)]
        assert not parts, (kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__, parts)


@pytest.mark.interpreter
def test_emulated_backend_keeps_only_its_gemms_opaque():
    """The CPU reference GEMMs and quantizers (what ``emulated`` runs) read the offsets on the host:
    they stay opaque custom ops; routing, permute, SwiGLU and combine are still traced to kernels."""
    torch.manual_seed(1)
    moe = FP8MoE(H, I, E, K, recipe="rowwise", backend="emulated", cache_weights=False).to(torch.bfloat16)
    x, dy = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    want, got, cap = _compiled_vs_eager(moe, x, dy)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    fw, bw = cap.graphs
    for graph, gemm in ((fw, "moe_fp8.gg_mm_2d3d_opaque.default"), (bw, "moe_fp8.gg_mm_2d2d_opaque.default")):
        assert gemm in cap.library_ops(graph)
        assert all(op.endswith("_opaque.default") for op in cap.library_ops(graph))
    assert {"permute_rows_kernel", "combine_kernel"} <= set(cap.kernels(fw))


@pytest.mark.interpreter
def test_fp8_linear_graph_holds_the_quantization_kernels():
    torch.manual_seed(2)
    lin = FP8Linear(32, 16, dtype=torch.bfloat16)
    x, dy = torch.randn(8, 32).bfloat16(), torch.randn(8, 16).bfloat16()
    want, got, cap = _compiled_vs_eager(lin, x, dy)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(want[2][n], got[2][n]) for n in want[2])
    assert cap.kernels(cap.graphs[0]) and cap.kernels(cap.graphs[1])
    assert not any(cap.library_ops(g) for g in cap.graphs)


@pytest.mark.interpreter
@pytest.mark.parametrize("which", ["fp8_moe", "fp8_linear_cached"])
def test_token_counts_that_vary(which):
    """Batches of other token counts: Dynamo recompiles once with a dynamic token count, which the
    library's launches do not specialize (their block sizes guard ranges of counts: here 33-64, even,
    not a multiple of 16), so later counts in that range reuse the graph; outputs and gradients equal
    eager ones at every count, odd ones and counts below a group's size included."""
    torch.manual_seed(6)
    if which == "fp8_moe":
        module = FP8MoE(H, I, E, K, recipe="rowwise", backend="triton").to(torch.bfloat16)
    else:
        module = FP8Linear(H, 48, dtype=torch.bfloat16, cache_weights=True)
    torch._dynamo.reset()
    cap = _Capture()
    compiled = torch.compile(module, backend=cap.backend)
    for i, tokens in enumerate((T, 40, 44, 58, 7, 9)):
        x = torch.randn(tokens, H).bfloat16()
        dy = torch.randn(tokens, module(x).shape[-1]).bfloat16()
        want = _run(module, x, dy)
        got = _run(module, x, dy, compiled)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), tokens
        assert want[2].keys() == got[2].keys() and all(torch.equal(want[2][n], got[2][n]) for n in want[2])
        if i == 3:
            assert len(cap.graphs) == 4, "the static graph pair, then one dynamic pair for 40, 44 and 58"


def _config(name: str):
    common = dict(hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=K, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    if name == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=E, intermediate_size=64, norm_topk_prob=True, head_dim=16, **common)
    if name == "llama":
        return LlamaConfig(intermediate_size=64, **{k: v for k, v in common.items()
                                                    if k not in ("moe_intermediate_size", "num_experts_per_tok")})
    return DeepseekV3Config(n_routed_experts=E, intermediate_size=64, n_group=2, topk_group=1, n_shared_experts=1,
                            first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=16, **common)


class _Layer(torch.nn.Module):
    """A converted model's first decoder layer, with the model's rotary embedding for its inputs."""

    def __init__(self, model):
        super().__init__()
        self.layer, self.rotary = model.model.layers[0], model.model.rotary_emb

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)[None]
        return self.layer(x, position_ids=pos, position_embeddings=self.rotary(x, pos))


def _converted_layer(name: str, recipe: str, backend: str, device="cpu"):
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(_config(name)).to(device, torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    dense = dict(min_dense_size=0) if name == "llama" else {}  # every linear of the dense model in FP8
    hf.convert(model, recipe=recipe, backend=backend, min_expert_size=0, min_fp8_wgrad_size=0, cache_weights=True,
               **dense)
    return _Layer(model)


@pytest.mark.slow(9)
@pytest.mark.interpreter
@pytest.mark.parametrize("name, recipe", [("qwen3_moe", "rowwise"), ("deepseek_v3", "bf16")])
def test_hf_decoder_layer_compiles_with_the_triton_kernels(name, recipe):
    """One decoder layer of a converted tiny model (weight cache on), attention included: fullgraph
    forward+backward, our kernels in the graph, equal to eager (the same kernels; the compiled attention and norms may
    round differently, hence SQNR)."""
    layer = _converted_layer(name, recipe, "triton")
    x, dy = torch.randn(1, 8, H).bfloat16(), torch.randn(1, 8, H).bfloat16()
    want, got, cap = _compiled_vs_eager(layer, x, dy)
    assert sqnr(want[0], got[0]) >= 40 and sqnr(want[1], got[1]) >= 40
    assert want[2].keys() == got[2].keys()
    for n in want[2]:
        assert sqnr(want[2][n], got[2][n]) >= 30, n
    fw, bw = (set(cap.kernels(g)) for g in cap.graphs)
    assert {"permute_rows_kernel", "combine_kernel"} <= fw and "combine_backward_kernel" in bw
    if recipe == "rowwise":  # the weight cache on: the forward and dgrad GEMMs read it inside one op each
        assert "_grouped_mm_2d2d_kernel" in bw
        assert [cap.library_ops(g) for g in cap.graphs] == [{_CACHED_GEMM}] * 2
        assert [str(n.target) for g in cap.graphs for n in g.graph.nodes].count(_CACHED_GEMM) == 4
    else:
        assert not any(cap.library_ops(g) for g in cap.graphs)


@pytest.mark.slow(6)
@pytest.mark.interpreter
def test_hf_dense_decoder_layer_compiles_with_the_triton_kernels():
    """A converted Llama decoder layer, every linear an ``FP8Linear``: one forward and one backward
    graph (fullgraph: no break around the FP8 linears), the quantization kernels and the FP8 GEMMs
    in them, no opaque library op, results close to eager (the compiled attention and norms may
    round differently)."""
    layer = _converted_layer("llama", "rowwise", None)
    assert sum(type(m).__name__ == "FP8Linear" for m in layer.modules()) == 7
    x, dy = torch.randn(1, 8, H).bfloat16(), torch.randn(1, 8, H).bfloat16()
    want, got, cap = _compiled_vs_eager(layer, x, dy)
    assert sqnr(want[0], got[0]) >= 40 and sqnr(want[1], got[1]) >= 40
    for n in want[2]:
        assert sqnr(want[2][n], got[2][n]) >= 30, n
    fw, bw = (set(cap.kernels(g)) for g in cap.graphs)
    # x's rows (with its column amax where traced for a GPU), W's forward layout; W's dgrad layout
    assert fw & {"_rowwise_kernel", "_group_rowwise_amax_kernel"} and "_expert_rowwise_col_amax_kernel" in fw, fw
    assert "_colwise_kernel" in bw, bw
    assert not any(cap.library_ops(g) for g in cap.graphs)
    from moe_fp8.layers.scaled_mm import cpu_kernel_takes_row_scales

    if cpu_kernel_takes_row_scales():  # else (torch < 2.13) the CPU stand-in's fp32 matmuls
        gemms = [sum(str(n.target) == "aten._scaled_mm.default" for n in g.graph.nodes) for g in cap.graphs]
        assert gemms == [7, 14], gemms  # each linear's forward; its dgrad and wgrad


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name, recipe", [(n, r) for n in ("qwen3_moe", "deepseek_v3") for r in ("rowwise", "bf16")]
                         + [("llama", "rowwise")])
def test_gpu_hf_decoder_layer_inductor(name, recipe):
    """Inductor, fullgraph, forward+backward of a converted decoder layer against eager (a dense
    layer under ``bf16`` has nothing to convert: ``hf.convert`` refuses it)."""
    layer = _converted_layer(name, recipe, None, device="cuda")
    x, dy = torch.randn(2, 64, H, device="cuda").bfloat16(), torch.randn(2, 64, H, device="cuda").bfloat16()
    torch._dynamo.reset()
    want = _run(layer, x, dy)
    got = _run(layer, x, dy, torch.compile(layer, fullgraph=True))
    assert sqnr(want[0], got[0]) >= 30 and sqnr(want[1], got[1]) >= 30
    for n in want[2]:
        assert sqnr(want[2][n], got[2][n]) >= 25, n


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "bf16"])
def test_gpu_reduce_overhead_whole_model_sees_optimizer_updates(recipe):
    """``mode="reduce-overhead"`` (CUDA graphs) on a whole converted model: training steps with an
    optimizer between replays; each compiled step equals an eager step of the same weights (the
    FP8 weight cache must see every update: a stale cache would give the first step's weights)."""
    torch.manual_seed(4)
    cfg = _config("qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16)
    hf.convert(model, recipe=recipe, min_expert_size=0, cache_weights=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    losses = []
    for step in range(4):
        with torch.no_grad():
            want = model(ids, labels=ids).loss.float()
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(ids, labels=ids).loss
        assert abs(loss.float().item() - want.item()) <= 2e-2 * max(1.0, abs(want.item())), step
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert len(set(losses)) == len(losses), "every step sees the updated weights"
