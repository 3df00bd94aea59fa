"""Registers and spills of the column-wise quantization kernel for sm_90a, compiled on any machine.

No GPU needed: the kernel is compiled with Triton's NVIDIA backend for an H100/H200 target, its
integer arguments specialized the way a real launch specializes them (1, multiples of 16), and
``ptxas -v`` (the one bundled with Triton) reports registers per thread and spill stores. Use it
to check a kernel change before spending GPU time; to match the H200 runs of BENCHMARKS.md, run it
with the GPU machine's Triton (3.6: ``pip install --no-deps --target DIR triton==3.6.0`` and
``PYTHONPATH=DIR``). It uses Triton internals (``ASTSource``, ``native_specialize_impl``) present
in triton 3.4-3.9.

Usage: ``python benchmarks/colwise_registers.py [--maxnreg 96] [--lag 4] [--chunk 512] [--two-pass]``.
Cases: the dgrad weight layout of DeepSeek-V3 W1 (8x4096x7168), the wgrad dual over 8 and 32
groups (32768 rows, 4096 + 7168 columns) and over 128 groups (Qwen3, 65536 rows, 1536 + 2048);
each with the launch's roles (both in one launch, or members then workers with ``--two-pass``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from moe_fp8.quant.formats import resolve_format
from moe_fp8.quant.kernels.colwise import (ROLES_BOTH, ROLES_MEMBERS, ROLES_WORKERS, _colwise_kernel,
                                           colwise_config)
from moe_fp8.quant.kernels.common import format_constexprs

POINTERS = {"a_ptr": "*bf16", "qa_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*bf16", "qb_ptr": "*fp8e4nv",
            "sb_ptr": "*fp32", "offs_ptr": "*i32", "poffs_ptr": "*i32", "amax_ptr": "*i32", "cnt_ptr": "*i32"}


def expert_dgrad_case(E: int, N: int, K: int, chunk: int, block_c: int) -> tuple[dict, dict]:
    """Integer arguments and flags of ``launch_expert_colwise_t`` on ``w (E, N, K)``."""
    return dict(C_A=K, stride_ag=N * K, stride_ar=K, stride_ac=1, stride_qag=K * N, stride_qar=1, stride_qac=N,
                C_B=0, stride_br=0, stride_bc=0, stride_qbr=0, stride_qbc=0, G=E, N_UNI=N, rows_in=N, rows_out=N,
                n_chunks=E * N // chunk, tail_per_chunk=1, NB_A=triton.cdiv(K, block_c), NB_B=0), dict(
        UNIFORM=True, HAS_B=False, PADDED=False, G_POW2=triton.next_power_of_2(E))


def wgrad_case(M: int, G: int, c_a: int, c_b: int, chunk: int, block_c: int) -> tuple[dict, dict]:
    """Integer arguments and flags of the padded wgrad dual (column-major outputs) over ``G`` groups."""
    rows = M + 16 * G
    return dict(C_A=c_a, stride_ag=0, stride_ar=c_a, stride_ac=1, stride_qag=0, stride_qar=1, stride_qac=rows,
                C_B=c_b, stride_br=c_b, stride_bc=1, stride_qbr=1, stride_qbc=rows, G=G, N_UNI=1, rows_in=M,
                rows_out=rows, n_chunks=M // chunk, tail_per_chunk=triton.cdiv(rows, M // chunk),
                NB_A=c_a // block_c, NB_B=c_b // block_c), dict(UNIFORM=False, HAS_B=True, PADDED=True,
                                                                 G_POW2=triton.next_power_of_2(G))


def registers(ints: dict, flags: dict, cfg: dict, roles: int) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) of one compiled variant, from ``ptxas -v``."""
    fn = _colwise_kernel
    launch_opts = ("num_warps", "maxnreg", "TWO_PASS")
    consts = dict(POW2=True, TICKETS=False, ROLES=roles, **flags,
                  **{k: v for k, v in cfg.items() if k not in launch_opts},
                  **format_constexprs(resolve_format("e4m3fn"), torch.device("cpu"), hw_cast=True))
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name], constexprs[name] = "constexpr", consts[name]
        elif name in POINTERS:
            signature[name], attrs[(i,)] = POINTERS[name], [["tt.divisibility", 16]]
        else:
            kind, spec = native_specialize_impl(BaseBackend, ints[name], False, True, True)
            if kind == "constexpr":  # an int equal to 1
                signature[name], constexprs[name] = "constexpr", ints[name]
            else:
                signature[name] = kind
                if spec == "D":
                    attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {})}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    # Triton assembles sm_90 with its plain ``ptxas`` (the GPU's register counts match it); where that
    # one is older than the PTX this Triton emits (triton 3.9), the ``-blackwell`` one beside it.
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        for ptxas in ("ptxas", "ptxas-blackwell"):
            log = subprocess.run([os.path.join(bin_dir, ptxas), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
            if "Unsupported .version" not in log:
                break
    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        raise RuntimeError(log[-2000:])
    spill = re.search(r"(\d+) bytes spill stores", log)
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap (default: none)")
    ap.add_argument("--lag", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--two-pass", action="store_true")
    args = ap.parse_args()
    cfg = colwise_config(chunk=args.chunk, lag=args.lag, maxnreg=args.maxnreg, two_pass=args.two_pass)
    bc = cfg["BLOCK_C"]
    cases = {
        "expert dgrad 8x4096x7168": expert_dgrad_case(8, 4096, 7168, args.chunk, bc),
        "wgrad dual 32768x(4096+7168) E=8": wgrad_case(32768, 8, 4096, 7168, args.chunk, bc),
        "wgrad dual 32768x(4096+7168) E=32": wgrad_case(32768, 32, 4096, 7168, args.chunk, bc),
        "wgrad dual 65536x(1536+2048) E=128": wgrad_case(65536, 128, 1536, 2048, args.chunk, bc),
    }
    roles = {"members": ROLES_MEMBERS.value, "workers": ROLES_WORKERS.value} if args.two_pass else {
        "members+workers": ROLES_BOTH.value}
    print(f"triton {triton.__version__}, sm_90a, config {cfg}")
    for name, (ints, flags) in cases.items():
        for role, value in roles.items():
            regs, spill = registers(ints, flags, cfg, value)
            print(f"{name:36s} {role:16s} {regs:4d} registers, {spill} bytes of spill stores", flush=True)


if __name__ == "__main__":
    main()
