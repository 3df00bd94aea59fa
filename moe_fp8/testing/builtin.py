"""Built-in adapters: ``torch._grouped_mm``, ``torch._scaled_grouped_mm``, TorchAO's FP8 grouped
GEMMs and ``moe_fp8.fp8_grouped_mm`` on each backend, by spec string (``get_adapter``).

Specs: ``torch`` (BF16 ``torch._grouped_mm``), ``torch_scaled`` (``torch._scaled_grouped_mm``,
rowwise e4m3fn scales from the reference quantizers, fast accumulation, CUDA only),
``torchao`` / ``torchao:fp8_rowwise`` (``_to_fp8_rowwise_then_scaled_grouped_mm``),
``torchao:mxfp8`` / ``torchao:mxfp8_emulated`` (``_to_mxfp8_then_scaled_grouped_mm`` with its
CUDA kernels / its emulated path), ``moe_fp8[:backend[:recipe]]`` (default backend: the
platform's, recipe ``rowwise``). TorchAO is imported only when one of its specs is asked for.

TorchAO's and our GEMMs have no public 2d2d form: their wgrad runs inside autograd and is
checked as ``dw`` of the 2d3d cases (their 2d2d cases are skipped).
"""

from __future__ import annotations

import functools

import torch

from ..grouped_gemm import fp8_grouped_mm
from ..grouped_gemm.backends import BACKENDS, get_backend
from ..quant.formats import E4M3FN
from ..quant.recipes import RECIPES, get_recipe
from ..quant.reference import quantize_expert_colwise, quantize_group_colwise, quantize_rowwise
from .adapter import GroupedMMAdapter, Part
from .cases import GroupedMMCase

__all__ = ["ADAPTER_SPECS", "get_adapter"]

ADAPTER_SPECS: tuple[str, ...] = (
    "torch", "torch_scaled", "torchao", "torchao:fp8_rowwise", "torchao:mxfp8", "torchao:mxfp8_emulated",
    "moe_fp8[:backend[:recipe]]",
)
_ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interior_sizes_not_multiple(case: GroupedMMCase, multiple: int) -> bool:
    """A group other than the last, or the row count, is not a multiple of ``multiple``."""
    return any(s % multiple for s in case.sizes[:-1]) or case.rows % multiple != 0


# --- torch._grouped_mm -------------------------------------------------------------------------

def _torch_2d3d(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def _torch_2d2d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a.t(), b, offs=offs)


def _torch_unsupported(case: GroupedMMCase, part: Part, device: torch.device) -> str | None:
    needs_aligned_rows = case.form == "2d2d" or part == "backward"  # the 2D x 2D form: M is a stride
    if device.type == "cuda" and needs_aligned_rows and case.rows * case.torch_dtype.itemsize % 16:
        return "its 2D x 2D form on CUDA needs the row count to be a multiple of 16 bytes"
    return None


def _torch_adapter() -> GroupedMMAdapter:
    return GroupedMMAdapter("torch._grouped_mm", "bf16", _torch_2d3d, _torch_2d2d, zero_tail=False,
                            unsupported=_torch_unsupported, spec="torch")


# --- torch._scaled_grouped_mm ------------------------------------------------------------------

