"""Argument validation shared by every public function.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, rank,
device or content) naming the argument and what was expected, before any kernel launches.
Checks read only metadata (shape, dtype, device, strides): none of them syncs with the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["check_tensor", "check_offsets", "check_offsets_values", "check_same_device", "check_multiple_of"]


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    shape: tuple | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of one of ``dtypes``, of rank ``ndim`` and of ``shape``.

    In ``shape``, ``None`` entries match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        if type(dtypes) is not tuple:
            dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype in ({_names(dtypes)}), got {_names([t.dtype])}")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ranks:
            want = " or ".join(f"{r}-D" for r in ranks)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    if shape is not None and not _shape_matches(t.shape, shape):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    return t


def _shape_matches(got: torch.Size, want: tuple) -> bool:
    if len(got) != len(want):
        return False
    for w, g in zip(want, got):
        if w is not None and w != g:
            return False
    return True


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all given tensors live on one device; return it."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"{name}: expected all tensors on one device, got {listing}")
    return first


def check_multiple_of(name: str, value: int, multiple: int) -> None:
    if value % multiple != 0:
        raise ValueError(f"{name}: expected a multiple of {multiple}, got {value}")


def check_offsets(offs, *, num_groups: int | None = None, device: torch.device | None = None,
                  name: str = "offs") -> torch.Tensor:
    """Check the metadata of a token-group offsets tensor (``name`` in the errors).

    ``offs`` must be a contiguous 1-D int32 tensor of cumulative END offsets, one per group
    (``offs[-1]`` = rows used). Monotonicity and ``offs[-1] <= rows`` depend on device data: check them with
    :func:`check_offsets_values` where a host sync is acceptable (tests, reference code).
    """
    check_tensor(name, offs, dtypes=(torch.int32,), ndim=1)
    if offs.numel() > 1 and offs.stride(0) != 1:  # kernels index offs[g] as base + g
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {offs.stride(0)} (call .contiguous())")
    if num_groups is not None and offs.numel() != num_groups:
        raise ValueError(f"{name}: expected length {num_groups} (one end offset per group), got {offs.numel()}")
    if device is not None and offs.device != device:
        raise ValueError(f"{name}: expected device {device}, got {offs.device}")
    return offs


def check_offsets_values(offs: torch.Tensor, num_rows: int, name: str = "offs") -> None:
    """Check that ``offs`` is non-decreasing, starts >= 0 and ends <= ``num_rows`` (syncs on GPU)."""
    if offs.numel() == 0:
        return
    o = offs.detach().to("cpu", torch.int64)
    if int(o[0]) < 0 or bool((o[1:] < o[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing, non-negative end offsets, got {o.tolist()[:16]}")
    if int(o[-1]) > num_rows:
        raise ValueError(f"{name}: expected {name}[-1] <= {num_rows} rows, got {int(o[-1])}")
