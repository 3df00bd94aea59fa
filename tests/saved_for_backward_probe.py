"""What torch.compile's partitioner saves from forward to backward around the library's FP8 ops on a
GPU, found on the CPU: the ops traced on meta tensors as if Triton ran on them (so the graphs hold
the kernels a GPU launches), torch's analysis of each kernel's writes built for sm_90, the joint
graph split by Inductor's partitioner (``min_cut_rematerialization_partition``).

``python tests/saved_for_backward_probe.py`` (without ``TRITON_INTERPRET``: the kernels must be
``triton.jit`` functions) prints one JSON object: case -> the forward's saved tensors as
``[dtype, shape]`` pairs; with transformers, ``"llama decoder"``: the bytes a Llama3-8B-sized
decoder layer's compiled forward saves, HF's and converted; and ``"analysis fallbacks"``: the
kernels torch could not analyse.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run without TRITON_INTERPRET=1: the kernels must be triton.jit functions")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from traced_writes import _sm90_analysis  # noqa: E402

from moe_fp8 import FP8MoE  # noqa: E402
from moe_fp8.grouped_gemm import Fp8WeightCache  # noqa: E402
from moe_fp8.grouped_gemm.op import fp8_grouped_mm  # noqa: E402
from moe_fp8.kernel_backend import LaunchTarget, configure_launches_for  # noqa: E402
from moe_fp8.layers.fp8_linear import fp8_linear  # noqa: E402


def _triton_on_meta() -> None:
    """Every library module takes meta tensors for tensors Triton runs on (the triton backend too),
    and modules take meta parameters (no autocast state on meta)."""
    from moe_fp8.grouped_gemm.backends.select import BACKENDS

    BACKENDS["triton"].unavailable_reason = lambda device: None
    torch.is_autocast_enabled = lambda *args: False
    for name, module in list(sys.modules.items()):
        if name.startswith("moe_fp8"):
            for attr in ("triton_runs_on", "_use_triton"):
                if callable(getattr(module, attr, None)):
                    setattr(module, attr, lambda t: True)
            if callable(getattr(module, "use_triton", None)):
                module.use_triton = lambda kernel, t: True
            if callable(getattr(module, "check_parameters", None)):
                module.check_parameters = lambda *args: None


def _dense(x, wa, wb):
    """Two rowwise FP8 linears with a SiLU between (the second one's input is an activation)."""
    return fp8_linear(F.silu(fp8_linear(x, wa, fmt="e4m3fn")), wb, fmt="e4m3fn")


def _dense_cached(x, wa, wb):
    """The same two linears with weight caches: compiled, the GEMMs read the compiled cache."""
    cache = Fp8WeightCache()
    return fp8_linear(F.silu(fp8_linear(x, wa, fmt="e4m3fn", weight_cache=cache)), wb, fmt="e4m3fn",
                      weight_cache=cache)


def _dense_stack(x, wa, wb):
    """Two rowwise FP8 linears of one shape with a SiLU between: their launches' outputs have equal
    shapes, which the compiled graph's common-subexpression pass may merge."""
    return fp8_linear(F.silu(fp8_linear(x, wa, fmt="e4m3fn")), wb, fmt="e4m3fn")


def _moe_stack():
    """Two uncached rowwise ``FP8MoE`` layers of one shape (4 experts, top-2), one after the other."""
    torch.manual_seed(0)
    first, second = (FP8MoE(64, 64, 4, 2, backend="triton", cache_weights=False).to(device="meta",
                                                                                     dtype=torch.bfloat16)
                     for _ in range(2))
    return lambda x: second(first(x))


def _experts(x, w, offs):
    """The rowwise grouped GEMM without a weight cache (the weight's dgrad layout made in backward)."""
    return fp8_grouped_mm(x, w, offs, backend="triton")


def _moe(cache_weights: bool):
    """A rowwise ``FP8MoE`` (4 experts, top-2) on meta parameters, with or without the weight cache."""
    torch.manual_seed(0)
    moe = FP8MoE(64, 64, 4, 2, backend="triton", cache_weights=cache_weights)
    moe = moe.to(device="meta", dtype=torch.bfloat16)
    return lambda x: moe(x)


def _keeper(graphs: dict, name: str):
    """A compiler that keeps the graph as ``graphs[name]`` and runs nothing: meta results of the
    graph's output shapes."""
    def compiler(gm, example_inputs):
        graphs[name] = gm
        vals = [n.meta.get("val") if n is not None else None
                for n in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
        results = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                   if isinstance(v, torch.Tensor) else v for v in vals]
        return make_boxed_func(lambda *args: list(results))
    return compiler


_VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice",
          "alias", "reshape", "detach"}


