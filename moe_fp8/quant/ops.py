"""Public Triton FP8 quantizers: validated wrappers around the ``moe_fp8::*`` torch ops.

Each ``triton_quantize_*`` function resolves the format (a :class:`Float8Format`, its name, its
torch dtype, or ``None`` to detect it), then calls a ``torch.library.triton_op`` whose fake
implementation gives shapes, dtypes and strides, so ``torch.compile(fullgraph=True)`` traces
through without graph breaks, down to the Triton kernels; eager calls skip the dispatcher and run
the op's function directly (``kernel_backend.eager_triton_op``). The op checks its inputs (metadata
only, no device sync) and raises ``TypeError``/``ValueError`` naming the argument. Results equal the
matching function of :mod:`moe_fp8.quant.reference` byte for byte (FP8 values and fp32 scales).

Inputs may be bf16, fp16 or fp32 with any strides (unit stride on the last dim is what makes the
loads wide). Kernels run on CUDA/ROCm tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from typing import Optional

import torch

from ..checks import check_offsets, check_same_device, check_tensor
from ..kernel_backend import eager_triton_op
from ..launch import zeroed
from .formats import Float8Format, resolve_format
from .kernels.blockwise import launch_blockwise, supported_block
from .kernels.colwise import launch_expert_colwise_t, launch_group_colwise
from .kernels.expert_amax import launch_expert_amax
from .kernels.rowwise import col_amax_fits, launch_expert_rowwise_col_amax, launch_group_rowwise_amax, launch_rowwise
from .kernels.tensorwise import launch_expert_tensorwise, launch_tensorwise
from .reference import HIGH_PRECISION_DTYPES

__all__ = [
    "expert_amax_fits",
    "triton_expert_amax",
    "triton_quantize_rowwise",
    "triton_quantize_rowwise_with_group_amax",
    "triton_group_amax",
    "triton_quantize_expert_colwise",
    "triton_quantize_expert_colwise_dual",
    "triton_quantize_expert_colwise_from_amax",
    "triton_quantize_expert_rowwise_with_amax",
    "triton_quantize_expert_tensorwise",
    "triton_quantize_group_colwise",
    "triton_quantize_group_colwise_dual",
    "triton_quantize_tensorwise",
    "triton_quantize_blockwise",
]

_F32 = torch.float32


def _format(fmt, device: torch.device) -> Float8Format:
    f = resolve_format(fmt, device)
    if f.is_fnuz and device.type == "cuda" and torch.version.hip is None:
        raise ValueError(f"fmt: {f.name} is a ROCm gfx94x format; Triton cannot write it on an NVIDIA GPU")
    return f


def _amax_bits(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Zeroed int32 buffer for a kernel's atomic max of fp32 amax bits, viewed as fp32 only AFTER the
    launch: a kernel under torch.compile mutates the buffer it is given, and a dtype view handed to
    it would have to carry the mutation back to its base."""
    return zeroed(shape, torch.int32, device)


def _hp(name: str, t, ndim) -> None:
    check_tensor(name, t, dtypes=HIGH_PRECISION_DTYPES, ndim=ndim)


def _col_major(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(rows, cols)`` with strides ``(1, rows)``: its transpose is row-major. Made as that transpose:
    the compiled graph's common-subexpression pass merges ``empty_strided`` calls of one shape (not
    ``empty``), and each kernel writing the one buffer would then get a copy of it first."""
    return torch.empty((cols, rows), dtype=dtype, device=device).t()


# ----------------------------------------------------------------------------------------- rowwise


def _check_rowwise(x, fmt: str) -> Float8Format:
    _hp("x", x, 2)
    return _format(fmt, x.device)


@eager_triton_op("moe_fp8::quantize_rowwise")
def _rowwise_op(x: torch.Tensor, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    f = _check_rowwise(x, fmt)
    M, K = x.shape
    q = torch.empty((M, K), dtype=f.torch_dtype, device=x.device)
    scale = torch.empty((M,), dtype=_F32, device=x.device)
    launch_rowwise(x, q, scale, f, pow2, M=M, K=K, rows_per_group=M, stride_g=0, stride_r=x.stride(0),
                   stride_k=x.stride(1))
    return q, scale


@_rowwise_op.register_fake
def _(x, fmt, pow2):
    f = _check_rowwise(x, fmt)
    return x.new_empty(x.shape, dtype=f.torch_dtype), x.new_empty((x.shape[0],), dtype=_F32)


def triton_quantize_rowwise(x: torch.Tensor, fmt=None, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row: ``x (M, K)`` -> ``q (M, K)`` row-major fp8, ``scale (M,)`` fp32 (dequant)."""
    _hp("x", x, 2)
    return _rowwise_op(x, _format(fmt, x.device).name, bool(pow2))


