"""Compile every Triton kernel of the library for sm_90a, gfx942 and gfx950 on a machine without a GPU.

For each target, ``launch_recorder.py`` (in a subprocess, under the interpreter) records the kernel
specializations a GPU of that kind would launch; each one is then compiled here by Triton's own
compiler down to the binary (``cubin`` through ptxas for sm_90a, ``hsaco`` through the AMD backend's
linker for gfx942 / gfx950). For sm_90a, ptxas ``-v`` reports registers and spill stores; for AMD the
VGPR / SGPR spill counts come from the kernel's metadata in the AMDGCN assembly. For sm_90a it also
counts the PTX's narrow global loads (scalar 1- or 2-byte ``ld.global``): a tile load Triton could
not prove contiguous becomes one such load per element instead of 16-byte vectors.

    python tools/offline_compile.py [--targets sm_90a gfx942 gfx950] [--out DIR] [--update-baseline]

Fails (exit 1) when a specialization does not compile for a target, when a kernel of the library
(a ``triton.jit`` function named ``*_kernel``) was never launched by the workload, when a kernel
spills more on sm_90a than ``compile_baseline.json`` allows, or issues more narrow loads than it
allows, or when torch's analysis of a traced
launch fails or misses a write (``traced_writes.py``). Writes ``offline_compile.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import json
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions here, not interpreted ones

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import traced_writes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).resolve().parent / "compile_baseline.json"
GPU_TARGETS = {
    "sm_90a": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}
_TORCH_TO_TRITON = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32", "int64": "i64", "uint8": "u8",
    "int8": "i8", "int16": "i16", "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e4m3fnuz": "fp8e4b8",
    "float8_e5m2": "fp8e5", "float8_e5m2fnuz": "fp8e5b16",
}


def library_kernels() -> set[tuple[str, str]]:
    """(module, name) of every ``triton.jit`` function of ``moe_fp8`` whose name ends in ``_kernel``."""
    import moe_fp8

    found = set()
    for info in pkgutil.walk_packages(moe_fp8.__path__, "moe_fp8."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            jit = isinstance(obj, triton.runtime.JITFunction)
            if jit and name.endswith("_kernel") and obj.fn.__module__ == info.name:
                found.add((info.name, name))
    return found


def record(target: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "launches.json"
        path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
        subprocess.run([sys.executable, str(Path(__file__).with_name("launch_recorder.py")), target, str(out)],
                       env=env, check=True)
        return json.loads(out.read_text())


def _source(launch: dict) -> ASTSource:
    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    described = dict((name, tuple(d)) for name, d in launch["args"])
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        kind, value = described[param.name]
        if kind == "tl_dtype":
            value = tl.dtype(value)
        if param.is_constexpr or kind in ("const", "tl_dtype"):
            signature[param.name], constexprs[(i,)] = "constexpr", value
        elif kind == "ptr":
            signature[param.name] = "*" + _TORCH_TO_TRITON[value]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "int":
            if value == 1 and i not in fn.do_not_specialize:  # Triton specializes 1 as a constant
                signature[param.name], constexprs[(i,)] = "constexpr", 1
                continue
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and i not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas_report(ptx: str) -> tuple[int, int]:
    from triton.backends.nvidia import compiler as nvidia

    try:
        ptxas = nvidia.get_ptxas(90).path
    except TypeError:  # triton < 3.6: no arch argument
        ptxas = nvidia.get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".o"))],
                                capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", report)[1]), int(re.search(r"(\d+) bytes spill stores", report)[1])


_NARROW_LOAD = re.compile(r"\bld\.global(?![\w.:]*\.v\d)[\w.:]*\.[bus](?:8|16)\b")


def _amd_spills(amdgcn: str) -> tuple[int, int]:
    def count(key: str) -> int:
        m = re.search(rf"\.{key}:\s*(\d+)", amdgcn)
        return int(m[1]) if m else 0

    regs = re.search(r"\.vgpr_count:\s*(\d+)", amdgcn)
    return (int(regs[1]) if regs else -1), count("vgpr_spill_count") + count("sgpr_spill_count")


def compile_one(target: str, launch: dict) -> dict:
    """Compile one recorded specialization; the row of the report."""
    row = dict(target=target, kernel=launch["kernel"], module=launch["module"], options=dict(launch["options"]),
               constexprs={n: d[1] for n, d in launch["args"] if d[0] in ("const", "tl_dtype")})
    options = dict(launch["options"])
    if GPU_TARGETS[target].backend != "cuda":
        options.pop("maxnreg", None)
    try:
        kernel = triton.compile(_source(launch), target=GPU_TARGETS[target], options=options)
        if target == "sm_90a":
            row["registers"], row["spills"] = _ptxas_report(kernel.asm["ptx"])
            row["narrow_loads"] = len(_NARROW_LOAD.findall(kernel.asm["ptx"]))
            row["stage"] = "cubin" if "cubin" in kernel.asm else "ptx"
        else:
            row["registers"], row["spills"] = _amd_spills(kernel.asm["amdgcn"])
            row["stage"] = "hsaco" if "hsaco" in kernel.asm else "amdgcn"
        row["shared"] = kernel.metadata.shared
        row["ok"] = True
    except Exception as e:  # a compile error is the finding, reported per row
        last_line = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
        row.update(ok=False, error=f"{type(e).__name__}: {last_line}")
    return row


def _variant(row: dict) -> str:
    const = ",".join(f"{k}={v}" for k, v in sorted(row["constexprs"].items()) if not k.startswith("FP8_"))
    return f"{row['kernel']}[{const};{','.join(f'{k}={v}' for k, v in sorted(row['options'].items()))}]"


def check(rows: list[dict], missing: set, baseline: dict) -> list[str]:
    problems = [f"{r['target']}: {_variant(r)} does not compile: {r['error']}" for r in rows if not r["ok"]]
    problems += [f"{mod}.{name} was never launched by the workload (add it to launch_recorder.workload)"
                 for mod, name in sorted(missing)]
    for key, what in (("spills", "spill bytes"), ("narrow_loads", "narrow global loads")):
        allowed = baseline.get(f"sm_90a_{key}", {})
        for r in rows:
            if r["ok"] and r["target"] == "sm_90a" and r[key] > allowed.get(r["kernel"], 0):
                problems.append(f"sm_90a: {_variant(r)} has {r[key]} {what} (baseline allows "
                                f"{allowed.get(r['kernel'], 0)} for {r['kernel']})")
    return problems


def sm90_baseline(rows: list[dict]) -> dict:
    """Per kernel, the most spill bytes and narrow loads of its sm_90a specializations (nonzero only)."""
    baseline: dict[str, dict[str, int]] = {"sm_90a_spills": {}, "sm_90a_narrow_loads": {}}
    for r in rows:
        if r["ok"] and r["target"] == "sm_90a":
            for key in ("spills", "narrow_loads"):
                if r[key]:
                    seen = baseline[f"sm_90a_{key}"]
                    seen[r["kernel"]] = max(seen.get(r["kernel"], 0), r[key])
    return baseline


def markdown(rows: list[dict], problems: list[str], header: str) -> str:
    lines = [f"# Offline compile of the Triton kernels\n\n{header}\n",
             "| kernel | target | specializations | compiled to | max registers | max spill bytes | max narrow loads "
             "| max shared |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["target"]), []).append(r)
    for (kernel, target), rs in sorted(groups.items()):
        ok = [r for r in rs if r["ok"]]
        stage = ok[0]["stage"] if len(ok) == len(rs) else f"{len(rs) - len(ok)} failed"
        peak = {key: max((r.get(key, "-") for r in ok), default="-")
                for key in ("registers", "spills", "narrow_loads", "shared")}
        lines.append(f"| `{kernel}` | {target} | {len(rs)} | {stage} | {peak['registers']} | {peak['spills']} "
                     f"| {peak['narrow_loads']} | {peak['shared']} |")
    lines.append("\n" + ("Problems:\n\n" + "\n".join(f"- {p}" for p in problems) if problems else "No problems."))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(GPU_TARGETS), choices=list(GPU_TARGETS))
    parser.add_argument("--out", type=Path, default=None, help="folder for offline_compile.json / .md")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--update-baseline", action="store_true",
                        help="write the sm_90a spills and narrow loads seen as the baseline")
    args = parser.parse_args()

    rows, launched, traced = [], set(), []
    for target in args.targets:
        launches = record(target)
        launched |= {(lc["module"], lc["kernel"]) for lc in launches}
        if target == "sm_90a":
            traced = traced_writes.check(launches, _source, GPU_TARGETS[target])
            print(f"sm_90a: torch's analysis of traced kernels, {len(traced)} problems", flush=True)
        # fresh processes: a worker forked after the recording crashes in triton 3.4 / 3.5's compiler
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows += list(pool.map(compile_one, [target] * len(launches), launches))
        failed = sum(not r["ok"] for r in rows if r["target"] == target)
        print(f"{target}: {len(launches)} specializations, {failed} failed", flush=True)
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    if args.update_baseline:
        baseline = sm90_baseline(rows)
        BASELINE.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    problems = check(rows, library_kernels() - launched, baseline) + traced
    header = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, triton {triton.__version__}, "
              f"no GPU: Triton's compiler to each target's binary.")
    report = markdown(rows, problems, header)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offline_compile.json").write_text(json.dumps(dict(header=header, rows=rows, problems=problems),
                                                                  indent=1, default=str))
        (args.out / "offline_compile.md").write_text(report)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
