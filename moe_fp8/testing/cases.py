"""The battery of grouped-GEMM cases: shapes, routings and inputs that have broken real kernels.

A case names one problem of one form:

* ``2d3d`` (forward, and its gradients): ``out[rows of g] = x[rows of g] @ w[g].T`` with
  ``x (M, K)``, ``w (E, N, K)`` (``nn.Linear`` layout), ``offs (E,)`` int32 cumulative END offsets.
* ``2d2d`` (the wgrad form): ``out[g] = a[rows of g].T @ b[rows of g]`` with ``a (M, N)``,
  ``b (M, K)`` and ``out (E, N, K)``.

``M = sum(sizes) + tail``: the ``tail`` rows past ``offs[-1]`` belong to no group and hold random
values, NaN or huge values (``tail_fill``); no result may depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["FORMS", "GroupedMMCase", "grouped_mm_cases"]

Form = Literal["2d3d", "2d2d"]
FORMS: tuple[str, ...] = ("2d3d", "2d2d")
TailFill = Literal["random", "nan", "huge"]
Layout = Literal["contiguous", "strided"]


@dataclass(frozen=True)
class GroupedMMCase:
    """One problem of the battery.

    Attributes:
        name: what the case is about (``empty_first``, ``dirichlet``, ...); ``str(case)`` is
            ``"<form>-<name>"``, the case's id in tables and pytest.
        form: ``"2d3d"`` or ``"2d2d"``.
        sizes: rows of each group (``E = len(sizes)``).
        k, n: the inner sizes (``x (M, k)``, ``w (E, n, k)``; ``a (M, n)``, ``b (M, k)``).
        tail: rows past ``offs[-1]``; ``tail_fill`` says what they hold.
        dtype: the inputs' dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
        magnitude: every input is multiplied by it (huge and tiny values).
        layout: ``"contiguous"``, or ``"strided"`` (x, grad_out, a, b are column slices of wider
            tensors; w is a transposed view of ``(E, K, N)`` storage).
        seed: seed of the inputs' generator.
    """

    name: str
    form: Form
    sizes: tuple[int, ...]
    k: int = 32
    n: int = 16
    tail: int = 0
    tail_fill: TailFill = "random"
    dtype: str = "bfloat16"
    magnitude: float = 1.0
    layout: Layout = "contiguous"
    seed: int = 0

    def __str__(self) -> str:
        return f"{self.form}-{self.name}"

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    @property
    def rows(self) -> int:
        """``M``: every row of the activation, the tail included."""
        return sum(self.sizes) + self.tail

    @property
    def used_rows(self) -> int:
        """``offs[-1]``."""
        return sum(self.sizes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def offsets(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(E,)`` int32 cumulative end offsets."""
        return torch.tensor(self.sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)

    def empty_groups(self) -> list[int]:
        return [g for g, s in enumerate(self.sizes) if s == 0]


def _routed_sizes(rows: int, probs: torch.Tensor, gen: torch.Generator) -> tuple[int, ...]:
    picks = torch.multinomial(probs, rows, replacement=True, generator=gen)
    return tuple(torch.bincount(picks, minlength=probs.numel()).tolist())


def _routings(gen: torch.Generator, rows: int, groups: int) -> dict[str, tuple[int, ...]]:
    """Balanced, skewed (group probabilities ~ U^4) and Dirichlet(0.3) routings of ``rows`` rows."""
    u = torch.rand(groups, generator=gen, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):  # Dirichlet samples from the global CPU generator only
        torch.default_generator.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        p = torch.distributions.Dirichlet(torch.full((groups,), 0.3, dtype=torch.float64)).sample()
    return {
        "balanced": _routed_sizes(rows, torch.ones(groups, dtype=torch.float64), gen),
        "skewed": _routed_sizes(rows, u**4 + 1e-3, gen),
        "dirichlet": _routed_sizes(rows, p + 1e-9, gen),
    }


def _specs(quick: bool) -> list[dict]:
    """The battery's problems (form-free); ``quick`` keeps M <= 80, K, N in {16, 32, 48}, E <= 8 (the
    Triton interpreter runs the whole quick battery in well under a minute)."""
    gen = torch.Generator().manual_seed(20261201)
    r4, r8 = _routings(gen, 48, 4), _routings(gen, 64, 8)
    specs = [
        dict(name="balanced", sizes=r4["balanced"], tail=6),
        dict(name="skewed", sizes=r8["skewed"], tail=8),
        dict(name="dirichlet", sizes=r8["dirichlet"], tail=5),
        dict(name="empty_first", sizes=(0, 13, 21, 14), tail=6),
        dict(name="empty_last", sizes=(13, 21, 14, 0), tail=6),
        dict(name="empty_many", sizes=(0, 11, 0, 0, 20, 0, 9, 0), tail=4),
        dict(name="all_empty", sizes=(0, 0, 0, 0), tail=16),
        dict(name="one_group", sizes=(0, 0, 48, 0)),
        dict(name="sizes_not_16", sizes=(1, 15, 17, 33), tail=7),
        dict(name="sizes_16", sizes=(16, 32, 0, 16), tail=16),
        dict(name="m0", sizes=(0, 0, 0, 0)),
        dict(name="k16_n16", sizes=r4["balanced"], k=16, n=16, tail=3),
        dict(name="k16_n48", sizes=r4["balanced"], k=16, n=48, tail=3),
        dict(name="k48_n16", sizes=r4["balanced"], k=48, n=16, tail=3),
        dict(name="huge", sizes=r4["balanced"], tail=6, magnitude=2.0**50),
        dict(name="tiny", sizes=r4["balanced"], tail=6, magnitude=2.0**-30),
        dict(name="tail_nan", sizes=r4["balanced"], tail=16, tail_fill="nan"),
        dict(name="tail_huge", sizes=r4["balanced"], tail=16, tail_fill="huge"),
        dict(name="strided", sizes=r4["skewed"], tail=6, layout="strided"),
        dict(name="fp16", sizes=r4["balanced"], tail=6, dtype="float16"),
        dict(name="fp32", sizes=r4["balanced"], tail=6, dtype="float32"),
    ]
    if not quick:
        r32 = _routings(gen, 4096, 32)
        specs += [
            dict(name="big_balanced", sizes=r32["balanced"], k=512, n=256, tail=64),
            dict(name="big_dirichlet", sizes=r32["dirichlet"], k=256, n=512, tail=17),
            dict(name="sizes_not_128", sizes=(127, 129, 0, 255, 1, 385, 0, 128), k=256, n=256, tail=9),
            dict(name="e128", sizes=_routings(gen, 2048, 128)["skewed"], k=128, n=128, tail=5),
            dict(name="big_sizes_16", sizes=tuple(16 * s for s in _routings(gen, 256, 16)["dirichlet"]), k=256,
                 n=512, tail=32),
        ]
    return specs


def grouped_mm_cases(*, quick: bool = True, forms: tuple[str, ...] = FORMS) -> list[GroupedMMCase]:
    """The battery: every problem in each of ``forms``, deterministic (same sizes and seeds in every run).

    ``quick`` keeps the shapes tiny (M <= 80, K and N in {16, 32, 48}, E <= 8: seconds on a CPU);
    otherwise a few GPU-sized problems (M up to 4096, K and N up to 512, E up to 128) are added.
    """
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        raise ValueError(f"forms: expected a non-empty subset of {FORMS}, got {forms!r}")
    return [GroupedMMCase(form=form, seed=i, **spec) for form in forms for i, spec in enumerate(_specs(quick))]
