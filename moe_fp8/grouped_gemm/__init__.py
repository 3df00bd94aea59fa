"""FP8 grouped GEMM: the exact CPU reference (``emulated``); backends and the autograd op follow."""

from .emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d

__all__ = ["emulated_grouped_mm_2d2d", "emulated_grouped_mm_2d3d"]
