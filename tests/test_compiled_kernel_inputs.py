"""Under ``torch.compile`` a tensor that our Triton kernels read is written once by the Inductor
kernel that computes it (``moe_fp8.launch.kernel_input``), not once more for each launch that reads
it: the generated code of a compiled forward + backward holds no Inductor kernel that stores one
value to two outputs."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_fp8 import FP8Linear, FP8MoE

_KERNEL = re.compile(r"async_compile\.triton\('(triton_\w+)', '''(.*?)'''", re.S)  # Inductor's, not ours
_POINTERS = re.compile(r"'signature': \{(.*?)\}")
_STORE = re.compile(r"tl\.store\((\w+) \+ \(?(.*?)\)?, (\w+)[,)]")


def duplicate_stores(code: str) -> dict[str, list[str]]:
    """``{kernel: [value, ...]}``: the Inductor kernels in generated ``code`` that store a value to two
    outputs. Kernels whose pointers are all int32 are left out: Inductor folds the zeroed amax
    buffers of a graph into one constant and copies it into each (a launch each, a few KB)."""
    found = {}
    for name, body in _KERNEL.findall(code):
        pointers = re.findall(r"'\*(\w+)'", (_POINTERS.search(body) or ["", ""])[1])
        if pointers and all(p == "i32" for p in pointers):
            continue
        values = [value for _, _, value in _STORE.findall(body)]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            found[name] = repeated
    return found


def _kernel_source(name: str, signature: str, body: str) -> str:
    return (f"{name} = async_compile.triton('{name}', '''\n@triton_heuristics.pointwise(\n"
            f"    triton_meta={{'signature': {{{signature}}}, 'device': 0}},\n)\n@triton.jit\n"
            f"def {name}(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):\n{body}''', device_str='cuda')\n")


def test_duplicate_stores_finds_a_repeated_value():
    twice = "    tmp0 = tl.load(in_ptr0 + (x0), None)\n    tmp1 = tmp0 * tmp0\n" \
            "    tl.store(out_ptr0 + (x0), tmp1, None)\n    tl.store(out_ptr1 + (x0), tmp1, None)\n"
    once = "    tmp0 = tl.load(in_ptr0 + (x0), None)\n    tl.store(out_ptr0 + (x0), tmp0, None)\n"
    copies = "    tmp0 = tl.load(in_ptr0 + (x0), None)\n" \
             "    tl.store(out_ptr0 + (x0), tmp0, None)\n    tl.store(out_ptr1 + (x0), tmp0, None)\n"
    bf16 = "'in_ptr0': '*bf16', 'out_ptr0': '*bf16', 'out_ptr1': '*bf16', 'xnumel': 'i32'"
    i32 = "'in_ptr0': '*i32', 'out_ptr0': '*i32', 'out_ptr1': '*i32', 'xnumel': 'i32'"
    code = (_kernel_source("triton_poi_fused_mul_0", bf16, twice) + _kernel_source("triton_poi_fused_1", bf16, once)
            + _kernel_source("triton_poi_fused_2", i32, copies) + _kernel_source("triton_poi_fused_3", bf16, copies))
    assert duplicate_stores(code) == {"triton_poi_fused_mul_0": ["tmp1"], "triton_poi_fused_3": ["tmp0"]}


def test_kernel_input_keeps_the_elements_under_compile(monkeypatch):
    """Under ``torch.compile`` (Inductor, here its CPU code) ``kernel_input`` is an ``as_strided`` of
    the tensor onto its storage that reads the same elements: rows at a storage offset, a flat
    slice re-viewed, a transpose, all views of a pointwise result not yet written out."""
    from torch._inductor.compile_fx import compile_fx

    from moe_fp8 import launch

    monkeypatch.setattr(launch, "_INTERPRET", False)  # CPU tensors as a GPU's: no interpreted launches

    def f(a):
        p = a * 2
        return (launch.kernel_input(p[1:]) + 1, launch.kernel_input(p.view(-1)[8:].view(-1, 8)) * 3,
                launch.kernel_input(p.t()) - 1)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    a = torch.randn(6, 8)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)(a)
    assert sum("as_strided" in str(n.target) for n in graphs[0].graph.nodes) == 3
    for eager, out in zip(f(a), compiled):
        assert torch.equal(eager, out)


class _SwiGLU(nn.Module):
    """A Llama-style MLP of ``FP8Linear`` layers: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate, self.up = FP8Linear(hidden, inter, bias=False), FP8Linear(hidden, inter, bias=False)
        self.down = FP8Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _generated_code(model: nn.Module, x: torch.Tensor) -> str:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)

    def step():
        out = compiled(x)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=x.device)).sum().backward()

    _, codes = run_and_get_code(step)
    return "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense_swiglu", "moe"])
def test_compiled_step_writes_each_kernel_input_once(kind):
    torch.manual_seed(0)
    if kind == "dense_swiglu":
        model = _SwiGLU(256, 512).to("cuda", torch.bfloat16)
    else:
        model = FP8MoE(256, 128, num_experts=8, top_k=2).to("cuda", torch.bfloat16)
    # the input comes out of a pointwise op, as a norm's output does in a decoder layer
    h = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    class _Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, h):
            out = self.inner(h * torch.rsqrt(h.float().square().mean(-1, keepdim=True) + 1e-6).to(h.dtype))
            return h + (out[0] if isinstance(out, tuple) else out)

    code = _generated_code(_Block(), h)
    assert "def triton_" in code, "nothing compiled by Inductor"
    assert duplicate_stores(code) == {}, duplicate_stores(code)
