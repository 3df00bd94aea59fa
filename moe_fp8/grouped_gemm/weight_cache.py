"""``Fp8WeightCache``: quantized expert weights reused while the weights have not changed.

Under gradient accumulation the same weights are quantized once per micro-batch; with a cache
they are quantized once per optimizer step. An entry is served only while it provably belongs
to the same tensor in the same state:

* the tensor object is the one quantized (a weak reference: a new tensor that happens to reuse
  the freed memory never hits); for a view (``p.transpose(1, 2)``, made anew on every call of a
  module that stores its weights transposed) the view's base, with the view's shape, strides and
  offset;
* its ``data_ptr()`` is unchanged;
* its version counter ``_version`` is unchanged: every in-place update through the tensor or any
  view of it (views share the counter) bumps it: ``p.add_()``, ``p.copy_()`` under ``no_grad``, and
  every ``torch.optim`` step of a parameter with a gradient, through a step pre-hook
  (``moe_fp8.optimizer_steps``), since fused and foreach optimizer kernels (``AdamW(fused=True)``)
  write parameters without bumping it.

While a CUDA graph is being captured the cache is bypassed: neither read nor filled. A hit would
freeze the FP8 copy into the graph (replays after a weight update would use the old weights, and
read freed memory once the entry is replaced), and a miss would fill the cache with the graph's
memory. So a captured step quantizes the weights inside the graph, on every replay, and replays
see every in-place weight update; ``fp8_grouped_mm`` then takes its uncached path (no FP8 copy of
a parameter kept from forward to backward). Under ``torch.compile`` the GEMMs read one process-wide
cache inside opaque ops (``compiled_cache``).

Parameters sharded by FSDP2 (``fully_shard``): the module sees the unsharded parameter, one
tensor object whose storage FSDP frees after use and fills again by each all-gather with its
version counter left unchanged, so neither its version nor its address tells an optimizer step of
the sharded parameter apart. The owner then sets :attr:`Fp8WeightCache.source_stamp` to a value
that changes whenever the tensors the weights are gathered from change (the sharded parameters'
identities and version counters; ``moe_fp8.parallel.parallelize`` does it in a forward pre-hook):
while it is set an entry is served only under the stamp it was made with, whatever the address
(the same values gathered again hit), and :meth:`refresh` leaves such entries alone (the unsharded
storage is gone after the step; the next forward quantizes).

Entries made under ``torch.inference_mode`` hold inference tensors, which autograd cannot save:
they are served only under inference mode, and a forward outside it misses (and replaces them).
Weights that are inference tensors themselves (made under inference mode) are never cached.

Limitations: writes through ``p.data`` (a separate version counter, by PyTorch's design) are
invisible; code that updates weights that way must call :meth:`Fp8WeightCache.invalidate`.

Weights cast for the GEMM (fp32 parameters under ``torch.autocast``, or on a backend that takes
bf16 only): ``p.to(bfloat16)`` would be a new tensor on every call and never hit. Pass
``cache.stand_in(p, torch.bfloat16)`` instead: the entry is keyed on ``p`` itself (with the
target dtype) and the cast happens inside the quantization, on a miss only, so a hit never casts.
The cached FP8 copies take as much memory as one BF16 copy of the weights.

What is kept (:meth:`Fp8WeightCache.serve`, the lookup of the layers' forwards): a copy is kept
only where it will be read again, so that a training step without gradient accumulation costs no
memory over no cache at all:

* a forward with gradients enabled keeps the copies when this state of the weight has already
  served one (a second micro-batch), or when its previous state served two or more (gradient
  accumulation: from the first micro-batch of each optimizer step on), or served none and was
  kept at once itself (a copy :meth:`Fp8WeightCache.refresh` or :meth:`Fp8WeightCache.put` made,
  overwritten before any forward);
* a forward without gradients (evaluation, generation) keeps them from its second forward of the
  same state on; a later forward with gradients that the first rule does not cover drops them;
* a forward the autograd engine runs (activation checkpointing's recomputation in the backward)
  reads a valid copy but counts nothing and keeps nothing.

A forward that keeps nothing quantizes on its own, as without a cache, and the record of the
weight's state (a few integers, and under ``torch.compile`` the dgrad layout's amax for the
backward) drops any stale copies at once. :meth:`Fp8WeightCache.get` always keeps.

After an optimizer step, :meth:`Fp8WeightCache.refresh` quantizes every weight the cache has seen
whose tensor changed (with the settings it was quantized with), and :meth:`Fp8WeightCache.put`
stores copies made elsewhere (a fused optimizer kernel): either way the entry is keyed on the
tensor's state now, so the next forward hits and any later in-place write misses
(``moe_fp8.optim``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from .. import optimizer_steps  # noqa: F401  (registers the step pre-hook the entries rely on)

__all__ = ["Fp8WeightCache"]

Quantized = tuple[torch.Tensor, ...]


@dataclass
class _Entry:
    ref: weakref.ref
    data_ptr: int
    version: int
    stamp: Hashable
    value: Quantized
    quantize: Callable[[torch.Tensor], Quantized] | None
    inference: bool = False
    uses: int = 0  # forwards with gradients this state served (``serve``)
    evals: int = 0  # forwards without gradients this state served
    reused: bool = False  # its copies are kept from the first forward with gradients on
    aux: Quantized = ()  # what a forward that kept nothing leaves for its backward


def _quantized(w: torch.Tensor, dtype: torch.dtype, quantize: Callable[[torch.Tensor], Quantized]) -> Quantized:
    """``quantize`` of ``w`` cast to ``dtype``, outside autograd."""
    with torch.no_grad():
        return tuple(quantize(w.detach().to(dtype)))


class _StandIn(torch.autograd.Function):
    """``apply(w, dtype)``: an UNINITIALISED tensor of ``w``'s shape and strides in ``dtype``, whose
    gradient flows back to ``w`` cast to ``w``'s dtype (see :meth:`Fp8WeightCache.stand_in`)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.w_dtype = w.dtype
        return torch.empty_strided(w.shape, w.stride(), dtype=dtype, device=w.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.w_dtype), None


