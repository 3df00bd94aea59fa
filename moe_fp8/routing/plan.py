"""The dispatch plan: where each (token, slot) pair goes in the expert-sorted activation.

Layout of the permuted activation (``M = num_rows`` rows, a static size):

* pairs are numbered ``p = t * k + j`` (token ``t``, slot ``j``); expert ``e``'s group holds its
  pairs in increasing ``p`` (a STABLE sort by expert), starting at row ``offsets[e-1]``
  (0 for ``e = 0``);
* with ``pad_multiple = P > 1`` each group is followed by zero rows up to a multiple of ``P``
  (what some grouped GEMMs need); ``offsets`` are the PADDED cumulative end offsets, so every
  group, padding included, is a multiple of ``P`` rows;
* ``M = T*k + (P-1)*E``: the static upper bound of the padded total (each group adds at most
  ``P-1`` rows). Rows ``[offsets[-1], M)`` belong to no group; they and the in-group padding
  rows are listed in ``pad_rows`` (exactly ``(P-1)*E`` of them) and are written as zeros by
  the permutes (never read back by the GEMMs or the combine);
* with ``empty_group_rows`` every expert without pairs still gets ``P`` zero rows, at its place in
  expert order, so that the weight gradient's grouped GEMM (``wgrad_offsets``, every group at
  least ``P`` rows) reduces over zero rows instead of over nothing: a library GEMM then writes
  that expert's zero gradient itself (its result for an empty reduction is not trusted). The
  forward and dgrad GEMMs take ``offsets``, where those rows join the next non-empty group (zero
  rows add zero rows to its output) or lie past ``offsets[-1]``, so an empty expert costs them no
  tile. Each expert owns ``P`` padding rows then: ``M = T*k + P*E``.

Pairs whose id lies outside ``[0, E)`` (e.g. -1 for "no expert") are DROPPED, not checked (a
check would sync): they get ``pair_to_row = -1``, join no group and contribute 0 to the combine.
Then ``offsets[-1]`` is smaller and the last ``dropped`` rows past the listed padding rows are
left unwritten by the permutes (they belong to no group).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import valid_offsets
from ..checks import check_tensor
from ..kernel_backend import device_guard, eager_or_custom_op, use_triton
from ..launch import launch, zeroed
from ..launch_math import cdiv, next_power_of_2
from ..quant.kernels.common import multiprocessor_count
from .plan_kernels import SYNC_SLOTS, plan_kernel
from .reference import dispatch_plan_reference

__all__ = ["DispatchPlan", "make_dispatch_plan", "packed_sizes", "padded_num_rows"]


class DispatchPlan(NamedTuple):
    """Where each (token, slot) pair goes; all tensors int32 on the device of ``topk_ids``.

    Attributes:
        counts: ``(E,)`` pairs routed to each expert (unpadded).
        offsets: ``(E,)`` cumulative END offsets of the groups in the permuted rows (padded
            when ``pad_multiple > 1``): the ``offs`` of the grouped GEMMs.
        pair_to_row: ``(T*k,)`` row of pair ``t*k + j`` (-1 if dropped): the combine's gather map.
        row_to_pair: ``(M,)`` pair held by each row, -1 for padding rows: the permute's source
            map (source token ``row_to_pair[r] // k``).
        pad_rows: ``((P-1)*E,)`` every padding row (in-group padding and rows past the groups);
            ``(P*E,)`` with ``empty_group_rows``.
        wgrad_offsets: ``(E,)`` END offsets of the weight gradient's groups over the same rows:
            ``offsets`` itself, or with ``empty_group_rows`` the groups with an empty expert's
            ``P`` zero rows its own (none empty).
        top_k: ``k``.
        pad_multiple: ``P``.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    pair_to_row: torch.Tensor
    row_to_pair: torch.Tensor
    pad_rows: torch.Tensor
    wgrad_offsets: torch.Tensor
    top_k: int
    pad_multiple: int

    @property
    def num_rows(self) -> int:
        """``M``: rows of the permuted activation (static)."""
        return self.row_to_pair.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.pair_to_row.shape[0] // self.top_k

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]


def padded_num_rows(num_pairs: int, num_experts: int, pad_multiple: int = 1, empty_group_rows: bool = False) -> int:
    """Static row count of the permuted activation: ``num_pairs + (pad_multiple - 1) * num_experts``,
    or ``num_pairs + pad_multiple * num_experts`` with ``empty_group_rows``."""
    return num_pairs + _own_rows(pad_multiple, empty_group_rows) * num_experts


def _own_rows(pad_multiple: int, empty_group_rows: bool) -> int:
    """Padding rows each expert owns (its group's tail, then its share of the rows past the groups)."""
    return pad_multiple - 1 + int(empty_group_rows)


