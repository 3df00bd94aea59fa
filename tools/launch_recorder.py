"""Record the Triton launches a GPU would make, by running a small workload in the CPU interpreter.

``record(target_name)`` runs :func:`workload` under ``TRITON_INTERPRET=1`` with every launch
configured for that GPU (``kernel_backend.configure_launches_for``: its tile sizes, casts, launch
options and multiprocessor count) and returns one :class:`Launch` per distinct kernel
specialization: the kernel's module and name, each argument described by type (pointer dtype,
int, float) or constexpr value, and the launch options; with each, the tensor arguments any of its
launches changed (``written``) and the groups of arguments that shared a storage (``aliases``).
``offline_compile.py`` compiles them; ``traced_writes.py`` checks torch's analysis against them.

Run as ``TRITON_INTERPRET=1 python tools/launch_recorder.py TARGET OUT.json`` (the compile step
runs it so, in a process of its own, since the interpreter replaces every ``triton.jit``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("launch_recorder.py runs under TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from moe_fp8 import FP8MoE, fp8_grouped_mm  # noqa: E402
from moe_fp8.grouped_gemm.tail import launch_zero_empty_groups_kernel, launch_zero_rows_kernel  # noqa: E402
from moe_fp8.kernel_backend import LaunchTarget, configure_launches_for  # noqa: E402
from moe_fp8.layers.fp8_linear import fp8_linear  # noqa: E402
from moe_fp8.optim.adamw_quantize import adamw_hyper, adamw_quantize  # noqa: E402
from moe_fp8.quant import E4M3FN, E4M3FNUZ  # noqa: E402
from moe_fp8.quant.formats import FORMAT_ENV_VAR  # noqa: E402
from moe_fp8.quant.ops import triton_quantize_expert_rowwise_with_amax  # noqa: E402
from moe_fp8.routing import make_dispatch_plan  # noqa: E402

#: The GPUs checked: launch target and the FP8 format the library takes there.
TARGETS = {
    "sm_90a": (LaunchTarget("cuda", (9, 0), 132), E4M3FN),  # H100 / H200
    "gfx942": (LaunchTarget("hip", "gfx942", 304), E4M3FNUZ),  # MI300X / MI325X
    "gfx950": (LaunchTarget("hip", "gfx950", 256), E4M3FN),  # MI350X / MI355X
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


@dataclass(frozen=True)
class Launch:
    module: str
    kernel: str
    args: tuple  # per parameter: ["ptr", dtype] | ["int", value] | ["float", value] | ["const", repr-able value]
    options: tuple  # sorted (name, value) launch options


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("ptr", str(value.dtype).removeprefix("torch."))
    if isinstance(value, tl.dtype):
        return ("tl_dtype", str(value))
    if isinstance(value, bool) or value is None:
        return ("const", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value)
    if isinstance(value, tl.constexpr):
        return _describe(value.value)
    raise TypeError(f"cannot describe a launch argument of type {type(value).__name__}")


class _Recorder:
    def __init__(self) -> None:
        self.launches: dict[Launch, None] = {}
        self.written: dict[Launch, set[str]] = {}
        self.aliases: dict[Launch, set[tuple[str, ...]]] = {}

    def __enter__(self):
        # triton >= 3.6 launches through the class's ``run``; 3.4 / 3.5 through ``kernel[grid]``,
        # an executor made by ``__getitem__`` (their ``run`` is an attribute of each kernel)
        self._patched = "run" if "run" in vars(InterpretedFunction) else "__getitem__"
        self._original = getattr(InterpretedFunction, self._patched)
        original = self._original

        def run(fn, *args, grid, warmup, **kwargs):
            return self._launch(fn, args, kwargs, lambda kw: original(fn, *args, grid=grid, warmup=warmup, **kw))

        def getitem(fn, grid):
            execute = original(fn, grid)
            return lambda *args, **kwargs: self._launch(fn, args, kwargs, lambda kw: execute(*args, **kw))

        setattr(InterpretedFunction, self._patched, run if self._patched == "run" else getitem)
        return self

    def __exit__(self, *exc) -> None:
        setattr(InterpretedFunction, self._patched, self._original)

    def _launch(self, fn, args: tuple, kwargs: dict, call):
        """Record the launch of ``fn`` with ``args``, ``kwargs`` and run it (``call(kwargs)``, the
        launch options left out): the arguments it wrote and those that shared a storage."""
        options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
        params = dict(zip(fn.arg_names, args))
        params.update(kwargs)
        described = tuple((name, _describe(params[name])) for name in fn.arg_names if name in params)
        launch = Launch(fn.fn.__module__, fn.fn.__name__, described, tuple(sorted(options.items())))
        self.launches[launch] = None
        tensors = {n: v for n, v in params.items() if isinstance(v, torch.Tensor)}
        before = {n: _bytes(t).clone() for n, t in tensors.items()}
        result = call(kwargs)
        changed = {n for n, t in tensors.items() if not torch.equal(_bytes(t), before[n])}
        self.written.setdefault(launch, set()).update(changed)
        storages: dict[int, list[str]] = {}
        for n, t in tensors.items():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(n)
        self.aliases.setdefault(launch, set()).update(tuple(g) for g in storages.values() if len(g) > 1)
        return result


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def workload(fmt) -> None:
    """Launch every kernel of the library at least once, in the layouts training uses: FP8MoE
    (rowwise, weights cached and not, the gradients' FP8 rows from the SwiGLU and combine backwards
    and from the dgrads), the forward layout of (E, K, N) storage, the grouped GEMM in each FP8
    recipe and adding its weight gradient in place (fp8 and bf16 operands), FP8Linear, the zeroing
    kernels, the dispatch plan without empty-expert rows, and the fused AdamW + quantize step. Shapes are small
    but wide enough (256) for the GPU's widest tiles."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    H, I, E, T = 256, 256, 4, 64
    for cache, fused in ((True, True), (False, True), (False, False)):  # fused: the gradients' rows from upstream
        moe = FP8MoE(H, I, E, 2, shared_expert_hidden_size=0, recipe="rowwise", backend="triton", fmt=fmt,
                     cache_weights=cache, dtype=bf16)
        moe.experts.fused_grad_quant = fused
        x = torch.randn(T, H, dtype=bf16, requires_grad=True)
        for _ in range(1 if cache else 2):  # uncached, the second forward reads the weights' kept amaxes
            moe(x).sum().backward()
    w = torch.randn(E, H, I, dtype=bf16).transpose(1, 2)  # (E, K, N) storage: the layout reads the storage's rows
    triton_quantize_expert_rowwise_with_amax(w, fmt)
    offs = torch.tensor([20, 20, 50, 64], dtype=torch.int32)
    for recipe in ("rowwise", "rowwise_gw_hp", "tensorwise", "blockwise"):
        x = torch.randn(T, H, dtype=bf16, requires_grad=True)
        w = torch.randn(E, I, H, dtype=bf16, requires_grad=True)
        fp8_grouped_mm(x, w, offs, recipe=recipe, backend="triton").sum().backward()
    for recipe in ("rowwise", "rowwise_gw_hp"):  # the weight gradient added to .grad in place (fp8, bf16)
        x = torch.randn(T, H, dtype=bf16, requires_grad=True)
        w = torch.randn(E, I, H, dtype=bf16, requires_grad=True)
        fp8_grouped_mm(x, w, offs, recipe=recipe, backend="triton", grad_into=torch.zeros_like(w)).sum().backward()
    for recipe in ("rowwise", "tensorwise"):
        x = torch.randn(48, H, dtype=bf16, requires_grad=True)
        w = torch.randn(I, H, dtype=bf16, requires_grad=True)
        fp8_linear(x, w, recipe=recipe, fmt=fmt).sum().backward()
    # the plan without empty experts' zero rows (expert-parallel destinations), with padded groups
    make_dispatch_plan(torch.randint(0, E, (T, 2), dtype=torch.int32), E, pad_multiple=16)
    launch_zero_rows_kernel(torch.randn(T, H, dtype=bf16), torch.tensor([10, 40], dtype=torch.int32))
    launch_zero_empty_groups_kernel(torch.randn(E, I, H, dtype=bf16), offs)
    w = torch.randn(E, I, H, dtype=bf16)
    hyper = adamw_hyper(step=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adamw_quantize(w, torch.randn_like(w), torch.zeros(w.shape), torch.zeros(w.shape), hyper, fmt=fmt)


def record(target_name: str) -> list[dict]:
    """The launches of :func:`workload` for ``target_name``: each :class:`Launch` as a dict, with its
    ``written`` argument names and ``aliases`` (lists of argument names that shared a storage)."""
    target, fmt = TARGETS[target_name]
    os.environ[FORMAT_ENV_VAR] = fmt.name  # the format the library detects on that GPU
    with _Recorder() as rec, configure_launches_for(target):
        workload(fmt)
    return [dict(asdict(launch), written=sorted(rec.written[launch]), aliases=sorted(rec.aliases[launch]))
            for launch in rec.launches]


if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    with open(out, "w") as f:
        json.dump(record(name), f)
