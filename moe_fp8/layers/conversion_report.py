"""``ConversionReport``: what a whole-model conversion did to each module, and why.

``moe_fp8.hf.convert`` and ``convert_to_fp8`` attach one to the model they return, as
``model.fp8_conversion_report``. Each entry is one module the converter looked at: MoE experts,
dense ``nn.Linear`` layers, routers and embeddings. Parameters are counted once each (a tied
``lm_head`` shares the embedding's weight); the FP8 fraction is over the matmul parameters
(experts, linears, routers, ``lm_head``), embeddings excluded.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from torch import nn

__all__ = ["BECAME", "ConversionReport", "ModuleConversion", "REASONS"]

FP8_EXPERTS, BF16_EXPERTS, FP8_LINEAR, KEPT = "fp8 experts", "bf16 experts", "FP8Linear", "kept"
BECAME = (FP8_EXPERTS, BF16_EXPERTS, FP8_LINEAR, KEPT)

ROUTER, EMBEDDING, LM_HEAD = "router", "embedding", "lm_head"
NOT_MULTIPLE_OF_16, BELOW_MIN_SIZE, FILTER_FN = "not a multiple of 16", "below min_dense_size", "filter_fn"
NOT_PLAIN_LINEAR, DENSE_OFF, BF16_RECIPE = "not a plain nn.Linear", "dense=False", "recipe bf16"
BELOW_MIN_EXPERT_SIZE = "below min_expert_size"
#: not a reason to keep a module: FP8 experts whose weight gradient runs in BF16 (named in the detail)
BELOW_MIN_FP8_WGRAD_SIZE = "below min_fp8_wgrad_size"
REASONS = (ROUTER, EMBEDDING, LM_HEAD, NOT_MULTIPLE_OF_16, BELOW_MIN_SIZE, FILTER_FN, NOT_PLAIN_LINEAR, DENSE_OFF,
           BF16_RECIPE, BELOW_MIN_EXPERT_SIZE)


@dataclass(frozen=True)
class ModuleConversion:
    """One module: its fully qualified name (``""`` for the root), original class, what it became
    (one of ``BECAME``), why it was kept (one of ``REASONS``, ``None`` unless kept), a detail
    (shapes, the recipe), whether its matmuls run in FP8 (an ``FP8Linear`` with recipe ``bf16``
    does not), its parameters (the objects, for counting each once), the bytes of its weights' FP8
    layouts (``weight_layouts_nbytes``; 0 unless FP8) and those its weight cache holds once filled
    (the same bytes; 0 without a cache)."""

    fqn: str
    cls: str
    became: str
    reason: str | None
    detail: str
    fp8: bool
    params: tuple[nn.Parameter, ...] = field(repr=False, compare=False)
    weight_cache_nbytes: int = 0
    weight_layouts_nbytes: int = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class ConversionReport:
    """The entries of one conversion (model order), with the settings that decided them, and the
    number of supported MoE blocks found (``min_expert_size``, ``min_bf16_expert_size``,
    ``min_fp8_wgrad_size`` and ``moe_blocks`` are ``None`` for ``convert_to_fp8``, which leaves MoE
    blocks alone;
    ``moe_blocks == 0``: a dense model, whose linears alone were converted)."""

    recipe: str
    min_dense_size: int
    min_expert_size: int | None = None
    min_bf16_expert_size: int | None = None
    min_fp8_wgrad_size: int | None = None
    entries: list[ModuleConversion] = field(default_factory=list)
    moe_blocks: int | None = None

    def add(self, fqn: str, module: nn.Module, became: str, reason: str | None = None, detail: str = "",
            cls: str | None = None) -> None:
        """Record ``module`` (after conversion: its replacement; ``cls`` the original class) under ``fqn``."""
        if became not in BECAME or (reason is None) != (became != KEPT) or (reason and reason not in REASONS):
            raise ValueError(f"became/reason: expected one of {BECAME} and, when kept, one of {REASONS}; "
                             f"got {became!r}, {reason!r}")
        recipe = getattr(module, "recipe", None)
        fp8 = became in (FP8_EXPERTS, FP8_LINEAR) and (recipe is None or recipe.is_fp8)
        params = tuple(module.parameters())
        layouts = getattr(module, "weight_layouts_nbytes", 0) if fp8 else 0
        cache = layouts if getattr(module, "cache_weights", False) else 0
        self.entries.append(ModuleConversion(fqn, cls or type(module).__name__, became, reason, detail, fp8, params,
                                             cache, layouts))

    def annotate(self, fqn: str, note: str) -> None:
        """Append ``note`` to the detail of the entry of ``fqn``."""
        for i, e in enumerate(self.entries):
            if e.fqn == fqn:
                self.entries[i] = replace(e, detail=f"{e.detail}; {note}" if e.detail else note)
                return
        raise KeyError(fqn)

    def __getitem__(self, fqn: str) -> ModuleConversion:
        for e in self.entries:
            if e.fqn == fqn:
                return e
        raise KeyError(fqn)

    def counts(self) -> dict[str, int]:
        """Modules per outcome (``BECAME``), and ``"kept: <reason>"`` per reason."""
        c = Counter(e.became for e in self.entries)
        c.update(f"kept: {e.reason}" for e in self.entries if e.reason)
        return dict(c)

    def _unique_numel(self, entries) -> int:
        seen = {}
        for e in entries:
            for p in e.params:
                seen[id(p)] = p.numel()
        return sum(seen.values())

    @property
    def matmul_params(self) -> int:
        """Parameters of experts, linears, routers and ``lm_head`` (embeddings excluded), each once."""
        return self._unique_numel(e for e in self.entries if e.reason != EMBEDDING)

    @property
    def fp8_params(self) -> int:
        """Parameters whose matmuls now run in FP8 (FP8 experts and ``FP8Linear``), each once."""
        return self._unique_numel(e for e in self.entries if e.fp8)

    @property
    def weight_cache_nbytes(self) -> int:
        """Device bytes the FP8 weight caches of the converted modules hold once filled (under gradient
        accumulation, from an optimizer step's first micro-batch to the next step): memory on top of
        the step's peak, which ``cache_weights=False`` (experts) and ``cache_dense_weights=False``
        (linears) avoid."""
        return sum(e.weight_cache_nbytes for e in self.entries)

    @property
    def uncached_layouts_nbytes(self) -> int:
        """Device bytes the FP8 weight caches that are off would hold once filled, if turned on
        (``cache_weights=True`` for experts, ``cache_dense_weights=True`` for linears)."""
        return sum(e.weight_layouts_nbytes - e.weight_cache_nbytes for e in self.entries)

    @property
    def fp8_fraction(self) -> float:
        """``fp8_params / matmul_params`` (0.0 when there are none)."""
        total = self.matmul_params
        return self.fp8_params / total if total else 0.0

    def table(self) -> str:
        """One line per entry: module, class, what it became, why it was kept, detail."""
        rows = [(e.fqn or "<model>", e.cls, e.became, e.reason or "", e.detail) for e in self.entries]
        head = ("module", "class", "became", "kept because", "detail")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = "  ".join("{:<%d}" % w for w in widths)
        return "\n".join(line.format(*r).rstrip() for r in [head, *rows])

    def __str__(self) -> str:
        counts = self.counts()
        why = ", ".join(f"{k[len('kept: '):]} {v}" for k, v in counts.items() if k.startswith("kept: "))
        counts = ", ".join(f"{k} {v}" + (f" ({why})" if k == KEPT else "") for k, v in counts.items()
                           if not k.startswith("kept: "))
        sizes = f"min_dense_size {self.min_dense_size}"
        if self.min_expert_size is not None:
            sizes += (f", min_expert_size {self.min_expert_size}, min_bf16_expert_size {self.min_bf16_expert_size}"
                      f", min_fp8_wgrad_size {self.min_fp8_wgrad_size}")
        no_moe = ["no MoE block found (a dense model): the dense rules alone applied"] if self.moe_blocks == 0 else []
        cache = [f"FP8 weight caches: {_size(self.weight_cache_nbytes)} once filled under gradient "
                 "accumulation, on top of the step's peak"] if self.weight_cache_nbytes else []
        if self.uncached_layouts_nbytes:  # convert_to_fp8 (moe_blocks None) names its linears' flag cache_weights
            flags = ("cache_weights=True" if self.moe_blocks is None
                     else "cache_weights=True (experts) / cache_dense_weights=True (linears)")
            cache.append(f"FP8 weight caches off: {flags} would hold {_size(self.uncached_layouts_nbytes)} more under "
                         "gradient accumulation and quantize each weight once per optimizer step, not per micro-batch")
        return "\n".join([
            f"moe_fp8 conversion (recipe {self.recipe}, {sizes}): {counts}",
            *no_moe,
            f"FP8 parameters: {self.fp8_params:,} of {self.matmul_params:,} matmul parameters "
            f"({100 * self.fp8_fraction:.1f}%)",
            *cache,
            self.table(),
        ])


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB, or in MiB below 0.01 GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 // 100 else f"{nbytes / 2**20:.2f} MiB"