def _block_size(e_pow2: int) -> int:
    """Pairs per step of a program: keeps the (pairs x experts) one-hot tile near 8K elements."""
    return max(16, min(128, 8192 // e_pow2))


_SCAN = 1024  # chunks per step of an expert's scan (tests shrink it to exercise the carry)
_CHUNKS_PER_SM = 8  # chunks of pairs per multiprocessor, at most: programs enough to hide latency


def make_dispatch_plan(topk_ids: torch.Tensor, num_experts: int, *, pad_multiple: int = 1,
                       empty_group_rows: bool = False) -> DispatchPlan:
    """Build the :class:`DispatchPlan` on the device of ``topk_ids`` (no host sync, static sizes).

    Args:
        topk_ids: ``(T, k)`` int32/int64 expert ids (``T`` may be 0; ``k >= 1``, also above ``E``
            when slots are dropped, as on a rank of an expert-parallel group). Ids outside
            ``[0, E)`` drop their pair (see the module docstring).
        num_experts: ``E``.
        pad_multiple: ``P``: pad each group to a multiple of ``P`` rows (1: no padding).
        empty_group_rows: give every expert without pairs ``P`` zero rows of its own in the weight
            gradient's groups (``wgrad_offsets``; see the module docstring).
    Returns:
        the plan; ``plan.num_rows == T*k + (P-1)*E`` (``T*k + P*E`` with ``empty_group_rows``).
        Its tensors are views of one int32 buffer (one allocation), each starting 16-byte aligned.
    """
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"pad_multiple: expected a positive int, got {pad_multiple!r}")
    if not isinstance(empty_group_rows, bool):
        raise TypeError(f"empty_group_rows: expected a bool, got {type(empty_group_rows).__name__}")
    T, k = topk_ids.shape
    if k < 1:
        raise ValueError(f"topk_ids: expected at least one column, got shape {(T, k)}")
    packed = _build_plan(topk_ids.contiguous(), num_experts, pad_multiple, empty_group_rows)
    offsets, _, counts, _, pair_to_row, _, row_to_pair, _, pad_rows, _, wgrad_offsets, _ = packed.split_with_sizes(
        packed_sizes(num_experts, T * k, pad_multiple, empty_group_rows))
    M = row_to_pair.shape[0]
    offsets = valid_offsets.mark_valid(offsets, M)
    wgrad_offsets = valid_offsets.mark_valid(wgrad_offsets, M) if empty_group_rows else offsets
    return DispatchPlan(counts, offsets, pair_to_row, row_to_pair, pad_rows, wgrad_offsets, k, pad_multiple)


def packed_sizes(num_experts: int, num_pairs: int, pad_multiple: int, empty_group_rows: bool = False) -> list[int]:
    """Lengths of the pieces of the packed plan buffer, each output followed by the gap that makes
    the next one start at a multiple of 4 int32 (16 bytes): ``offsets (E)``, ``counts (E)``,
    ``pair_to_row (N)``, ``row_to_pair (M)``, ``pad_rows (R*E)``, ``wgrad_offsets`` (``E`` with
    ``empty_group_rows``, else empty), with ``N = T*k``, ``M`` the padded row count and ``R`` the
    padding rows each expert owns."""
    pieces = (num_experts, num_experts, num_pairs,
              padded_num_rows(num_pairs, num_experts, pad_multiple, empty_group_rows),
              _own_rows(pad_multiple, empty_group_rows) * num_experts, num_experts if empty_group_rows else 0)
    return [n for piece in pieces for n in (piece, -piece % 4)]


def _plan(ids: torch.Tensor, num_experts: int, pad_multiple: int, empty_group_rows: bool) -> torch.Tensor:
    """The packed int32 plan buffer (see :func:`packed_sizes`) for contiguous ``ids (T, k)``."""
    T, k = ids.shape
    E, P, Z = num_experts, pad_multiple, empty_group_rows
    sizes = packed_sizes(E, T * k, P, Z)
    if not use_triton(plan_kernel, ids):
        counts, offsets, pair_to_row, row_to_pair, pad_rows, wgrad_offsets = dispatch_plan_reference(ids, E, P, Z)
        pieces = (offsets, counts, pair_to_row, row_to_pair, pad_rows, wgrad_offsets[:E if Z else 0])
        return torch.cat([t for piece, gap in zip(pieces, sizes[1::2]) for t in (piece, piece.new_zeros(gap))])

    N = T * k
    M = padded_num_rows(N, E, P, Z)
    own = _own_rows(P, Z)
    e_pow2 = next_power_of_2(E)
    block = _block_size(e_pow2)
    dev = ids.device
    # one chunk per program, a multiple of `block` pairs, at most _CHUNKS_PER_SM per multiprocessor
    max_chunks = _CHUNKS_PER_SM * multiprocessor_count(dev)
    chunk = cdiv(cdiv(max(N, 1), max_chunks), block) * block
    num_chunks = cdiv(max(N, 1), chunk)
    scratch = zeroed(SYNC_SLOTS.value + E * num_chunks + E, torch.int32, dev)
    packed = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
    with device_guard(ids):
        launch(plan_kernel)[(num_chunks,)](
            ids, scratch, packed, N, M, num_chunks, chunk, cdiv(M, num_chunks),
            E=E, E_POW2=e_pow2, BLOCK=block, SCAN=_SCAN,
            PAD=P, OWN=own, OWN_POW2=next_power_of_2(max(own, 1)), EMPTY_ROWS=Z,
        )
    return packed


# Under torch.compile the plan is a triton_op (with a fake kernel, static output shape): traced to its
# Triton launch; eagerly a plain call. It returns the one packed buffer
# (a custom op's outputs may not alias each other), which make_dispatch_plan splits into views.
_plan_op = torch.library.triton_op("moe_fp8::routing_dispatch_plan", _plan, mutates_args=())
_build_plan = eager_or_custom_op(_plan_op, _plan)


@_plan_op.register_fake
def _(ids, num_experts, pad_multiple, empty_group_rows):
    return ids.new_empty(sum(packed_sizes(num_experts, ids.shape[0] * ids.shape[1], pad_multiple, empty_group_rows)),
                         dtype=torch.int32)
