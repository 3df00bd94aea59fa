"""What one training step's device time and peak memory are made of.

* :func:`kernel_time`: device time of the step by kernel category (``torch.profiler``): the
  library's own Triton kernels (known by name), Inductor's fused kernels, GEMMs (FP8 where the
  kernel name says so), attention, the optimizer's multi-tensor kernels, ATen's elementwise and
  reduction kernels, copies; and the kernels that took longest.
* :func:`peak_allocations`: the allocations alive when the step's allocated memory peaked, by the
  line that made them (the CUDA caching allocator's recorded history, replayed). A line of
  Inductor's generated code is shown with its source (``buf12 = empty_strided_cuda(...)``).

Both take a ``step()`` callable and run it once. Off CUDA the profile counts CPU operator time
instead (its numbers mean nothing beyond the smoke run) and there is no allocation history.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
import sysconfig
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

__all__ = ["kernel_category", "library_kernel_names", "profiled_events", "kernel_time", "replay_peak",
           "peak_allocations"]

#: (category, pattern on the lower-cased kernel name), first match wins, after the library's own
#: kernels and Inductor's (``triton_`` prefix)
_NAME_RULES = (
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("optimizer and clipping", r"multi_tensor|adam|foreach"),
    ("GEMM FP8 (cuBLAS / CUTLASS)", r"(gemm|xmma|nvjet|cutlass|matmul).*(e4m3|e5m2|fp8|f8f8|float8)"
                                    r"|(e4m3|e5m2|fp8|float8).*(gemm|xmma|nvjet|cutlass|matmul)"
                                    r"|aten::_scaled_(grouped_)?mm$"),
    ("GEMM (cuBLAS / CUTLASS)", r"gemm|xmma|nvjet|cutlass|cublas|gemv|matmul|splitk|aten::(mm|addmm|bmm|_grouped_mm)$"),
    ("copy and memset", r"memcpy|memset|copy"),
    ("ATen elementwise and reductions", r"elementwise|reduce_kernel|at::native|index|scatter|gather|cat"),
)


#: (module name part, kernel name pattern, category) of the library's kernels; the rest quantize
_LIBRARY_RULES = (
    ("grouped_gemm", r"gemm|_mm", "moe_fp8 GEMM"),
    (".routing", r"", "moe_fp8 routing (plan, permute, combine)"),
    (".optim", r"", "moe_fp8 optimizer"),
)


def library_kernel_names() -> dict[str, str]:
    """``{name: category}`` of every Triton kernel (``triton.jit`` function) of the loaded
    ``moe_fp8`` modules: the grouped-GEMM kernels, routing (plan, permute, combine), the optimizer's,
    and the rest (quantization, the fused SwiGLU)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface  # a JITFunction, an autotuner (and the interpreter's)

    kernel_types = (KernelInterface, InterpretedFunction)
    names = {}
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("moe_fp8") or module is None:
            continue
        for fn in vars(module).values():
            if not isinstance(fn, kernel_types):
                continue
            while isinstance(getattr(fn, "fn", None), kernel_types):  # an autotuner's kernel
                fn = fn.fn
            if fn.fn.__module__ != mod_name:  # imported from the module that defines it
                continue
            name = fn.fn.__name__
            names[name] = next((cat for part, pattern, cat in _LIBRARY_RULES
                                if part in mod_name and re.search(pattern, name)), "moe_fp8 quantization")
    return names


def kernel_category(name: str, library: dict[str, str]) -> str:
    """The category of the device kernel ``name`` (``library``: :func:`library_kernel_names`)."""
    base = re.sub(r"_[0-9de]+$", "", name)  # older Tritons append the signature's specialization
    for known in (name, base):
        if known in library:
            return library[known]
    if name.startswith("triton_"):
        return "Inductor fused (triton_*)"
    lower = name.lower()
    for category, pattern in _NAME_RULES:
        if re.search(pattern, lower):
            return category
    return "other"


