"""The steps the autograd op runs, each callable two ways.

Eagerly they are plain Python calls (no dispatcher overhead). Under ``torch.compile`` they are
``torch.library`` ops (``moe_fp8::gg_*``) with shape-only fake implementations: ``triton_op`` s,
whose bodies the compiler traces (our Triton kernels become ``triton_kernel_wrapper`` nodes, the
library GEMMs aten ops), except the FP8 GEMMs of the ``emulated`` CPU reference, which read the
offsets on the host and stay opaque custom ops. ``fullgraph=True`` works for every backend.
"""

# No ``from __future__ import annotations`` here: torch.library infers each op's schema from the
# annotations, which must be real types on every supported torch version.
from typing import Optional

import torch
from torch import Tensor

from ..kernel_backend import eager_or_custom_op, triton_runs_on
from ..launch_math import cdiv
from ..quant.formats import resolve_format
from . import quant_seam
from .backends import get_backend
from .emulated import emulated_grouped_mm_2d2d
from .triton_kernel import triton_grouped_mm_2d2d

__all__ = [
    "mm_2d3d",
    "mm_dgrad_quantize_w",
    "mm_2d2d",
    "mm_2d2d_into",
    "bf16_mm_2d3d",
    "bf16_mm_2d2d",
    "quantize_activation",
    "quantize_activation_group_amax",
    "group_amax",
    "quantize_weight",
    "quantize_weight_dgrad_layout",
    "quantize_weight_forward_layout",
    "quantize_wgrad_operands",
    "wgrad_operand_layout",
    "weight_layouts_nbytes",
]


def _fp8(fmt: str) -> torch.dtype:
    return resolve_format(fmt).torch_dtype


# ----------------------------------------------------------------------------- implementations
# A GEMM whose reduction is empty (2D x 3D: ``a (M, 0)``, K = 0 in forward, N = 0 in dgrad; 2D x 2D:
# no rows) or whose output is empty is zeros by construction here, on every backend: no library
# GEMM is trusted to write an empty sum (torch 2.13's CPU ``torch._scaled_mm`` returns uninitialised
# memory for one). Empty groups among others of the 2D x 2D form are zeroed where a library GEMM
# runs (``tail.zero_empty_groups``); our Triton kernels and the emulated path write them as zeros.
def _mm_2d3d(backend: str, a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    if a.shape[1] == 0 or b.shape[1] == 0:  # an empty reduction, or an empty output
        return a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)
    return get_backend(backend).mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)


def _mm_dgrad_quantize_w(backend: str, a: Tensor, scale_a: Tensor, w: Tensor, w_amax: Tensor, offs: Tensor,
                         out_dtype: torch.dtype, fmt: str, pow2: bool) -> Tensor:
    if a.shape[1] == 0 or w.shape[2] == 0:  # an empty reduction, or an empty output
        return a.new_zeros(a.shape[0], w.shape[2], dtype=out_dtype)
    return get_backend(backend).mm_dgrad_quantize_w(a, scale_a, w, w_amax, offs, out_dtype, resolve_format(fmt), pow2)


def _mm_2d2d(backend: str, a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, offs: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    if 0 in (a.shape[0], a.shape[1], b.shape[1]):  # no rows to reduce, or an empty output
        return a.new_zeros(offs.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)
    return get_backend(backend).mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype)


def _bf16_mm_2d3d(backend: str, a: Tensor, w: Tensor, offs: Tensor, transpose_w: bool) -> Tensor:
    cols = w.shape[1] if transpose_w else w.shape[2]
    if a.shape[1] == 0 or cols == 0:
        return a.new_zeros(a.shape[0], cols)
    return get_backend(backend).bf16_mm_2d3d(a, w, offs, transpose_w)