def _base(node):
    """The node whose buffer ``node`` views (``node`` itself when it is no view)."""
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEWS:
        node = node.args[0]
    return node


def _llama_saved_bytes(convert: bool) -> tuple[int, list]:
    """Bytes of the distinct buffers (not parameters) the compiled forward of a Llama3-8B-sized
    decoder layer (8 x 1024 tokens, flash attention's saved tensors) keeps for the backward, HF's
    own or converted by ``hf.convert``'s defaults; and the FP8 tensors among them."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from moe_fp8 import hf

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, scale=scaling)[0]
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("probe_meta_attention", attention)
    config = LlamaConfig(vocab_size=272, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         attn_implementation="probe_meta_attention")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if convert:
        hf.convert(model)
    graphs = {}
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=_keeper(graphs, "forward"), bw_compiler=_keeper(graphs, "backward"),
                           partition_fn=min_cut_rematerialization_partition)
    ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(input_ids=ids, use_cache=False)
    output = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
    bases = {_base(n) for n in output.args[0][1:] if isinstance(n, torch.fx.Node)}
    bases = [n for n in bases if n.op != "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    nbytes = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in bases)
    fp8 = [[str(n.meta["val"].dtype), list(n.meta["val"].shape)] for n in bases if "float8" in str(n.meta["val"].dtype)]
    return nbytes, fp8


def _saved(fn, *shapes) -> list:
    graphs = {}
    torch._dynamo.reset()
    args = [torch.empty(s, device="meta", dtype=d, requires_grad=g) for s, d, g in shapes]
    backend = aot_autograd(fw_compiler=_keeper(graphs, "forward"), bw_compiler=_keeper(graphs, "backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)  # the partition is made here
    output = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
    saved = output.args[0][1:]  # after the forward's one result
    return [[str(n.meta["val"].dtype), list(n.meta["val"].shape)] for n in saved]


def _written_twice(fn, *shapes) -> list:
    """``[graph, argument, factory, shape]`` for each buffer that two traced launches are handed to
    write (a functionalized launch writes a copy of a buffer that is also another's: a merged
    allocation, copied before every launch but one)."""
    graphs = {}
    torch._dynamo.reset()
    args = [torch.empty(s, device="meta", dtype=d, requires_grad=g) for s, d, g in shapes]
    backend = aot_autograd(fw_compiler=_keeper(graphs, "forward"), bw_compiler=_keeper(graphs, "backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    found = []
    for name, gm in sorted(graphs.items()):
        writers: dict = {}
        for n in gm.graph.nodes:
            if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target):
                for arg in n.kwargs["tensors_to_clone"]:
                    source = n.kwargs["kwargs"][arg]
                    if isinstance(source, torch.fx.Node):
                        writers.setdefault(source, []).append(arg)
        found += [[name, args[0], str(src.target), list(src.meta["val"].shape)]
                  for src, args in writers.items() if len(args) > 1]
    return found


def main() -> None:
    _triton_on_meta()
    sm90 = configure_launches_for(LaunchTarget("cuda", (9, 0), 132))  # a GPU's tiles and casts, not the interpreter's
    bf16 = torch.bfloat16
    with _sm90_analysis() as warned, sm90:
        report = {
            "fp8_linear": _saved(_dense, ((48, 64), bf16, True), ((128, 64), bf16, True), ((64, 128), bf16, True)),
            "fp8_linear cached": _saved(_dense_cached, ((48, 64), bf16, True), ((128, 64), bf16, True),
                                        ((64, 128), bf16, True)),
            "fp8_grouped_mm": _saved(_experts, ((96, 64), bf16, True), ((4, 128, 64), bf16, True),
                                     ((4,), torch.int32, False)),
            "fp8_moe cached": _saved(_moe(True), ((96, 64), bf16, True)),
            "fp8_moe uncached": _saved(_moe(False), ((96, 64), bf16, True)),
            "written twice": {
                "fp8_linear stack": _written_twice(_dense_stack, ((48, 64), bf16, True), ((64, 64), bf16, True),
                                                   ((64, 64), bf16, True)),
                "fp8_moe stack": _written_twice(_moe_stack(), ((96, 64), bf16, True)),
            },
        }
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass
        else:
            hf_bytes, _ = _llama_saved_bytes(False)
            ours_bytes, ours_fp8 = _llama_saved_bytes(True)
            report["llama decoder"] = dict(hf_bytes=hf_bytes, ours_bytes=ours_bytes, ours_fp8=ours_fp8)
    report["analysis fallbacks"] = [r.getMessage()[:200] for r in warned.records]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
