"""The compiled whole-model step's peak with Inductor's buffer reuse on and off, HF BF16 against ours.

Inductor keeps a buffer past its last use where its memory plan hands it to a later allocation of
the same size and dtype (``torch._inductor.config.allow_buffer_reuse``, on by default). In the
compiled backward of a converted model that holds FP8 buffers of finished steps (a layer's MLP and
``o_proj``) alive at the next layer's attention backward, where the step peaks. Each row: the model
built from its config (``moe_fp8.bench.models``), compiled with the setting, 6 optimizer steps of
``ACCUMULATE`` micro-batches of 8 x 1024 tokens, the median of the last 3 (``step_ms``), and the
peak of the allocated memory over the run and over the timed steps (GiB).

Usage: ``python benchmarks/bench_inductor_buffer_reuse.py [MODEL] [ACCUMULATE] [--out DIR]`` (default
``llama3_8b 4``; writes ``inductor_buffer_reuse_<MODEL>.json`` and ``.md``). GPU only.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch._inductor.config as inductor_config

from moe_fp8.bench import models as m
from moe_fp8.bench.report import run_env, write_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="llama3_8b")
    ap.add_argument("accumulate", nargs="?", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    spec = m._spec(args.model, "cuda", 4)
    batch, seq = m._shapes("cuda")
    train = m._corpus("cuda", 10, args.accumulate)
    base = m.build(spec, seq, "cuda")
    rows = []
    for reuse in (True, False):
        for variant in ("hf_bf16", "ours_fp8"):
            inductor_config.allow_buffer_reuse = reuse
            torch._dynamo.reset()
            data = (b.to("cuda") for b in m.batches(train, batch, seq, seed=0))
            r = m.run_variant(base, variant, "compiled", data, steps=6, timed=3, lr=1e-4, device="cuda", backend=None,
                              size_rules=True, accumulate=args.accumulate)
            rows.append(dict(reuse=reuse, variant=variant, step_ms=round(r["step_ms"], 1), peak=r["peak_gib"],
                             steady_peak=r["steady_peak_gib"]))
            print(rows[-1], flush=True)
            gc.collect()
    body = ["| buffer reuse | variant | step ms | peak GiB | steady peak GiB |", "|---|---|---:|---:|---:|"]
    body += [f"| {'on' if r['reuse'] else 'off'} | {r['variant']} | {r['step_ms']:.1f} | {r['peak']:.2f} | "
             f"{r['steady_peak']:.2f} |" for r in rows]
    print("\n".join(body))
    write_report(args.out, f"inductor_buffer_reuse_{args.model}", run_env("cuda"), rows,
                 "Compiled step peak with Inductor's buffer reuse on and off",
                 f"`python benchmarks/bench_inductor_buffer_reuse.py {args.model} {args.accumulate}`, 4 layers, "
                 f"{args.accumulate} micro-batches of 8 x 1024 tokens, 6 steps, median of the last 3", body)


if __name__ == "__main__":
    main()
