"""Triton kernels of the dispatch plan: a stable counting sort of the (token, slot) pairs by expert.

Two launches, no atomics, no host sync, every size static:

1. ``plan_count_kernel`` (one program per block of ``BLOCK`` pairs, walked in sub-blocks of
   ``SUB``): the block's per-expert counts (stored expert-major, ``(E, num_blocks)``) and each
   pair's rank among the pairs of the same expert earlier in the block (a cumulative sum of the
   sub-block's one-hot ``(SUB, E)`` tile plus the counts carried from earlier sub-blocks). It also
   fills its share of ``row_to_pair`` with -1 (the value of padding rows), so no separate fill runs.
2. ``plan_rows_kernel`` (one program per block): every expert's total and the pairs of earlier
   blocks (sums over the ``(E, num_blocks)`` counts, read ``NB_CHUNK`` blocks at a time), group
   starts from the totals (padded to ``PAD``), then ``row = group start + earlier blocks + rank``
   for every pair, written to both maps; program 0 also writes counts, offsets and the list of
   padding rows.

The block size is chosen so that there are at most a few hundred blocks: the second kernel's sums
cost ``E * num_blocks`` reads per program.

Pairs whose expert id lies outside ``[0, E)`` are dropped: they get row -1 and no group.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["plan_count_kernel", "plan_rows_kernel"]


@triton.jit
def _load_ids(ids_ptr, pairs, num_pairs, E: tl.constexpr):
    """Expert ids of ``pairs`` as int32, -1 for pairs out of range or with an invalid id."""
    in_range = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < E)
    return tl.where(valid, ids, -1).to(tl.int32), valid, in_range


@triton.jit
def plan_count_kernel(
    ids_ptr, block_counts_ptr, rank_ptr, row_to_pair_ptr, num_pairs, num_blocks, num_rows, fill_rows,
    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
):
    b = tl.program_id(0)
    lanes = tl.arange(0, SUB)
    first = b * fill_rows  # rows [first, first + fill_rows) of row_to_pair start as -1
    for r in range(first, first + fill_rows, SUB):
        rows = r + lanes
        tl.store(row_to_pair_ptr + rows, tl.full([SUB], -1, tl.int32), mask=(rows < num_rows) & (rows < first + fill_rows))
    experts = tl.arange(0, E_POW2)
    seen = tl.zeros([E_POW2], dtype=tl.int32)  # pairs of each expert in earlier sub-blocks
    for s in range(0, BLOCK, SUB):
        pairs = b * BLOCK + s + lanes
        ids, valid, in_range = _load_ids(ids_ptr, pairs, num_pairs, E)
        hot = ids[:, None] == experts[None, :]  # invalid ids (-1) match no expert
        upto = tl.cumsum(hot.to(tl.int32), axis=0)  # pairs of the same expert up to this one
        rank = tl.sum(tl.where(hot, upto - 1 + seen[None, :], 0), axis=1)
        tl.store(rank_ptr + pairs, rank, mask=in_range)
        seen += tl.sum(hot.to(tl.int32), axis=0)
    tl.store(block_counts_ptr + experts * num_blocks + b, seen, mask=experts < E)


@triton.jit
def plan_rows_kernel(
    ids_ptr, rank_ptr, block_counts_ptr,
    counts_ptr, offsets_ptr, pair_to_row_ptr, row_to_pair_ptr, pad_rows_ptr,
    num_pairs, num_blocks,
    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, NB_CHUNK: tl.constexpr,
    PAD: tl.constexpr, PAD_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    emask = experts < E
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    earlier = tl.zeros([E_POW2], dtype=tl.int32)  # pairs of each expert in blocks before b
    for c in range(0, num_blocks, NB_CHUNK):
        blocks = c + tl.arange(0, NB_CHUNK)
        tile = tl.load(block_counts_ptr + experts[:, None] * num_blocks + blocks[None, :],
                       mask=emask[:, None] & (blocks < num_blocks)[None, :], other=0)
        counts += tl.sum(tile, axis=1)
        earlier += tl.sum(tl.where((blocks < b)[None, :], tile, 0), axis=1)
    padded = (counts + (PAD - 1)) // PAD * PAD
    group_end = tl.cumsum(padded, axis=0)
    group_start = group_end - padded
    base = group_start + earlier

    lanes = tl.arange(0, SUB)
    for s in range(0, BLOCK, SUB):
        pairs = b * BLOCK + s + lanes
        ids, valid, in_range = _load_ids(ids_ptr, pairs, num_pairs, E)
        start = tl.sum(tl.where(ids[:, None] == experts[None, :], base[None, :], 0), axis=1)
        rank = tl.load(rank_ptr + pairs, mask=valid, other=0)
        row = start + rank
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
