"""Registers, spills and shared memory of our Triton kernels compiled for sm90 (H100/H200), on any machine.

``triton.compile`` builds a kernel for a GPU target without a GPU, and the ptxas that this Triton
uses reports registers and spills. A GPU sweep then need not find out that a configuration spills,
and a Triton version other than the device's can be checked. The configurations: the Triton wgrad
GEMM's variants (``bench_grouped_gemm_triton.VARIANTS_2D2D``, column-major operands, rowwise
scales) and the column-wise quantization kernel's (``STRIP_SWEEP`` below, plus the workers
alone at ``colwise_config``'s default) on the expert dgrad layout and the group dual. ``pipelined``: the
GEMM's main loop waits for its oldest operand slices only (a software pipeline).

    python benchmarks/sm90_resources.py --out benchmarks/results   # -> sm90_resources_triton<version>.json / .md

Compile-only: ``TRITON_INTERPRET`` is cleared before Triton is imported. The integer arguments are
specialized as in a typical launch (unit strides as constants, other strides, sizes and pointers
as multiples of 16); a real launch may specialize some differently, so its register count can
differ (one column-wise configuration: 104 here with triton 3.6, 126 reported on the H200).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia import compiler as nvidia_compiler  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grouped_gemm_triton import VARIANTS_2D2D  # noqa: E402

from moe_fp8.grouped_gemm import triton_kernel  # noqa: E402
from moe_fp8.quant.formats import E4M3FN  # noqa: E402
from moe_fp8.quant.kernels import colwise  # noqa: E402
from moe_fp8.quant.kernels.colwise import colwise_config  # noqa: E402
from moe_fp8.quant.kernels.common import format_constexprs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Column-wise kernel configurations: (CHUNK, BLOCK_R, BLOCK_C, STAGES, LAG, num_warps, maxnreg, two_pass);
# the 256-row chunks of 32 x 128 tiles are colwise_config's default (at auto_lag).
STRIP_SWEEP = [(512, 64, 64, 3, 0, 4, 96, False), (512, 64, 64, 3, 4, 4, 96, False),
               (512, 64, 64, 3, 0, 4, None, False), (512, 64, 64, 3, 0, 4, 96, True),
               (512, 64, 64, 3, 0, 4, None, True), (1024, 64, 64, 3, 0, 4, None, True),
               (2048, 64, 64, 3, 0, 4, None, True),
               (256, 32, 128, 3, 0, 4, 96, False), (256, 32, 128, 3, 2, 4, 96, False),
               (512, 32, 128, 3, 0, 4, 96, False), (256, 32, 128, 3, 0, 4, 96, True)]


def _strip_config(chunk, br, bc, stages, lag, warps, maxnreg, two_pass):
    return colwise_config(chunk=chunk, block_r=br, block_c=bc, stages=stages, lag=lag, num_warps=warps,
                          maxnreg=maxnreg, two_pass=two_pass)


def _strip_label(v) -> str:
    return "chunk={} {}x{} stages={} lag={} w{} maxnreg={} two_pass={}".format(*v)


def _ptxas() -> str:
    try:
        return nvidia_compiler.get_ptxas(TARGET.arch).path
    except TypeError:  # triton < 3.6: no arch argument
        return nvidia_compiler.get_ptxas().path


def compile_sm90(fn, pointers: dict, constexprs: dict, aligned: list, options: dict) -> dict:
    """Compile ``fn`` for sm90: ``pointers`` name -> Triton pointer type, ``constexprs`` name ->
    value, ``aligned`` the int and pointer arguments specialized as multiples of 16; every other
    argument an i32. Returns shared memory, registers, spill stores and whether a loop is pipelined."""
    sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([_ptxas(), f"-arch=sm_{TARGET.arch}a", "-v", str(ptx), "-o", str(ptx.with_suffix(".o"))],
                                capture_output=True, text=True, check=True).stderr
    return dict(shared=kernel.metadata.shared, registers=int(re.search(r"Used (\d+) registers", report)[1]),
                spill_stores=int(re.search(r"(\d+) bytes spill stores", report)[1]),
                pipelined=re.search(r"async_wait[^\n]*\{num = [1-9]", kernel.asm["ttgir"]) is not None)


def wgrad_rows(variants: dict) -> list[dict]:
    """The 2D x 2D kernel per tile configuration: fp8 column-major operands, rowwise scales, bf16 out."""
    fn = triton_kernel._grouped_mm_2d2d_kernel
    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
                "offs_ptr": "*i32"}
    ones = {n: 1 for n in ("stride_ar", "stride_br", "stride_ok", "stride_san", "stride_sbk")}
    aligned = [*pointers, "stride_an", "stride_bk", "stride_oe", "stride_on", "stride_sae", "stride_sbe", "M", "N", "K"]
    rows = []
    for name, cfg in variants.items():
        imprecise = None if cfg.fast_accum else cfg.block_k
        meta = dict(SCALE_MODE=1, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
                    MAX_IMPRECISE=imprecise, EDGE_MAX_IMPRECISE=imprecise and min(imprecise, 32), OUT_BF16=True,
                    ACCUMULATE=False, UPCAST=False, **ones)
        res = compile_sm90(fn, pointers, meta, aligned, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        rows.append(dict(kernel="wgrad 2D x 2D", variant=name, **res))
    return rows


def colwise_rows(configs: list[tuple[str, dict]]) -> list[dict]:
    """The column-wise kernel per configuration, on the expert dgrad layout (uniform experts, one
    tensor) and on the group dual (jagged groups, two tensors; unpadded and padded): bf16 row-major
    in, fp8 column-major out."""
    fn = colwise._colwise_kernel
    pointers = {"a_ptr": "*bf16", "qa_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*bf16", "qb_ptr": "*fp8e4nv",
                "sb_ptr": "*fp32", "offs_ptr": "*i32", "poffs_ptr": "*i32", "amax_ptr": "*i32", "cnt_ptr": "*i32"}
    aligned = [*pointers, "stride_ag", "stride_ar", "stride_qag", "stride_qac", "stride_br", "stride_qbc", "C_A", "C_B",
               "rows_in", "rows_out"]
    fmt = format_constexprs(E4M3FN, torch.device("cpu"), hw_cast=True)
    rows = []
    for kind, uniform, padded, g_pow2 in (("expert dgrad", True, False, 8), ("group dual", False, False, 128),
                                          ("group dual, padded", False, True, 128)):
        for label, cfg in configs:
            cfg = dict(cfg)
            roles = colwise.ROLES_WORKERS if cfg.pop("workers_only", False) else colwise.ROLES_BOTH
            two_pass = cfg.pop("TWO_PASS")
            options = dict(num_warps=cfg.pop("num_warps"), **({"maxnreg": cfg.pop("maxnreg")} if cfg["maxnreg"] else {}))
            cfg.pop("maxnreg", None)
            lag = 0 if cfg["LAG"] is None or two_pass else cfg["LAG"]
            meta = dict(cfg, LAG=lag, POW2=True, HAS_B=not uniform, TICKETS=False, UNIFORM=uniform, PADDED=padded,
                        ZERO_FILL=colwise.zero_fill(uniform, 4096, padded, 4096), G_POW2=g_pow2,
                        ROLES=colwise.ROLES_MEMBERS if two_pass else roles, stride_ac=1, stride_qar=1, stride_bc=1,
                        stride_qbr=1, **fmt)
            res = compile_sm90(fn, pointers, meta, [a for a in aligned if a not in meta], options)
            rows.append(dict(kernel=f"colwise {kind}", variant=label + (" (members' pass)" if two_pass else ""),
                             **res))
    return rows


def _markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# Our Triton kernels compiled for sm90 (no GPU): registers, spills, shared memory", "",
             f"{meta['date']}, triton {meta['triton']} (ptxas `{meta['ptxas']}`), torch {meta['torch']}. "
             "`python benchmarks/sm90_resources.py`. Registers per thread (the column-wise kernel is capped by "
             "its `maxnreg`), spill stores in bytes, shared memory in bytes; `pipelined`: the main loop waits "
             "for its oldest operand slices only. Integer arguments specialized as in a typical launch "
             "(unit strides constant, the rest multiples of 16): a real launch may differ (one column-wise "
             "configuration: 104 registers here with triton 3.6, 126 reported on the H200).", "",
             "| kernel | variant | registers | spill stores | shared | pipelined |", "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['kernel']} | {r['variant']} | {r['registers']} | {r['spill_stores']} | {r['shared']} | "
              f"{'yes' if r['pipelined'] else '-'} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for sm90_resources_triton<version>.json / .md")
    p.add_argument("--smoke", action="store_true", help="one configuration of each kernel")
    args = p.parse_args()
    variants = dict(list(VARIANTS_2D2D.items())[:1]) if args.smoke else VARIANTS_2D2D
    configs = [(_strip_label(v), _strip_config(*v)) for v in (STRIP_SWEEP[:1] if args.smoke else STRIP_SWEEP)]
    configs.append(("default, workers alone", dict(colwise.colwise_config(), workers_only=True)))
    rows = wgrad_rows(variants) + colwise_rows(configs)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                triton=triton.__version__, torch=torch.__version__, ptxas=Path(_ptxas()).name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"sm90_resources_triton{triton.__version__}"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{stem}.md").write_text(_markdown(meta, rows))
    for r in rows:
        print(f"{r['kernel']:22s} {r['variant']:70s} regs {r['registers']:3d} spills {r['spill_stores']:4d} "
              f"shared {r['shared']:6d} {'pipelined' if r['pipelined'] else ''}", flush=True)


if __name__ == "__main__":
    main()
