"""``QuantizedExpertWeight``: an expert weight held only as the FP8 operands of ``fp8_grouped_mm``.

Someone else quantized the weight (FSDP's FP8 all-gather, ``moe_fp8.parallel.fp8_all_gather``,
quantizes each shard before gathering it): the tensor carries the shape and dtype of the weight,
no values, and a :class:`WeightOperands` with the rowwise FP8 operands in the layouts gathered
last. ``fp8_grouped_mm`` reads the forward layout in forward and the dgrad layout in backward from
it (at that time: the owner may replace the layouts in between), and raises when the layout it
needs is not held or was quantized with other settings; it never quantizes such a weight.

Autograd sees a tensor like any other: its gradient is an ordinary ``(E, N, K)`` tensor of its
dtype. Only the ops that move no values run on it: ``detach``, ``alias``, ``view`` /
``as_strided`` to its own geometry, ``transpose(1, 2)``, a dtype cast (``.to(dtype)``), and
``zeros_like`` (a plain tensor of zeros); any other op raises ``NotImplementedError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizedExpertWeight", "WeightOperands"]

_aten = torch.ops.aten
_NO_VALUES = (_aten.detach.default, _aten.alias.default)


@dataclass
class WeightOperands:
    """The rowwise FP8 operands of one expert weight ``w (E, N, K)`` (``nn.Linear`` layout per
    expert, the GEMM's orientation), laid out as ``quant_seam.quantize_weight`` returns them.

    Attributes:
        dtype: the dtype of the weights they quantize (the GEMM's weight dtype).
        fmt: the FP8 format's name; pow2: power-of-two scales.
        forward: ``(q (E, N, K) fp8 contiguous, s (E, N) fp32)``, scales over K; or ``None``.
        dgrad: ``(q (E, K, N) fp8 contiguous, s (E, K) fp32)``, scales over N; or ``None``.

    ``None``: the layout is not held now. The owner replaces the layouts in place (every view of a
    :class:`QuantizedExpertWeight` shares one ``WeightOperands``).
    """

    dtype: torch.dtype
    fmt: str
    pow2: bool
    forward: tuple[torch.Tensor, torch.Tensor] | None = None
    dgrad: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, layout: str, dtype: torch.dtype, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, s)`` of ``layout`` (``"forward"`` or ``"dgrad"``) for a GEMM on ``dtype`` weights in
        format ``fmt`` with ``pow2`` scales. Raises ``ValueError`` when they were quantized from
        another dtype or with other settings, ``RuntimeError`` when the layout is not held now."""
        if (dtype, fmt, pow2) != (self.dtype, self.fmt, self.pow2):
            raise ValueError(f"w: its FP8 operands quantize {self.dtype} weights to {self.fmt} (pow2={self.pow2}); "
                             f"this GEMM takes {dtype} weights to {fmt} (pow2={pow2}): the weights' values are not "
                             "at hand to quantize them again")
        value = getattr(self, layout)
        if value is None:
            held = [n for n in ("forward", "dgrad") if getattr(self, n) is not None] or ["none"]
            raise RuntimeError(f"w: the {layout} layout of its FP8 operands is not held now (held: {', '.join(held)}); "
                               "whoever gathers them (moe_fp8.parallel.parallelize(fp8_all_gather=True)) must gather "
                               f"that layout before this use")
        return value


class QuantizedExpertWeight(torch.Tensor):
    """An expert weight of ``shape`` and ``dtype`` (a parameter's) whose values exist only as the FP8
    ``operands`` (see the module docstring).

    Args:
        operands: the :class:`WeightOperands`, shared by every view of this tensor.
        shape, stride: its geometry: the parameter's, or ``transpose(1, 2)`` of it.
        dtype, device: the weight's.
        gemm_orientation: ``shape`` is the GEMM's ``(E, N, K)`` (``False``: its ``(E, K, N)``
            transpose, the storage of Llama 4's ``in_out_layout``).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, operands: WeightOperands, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, gemm_orientation: bool, requires_grad: bool = False) -> QuantizedExpertWeight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, operands: WeightOperands, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, gemm_orientation: bool, requires_grad: bool = False) -> None:
        self.operands = operands
        self.gemm_orientation = gemm_orientation

    def layout(self, name: str, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, s)`` of layout ``name`` for ``fp8_grouped_mm`` on this tensor (its dtype), which must be in
        the GEMM's orientation (see :meth:`WeightOperands.get`)."""
        if not self.gemm_orientation:
            raise ValueError("w: a QuantizedExpertWeight in its (E, K, N) storage orientation; pass its "
                             "transpose(1, 2), the (E, N, K) weight of the GEMM")
        return self.operands.get(name, self.dtype, fmt, pow2)

    def _like(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype,
              gemm_orientation: bool) -> QuantizedExpertWeight:
        return QuantizedExpertWeight(self.operands, shape, stride, dtype, self.device, gemm_orientation)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        same = (w.shape, w.stride(), w.dtype, w.gemm_orientation)
        if func in _NO_VALUES:
            return w._like(*same)
        if func is _aten.view.default and tuple(args[1]) == tuple(w.shape):
            return w._like(*same)
        if (func is _aten.as_strided.default and tuple(args[1]) == tuple(w.shape)
                and tuple(args[2]) == w.stride() and (args[3] if len(args) > 3 else 0) in (0, None)):
            return w._like(*same)
        if func is _aten.transpose.int and sorted(d % 3 for d in args[1:3]) == [1, 2]:
            E, A, B = w.shape
            s0, s1, s2 = w.stride()
            return w._like(torch.Size((E, B, A)), (s0, s2, s1), w.dtype, not w.gemm_orientation)
        if func is _aten._to_copy.default and _dtype_cast_only(w, kwargs):
            return w._like(w.shape, w.stride(), kwargs.get("dtype") or w.dtype, w.gemm_orientation)
        if func is _aten.zeros_like.default:
            dtype = kwargs.get("dtype") or w.dtype
            return torch.empty_strided(w.shape, w.stride(), dtype=dtype, device=w.device).zero_()
        raise NotImplementedError(f"{func}: a QuantizedExpertWeight holds no values, only the FP8 operands of "
                                  "fp8_grouped_mm")

    def __repr__(self, *, tensor_contents=None) -> str:
        held = [n for n in ("forward", "dgrad") if getattr(self.operands, n) is not None]
        return (f"QuantizedExpertWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fmt={self.operands.fmt}, "
                f"layouts held={held})")


def _dtype_cast_only(w: torch.Tensor, kwargs: dict) -> bool:
    """Whether ``_to_copy(w, **kwargs)`` changes the dtype at most (same device, layout, strides)."""
    device = kwargs.get("device")
    return ((device is None or torch.device(device) == w.device) and kwargs.get("layout") in (None, torch.strided)
            and kwargs.get("memory_format") in (None, torch.preserve_format))