def _dropper(cache_ref: weakref.ref, slot: tuple) -> Callable:
    """Weakref callback: drop ``slot``'s entry (and its FP8 copies) when its tensor dies."""

    def drop(dead_ref: weakref.ref) -> None:
        cache = cache_ref()
        if cache is not None and slot in cache._entries and cache._entries[slot].ref is dead_ref:
            del cache._entries[slot]

    return drop


class Fp8WeightCache:
    """Cache of quantized weights, keyed by tensor and quantization settings.

    Pass one to ``fp8_grouped_mm(..., weight_cache=cache)`` (or share one per module); ``hits``
    and ``misses`` count lookups. ``copies=False``: an amax-only cache, which keeps no FP8 copy but
    weight states' amaxes over K and over N (4 bytes per row and per column; kept by the rules of
    :meth:`serve`), from which ``rowwise`` GEMMs that quantize the weight inside (small groups: the
    backend's ``quantizes_w_in_gemm``) read the BF16 weight in forward and dgrad; other GEMMs, and
    forwards that keep nothing, run as without a cache.
    """

    def __init__(self, copies: bool = True) -> None:
        #: whether FP8 copies of the weights are kept (``False``: amaxes only)
        self.copies = bool(copies)
        self._entries: dict[tuple, _Entry] = {}
        self.hits = 0
        self.misses = 0
        #: ``None``, or the state of the tensors the cached weights are gathered from (see the module docstring)
        self.source_stamp: Hashable = None

    def __reduce__(self):
        """A copy (``copy.deepcopy``) or a pickle (``torch.save`` of a whole module) starts empty: the
        entries are derived from tensors of this process, keyed on their identities."""
        return type(self), (self.copies,)

    def stand_in(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``w`` in ``dtype`` for ``fp8_grouped_mm(..., weight_cache=self)`` with an FP8 recipe,
        without casting it.

        Returns a differentiable stand-in of ``w``'s shape and strides (an allocation, never
        written): :meth:`get` quantizes ``w.to(dtype)`` (on a miss only) and keys the entry on
        ``w``, whose version counter invalidates it; gradients flow back to ``w`` in ``w``'s
        dtype. Its VALUES are garbage: pass it only where the weight is read through this cache
        (``fp8_grouped_mm`` with an FP8 recipe), not to the ``bf16`` recipe or without the cache.
        Returns ``w`` itself when it already has ``dtype``.
        """
        if w.dtype == dtype:
            return w
        out = _StandIn.apply(w, dtype)
        out._fp8_cache_source = w
        return out

    @staticmethod
    def bypassed(w: torch.Tensor) -> bool:
        """True while a CUDA graph is being captured on the current stream of ``w``'s (CUDA) device:
        the cache is then neither read nor filled (see the module docstring)."""
        return w.is_cuda and torch.cuda.is_current_stream_capturing()

    @staticmethod
    def values(w: torch.Tensor) -> torch.Tensor:
        """``w`` itself, or for a :meth:`stand_in` its source cast to the stand-in's dtype
        (differentiable): what to quantize where the cache is bypassed."""
        src = getattr(w, "_fp8_cache_source", None)
        return w if src is None else src.to(w.dtype)

    def get(self, w: torch.Tensor, key: Hashable, quantize: Callable[[torch.Tensor], Quantized]) -> Quantized:
        """The quantized ``w`` for settings ``key``: cached if still valid, else ``quantize(w)``, kept.

        For a :meth:`stand_in` of ``src``: the entry of ``src`` in ``w``'s dtype, else
        ``quantize(src.to(w.dtype))``. During a CUDA graph capture, or for a ``w`` that is an
        inference tensor: ``quantize`` (of ``src``), and nothing stored or counted.
        """
        found = self._find(w, key)
        if found is None:  # see the module docstring
            return _quantized(getattr(w, "_fp8_cache_source", w), w.dtype, quantize)
        w, dtype, anchor, slot, entry = found
        if entry is not None and entry.value and self._valid(entry, anchor, w):
            self.hits += 1
            return entry.value
        self.misses += 1
        value = _quantized(w, dtype, quantize)
        self._store(anchor, w, slot, value, quantize, reused=True)
        return value

    def serve(self, w: torch.Tensor, key: Hashable, quantize: Callable[[torch.Tensor], Quantized],
              training: bool) -> Quantized | None:
        """A forward's lookup: the quantized ``w`` for settings ``key`` where the module docstring's
        rules keep it (a valid entry, or ``quantize(w)`` stored), else ``None``: the caller quantizes
        ``w`` itself (:meth:`values` of a :meth:`stand_in`) and the state is only recorded.
        ``training``: the forward runs with gradients enabled (decided where the module is called:
        inside an autograd function, and in a compiled graph, they are off). ``None`` too while a
        CUDA graph is captured and for inference tensors, with nothing recorded."""
        found = self._find(w, key)
        if found is None:
            return None
        w, dtype, anchor, slot, entry = found
        same = entry is not None and self._same_state(entry, anchor, w)
        if torch._C._current_graph_task_id() != -1:  # run by the autograd engine: a recomputation
            if same and entry.value and self._valid(entry, anchor, w):
                self.hits += 1
                return entry.value
            return None
        if same:
            uses, evals, reused = entry.uses, entry.evals, entry.reused
        else:  # a new state: kept at once where the previous one served two forwards with gradients
            uses = evals = 0  # (or served none and was itself kept at once: made by refresh or put)
            reused = (entry is not None and entry.ref() is anchor
                      and (entry.uses >= 2 or (entry.uses == 0 and entry.reused)))
        if training:
            keep, uses = uses >= 1 or reused, uses + 1
        else:
            keep, evals = evals >= 1 or (same and bool(entry.value)), evals + 1
        if keep and same and entry.value and self._valid(entry, anchor, w):
            entry.uses, entry.evals = uses, evals
            self.hits += 1
            return entry.value
        self.misses += 1
        value = _quantized(w, dtype, quantize) if keep else ()
        self._store(anchor, w, slot, value, quantize, uses=uses, evals=evals, reused=reused)
        return value or None

    def held(self, w: torch.Tensor, key: Hashable) -> tuple[Quantized, Quantized]:
        """``(value, aux)`` of ``w``'s entry for settings ``key`` in its current state (each ``()``
        where there is none): the backward's read of what its forward kept (:meth:`serve`) or left
        (:meth:`leave`). A value read counts as a hit."""
        found = self._find(w, key)
        if found is None:
            return (), ()
        w, _, anchor, _, entry = found
        if entry is None or not self._valid(entry, anchor, w):
            return (), ()
        self.hits += bool(entry.value)
        return entry.value, entry.aux

    def leave(self, w: torch.Tensor, key: Hashable, aux: Quantized) -> None:
        """Attach ``aux`` (small tensors a forward that kept nothing made for its backward) to the
        record of ``w``'s current state for settings ``key``; nothing happens without one."""
        found = self._find(w, key)
        if found is not None:
            w, _, anchor, _, entry = found
            if entry is not None and self._valid(entry, anchor, w):
                entry.aux = tuple(aux)

    def keys(self, w: torch.Tensor) -> list[tuple[torch.dtype, Hashable]]:
        """The ``(dtype, key)`` pairs the cache has seen ``w`` (this very view of its base, in any
        state) quantized with, copies kept or not: the settings the GEMMs quantize it with."""
        anchor = w if w._base is None else w._base
        geometry = (tuple(w.shape), w.stride(), w.storage_offset())
        return [(slot[1], slot[5]) for slot, e in self._entries.items()
                if slot[0] == id(anchor) and e.ref() is anchor and slot[2:5] == geometry]

    def put(self, w: torch.Tensor, dtype: torch.dtype, key: Hashable, value: Quantized) -> None:
        """Store ``value`` as the quantization of ``w`` (its state now) cast to ``dtype`` for settings
        ``key``: what :meth:`get` would return on a miss, made elsewhere. Trusted, not checked. The
        entry keeps the quantizer of the entry it replaces, if any, for :meth:`refresh`."""
        anchor, slot = self._slot(w, dtype, key)
        old = self._entries.get(slot)
        quantize = old.quantize if old is not None and old.ref() is anchor else None
        self._store(anchor, w, slot, tuple(value), quantize, reused=True)

    def refresh(self, of: list[torch.Tensor] | None = None) -> int:
        """Quantize every weight seen whose tensor is alive and changed since, with the settings it was
        quantized with, and keep the copies (call after the weights' in-place update, e.g.
        ``optimizer.step()``); skipped while a CUDA graph is captured. ``of``: only the entries of
        these tensors (of them or of views of them; ``None``: all). Returns how many entries were
        re-quantized."""
        ids = None if of is None else {id(t if t._base is None else t._base) for t in of}
        done = 0
        for slot, entry in list(self._entries.items()):
            anchor = entry.ref()
            if anchor is None or entry.quantize is None or entry.stamp is not None or self.bypassed(anchor):
                continue
            if ids is not None and slot[0] not in ids:
                continue
            with torch.no_grad():
                w = anchor.detach().as_strided(slot[2], slot[3], slot[4])
                if self._valid(entry, anchor, w):
                    continue
                entry.value = entry.aux = ()  # free the stale copies before making the new ones
                value = tuple(entry.quantize(w.to(slot[1])))
            self._store(anchor, w, slot, value, entry.quantize, reused=True)
            done += 1
        return done

    def _find(self, w: torch.Tensor, key: Hashable) -> tuple | None:
        """``(w, dtype, anchor, slot, entry)`` for a lookup of ``w`` (its source, for a :meth:`stand_in`,
        with the stand-in's dtype) under settings ``key`` (``entry``: ``None`` where there is none), or
        ``None`` where the cache is not used: during a CUDA graph capture, for an inference tensor."""
        dtype = w.dtype
        w = getattr(w, "_fp8_cache_source", w)
        if self.bypassed(w) or w.is_inference():
            return None
        anchor, slot = self._slot(w, dtype, key)
        return w, dtype, anchor, slot, self._entries.get(slot)

    @staticmethod
    def _slot(w: torch.Tensor, dtype: torch.dtype, key: Hashable) -> tuple[torch.Tensor, tuple]:
        anchor = w if w._base is None else w._base
        return anchor, (id(anchor), dtype, tuple(w.shape), w.stride(), w.storage_offset(), key)

    def _same_state(self, entry: _Entry, anchor: torch.Tensor, w: torch.Tensor) -> bool:
        """``entry`` was made from ``w`` (through ``anchor``) in the state it is in now."""
        if entry.ref() is not anchor or entry.version != w._version or entry.stamp != self.source_stamp:
            return False
        return entry.stamp is not None or entry.data_ptr == w.data_ptr()

    def _valid(self, entry: _Entry, anchor: torch.Tensor, w: torch.Tensor) -> bool:
        """``entry`` may be served here: made from ``w``'s current state, and not made under inference
        mode unless that is on."""
        if entry.inference and not torch.is_inference_mode_enabled():
            return False
        return self._same_state(entry, anchor, w)

    def _store(self, anchor: torch.Tensor, w: torch.Tensor, slot: tuple, value: Quantized, quantize, *,
               uses: int = 0, evals: int = 0, reused: bool = False) -> None:
        ref = weakref.ref(anchor, _dropper(weakref.ref(self), slot))
        self._entries[slot] = _Entry(ref, w.data_ptr(), w._version, self.source_stamp, value, quantize,
                                     any(t.is_inference() for t in value), uses, evals, reused)

    def invalidate(self) -> None:
        """Drop every entry (after writing weights through ``.data``)."""
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        """Device bytes held by the cached FP8 copies and their scales (and the records' amaxes)."""
        return sum(t.numel() * t.element_size() for e in self._entries.values() for t in (*e.value, *e.aux))

    def nbytes_of(self, tensors: list[torch.Tensor]) -> int:
        """Device bytes held by the entries of ``tensors`` (of them or of any view of them)."""
        ids = {id(t) for t in tensors}
        return sum(t.numel() * t.element_size() for slot, e in self._entries.items()
                   if slot[0] in ids and e.ref() is not None and id(e.ref()) == slot[0] for t in (*e.value, *e.aux))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Fp8WeightCache(copies={self.copies}, entries={len(self)}, hits={self.hits}, misses={self.misses})"
