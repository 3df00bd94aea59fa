"""The dense SwiGLU MLP as one FP8 unit built from the experts' grouped path, against three FP8Linears.

``down(silu(gate(x)) * up(x))`` at dense model sizes (``M`` token rows, ``H`` hidden, ``I``
intermediate), forward + backward with the weights' gradients, three ways on the same weights:

* ``bf16``: ``F.linear`` three times (what the unconverted model runs);
* ``linears``: three ``FP8Linear`` (rowwise), what ``hf.convert`` makes of a dense MLP;
* ``unit``: one group of the experts' path: ``gate`` and ``up`` weights concatenated into one
  ``(1, 2I, H)`` weight per call, ``fp8_grouped_mm_swiglu`` (one GEMM over ``2I``, the SwiGLU kernel
  writing ``a``'s FP8 rows, its backward the FP8 rows of ``[dg | du]`` for one dgrad GEMM) and
  ``fp8_grouped_mm`` for ``down``. It quantizes ``x`` once for gate and up and never reads ``a`` or
  ``[dg | du]`` back for a row quantization;
* ``unit_one_weight``: the same unit on a ``(1, 2I, H)`` parameter that holds gate and up already
  (no concatenation per call, the weight gradient not split): what the grouped path itself costs
  against the linears' ``torch._scaled_mm``.

Eager and compiled (``torch.compile`` of the function), median of ``--steps`` CUDA-event times after
3 warm-up steps; peak: the largest allocation above the one before the timed steps. Accuracy: SQNR
(dB) of the output and every gradient against an fp64 computation of the same MLP.

Usage: ``python benchmarks/bench_dense_mlp_unit.py [--steps 20] [--out benchmarks/results]`` (writes
``dense_mlp_unit.json`` and ``.md``); ``--quick``: tiny shapes on the CPU, eager (a smoke run, under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_fp8.bench.report import run_env, script_args, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.grouped_gemm import fp8_grouped_mm
from moe_fp8.grouped_gemm.with_neighbors import fp8_grouped_mm_swiglu
from moe_fp8.layers.mlp import SwiGLUMLP
from moe_fp8.testing import sqnr

# model -> (M token rows, H, I): Llama3-8B's MLP, DeepSeek-V3's dense (first-layer) MLP, at 8 x 1024 tokens
SHAPES = {"llama3_8b": (8192, 4096, 14336), "dsv3_dense": (8192, 7168, 18432)}
QUICK_SHAPES = {"tiny": (40, 64, 96)}
VARIANTS = ("bf16", "linears", "unit", "unit_one_weight")


def _one_group_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``x (M, H)`` through ``w_gate_up (1, 2I, H)`` and ``w_down (1, H, I)`` as one group of the experts'
    grouped path -> ``(M, H)`` bf16."""
    offs = torch.empty((1,), dtype=torch.int32, device=x.device).fill_(x.shape[0])
    a, a_q, a_s = fp8_grouped_mm_swiglu(x, w_gate_up, offs, recipe="rowwise")
    return fp8_grouped_mm(a, w_down, offs, recipe="rowwise", x_fp8=(a_q, a_s))


def unit(mlp: SwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    """``mlp``'s gate and up weights concatenated per call."""
    w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])[None]
    return _one_group_mlp(x, w_gate_up, mlp.down_proj.weight[None])


