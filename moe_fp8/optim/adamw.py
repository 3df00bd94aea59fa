"""``AdamWQuantize``: ``torch.optim.AdamW`` whose step also writes the FP8 copies of the expert weights.

The expert weights of ``FP8GroupedExperts`` (``nn.Linear`` layout, contiguous, a recipe with row
scales) take :func:`.adamw_quantize.adamw_quantize`: the update and the forward-layout FP8 copy in
one pass, the dgrad layout from one more read, stored in the module's weight cache (the compiled
cache, after a compiled forward) under the settings the last forward used (an entry exists once a
forward ran; before, the update alone).
Every other parameter takes ``torch.optim.AdamW`` itself, and after the step every other stale
cache entry is re-quantized (:func:`.after_step.refresh_weight_caches`).

State: the fused weights keep torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``), with moments in
``state_dtype`` (fp32 by default, or bf16) whatever the parameter dtype (torch keeps them in the
parameter's dtype); the update runs in fp32 and rounds the weight and moments once.
``load_state_dict`` loads them in ``state_dtype`` (torch's rule would cast them to the parameter's
dtype), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ..grouped_gemm.compiled_cache import compiled_weight_cache
from .adamw_kernel import adamw_fits
from .adamw_quantize import PARAM_DTYPES, STATE_DTYPES, adamw_hyper, adamw_quantize
from .after_step import cached_experts, refresh_weight_caches

__all__ = ["AdamWQuantize"]

_UNFUSED_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable")


class AdamWQuantize(torch.optim.AdamW):
    """``torch.optim.AdamW(params, ...)`` that fills ``model``'s FP8 expert-weight caches in its step.

    Args:
        params: as ``torch.optim.AdamW`` (parameters or groups); the expert weights among them are fused.
        model: the module holding the ``FP8GroupedExperts`` (``ValueError`` without any, or for one
            built with ``cache_weights=False``).
        state_dtype: the fused weights' moments, ``torch.float32`` (default) or ``torch.bfloat16``.
        **kwargs: ``torch.optim.AdamW``'s options. Groups with ``amsgrad``, ``maximize``,
            ``capturable`` or ``differentiable`` take torch's step for every parameter.
    """

    def __init__(self, params, model: nn.Module, *, state_dtype: torch.dtype = torch.float32, **kwargs) -> None:
        if state_dtype not in STATE_DTYPES:
            raise TypeError(f"state_dtype: expected one of {STATE_DTYPES}, got {state_dtype}")
        super().__init__(params, **kwargs)
        self._state_dtype = state_dtype
        self._experts = cached_experts(model)
        self._fusable = {}
        for m in self._experts:
            if m.recipe.scaling != "rowwise" or m.in_out_layout:
                continue
            for p, cache in ((m.gate_up_proj, m._caches[0]), (m.down_proj, m._caches[1])):
                if p.dtype in PARAM_DTYPES and p.is_contiguous() and adamw_fits(p.shape[2]):
                    self._fusable[p] = cache

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.AdamW.load_state_dict``, with the fused weights' moments kept in ``state_dtype``."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if p in self._fusable and i in saved:
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in saved[i]:
                        self.state[p][k] = saved[i][k].to(p.device, self._state_dtype, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = []
        for group in self.param_groups:
            if any(group.get(k) for k in _UNFUSED_OPTIONS):
                continue
            for p in group["params"]:
                if p.grad is None or p not in self._fusable or p.grad.is_sparse or p.grad.dtype != p.dtype:
                    continue
                self._fused_step(p, group)
                hidden.append((p, p.grad))
                p.grad = None
        try:
            super().step()
        finally:
            for p, g in hidden:
                p.grad = g
        refresh_weight_caches(self._experts)
        return loss

    def _fused_step(self, p: nn.Parameter, group: dict) -> None:
        state, dtype = self.state[p], self._state_dtype
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        for k in ("exp_avg", "exp_avg_sq"):
            if state[k].dtype != dtype or not state[k].is_contiguous():
                state[k] = state[k].to(dtype, memory_format=torch.contiguous_format)
        state["step"] += 1
        hyper = adamw_hyper(step=int(state["step"].item()), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])
        # the module's cache after an eager forward, the compiled cache after a compiled one
        cache, target = next(((c, (dtype, key)) for c in (self._fusable[p], compiled_weight_cache())
                              for dtype, key in c.keys(p) if key[0] == "rowwise" and dtype in (p.dtype, torch.bfloat16)),
                             (None, None))
        grad = p.grad.contiguous()
        if target is None:  # no forward has run yet: nothing says how the GEMMs quantize
            adamw_quantize(p, grad, state["exp_avg"], state["exp_avg_sq"], hyper, quantize=False)
            return
        dtype, key = target
        _, fmt, pow2, _ = key
        value = adamw_quantize(p, grad, state["exp_avg"], state["exp_avg_sq"], hyper, fmt=fmt, pow2=pow2,
                               quant_dtype=dtype)
        cache.put(p, dtype, key, value)
