"""Host overhead of an FP8MoE forward+backward on the GPU: rowwise against bf16, direct launch on and off.

For H=1024, E=64, I=384, top-8, T=8192 and H=2048, E=128, I=768, top-8, T=4096, per recipe
(``rowwise``, ``bf16``) and per launch mode (the direct launch of ``moe_fp8.launch`` on, and off:
every Triton launch through ``kernel[grid]``), one run measures:

* ``gpu_ms``: GPU time of one forward+backward (CUDA events around each step, median of 20);
* ``host_ms``: the Python of one forward+backward while the GPU is busy (a long ``torch.cuda._sleep``
  is enqueued first, so no launch waits for the device and the time is the host's alone; median of 20);
* ``wall_ms``: ``max`` of the two, what a step costs when nothing overlaps it;
* ``kernels``: device kernels (and memsets / copies) of one step in ``torch.profiler``;
  ``counted``: what ``moe_fp8.testing.launches`` counts (Triton launches + kernel-launching torch ops);
* per launch of a tiny Triton kernel (GPU busy, median of 5 x 400 launches): host microseconds of
  ``kernel[grid](...)`` and of ``launch(kernel)[grid](...)`` with the direct launch on and off.

Usage: ``python benchmarks/bench_host_overhead.py [--out DIR]`` on one GPU (about a minute, Triton
compiles included); ``--smoke`` runs a tiny layer on the CPU (Triton interpreter) to check the script.
Writes ``host_overhead.json`` and ``host_overhead.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_fp8 import FP8MoE
from moe_fp8.bench.report import run_env, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.launch import fast_launch, launch
from moe_fp8.testing.launches import count_launches

SHAPES = [dict(H=1024, E=64, I=384, K=8, T=8192), dict(H=2048, E=128, I=768, K=8, T=4096)]
SMOKE_SHAPES = [dict(H=64, E=4, I=32, K=2, T=48)]
RECIPES = ("rowwise", "bf16")
STEPS = 20
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: longer than the Python of any step here


@triton.jit
def _tiny_kernel(x_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def launch_us() -> dict:
    """Host microseconds per launch of ``_tiny_kernel``: Triton's own ``kernel[grid]``, and the seam with
    the direct launch on and off (the GPU kept busy so that no launch waits)."""
    x = torch.zeros(1000, device="cuda")
    calls = {
        "triton kernel[grid]": lambda: _tiny_kernel[(8,)](x, 1000, 1.0, BLOCK=128),
        "launch(kernel)[grid], direct": lambda: launch(_tiny_kernel)[(8,)](x, 1000, 1.0, BLOCK=128),
        "launch(kernel)[grid], off": lambda: launch(_tiny_kernel)[(8,)](x, 1000, 1.0, BLOCK=128),
    }
    out = {}
    for name, call in calls.items():
        with fast_launch(not name.endswith("off")):
            call()
            rounds = []
            for _ in range(5):
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES // 4)
                t0 = time.perf_counter()
                for _ in range(400):
                    call()
                rounds.append((time.perf_counter() - t0) / 400 * 1e6)
            torch.cuda.synchronize()
        out[name] = statistics.median(rounds)
    return out


def _layer(shape: dict, recipe: str, device: str):
    torch.manual_seed(0)
    backend = None if device == "cuda" else "triton"
    moe = FP8MoE(shape["H"], shape["I"], shape["E"], shape["K"], recipe=recipe, backend=backend)
    moe = moe.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(shape["T"], shape["H"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(grad)

    return step


def _host_ms(step, device: str, steps: int) -> float:
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def _profiled_kernels(step) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def measure(shape: dict, recipe: str, fast: bool, device: str, steps: int = STEPS) -> dict:
    step = _layer(shape, recipe, device)
    with fast_launch(fast):
        for _ in range(min(3, steps)):  # compile, fill the weight caches
            step()
        with count_launches() as counted:
            step()
        row = dict(shape=shape, recipe=recipe, fast_launch=fast, counted=counted.total, triton=counted.triton)
        if device == "cuda":
            torch.cuda.synchronize()
            row.update(gpu_ms=event_median_ms(step, steps), host_ms=_host_ms(step, device, steps),
                       kernels=_profiled_kernels(step))
        else:
            row.update(gpu_ms=float("nan"), host_ms=_host_ms(step, device, steps), kernels=-1)
    row["wall_ms"] = max(row["gpu_ms"], row["host_ms"]) if device == "cuda" else row["host_ms"]
    return row


def _label(shape: dict) -> str:
    return f"H={shape['H']} E={shape['E']} I={shape['I']} k={shape['K']} T={shape['T']}"


def _table(rows: list[dict]) -> list[str]:
    head = "| shape | recipe | direct launch | GPU ms | host ms | host / bf16 host | kernels | counted (Triton) |"
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        bf16 = next(b for b in rows if b["shape"] == r["shape"] and b["recipe"] == "bf16" and b["fast_launch"])
        lines.append(f"| {_label(r['shape'])} | {r['recipe']} | {'on' if r['fast_launch'] else 'off'} | "
                     f"{r['gpu_ms']:.3f} | {r['host_ms']:.3f} | {r['host_ms'] / bf16['host_ms']:.2f} | "
                     f"{r['kernels']} | {r['counted']} ({r['triton']}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU (Triton interpreter)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    steps = 1 if args.smoke else STEPS
    rows = [measure(shape, recipe, fast, device, steps)
            for shape in (SMOKE_SHAPES if args.smoke else SHAPES) for recipe in RECIPES for fast in (True, False)]
    lines = _table(rows)
    if device == "cuda":
        per_launch = launch_us()
        rows.append(dict(per_launch_us=per_launch))
        lines += ["", "| one launch of a tiny kernel | host µs |", "|---|---:|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in per_launch.items()]
    print("\n".join(lines))
    env = run_env(device)
    method = (f"median of {steps} steps; host time with the GPU kept busy by torch.cuda._sleep; "
              "kernels from torch.profiler; direct launch off = MOE_FP8_FAST_LAUNCH=0")
    write_report(args.out, "host_overhead" + ("_smoke" if args.smoke else ""), env, rows,
                 "FP8MoE forward+backward: host time and kernel launches", method, lines)


if __name__ == "__main__":
    main()