def unit_one_weight(mlp: SwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    """``mlp.gate_up (1, 2I, H)``, a parameter holding the gate and up weights."""
    return _one_group_mlp(x, mlp.gate_up, mlp.down_proj.weight[None])


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def bf16(mlp: SwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    return _swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def linears(mlp: SwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp(x)


FUNCTIONS = {"bf16": bf16, "linears": linears, "unit": unit, "unit_one_weight": unit_one_weight}


def _step(fn, mlp: SwiGLUMLP, x: torch.Tensor, gy: torch.Tensor) -> None:
    x.grad = None
    for p in mlp.parameters():
        p.grad = None
    fn(mlp, x).backward(gy)


def _time(fn, mlp: SwiGLUMLP, x: torch.Tensor, gy: torch.Tensor, steps: int) -> tuple[float, float | None]:
    """``(median ms, peak GiB above the start or None off CUDA)`` of ``steps`` forward + backward steps
    after 3 warm-up steps."""
    cuda = x.is_cuda
    for _ in range(3):
        _step(fn, mlp, x, gy)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = event_median_ms(lambda: _step(fn, mlp, x, gy), steps)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None


def _accuracy(model: str, ref: SwiGLUMLP, fp8: SwiGLUMLP, x: torch.Tensor, gy: torch.Tensor) -> list[dict]:
    """Per FP8 variant, the SQNR of the output and of every gradient against fp64."""
    x64 = x.detach().double().requires_grad_()
    w64 = [m.weight.detach().double().requires_grad_() for m in (ref.gate_proj, ref.up_proj, ref.down_proj)]
    y64 = _swiglu(x64, *w64)
    y64.backward(gy.double())
    rows = []
    for variant in VARIANTS[1:]:
        x.grad = None
        for p in fp8.parameters():
            p.grad = None
        y = FUNCTIONS[variant](fp8, x)
        y.backward(gy)
        grads = [m.weight.grad for m in (fp8.gate_proj, fp8.up_proj, fp8.down_proj)]
        if variant == "unit_one_weight":
            grads[:2] = fp8.gate_up.grad[0].chunk(2)
        rows.append(dict(model=model, variant=variant, sqnr_y=sqnr(y64, y), sqnr_dx=sqnr(x64.grad, x.grad),
                         **{f"sqnr_dw_{n}": sqnr(w.grad, g) for n, g, w in zip(("gate", "up", "down"), grads, w64)}))
    return rows


def report_body(rows: list[dict], accuracy: list[dict]) -> list[str]:
    """The markdown tables of the timed ``rows`` and the ``accuracy`` rows."""
    body = ["| model | mode | variant | ms | vs BF16 | peak GiB |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        base = next(b["ms"] for b in rows if (b["model"], b["mode"], b["variant"]) == (r["model"], r["mode"], "bf16"))
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        body.append(f"| {r['model']} | {r['mode']} | {r['variant']} | {r['ms']:.2f} | {base / r['ms']:.3f}x | {peak} |")
    body += ["", "SQNR against fp64 (dB):", "", "| model | variant | y | dx | dW gate | dW up | dW down |",
             "|---|---|---:|---:|---:|---:|---:|"]
    body += [f"| {a['model']} | {a['variant']} | {a['sqnr_y']:.2f} | {a['sqnr_dx']:.2f} | {a['sqnr_dw_gate']:.2f} | "
             f"{a['sqnr_dw_up']:.2f} | {a['sqnr_dw_down']:.2f} |" for a in accuracy]
    return body


def main() -> None:
    args, device = script_args(__doc__, 20)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    modes = ("eager",) if device == "cpu" else ("eager", "compiled")
    rows, accuracy = [], []
    for model, (m, h, i) in shapes.items():
        torch.manual_seed(0)
        ref = SwiGLUMLP(h, i, recipe="bf16", device=device, dtype=torch.bfloat16)
        fp8 = SwiGLUMLP(h, i, recipe="rowwise", device=device, dtype=torch.bfloat16)
        fp8.load_state_dict(ref.state_dict())
        fp8.gate_up = torch.nn.Parameter(torch.cat([fp8.gate_proj.weight, fp8.up_proj.weight]).detach()[None])
        x = torch.randn(m, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, h, device=device, dtype=torch.bfloat16)
        accuracy += _accuracy(model, ref, fp8, x, gy)
        for mode in modes:
            for variant in VARIANTS:
                fn = torch.compile(FUNCTIONS[variant]) if mode == "compiled" else FUNCTIONS[variant]
                ms, peak = _time(fn, ref if variant == "bf16" else fp8, x, gy, args.steps)
                rows.append(dict(model=model, mode=mode, variant=variant, ms=ms, peak_gib=peak))
                torch._dynamo.reset()
    body = report_body(rows, accuracy)
    print("\n".join(body))
    stem = "dense_mlp_unit" + ("_quick" if args.quick else "")
    write_report(args.out, stem, run_env(device), rows + accuracy,
                 "The dense SwiGLU MLP: one FP8 unit from the experts' grouped path against three FP8Linears",
                 f"`python benchmarks/bench_dense_mlp_unit.py --steps {args.steps}`, forward + backward, medians of "
                 "CUDA-event times", body)


if __name__ == "__main__":
    main()