def _device_events(prof) -> Iterable[tuple[str, float]]:
    """``(name, µs)`` of every device kernel, copy and memset the profile recorded (not the ranges
    of ``record_function`` annotations drawn on the device's timeline, which span kernels)."""
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU and not getattr(evt, "is_user_annotation", False):
            yield evt.name, evt.time_range.elapsed_us()


def _cpu_ops(prof) -> Iterable[tuple[str, float]]:
    """``(name, self µs)`` of every CPU operator (the smoke run's stand-in for kernels)."""
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CPU and not evt.is_async:
            yield evt.name, evt.self_cpu_time_total


def summarize(events: Iterable[tuple[str, float]], library: dict[str, str], top: int = 15) -> dict:
    """``{"ms": {category: ms}, "total_ms", "kernels": count, "top": [[name, category, calls, ms]],
    "by_kernel": [...]}`` of ``(name, µs)`` events: ``top`` the ``top`` longest of ``by_kernel`` (every
    kernel name); categories and both lists sorted by time, longest first."""
    by_category: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = {}
    count = 0
    for name, us in events:
        count += 1
        category = kernel_category(name, library)
        by_category[category] += us / 1e3
        entry = by_name.setdefault(name, [name, category, 0, 0.0])
        entry[2] += 1
        entry[3] += us / 1e3
    ms = dict(sorted(by_category.items(), key=lambda kv: -kv[1]))
    by_kernel = sorted(by_name.values(), key=lambda e: -e[3])
    return dict(ms=ms, total_ms=sum(ms.values()), kernels=count, top=by_kernel[:top], by_kernel=by_kernel)


def profiled_events(step: Callable[[], object], cuda: bool) -> list[tuple[str, float]]:
    """Run ``step()`` once under ``torch.profiler``: ``(name, µs)`` of its device kernels, copies and
    memsets (on the CPU: its operators' self time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    return list(_device_events(prof) if cuda else _cpu_ops(prof))


def kernel_time(step: Callable[[], object], cuda: bool) -> dict:
    """:func:`summarize` of :func:`profiled_events` of one ``step()``, plus ``"device"``: ``"cuda"``
    or ``"cpu"``."""
    return dict(summarize(profiled_events(step, cuda), library_kernel_names()), device="cuda" if cuda else "cpu")


@functools.lru_cache(maxsize=1)
def _skipped_dirs() -> tuple[tuple[str, ...], str]:
    """(torch's and triton's package folders, the standard library's folder)."""
    import triton

    return (tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, triton)),
            sysconfig.get_paths()["stdlib"] + os.sep)


def _site(frames: list[dict]) -> str:
    """The line that made an allocation: the innermost Python frame outside torch, triton and the
    standard library (Inductor's generated code included, with its source line)."""
    packages, stdlib = _skipped_dirs()
    for frame in frames:
        filename = frame.get("filename", "")
        if (not filename or filename.startswith(packages) or filename.startswith("<")
                or (filename.startswith(stdlib) and "-packages" not in filename)):
            continue
        line = frame.get("line", 0)
        source = linecache.getline(filename, line).strip()
        where = f"{os.path.basename(filename)}:{line}"
        if "torchinductor" in filename:
            where = f"inductor {where}"
        return f"{where} {source[:100]}".rstrip()
    return "(no Python frame outside torch)"


