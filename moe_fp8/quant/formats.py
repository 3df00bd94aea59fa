"""FP8 formats and platform detection.

A :class:`Float8Format` carries everything a kernel needs to know about an FP8 encoding: the
torch dtype, the Triton dtype, the largest finite value and the grid parameters used by the
interpreter-safe rounding helper. The format is chosen once per device and then passed
explicitly through every call: a wrong max (448 vs 240) is silent corruption.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "Float8Format",
    "E4M3FN",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "FORMATS",
    "FORMAT_ENV_VAR",
    "detect_format",
    "resolve_format",
]

FORMAT_ENV_VAR = "MOE_FP8_FORMAT"


@dataclass(frozen=True)
class Float8Format:
    """One FP8 encoding.

    Attributes:
        name: short name, e.g. ``"e4m3fn"``.
        torch_dtype: the torch dtype of the encoded tensors.
        triton_dtype_name: the ``triton.language`` attribute of the same encoding
            (``"float8e4nv"``, ``"float8e4b8"``, ...).
        max: largest finite value (448 for e4m3fn, 240 for e4m3fnuz, 57344 for e5m2).
        mantissa_bits: stored mantissa bits (3 for E4M3, 2 for E5M2).
        min_normal_exp: exponent of the smallest normal number (-6 for e4m3fn, -7 for e4m3fnuz);
            below ``2**min_normal_exp`` values sit on the fixed subnormal grid
            ``2**(min_normal_exp - mantissa_bits)``.
    """

    name: str
    torch_dtype: torch.dtype
    triton_dtype_name: str
    max: float
    mantissa_bits: int
    min_normal_exp: int

    @property
    def triton_dtype(self):
        """The ``triton.language`` dtype (imported lazily so that torch-only code needs no Triton)."""
        import triton.language as tl

        return getattr(tl, self.triton_dtype_name)

    @property
    def subnormal_quantum_exp(self) -> int:
        """``Q`` such that subnormals are multiples of ``2**-Q`` (9 for e4m3fn, 10 for e4m3fnuz)."""
        return self.mantissa_bits - self.min_normal_exp

    @property
    def is_fnuz(self) -> bool:
        return self.name.endswith("fnuz")

    def __repr__(self) -> str:
        return f"Float8Format({self.name}, max={self.max:g})"


E4M3FN = Float8Format("e4m3fn", torch.float8_e4m3fn, "float8e4nv", 448.0, 3, -6)
E4M3FNUZ = Float8Format("e4m3fnuz", torch.float8_e4m3fnuz, "float8e4b8", 240.0, 3, -7)
E5M2 = Float8Format("e5m2", torch.float8_e5m2, "float8e5", 57344.0, 2, -14)
E5M2FNUZ = Float8Format("e5m2fnuz", torch.float8_e5m2fnuz, "float8e5b16", 57344.0, 2, -15)

FORMATS: dict[str, Float8Format] = {f.name: f for f in (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ)}
_BY_DTYPE = {f.torch_dtype: f for f in FORMATS.values()}

# ROCm architectures whose FP8 is the FNUZ encoding (MI300A/MI300X/MI325X). gfx950 (MI350/MI355)
# and the RDNA4 parts use the OCP encoding, like CUDA.
_FNUZ_ARCH_PREFIX = "gfx94"


def resolve_format(fmt: "Float8Format | str | torch.dtype | None" = None, device=None) -> Float8Format:
    """Turn a format given by object, name or torch dtype into a :class:`Float8Format`.

    ``None`` means "detect": see :func:`detect_format`.
    """
    if fmt is None:
        return detect_format(device)
    if isinstance(fmt, Float8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        if fmt not in _BY_DTYPE:
            raise TypeError(f"fmt: expected an FP8 torch dtype ({sorted(map(str, _BY_DTYPE))}), got {fmt}")
        return _BY_DTYPE[fmt]
    if isinstance(fmt, str):
        key = fmt.strip().lower().removeprefix("float8_").removeprefix("torch.float8_")
        if key not in FORMATS:
            raise ValueError(f"fmt: expected one of {sorted(FORMATS)}, got {fmt!r}")
        return FORMATS[key]
    raise TypeError(f"fmt: expected Float8Format, str, torch.dtype or None, got {type(fmt).__name__}")


def _rocm_arch(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


def detect_format(device: "torch.device | str | int | None" = None, *, fmt=None) -> Float8Format:
    """The E4M3 format that the platform's FP8 GEMMs take.

    Order of precedence: the explicit ``fmt`` argument, then the ``MOE_FP8_FORMAT`` environment
    variable (``e4m3fn`` / ``e4m3fnuz`` / ...), then the platform:

    * CUDA and CPU: ``e4m3fn`` (max 448);
    * ROCm gfx940 / gfx941 / gfx942 (MI300A, MI300X, MI325X): ``e4m3fnuz`` (max 240);
    * ROCm gfx950 (MI350/MI355) and any other arch: ``e4m3fn``.

    ``device`` names the GPU whose arch is read on ROCm (default: the current device).
    """
    if fmt is not None:
        return resolve_format(fmt)
    env = os.environ.get(FORMAT_ENV_VAR)
    if env:
        try:
            return resolve_format(env)
        except ValueError as e:
            raise ValueError(f"environment variable {FORMAT_ENV_VAR}: {e}") from None
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is None:
        return E4M3FN
    return E4M3FNUZ if _rocm_arch(device).startswith(_FNUZ_ARCH_PREFIX) else E4M3FN
