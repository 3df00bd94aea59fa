"""Triton kernels of the dispatch plan: a stable counting sort of the (token, slot) pairs by expert.

Three launches, no atomics, no host sync, every size static:

1. ``plan_histogram_kernel`` (one program per block of ``BLOCK`` pairs): the block's per-expert
   counts (stored expert-major, ``(E, num_blocks)``) and each pair's rank among the pairs of the
   same expert earlier in the block; it also fills its share of ``row_to_pair`` with -1 (the
   value of padding rows), so no separate fill runs.
2. ``plan_scan_kernel`` (one program per expert): exclusive prefix sum of that expert's block
   counts over the blocks (in place) and the expert's total.
3. ``plan_rows_kernel`` (one program per block): group starts from the totals (padded to
   ``PAD``), then ``row = group_start + earlier blocks + rank in block`` for every pair, written
   to both maps; program 0 also writes counts, offsets and the list of padding rows.

Pairs whose expert id lies outside ``[0, E)`` are dropped: they get row -1 and no group.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["plan_histogram_kernel", "plan_scan_kernel", "plan_rows_kernel"]


@triton.jit
def _load_ids(ids_ptr, pairs, num_pairs, E: tl.constexpr):
    """Expert ids of ``pairs`` as int32, -1 for pairs out of range or with an invalid id."""
    in_range = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < E)
    return tl.where(valid, ids, -1).to(tl.int32), valid, in_range


@triton.jit
def plan_histogram_kernel(
    ids_ptr, block_counts_ptr, rank_ptr, row_to_pair_ptr, num_pairs, num_blocks, num_rows, fill_rows,
    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    first = b * fill_rows  # rows [first, first + fill_rows) of row_to_pair start as -1
    for r in range(first, first + fill_rows, BLOCK):
        rows = r + lanes
        tl.store(row_to_pair_ptr + rows, tl.full([BLOCK], -1, tl.int32), mask=(rows < num_rows) & (rows < first + fill_rows))
    pairs = b * BLOCK + lanes
    ids, valid, in_range = _load_ids(ids_ptr, pairs, num_pairs, E)
    experts = tl.arange(0, E_POW2)
    hist = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + experts * num_blocks + b, hist, mask=experts < E)
    same_earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(same_earlier.to(tl.int32), axis=1)
    tl.store(rank_ptr + pairs, rank, mask=in_range)


@triton.jit
def plan_scan_kernel(block_counts_ptr, totals_ptr, num_blocks, CHUNK: tl.constexpr):
    e = tl.program_id(0)
    row = block_counts_ptr + e * num_blocks
    carry = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)
    for start in range(0, num_blocks, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        m = idx < num_blocks
        c = tl.load(row + idx, mask=m, other=0)
        tl.store(row + idx, carry + tl.cumsum(c, axis=0) - c, mask=m)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + e, carry)


@triton.jit
def plan_rows_kernel(
    ids_ptr, rank_ptr, block_base_ptr, totals_ptr,
    counts_ptr, offsets_ptr, pair_to_row_ptr, row_to_pair_ptr, pad_rows_ptr,
    num_pairs, num_blocks,
    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, PAD: tl.constexpr, PAD_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    emask = experts < E
    counts = tl.load(totals_ptr + experts, mask=emask, other=0)
    padded = (counts + (PAD - 1)) // PAD * PAD
    group_end = tl.cumsum(padded, axis=0)
    group_start = group_end - padded

    pairs = b * BLOCK + tl.arange(0, BLOCK)
    ids, valid, in_range = _load_ids(ids_ptr, pairs, num_pairs, E)
    start = tl.sum(tl.where(ids[:, None] == experts[None, :], group_start[None, :], 0), axis=1)
    earlier = tl.load(block_base_ptr + ids * num_blocks + b, mask=valid, other=0)
    rank = tl.load(rank_ptr + pairs, mask=valid, other=0)
    row = start + earlier + rank
    tl.store(pair_to_row_ptr + pairs, tl.where(valid, row, -1), mask=in_range)
    tl.store(row_to_pair_ptr + row, pairs, mask=valid)

    if b == 0:
        tl.store(counts_ptr + experts, counts, mask=emask)
        tl.store(offsets_ptr + experts, group_end, mask=emask)
        if PAD > 1:
            # Expert e owns PAD-1 padding rows: its own group's tail, then its share of the rows
            # past the last group (shares in expert order tile [group_end[-1], num_rows)).
            own_pad = padded - counts
            pads_before = group_start - (tl.cumsum(counts, axis=0) - counts)
            used = tl.sum(padded, axis=0)
            j = tl.arange(0, PAD_POW2)
            own = (group_start + counts)[:, None] + j[None, :]
            tail = (used + experts * (PAD - 1) - pads_before - own_pad)[:, None] + j[None, :]
            rows = tl.where(j[None, :] < own_pad[:, None], own, tail)
            dst = pad_rows_ptr + experts[:, None] * (PAD - 1) + j[None, :]
            tl.store(dst, rows, mask=emask[:, None] & (j[None, :] < PAD - 1))