def _check_group_amax(x, offs, fmt: str) -> Float8Format:
    _hp("x", x, 2)
    check_offsets(offs, device=x.device)
    if not col_amax_fits(x.shape[1]):
        raise ValueError(f"x: rows of K = {x.shape[1]} do not fit the one-read kernel (K <= 16384)")
    return _format(fmt, x.device)


@eager_triton_op("moe_fp8::quantize_rowwise_group_amax")
def _rowwise_group_amax_op(
    x: torch.Tensor, offs: torch.Tensor, fmt: str, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = _check_group_amax(x, offs, fmt)
    M, K = x.shape
    q = torch.empty((M, K), dtype=f.torch_dtype, device=x.device)
    scale = torch.empty((M,), dtype=_F32, device=x.device)
    amax_bits = _amax_bits((offs.numel(), K), x.device)
    launch_group_rowwise_amax(x, q, scale, amax_bits, offs, f, pow2)
    return q, scale, amax_bits.view(_F32)


@_rowwise_group_amax_op.register_fake
def _(x, offs, fmt, pow2):
    f = _check_group_amax(x, offs, fmt)
    return (x.new_empty(x.shape, dtype=f.torch_dtype), x.new_empty((x.shape[0],), dtype=_F32),
            x.new_empty((offs.numel(), x.shape[1]), dtype=_F32))


def triton_quantize_rowwise_with_group_amax(
    x: torch.Tensor, offs: torch.Tensor, fmt=None, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`triton_quantize_rowwise` of ``x (M, K)`` and, from the same read, the per-group column
    amax ``(E, K)`` fp32 over the jagged row groups of ``offs (E,)`` int32 end offsets (on ``x``'s
    device, not checked for monotonicity: that would sync; ``reference.group_amax``). Hand it to
    :func:`triton_quantize_group_colwise_dual` (``a_amax``) so that the wgrad operand ``x`` is
    quantized per group in one read and one write. ``K`` at most 16384."""
    _hp("x", x, 2)
    return _rowwise_group_amax_op(x, offs, _format(fmt, x.device).name, bool(pow2))


@eager_triton_op("moe_fp8::group_amax")
def _group_amax_op(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    f = _check_group_amax(x, offs, None)  # the platform's format: the launch needs one, writes none
    amax_bits = _amax_bits((offs.numel(), x.shape[1]), x.device)
    launch_group_rowwise_amax(x, None, None, amax_bits, offs, f, False)
    return amax_bits.view(_F32)


@_group_amax_op.register_fake
def _(x, offs):
    _check_group_amax(x, offs, None)
    return x.new_empty((offs.numel(), x.shape[1]), dtype=_F32)


def triton_group_amax(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The per-group column amax ``(E, K)`` fp32 of ``x (M, K)`` over the jagged row groups of
    ``offs (E,)`` int32 end offsets, in one read of the groups' rows (``reference.group_amax``; the
    offsets are not checked for monotonicity: that would sync). For a tensor whose rows were
    quantized elsewhere (FP8MoE's fused permute): hand it to
    :func:`triton_quantize_group_colwise_dual` (``a_amax`` / ``b_amax``). ``K`` at most 16384."""
    _hp("x", x, 2)
    return _group_amax_op(x, offs)


# ---------------------------------------------------------------------------------- expert colwise


def _check_expert(w, fmt: str) -> Float8Format:
    _hp("w", w, 3)
    return _format(fmt, w.device)


def _layout_buffers(w: torch.Tensor, f: Float8Format, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(q, scale)`` of one layout of ``w (E, N, K)``: ``(E, N, K)``, ``(E, N)`` (forward) or
    ``(E, K, N)``, ``(E, K)`` (dgrad, ``transposed``)."""
    E, N, K = w.shape
    inner, outer = (K, N) if transposed else (N, K)
    return (torch.empty((E, inner, outer), dtype=f.torch_dtype, device=w.device),
            torch.empty((E, inner), dtype=_F32, device=w.device))


def _expert_layout(w: torch.Tensor, f: Float8Format, pow2: bool, transposed: bool,
                   after: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layout of ``w``, one launch: rows over K (forward) or the column-wise kernel (dgrad). The
    forward layout of a transposed view of ``(E, K, N)`` storage is the storage's column-wise layout:
    the row kernel would read rows of K strided by N (see :func:`_forward_layout_with_amax`)."""
    q, scale = _layout_buffers(w, f, transposed)
    if transposed or _stored_transposed(w):
        src = w if transposed else w.transpose(1, 2)
        launch_expert_colwise_t(src, q, scale, f, pow2, after=after)
    else:
        E, N, K = w.shape
        launch_rowwise(w, q, scale, f, pow2, M=E * N, K=K, rows_per_group=N, stride_g=w.stride(0),
                       stride_r=w.stride(1), stride_k=w.stride(2))
    return q, scale


@eager_triton_op("moe_fp8::quantize_expert_colwise")
def _expert_colwise_op(w: torch.Tensor, fmt: str, pow2: bool, transposed: bool,
                       after: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _expert_layout(w, _check_expert(w, fmt), pow2, transposed, after)


@_expert_colwise_op.register_fake
def _(w, fmt, pow2, transposed, after=None):
    f = _check_expert(w, fmt)
    E, N, K = w.shape
    inner, outer = (K, N) if transposed else (N, K)
    return w.new_empty((E, inner, outer), dtype=f.torch_dtype), w.new_empty((E, inner), dtype=_F32)


def triton_quantize_expert_colwise(
    w: torch.Tensor, fmt=None, pow2: bool = False, transposed: bool = False, *, after: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert, per-output-column scales of ``w (E, N, K)`` (``nn.Linear`` layout), one launch.

    ``transposed=False`` (forward): ``q (E, N, K)`` contiguous, ``scale (E, N)`` (amax over K).
    ``transposed=True`` (dgrad): ``q (E, K, N)`` contiguous, ``scale (E, K)`` (amax over N).
    ``after`` (``transposed`` only): a float32 or int32 tensor this launch is ordered after in a
    traced graph, never read (``kernels.colwise.order_token``): grad_out's scales keep the dgrad
    layout in the backward, where torch.compile would otherwise make it in the forward and keep it.
    """
    _hp("w", w, 3)
    return _expert_colwise_op(w, _format(fmt, w.device).name, bool(pow2), bool(transposed), after)


def _forward_layout_with_amax(w: torch.Tensor, f: Float8Format, pow2: bool):
    """The forward layout ``(q (E, N, K), scale (E, N))`` and the amax over N ``(E, K)`` fp32 from one
    read of ``w`` (``w`` must pass ``expert_amax_fits``). A transposed view of ``(E, K, N)`` storage
    (Llama 4's) is read along the storage's rows instead, twice: both amaxes, then the layout, which
    is the storage's dgrad layout (rows of ``K`` strided by ``N`` would make the one read scattered:
    45 ms against 2.5 for Llama 4 Scout's gate_up on an H100, ``forward_quantize_w_h100*.md``)."""
    if _stored_transposed(w):
        row_amax, col_amax = _amaxes(w)
        return (*_dgrad_layout_from_amax(w.transpose(1, 2), row_amax, f, pow2), col_amax)
    q, scale = _layout_buffers(w, f, False)
    col_amax_bits = _amax_bits((w.shape[0], w.shape[2]), w.device)
    launch_expert_rowwise_col_amax(w, q, scale, col_amax_bits, f, pow2)
    return q, scale, col_amax_bits.view(_F32)


def _dgrad_layout_from_amax(w: torch.Tensor, col_amax: torch.Tensor, f: Float8Format, pow2: bool,
                            after: Optional[torch.Tensor] = None):
    """The dgrad layout ``(q (E, K, N), scale (E, K))`` of ``w`` given its amax over N."""
    q, scale = _layout_buffers(w, f, True)
    launch_expert_colwise_t(w, q, scale, f, pow2, amax_bits=col_amax.contiguous().view(torch.int32), after=after)
    return q, scale


@eager_triton_op("moe_fp8::quantize_expert_colwise_dual")
def _expert_dual_op(
    w: torch.Tensor, fmt: str, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    f = _check_expert(w, fmt)
    if expert_amax_fits(w):
        q_fwd, s_fwd, col_amax = _forward_layout_with_amax(w, f, pow2)
        return q_fwd, s_fwd, *_dgrad_layout_from_amax(w, col_amax, f, pow2)
    return (*_expert_layout(w, f, pow2, False), *_expert_layout(w, f, pow2, True))


@_expert_dual_op.register_fake
def _(w, fmt, pow2):
    f = _check_expert(w, fmt)
    E, N, K = w.shape
    return (w.new_empty((E, N, K), dtype=f.torch_dtype), w.new_empty((E, N), dtype=_F32),
            w.new_empty((E, K, N), dtype=f.torch_dtype), w.new_empty((E, K), dtype=_F32))


def triton_quantize_expert_colwise_dual(
    w: torch.Tensor, fmt=None, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both layouts of ``w (E, N, K)``: ``(q_fwd (E,N,K), s_fwd (E,N), q_bwd (E,K,N), s_bwd (E,K))``.

    Equal to ``triton_quantize_expert_colwise(w, transposed=False)`` and ``(..., transposed=True)``,
    in one op (one graph node) of two launches: the layouts reduce over different axes (K and N)
    before any byte of either can be written and no on-chip buffer holds an expert, so ``w`` is
    read once per layout. The first launch writes the forward layout and merges the amax over N
    from the same read (:func:`triton_quantize_expert_rowwise_with_amax`), the second only scales
    and writes the dgrad layout (:func:`triton_quantize_expert_colwise_from_amax`); rows longer
    than 16384 (``K``) take the column-wise kernel for the dgrad layout instead.
    """
    _hp("w", w, 3)
    return _expert_dual_op(w, _format(fmt, w.device).name, bool(pow2))


@eager_triton_op("moe_fp8::quantize_expert_rowwise_with_amax")
def _expert_rowwise_amax_op(w: torch.Tensor, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = _check_expert(w, fmt)
    if not expert_amax_fits(w):
        raise ValueError(f"w: contiguous rows of {_row_length(w)} elements do not fit the one-read kernel "
                         "(at most 16384)")
    return _forward_layout_with_amax(w, f, pow2)


@_expert_rowwise_amax_op.register_fake
def _(w, fmt, pow2):
    f = _check_expert(w, fmt)
    E, N, K = w.shape
    return (w.new_empty((E, N, K), dtype=f.torch_dtype), w.new_empty((E, N), dtype=_F32),
            w.new_empty((E, K), dtype=_F32))


def triton_quantize_expert_rowwise_with_amax(
    w: torch.Tensor, fmt=None, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward layout of ``w (E, N, K)`` and, from the same read, the dgrad layout's amax.

    Returns ``q (E, N, K)`` contiguous and ``scale (E, N)`` (equal to
    ``triton_quantize_expert_colwise(w)``), and ``col_amax (E, K)`` fp32, the amax over N of every
    expert column (``reference.expert_amax(w, transposed=True)``). Hand ``col_amax`` to
    :func:`triton_quantize_expert_colwise_from_amax` for the dgrad layout at one read and one
    write of ``w``. Contiguous rows of at most 16384 elements (:func:`expert_amax_fits`); a
    transposed view of ``(E, K, N)`` storage is read twice along the storage's rows (amaxes, then
    the layout) instead of once across them.
    """
    _hp("w", w, 3)
    return _expert_rowwise_amax_op(w, _format(fmt, w.device).name, bool(pow2))


@eager_triton_op("moe_fp8::expert_amax")
def _expert_amax_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _hp("w", w, 3)
    if not expert_amax_fits(w):
        raise ValueError(f"w: contiguous rows of {_row_length(w)} elements do not fit the one-read kernel "
                         "(at most 16384)")
    return _amaxes(w)


def _amaxes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax over K (E, N), amax over N (E, K))`` of ``w (E, N, K)``, from its contiguous rows."""
    if _stored_transposed(w):  # (E, K, N) storage: the kernel reads the storage's rows
        col, row = _amaxes(w.transpose(1, 2))
        return row, col
    E, N, K = w.shape
    row_amax = torch.empty((E, N), dtype=_F32, device=w.device)
    col_bits = _amax_bits((E, K), w.device)
    launch_expert_amax(w, row_amax, col_bits)
    return row_amax, col_bits.view(_F32)


@_expert_amax_op.register_fake
def _(w):
    _hp("w", w, 3)
    E, N, K = w.shape
    return w.new_empty((E, N), dtype=_F32), w.new_empty((E, K), dtype=_F32)


def _stored_transposed(w: torch.Tensor) -> bool:
    """``w (E, N, K)`` is a transposed view of ``(E, K, N)`` storage (N the contiguous dim)."""
    return w.stride(1) == 1 and w.stride(2) != 1


def _row_length(w: torch.Tensor) -> int:
    """The length of ``w (E, N, K)``'s contiguous rows: ``N`` for (E, K, N) storage, else ``K``."""
    return w.shape[1] if _stored_transposed(w) else w.shape[2]


def expert_amax_fits(w: torch.Tensor) -> bool:
    """Whether :func:`triton_expert_amax` takes ``w``: its contiguous rows of at most 16384 elements."""
    return col_amax_fits(_row_length(w))


def triton_expert_amax(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (E, N, K)``'s amax over K, ``(E, N)``, and over N, ``(E, K)``, both fp32 from one read
    (``reference.expert_amax(w)`` and ``reference.expert_amax(w, transposed=True)``): the scales of
    both weight layouts, with nothing quantized. The kernel reads whole contiguous rows: of ``w``, or
    for a transposed view of ``(E, K, N)`` storage, of the storage (:func:`expert_amax_fits`)."""
    return _expert_amax_op(w)


def _check_col_amax(w, col_amax) -> None:
    check_tensor("col_amax", col_amax, dtypes=(_F32,), shape=(w.shape[0], w.shape[2]))
    check_same_device(w=w, col_amax=col_amax)


@eager_triton_op("moe_fp8::quantize_expert_colwise_from_amax")
def _expert_colwise_from_amax_op(
    w: torch.Tensor, col_amax: torch.Tensor, fmt: str, pow2: bool, after: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    f = _check_expert(w, fmt)
    _check_col_amax(w, col_amax)
    return _dgrad_layout_from_amax(w, col_amax, f, pow2, after)


@_expert_colwise_from_amax_op.register_fake
def _(w, col_amax, fmt, pow2, after=None):
    f = _check_expert(w, fmt)
    _check_col_amax(w, col_amax)
    E, N, K = w.shape
    return w.new_empty((E, K, N), dtype=f.torch_dtype), w.new_empty((E, K), dtype=_F32)


def triton_quantize_expert_colwise_from_amax(
    w: torch.Tensor, col_amax: torch.Tensor, fmt=None, pow2: bool = False, *, after: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad layout of ``w (E, N, K)`` with its scales from ``col_amax (E, K)`` fp32.

    ``q (E, K, N)`` contiguous, ``scale (E, K)``: equal to
    ``triton_quantize_expert_colwise(w, transposed=True)`` when ``col_amax`` is ``w``'s amax over
    N (as :func:`triton_quantize_expert_rowwise_with_amax` returns it); other values are trusted
    (not checked: that would sync) and give other scales. One read and one write of ``w``. ``after``:
    as in :func:`triton_quantize_expert_colwise`.
    """
    _hp("w", w, 3)
    return _expert_colwise_from_amax_op(w, col_amax, _format(fmt, w.device).name, bool(pow2), after)


# ----------------------------------------------------------------------------------- group colwise


def _check_group(a, b, offs, fmt: str, padded_offs, padded_rows, a_amax=None, b_amax=None,
                 a_amax_name: str = "a_amax") -> tuple[Float8Format, int]:
    """Validate the per-group operands; return the format and the output row count."""
    _hp("a", a, 2)
    for name, amax, x in ((a_amax_name, a_amax, a), ("b_amax", b_amax, b)):
        if amax is not None:
            check_tensor(name, amax, dtypes=(_F32,), shape=(offs.numel(), x.shape[1]))
            check_same_device(a=a, **{name: amax})
    if b is not None:
        _hp("b", b, 2)
        if b.shape[0] != a.shape[0]:
            raise ValueError(f"b: expected {a.shape[0]} rows like a, got shape {tuple(b.shape)}")
        check_same_device(a=a, b=b)
    check_offsets(offs, device=a.device)
    if (padded_offs is None) != (padded_rows is None):
        raise ValueError("padded_offs, padded_rows: expected both or neither")
    rows_out = a.shape[0]
    if padded_offs is not None:
        check_tensor("padded_offs", padded_offs, dtypes=(torch.int32,), shape=(offs.numel(),))
        if padded_offs.device != a.device:
            raise ValueError(f"padded_offs: expected device {a.device}, got {padded_offs.device}")
        if isinstance(padded_rows, bool) or not isinstance(padded_rows, (int, torch.SymInt)) or padded_rows < 0:
            raise ValueError(f"padded_rows: expected a non-negative int, got {padded_rows!r}")
        rows_out = padded_rows
    return _format(fmt, a.device), rows_out


@eager_triton_op("moe_fp8::quantize_group_colwise")
def _group_colwise_op(
    x: torch.Tensor, offs: torch.Tensor, fmt: str, pow2: bool, column_major: bool,
    padded_offs: Optional[torch.Tensor] = None, padded_rows: Optional[int] = None, amax: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    f, rows = _check_group(x, None, offs, fmt, padded_offs, padded_rows, amax, a_amax_name="amax")
    C = x.shape[1]
    q = _col_major(rows, C, f.torch_dtype, x.device) if column_major else torch.empty(
        (rows, C), dtype=f.torch_dtype, device=x.device)
    scale = torch.empty((offs.numel(), C), dtype=_F32, device=x.device)
    bits = None if amax is None else amax.contiguous().view(torch.int32)
    launch_group_colwise(x, q, scale, None, None, None, offs, padded_offs, f, pow2, amax_bits=bits)
    return q, scale


@_group_colwise_op.register_fake
def _(x, offs, fmt, pow2, column_major, padded_offs=None, padded_rows=None, amax=None):
    f, rows = _check_group(x, None, offs, fmt, padded_offs, padded_rows, amax, a_amax_name="amax")
    C = x.shape[1]
    q = _col_major(rows, C, f.torch_dtype, x.device) if column_major else x.new_empty((rows, C), dtype=f.torch_dtype)
    return q, x.new_empty((offs.numel(), C), dtype=_F32)


def triton_quantize_group_colwise(
    x: torch.Tensor, offs: torch.Tensor, fmt=None, pow2: bool = False, *, column_major: bool = False,
    padded_offs: Optional[torch.Tensor] = None, padded_rows: Optional[int] = None, amax: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group, per-column scales over jagged row groups (``reference.quantize_group_colwise``).

    ``x (M, C)``, ``offs (E,)`` int32 end offsets (on ``x``'s device, not checked for monotonicity:
    that would sync) -> ``q (R, C)`` (row-major, or column-major strides with ``column_major``;
    rows at or past ``offs[-1]`` are 0), ``scale (E, C)``. ``R = M``, or with ``padded_offs`` and
    ``padded_rows`` the padded row layout of :func:`triton_quantize_group_colwise_dual`. ``amax``:
    optional ``(E, C)`` fp32 per-group column amax of ``x`` (trusted): then no reduction, one read.
    """
    _hp("x", x, 2)
    return _group_colwise_op(x, offs, _format(fmt, x.device).name, bool(pow2), bool(column_major), padded_offs,
                             padded_rows, amax)


@eager_triton_op("moe_fp8::quantize_group_colwise_dual")
def _group_dual_op(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    fmt: str,
    pow2: bool,
    padded_offs: Optional[torch.Tensor],
    padded_rows: Optional[int],
    a_amax: Optional[torch.Tensor],
    b_amax: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    f, rows = _check_group(a, b, offs, fmt, padded_offs, padded_rows, a_amax, b_amax)
    E, N, K = offs.numel(), a.shape[1], b.shape[1]
    qa, qb = _col_major(rows, N, f.torch_dtype, a.device), _col_major(rows, K, f.torch_dtype, a.device)
    sa = torch.empty((E, N), dtype=_F32, device=a.device)
    sb = torch.empty((E, K), dtype=_F32, device=a.device)
    if a_amax is not None and b_amax is not None:  # one launch of workers for both
        bits = torch.cat([a_amax, b_amax], dim=1).view(torch.int32)
        launch_group_colwise(a, qa, sa, b, qb, sb, offs, padded_offs, f, pow2, amax_bits=bits)
    elif a_amax is None and b_amax is None:
        launch_group_colwise(a, qa, sa, b, qb, sb, offs, padded_offs, f, pow2)
    else:  # the tensor with an amax by workers alone, the other reduced
        (x, qx, sx, amax), (y, qy, sy) = ((a, qa, sa, a_amax), (b, qb, sb)) if b_amax is None else (
            (b, qb, sb, b_amax), (a, qa, sa))
        bits = amax.contiguous().view(torch.int32)
        launch_group_colwise(x, qx, sx, None, None, None, offs, padded_offs, f, pow2, amax_bits=bits)
        launch_group_colwise(y, qy, sy, None, None, None, offs, padded_offs, f, pow2)
    return qa, sa, qb, sb


@_group_dual_op.register_fake
def _(a, b, offs, fmt, pow2, padded_offs, padded_rows, a_amax, b_amax):
    f, rows = _check_group(a, b, offs, fmt, padded_offs, padded_rows, a_amax, b_amax)
    E, N, K = offs.numel(), a.shape[1], b.shape[1]
    return (_col_major(rows, N, f.torch_dtype, a.device), a.new_empty((E, N), dtype=_F32),
            _col_major(rows, K, f.torch_dtype, a.device), a.new_empty((E, K), dtype=_F32))


def triton_quantize_group_colwise_dual(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    fmt=None,
    pow2: bool = False,
    *,
    padded_offs: Optional[torch.Tensor] = None,
    padded_rows: Optional[int] = None,
    a_amax: Optional[torch.Tensor] = None,
    b_amax: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two wgrad operands in one launch: per-group, per-column scales over jagged row groups.

    Args:
        a: ``(M, N)`` (grad_output), bf16/fp16/fp32.
        b: ``(M, K)`` (activations), same rows.
        offs: ``(E,)`` int32 cumulative end offsets on the same device (values are not checked:
            that would sync; offsets past ``M`` are clamped so memory stays safe).
        padded_offs: optional ``(E,)`` int32 end offsets of the padded groups (every offset a
            multiple of 16, as ``grouped_gemm.padding.padded_offsets`` makes them, and each padded
            group at least as large as its group; not checked: that would sync), with
        padded_rows: the static row count of the padded outputs (>= ``padded_offs[-1]``).
        a_amax, b_amax: optional ``(E, N)`` and ``(E, K)`` fp32, the per-group column amaxes of
            ``a`` and ``b`` (as :func:`triton_quantize_rowwise_with_group_amax` returns them;
            trusted, not checked). A tensor with its amax is scaled and written without a
            reduction (one read and one write); with both, in one launch; with one, the other is
            reduced in a second launch.
    Returns:
        ``qa (R, N)`` and ``qb (R, K)`` with column-major strides (``qa.t()`` is row-major), where
        ``R = M`` or ``padded_rows``; group ``g``'s rows sit at ``offs[g-1]`` (or the padded start)
        and every other row is 0; ``sa (E, N)``, ``sb (E, K)`` fp32 dequant scales (empty group:
        ``EPS / fmt.max``).
    """
    _hp("a", a, 2)
    return _group_dual_op(a, b, offs, _format(fmt, a.device).name, bool(pow2), padded_offs, padded_rows, a_amax,
                          b_amax)


# -------------------------------------------------------------------------------------- tensorwise


def _check_tensorwise(x, fmt: str, rows: Optional[torch.Tensor] = None) -> Float8Format:
    _hp("x", x, None)
    if rows is not None:
        check_tensor("rows", rows, dtypes=(torch.int32,), ndim=1)
        if x.dim() < 1 or rows.numel() < 1:
            raise ValueError(f"rows: needs x of 1+ dims and 1+ elements, got x {tuple(x.shape)}, rows "
                             f"{tuple(rows.shape)}")
        check_same_device(x=x, rows=rows)
    return _format(fmt, x.device)


@eager_triton_op("moe_fp8::quantize_tensorwise")
def _tensorwise_op(x: torch.Tensor, fmt: str, pow2: bool,
                   rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    f = _check_tensorwise(x, fmt, rows)
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=f.torch_dtype, device=x.device)
    scale = torch.empty((), dtype=_F32, device=x.device)
    launch_tensorwise(x, q, scale, f, pow2, rows=rows)
    return q, scale


@_tensorwise_op.register_fake
def _(x, fmt, pow2, rows):
    f = _check_tensorwise(x, fmt, rows)
    return x.new_empty(x.shape, dtype=f.torch_dtype), x.new_empty((), dtype=_F32)


def triton_quantize_tensorwise(
    x: torch.Tensor, fmt=None, pow2: bool = False, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the tensor: ``x`` (any shape) -> ``q`` contiguous fp8, ``scale`` 0-d fp32
    (``reference.quantize_tensorwise``).

    A non-contiguous ``x`` is copied to contiguous first. ``rows``: optional int32 ``(n,)`` on
    ``x``'s device; its first element (not read on the host) counts the leading rows of ``x``
    (along dim 0) that the amax covers: the rows past it, which may hold anything (the tokens past
    ``offs[-1]``), are cast with the scale of the others.
    """
    _hp("x", x, None)
    return _tensorwise_op(x, _format(fmt, x.device).name, bool(pow2), rows)


@eager_triton_op("moe_fp8::quantize_expert_tensorwise")
def _expert_tensorwise_op(w: torch.Tensor, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    f = _check_expert(w, fmt)
    w = w.contiguous()
    q = torch.empty(w.shape, dtype=f.torch_dtype, device=w.device)
    scale = torch.empty(w.shape[0], dtype=_F32, device=w.device)
    launch_expert_tensorwise(w, q, scale, f, pow2)
    return q, scale


@_expert_tensorwise_op.register_fake
def _(w, fmt, pow2):
    f = _check_expert(w, fmt)
    return w.new_empty(w.shape, dtype=f.torch_dtype), w.new_empty(w.shape[0], dtype=_F32)


def triton_quantize_expert_tensorwise(w: torch.Tensor, fmt=None, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per expert of ``w (E, N, K)`` (``reference.quantize_expert_tensorwise``): ``q (E, N, K)``
    contiguous fp8, ``scale (E,)`` fp32. A non-contiguous ``w`` is copied to contiguous first.
    """
    _hp("w", w, 3)
    return _expert_tensorwise_op(w, _format(fmt, w.device).name, bool(pow2))


# --------------------------------------------------------------------------------------- blockwise


def _check_blockwise(x, fmt: str, block) -> Float8Format:
    _hp("x", x, (2, 3))
    if len(block) != 2 or not supported_block(tuple(block)):
        raise ValueError(f"block: expected (br, bc), powers of two with bc >= 16 and br * bc <= 16384, got {block}")
    return _format(fmt, x.device)


def _block_scale_shape(x, block) -> tuple[int, ...]:
    br, bc = block
    R, C = x.shape[-2:]
    return (*x.shape[:-2], -(-R // br), -(-C // bc))


@eager_triton_op("moe_fp8::quantize_blockwise")
def _blockwise_op(x: torch.Tensor, fmt: str, block: list[int], pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    f = _check_blockwise(x, fmt, block)
    q = torch.empty(x.shape, dtype=f.torch_dtype, device=x.device)
    scale = torch.empty(_block_scale_shape(x, block), dtype=_F32, device=x.device)
    launch_blockwise(x, q, scale, f, pow2, (block[0], block[1]))
    return q, scale


@_blockwise_op.register_fake
def _(x, fmt, block, pow2):
    f = _check_blockwise(x, fmt, block)
    return x.new_empty(x.shape, dtype=f.torch_dtype), x.new_empty(_block_scale_shape(x, block), dtype=_F32)


def triton_quantize_blockwise(
    x: torch.Tensor, fmt=None, block: tuple[int, int] = (1, 128), pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales over the last two dims of ``x (..., R, C)`` (2D or 3D).

    ``block=(1, 128)`` (activations) or ``(128, 128)`` (weights); any ``(br, bc)`` of powers of two
    with ``bc >= 16`` and ``br * bc <= 16384`` works. Returns ``q`` (same shape, contiguous) and
    ``scale (..., ceil(R/br), ceil(C/bc))``.
    """
    _hp("x", x, (2, 3))
    block = [int(v) for v in block]
    return _blockwise_op(x, _format(fmt, x.device).name, block, bool(pow2))