def _bf16_mm_2d2d(backend: str, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if 0 in (a.shape[0], a.shape[1], b.shape[1]):
        return a.new_zeros(offs.shape[0], a.shape[1], b.shape[1])
    return get_backend(backend).bf16_mm_2d2d(a, b, offs)


def _mm_2d2d_into(backend: str, out: Tensor, a: Tensor, scale_a: Optional[Tensor], b: Tensor,
                  scale_b: Optional[Tensor], offs: Tensor) -> None:
    if 0 in (a.shape[0], a.shape[1], b.shape[1]):  # nothing to add
        return
    if backend == "emulated" or not triton_runs_on(a):
        ref = emulated_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, torch.float32)
        rows = torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu()) > 0  # empty groups stay untouched
        out[rows] = (out[rows].float() + ref[rows]).to(out.dtype)
        return
    triton_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out.dtype, accumulate_into=out)


def _quantize_activation(x: Tensor, scaling: str, fmt: str, pow2: bool, fused: bool,
                         rows: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return quant_seam.quantize_activation(x, scaling, resolve_format(fmt), pow2, fused, rows)


def _quantize_activation_group_amax(x: Tensor, offs: Tensor, fmt: str, pow2: bool,
                                    fused: bool) -> tuple[Tensor, Tensor, Tensor]:
    return quant_seam.quantize_activation_group_amax(x, offs, resolve_format(fmt), pow2, fused)


def _group_amax(x: Tensor, offs: Tensor, fused: bool) -> Tensor:
    return quant_seam.group_amax(x, offs, fused)


def _quantize_weight(w: Tensor, scaling: str, fmt: str, pow2: bool,
                     fused: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return quant_seam.quantize_weight(w, scaling, resolve_format(fmt), pow2, fused)


def _quantize_weight_forward_layout(w: Tensor, fmt: str, pow2: bool, fused: bool) -> tuple[Tensor, Tensor, Tensor]:
    return quant_seam.quantize_weight_forward_layout(w, resolve_format(fmt), pow2, fused)


def _quantize_weight_dgrad_layout(w: Tensor, col_amax: Tensor, fmt: str, pow2: bool, fused: bool,
                                  after: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return quant_seam.quantize_weight_dgrad_layout(w, col_amax, resolve_format(fmt), pow2, fused, after)


def _quantize_wgrad_operands(a: Tensor, b: Tensor, offs: Tensor, fmt: str, pow2: bool, fused: bool,
                             padded_offs: Optional[Tensor], padded_rows: int, a_amax: Optional[Tensor] = None,
                             b_amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return quant_seam.quantize_wgrad_operands(
        a, b, offs, resolve_format(fmt), pow2, fused,
        padded_offs=padded_offs, padded_rows=padded_rows if padded_offs is not None else None, a_amax=a_amax,
        b_amax=b_amax,
    )


def _wgrad_operand_layout(q: Tensor, offs: Tensor, fused: bool, padded_offs: Optional[Tensor],
                          padded_rows: int) -> Tensor:
    return quant_seam.wgrad_operand_layout(
        q, offs, fused, padded_offs=padded_offs, padded_rows=padded_rows if padded_offs is not None else None
    )


# ----------------------------------------------------------------------------- torch.library ops
class _Op:
    """One step as two ops: ``moe_fp8::gg_<name>``, a ``triton_op`` traced under torch.compile, and
    ``moe_fp8::gg_<name>_opaque``, a custom op, for the calls where ``opaque(args)`` says the body
    reads device data on the host (the emulated backend, the reference quantizers)."""

    def __init__(self, name: str, impl, opaque):
        self.traced = torch.library.triton_op(f"moe_fp8::gg_{name}", impl, mutates_args=())
        self.opaque = torch.library.custom_op(f"moe_fp8::gg_{name}_opaque", impl, mutates_args=())
        self.calls = eager_or_custom_op(self.traced, impl), eager_or_custom_op(self.opaque, impl)
        self.is_opaque = opaque

    def register_fake(self, fake):
        self.traced.register_fake(fake)
        self.opaque.register_fake(fake)
        return fake

    def __call__(self, *args):
        traced, opaque = self.calls
        return opaque(*args) if self.is_opaque(args) else traced(*args)  # Dynamo cannot index by a bool


def _emulated(args) -> bool:
    return args[0] == "emulated"


def _unfused(position: int):
    return lambda args: len(args) <= position or not args[position]


_op_mm_2d3d = _Op("mm_2d3d", _mm_2d3d, _emulated)
_op_mm_dgrad_quantize_w = _Op("mm_dgrad_quantize_w", _mm_dgrad_quantize_w, lambda args: False)
_op_mm_2d2d = _Op("mm_2d2d", _mm_2d2d, _emulated)
_op_bf16_mm_2d3d = _Op("bf16_mm_2d3d", _bf16_mm_2d3d, lambda args: False)
_op_bf16_mm_2d2d = _Op("bf16_mm_2d2d", _bf16_mm_2d2d, lambda args: False)
_op_mm_2d2d_into = torch.library.custom_op("moe_fp8::gg_mm_2d2d_into", _mm_2d2d_into, mutates_args=("out",))
_op_quantize_activation = _Op("quantize_activation", _quantize_activation, _unfused(4))
_op_quantize_activation_group_amax = _Op("quantize_activation_group_amax", _quantize_activation_group_amax,
                                         _unfused(4))
_op_group_amax = _Op("group_amax", _group_amax, _unfused(2))
_op_quantize_weight = _Op("quantize_weight", _quantize_weight, _unfused(4))
_op_quantize_weight_forward_layout = _Op("quantize_weight_forward_layout", _quantize_weight_forward_layout,
                                         _unfused(3))
_op_quantize_weight_dgrad_layout = _Op("quantize_weight_dgrad_layout", _quantize_weight_dgrad_layout, _unfused(4))
_op_quantize_wgrad_operands = _Op("quantize_wgrad_operands", _quantize_wgrad_operands, _unfused(5))
_op_wgrad_operand_layout = _Op("wgrad_operand_layout", _wgrad_operand_layout, _unfused(2))


@_op_mm_2d3d.register_fake
def _(backend, a, scale_a, b, scale_b, offs, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@_op_mm_dgrad_quantize_w.register_fake
def _(backend, a, scale_a, w, w_amax, offs, out_dtype, fmt, pow2):
    return a.new_empty(a.shape[0], w.shape[2], dtype=out_dtype)


@_op_mm_2d2d.register_fake
def _(backend, a, scale_a, b, scale_b, offs, out_dtype):
    return a.new_empty(offs.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)


@_op_mm_2d2d_into.register_fake
def _(backend, out, a, scale_a, b, scale_b, offs):
    return None


@_op_bf16_mm_2d3d.register_fake
def _(backend, a, w, offs, transpose_w):
    return a.new_empty(a.shape[0], w.shape[1] if transpose_w else w.shape[2])


@_op_bf16_mm_2d2d.register_fake
def _(backend, a, b, offs):
    return a.new_empty(offs.shape[0], a.shape[1], b.shape[1])


def _scale_shape(shape, scaling: str) -> tuple:
    if scaling == "rowwise":
        return tuple(shape[:-1])
    if scaling == "tensorwise":
        return ()
    return (*shape[:-1], cdiv(shape[-1], quant_seam.BLOCK))


@_op_quantize_activation.register_fake
def _(x, scaling, fmt, pow2, fused, rows=None):
    return x.new_empty(x.shape, dtype=_fp8(fmt)), x.new_empty(_scale_shape(x.shape, scaling), dtype=torch.float32)


@_op_quantize_activation_group_amax.register_fake
def _(x, offs, fmt, pow2, fused):
    f32 = torch.float32
    return (x.new_empty(x.shape, dtype=_fp8(fmt)), x.new_empty(x.shape[0], dtype=f32),
            x.new_empty(offs.shape[0], x.shape[1], dtype=f32))


@_op_group_amax.register_fake
def _(x, offs, fused):
    return x.new_empty(offs.shape[0], x.shape[1], dtype=torch.float32)


@_op_quantize_weight.register_fake
def _(w, scaling, fmt, pow2, fused):
    E, N, K = w.shape
    f32 = torch.float32
    q_fwd, q_bwd = w.new_empty(E, N, K, dtype=_fp8(fmt)), w.new_empty(E, K, N, dtype=_fp8(fmt))
    if scaling == "rowwise":
        return q_fwd, w.new_empty(E, N, dtype=f32), q_bwd, w.new_empty(E, K, dtype=f32)
    if scaling == "tensorwise":
        return q_fwd, w.new_empty(E, dtype=f32), q_bwd, w.new_empty(E, dtype=f32)
    nb, kb = cdiv(N, quant_seam.BLOCK), cdiv(K, quant_seam.BLOCK)
    return q_fwd, w.new_empty(E, nb, kb, dtype=f32), q_bwd, w.new_empty(E, kb, nb, dtype=f32)


@_op_quantize_weight_forward_layout.register_fake
def _(w, fmt, pow2, fused):
    E, N, K = w.shape
    f32 = torch.float32
    return w.new_empty(E, N, K, dtype=_fp8(fmt)), w.new_empty(E, N, dtype=f32), w.new_empty(E, K, dtype=f32)


@_op_quantize_weight_dgrad_layout.register_fake
def _(w, col_amax, fmt, pow2, fused, after=None):
    E, N, K = w.shape
    return w.new_empty(E, K, N, dtype=_fp8(fmt)), w.new_empty(E, K, dtype=torch.float32)


@_op_quantize_wgrad_operands.register_fake
def _(a, b, offs, fmt, pow2, fused, padded_offs, padded_rows, a_amax=None, b_amax=None):
    rows = a.shape[0] if padded_offs is None else padded_rows
    E, N, K = offs.shape[0], a.shape[1], b.shape[1]
    qa = a.new_empty(N, rows, dtype=_fp8(fmt)).t()
    qb = b.new_empty(K, rows, dtype=_fp8(fmt)).t()
    return qa, a.new_empty(E, N, dtype=torch.float32), qb, b.new_empty(E, K, dtype=torch.float32)


@_op_wgrad_operand_layout.register_fake
def _(q, offs, fused, padded_offs, padded_rows):
    return q.new_empty(q.shape[1], q.shape[0] if padded_offs is None else padded_rows).t()


# ----------------------------------------------------------------------------- entry points
mm_2d3d = _op_mm_2d3d
#: ``mm_dgrad_quantize_w(backend, a (M, N), scale_a, w (E, N, K), w_amax (E, K), offs, out_dtype, fmt, pow2)``:
#: the rowwise dgrad ``a[rows of g] @ w[g]`` with the high-precision weight quantized inside the GEMM
#: with the scales of its amax over N (the dgrad layout's, not written); only where the backend's
#: ``quantizes_w_in_gemm`` says so.
mm_dgrad_quantize_w = _op_mm_dgrad_quantize_w
mm_2d2d = _op_mm_2d2d
#: ``mm_2d2d_into(backend, out (E, N, K), a, scale_a, b, scale_b, offs)``: ``out[g] += a_g^T @ b_g`` in
#: place, in fp32 and rounded once (FP8 operands as ``mm_2d2d`` takes them; bf16 / fp16 ones with
#: ``None`` scales); empty groups add nothing. Our Triton kernel wherever Triton runs, else the
#: emulated reference.
mm_2d2d_into = eager_or_custom_op(_op_mm_2d2d_into, _mm_2d2d_into)
bf16_mm_2d3d = _op_bf16_mm_2d3d
bf16_mm_2d2d = _op_bf16_mm_2d2d
quantize_activation = _op_quantize_activation
quantize_activation_group_amax = _op_quantize_activation_group_amax
group_amax = _op_group_amax
quantize_weight = _op_quantize_weight
quantize_weight_forward_layout = _op_quantize_weight_forward_layout
quantize_weight_dgrad_layout = _op_quantize_weight_dgrad_layout
quantize_wgrad_operands = _op_quantize_wgrad_operands
wgrad_operand_layout = _op_wgrad_operand_layout


def weight_layouts_nbytes(shape: tuple[int, int, int], scaling: str) -> int:
    """Bytes of both FP8 layouts of an ``(E, N, K)`` weight and their fp32 scales (what a weight cache
    holds for it once filled): :data:`quantize_weight`'s outputs, shaped by its fake on the meta device."""
    w = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    return sum(t.nbytes for t in _op_quantize_weight.opaque(w, scaling, "e4m3fn", False, False))