def replay_peak(trace: list[dict], base: int, top: int = 12) -> dict:
    """Replay the allocator's ``trace`` (``torch.cuda.memory._snapshot()["device_traces"][i]``) from
    ``base`` bytes allocated: ``{"peak_gib", "before_gib", "sites": [[site, count, GiB]], "all_sites",
    "files": [[file, count, GiB]]}``, the allocations made during the trace and alive at its highest
    point, grouped by :func:`_site` (``sites`` the ``top`` largest of ``all_sites``) and by the file of that site (an
    Inductor graph's: its forward's saved tensors, its backward's transients), largest first
    (``before_gib``: what was allocated when the trace began)."""
    def replay(until: int | None = None) -> tuple[dict[int, dict], int, int]:
        """(the blocks alive, the highest allocation total, the event index it was reached at)."""
        live: dict[int, dict] = {}
        allocated = peak = base
        at = -1
        for i, event in enumerate(trace[:until]):
            action, addr = event.get("action"), event.get("addr")
            if action == "alloc":
                live[addr] = event
                allocated += event["size"]
                if allocated > peak:
                    peak, at = allocated, i
            elif action in ("free_requested", "free_completed") and addr in live:
                allocated -= live.pop(addr)["size"]
        return live, peak, at

    _, peak, at = replay()
    peak_live = replay(at + 1)[0] if at >= 0 else {}  # the blocks alive at the peak: sites named for these only
    sites: dict[str, list] = {}
    files: dict[str, list] = {}
    for event in peak_live.values():
        site = _site(event.get("frames", []))
        for key, groups in ((site, sites), (site.split(":")[0], files)):
            entry = groups.setdefault(key, [key, 0, 0.0])
            entry[1] += 1
            entry[2] += event["size"] / 2**30
    all_sites = sorted(sites.values(), key=lambda e: -e[2])
    return dict(peak_gib=peak / 2**30, before_gib=base / 2**30, sites=all_sites[:top], all_sites=all_sites,
                files=sorted(files.values(), key=lambda e: -e[2]))


def peak_allocations(step: Callable[[], object], max_entries: int = 1_000_000) -> dict:
    """Run ``step()`` once on CUDA with the allocator's history recorded: :func:`replay_peak` of it,
    plus ``"max_allocated_gib"`` (the allocator's own peak of the step, which the replay matches
    unless the history overflowed ``max_entries``)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    return dict(replay_peak(trace, base), max_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)


def markdown(rows: list[dict]) -> list[str]:
    """Markdown lines for the whole-model rows that carry ``profile`` / ``peak_allocations``: per row,
    device ms by category, the longest kernels, and the allocations alive at the peak."""
    lines: list[str] = []
    for r in rows:
        prof, peak = r.get("profile"), r.get("peak_allocations")
        if prof is None and peak is None:
            continue
        lines += ["", f"### {r['model']} {r['mode']} {r['variant']}: one more optimizer step"]
        if prof is not None:
            what = "device kernels" if prof["device"] == "cuda" else "CPU operators' self time (smoke run)"
            cats = ", ".join(f"{c} {ms:.1f}" for c, ms in prof["ms"].items())
            calls = "launches" if prof["device"] == "cuda" else "operator calls"
            busy = f" (the timed steps' median: {r['step_ms']:.1f} ms)" if r.get("step_ms") else ""
            lines += ["", f"{prof['total_ms']:.1f} ms of {what}{busy} in {prof['kernels']} {calls}: {cats}.", "",
                      "| kernel | category | calls | ms |", "|---|---|---:|---:|"]
            lines += [f"| `{name[:90]}` | {cat} | {calls} | {ms:.2f} |" for name, cat, calls, ms in prof["top"]]
        if peak is not None:
            lines += ["", f"Peak {peak['peak_gib']:.2f} GiB (allocator: {peak['max_allocated_gib']:.2f}), of which "
                          f"{peak['before_gib']:.2f} allocated before the step; alive at the peak, made during it:",
                      "", "| made by | blocks | GiB |", "|---|---:|---:|"]
            lines += [f"| `{site}` | {count} | {gib:.3f} |" for site, count, gib in peak["sites"]]
            lines += ["", "By file (an Inductor graph's, or the line's):", "", "| file | blocks | GiB |",
                      "|---|---:|---:|"]
            lines += [f"| `{name}` | {count} | {gib:.3f} |" for name, count, gib in peak.get("files", [])]
    return lines