def _scaled_2d3d(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_rowwise(x, E4M3FN)
    wq, ws = quantize_expert_colwise(w, E4M3FN)  # (E, N, K) contiguous: its transpose is column-major
    return torch._scaled_grouped_mm(xq.contiguous(), wq.transpose(-2, -1), xs, ws, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def _scaled_2d2d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    aq, as_ = quantize_group_colwise(a, offs, E4M3FN)
    bq, bs = quantize_group_colwise(b, offs, E4M3FN)
    a_cm, b_cm = aq.t().contiguous().t(), bq.t().contiguous().t()  # column-major (M, N) and (M, K)
    return torch._scaled_grouped_mm(a_cm.t(), b_cm, as_.reshape(-1).contiguous(), bs.reshape(-1).contiguous(),
                                    offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)


def _scaled_unsupported(case: GroupedMMCase, part: Part, device: torch.device) -> str | None:
    if device.type != "cuda":
        return "torch._scaled_grouped_mm has no CPU kernel"
    if case.form == "2d2d" and _interior_sizes_not_multiple(case, 16):
        return "its 2D x 2D form needs groups (but the last) and the row count to be multiples of 16"
    return None


def _scaled_adapter() -> GroupedMMAdapter:
    return GroupedMMAdapter("torch._scaled_grouped_mm", "rowwise", _scaled_2d3d, _scaled_2d2d, differentiable=False,
                            zero_tail=False, unsupported=_scaled_unsupported, spec="torch_scaled")


# --- TorchAO -----------------------------------------------------------------------------------

def _torchao_fp8_2d3d(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(x, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16,
                                                  pad_token_groups_for_grouped_mm=False)


def _torchao_mxfp8_2d3d(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, emulated: bool) -> torch.Tensor:
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    pref = KernelPreference.EMULATED if emulated else KernelPreference.AUTO
    return _to_mxfp8_then_scaled_grouped_mm(x, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16,
                                            kernel_preference=pref)


def _torchao_unsupported(case: GroupedMMCase, part: Part, device: torch.device, *, block: int,
                         needs_sm: tuple[int, ...]) -> str | None:
    if device.type != "cuda" and needs_sm:
        return "its kernels need a CUDA GPU"
    if needs_sm and torch.cuda.get_device_capability(device)[0] not in needs_sm:
        return f"its kernels need sm{'/sm'.join(f'{m}x' for m in needs_sm)}"
    if case.layout == "strided":
        return "B_t must be column-major (strides (K*N, 1, K)), x row-major"
    if block > 16 and (case.k % block or case.n % block):
        return f"K and N must be multiples of {block}"
    if (case.form == "2d2d" or part == "backward") and _interior_sizes_not_multiple(case, block):
        return f"its wgrad needs groups (but the last) and the row count to be multiples of {block}"
    return None


def _torchao_adapter(kind: str) -> GroupedMMAdapter:
    import torchao.prototype.moe_training  # noqa: F401  (ImportError here: not installed)

    if kind == "fp8_rowwise":
        fn, recipe, block, sms, dtypes = _torchao_fp8_2d3d, "rowwise", 16, (9,), (torch.bfloat16, torch.float32)
    elif kind in ("mxfp8", "mxfp8_emulated"):
        emulated = kind == "mxfp8_emulated"
        fn = functools.partial(_torchao_mxfp8_2d3d, emulated=emulated)
        recipe, block, sms, dtypes = "mxfp8", 32, () if emulated else (10,), (torch.bfloat16, torch.float32)
    else:
        raise ValueError(f"impl: expected torchao[:fp8_rowwise|mxfp8|mxfp8_emulated], got torchao:{kind}")
    unsupported = functools.partial(_torchao_unsupported, block=block, needs_sm=sms)
    return GroupedMMAdapter(f"torchao:{kind}", recipe, fn, dtypes=dtypes,
                            zero_tail=False, unsupported=unsupported, spec=f"torchao:{kind}")


# --- moe_fp8 -----------------------------------------------------------------------------------

def _moe_fp8_unsupported(case: GroupedMMCase, part: Part, device: torch.device, *, backend: str) -> str | None:
    reason = get_backend(backend).unavailable_reason(device) if backend else None
    return f"backend {backend!r}: {reason}" if reason else None


def _moe_fp8_adapter(backend: str | None, recipe: str) -> GroupedMMAdapter:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"impl: expected moe_fp8:<backend> with a backend in {sorted(BACKENDS)}, got {backend!r}")
    rec = get_recipe(recipe)
    dtypes = get_backend(backend).out_dtypes if backend and rec.is_fp8 else _ALL_DTYPES
    fn = functools.partial(fp8_grouped_mm, recipe=recipe, backend=backend)
    name = ":".join(["moe_fp8", backend or "auto", recipe])
    return GroupedMMAdapter(name, recipe, fn, dtypes=dtypes,
                            unsupported=functools.partial(_moe_fp8_unsupported, backend=backend), spec=name)


def get_adapter(spec: str) -> GroupedMMAdapter:
    """The built-in adapter of ``spec`` (see the module docstring); ``ImportError`` when TorchAO is
    asked for and not installed."""
    if not isinstance(spec, str):
        raise TypeError(f"impl: expected a spec string, got {type(spec).__name__}")
    head, *rest = spec.split(":")
    if head == "torch" and not rest:
        return _torch_adapter()
    if head == "torch_scaled" and not rest:
        return _scaled_adapter()
    if head == "torchao" and len(rest) <= 1:
        return _torchao_adapter(rest[0] if rest else "fp8_rowwise")
    if head == "moe_fp8" and len(rest) <= 2:
        backend = rest[0] if rest and rest[0] not in ("", "auto") else None
        recipe = rest[1] if len(rest) == 2 else "rowwise"
        if recipe not in RECIPES:
            raise ValueError(f"impl: expected a recipe in {sorted(RECIPES)}, got {recipe!r} in {spec!r}")
        return _moe_fp8_adapter(backend, recipe)
    raise ValueError(f"impl: expected one of {ADAPTER_SPECS}, got {spec!r}")
