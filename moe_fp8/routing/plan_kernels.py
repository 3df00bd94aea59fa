"""Triton kernel of the dispatch plan: a stable counting sort of the (token, slot) pairs by expert.

One launch, no host sync, every size static. The ``N`` pairs are cut into ``NC`` contiguous
chunks of ``chunk`` pairs (``chunk`` a multiple of ``BLOCK``). Two phases, each handing out the
chunks through an atomic work counter (programs claim chunks until none is left):

1. *count*: chunk ``c``'s per-expert counts, one row of ``part_counts (NC, E_POW2)``; the chunk's
   share of ``row_to_pair`` is set to -1 (the value of padding rows), so no separate fill runs.
   Each counted chunk adds 1 to a *done* counter (a ``release`` atomic after a CTA barrier).
2. *place* (once *done* reaches ``NC``, read with ``acquire``): for chunk ``c``, the expert totals
   (sum of all rows of ``part_counts``) give the padded group starts, the rows before ``c`` give the
   pairs of each expert in earlier chunks; walking the chunk block by block, a pair's row is
   ``group start + pairs of its expert before it``, written to both maps. Whoever places chunk 0
   also writes counts, offsets and the list of padding rows.

The wait cannot deadlock however few programs are resident: a program waits only once every
chunk has been claimed, so the chunks it waits for belong to programs that are already running
(the Triton interpreter, which runs programs one after another, has program 0 do all the work).

Pairs whose expert id lies outside ``[0, E)`` are dropped: they get row -1 and no group.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["plan_kernel"]


@triton.jit
def _load_ids(ids_ptr, pairs, num_pairs, E: tl.constexpr):
    """Expert ids of ``pairs`` as int32, -1 for pairs out of range or with an invalid id."""
    in_range = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < E)
    return tl.where(valid, ids, -1).to(tl.int32), valid, in_range


@triton.jit
def _count_chunk(ids_ptr, part_counts_ptr, row_to_pair_ptr, c, chunk, num_pairs, num_rows, fill_rows,
                 E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``c`` of ``part_counts``: chunk ``c``'s pairs per expert; rows ``[c, c+1) * fill_rows``
    of ``row_to_pair`` set to -1."""
    lanes = tl.arange(0, BLOCK)
    first = c * fill_rows
    for r in range(first, first + fill_rows, BLOCK):
        rows = r + lanes
        tl.store(row_to_pair_ptr + rows, tl.full([BLOCK], -1, tl.int32),
                 mask=(rows < num_rows) & (rows < first + fill_rows))
    experts = tl.arange(0, E_POW2)
    hist = tl.zeros([E_POW2], dtype=tl.int32)
    start = c * chunk
    for p in range(start, start + chunk, BLOCK):
        ids, valid, in_range = _load_ids(ids_ptr, p + lanes, num_pairs, E)
        hist += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(part_counts_ptr + c * E_POW2 + experts, hist)


@triton.jit
def _place_chunk(ids_ptr, part_counts_ptr, counts_ptr, offsets_ptr, pair_to_row_ptr, row_to_pair_ptr, pad_rows_ptr,
                 c, num_chunks, chunk, num_pairs,
                 E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, SUM_ROWS: tl.constexpr,
                 PAD: tl.constexpr, PAD_POW2: tl.constexpr):
    """Rows of chunk ``c``'s pairs (both maps); for ``c == 0`` also counts, offsets and padding rows."""
    experts = tl.arange(0, E_POW2)
    emask = experts < E
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    earlier = tl.zeros([E_POW2], dtype=tl.int32)
    for r in range(0, num_chunks, SUM_ROWS):  # totals, and the part before chunk c
        rows = r + tl.arange(0, SUM_ROWS)
        part = tl.load(part_counts_ptr + rows[:, None] * E_POW2 + experts[None, :],
                       mask=(rows < num_chunks)[:, None], other=0, volatile=True)
        counts += tl.sum(part, axis=0)
        earlier += tl.sum(tl.where((rows < c)[:, None], part, 0), axis=0)
    padded = (counts + (PAD - 1)) // PAD * PAD
    group_end = tl.cumsum(padded, axis=0)
    group_start = group_end - padded

    lanes = tl.arange(0, BLOCK)
    next_row = group_start + earlier  # per expert: the row of its next pair
    start = c * chunk
    for p in range(start, start + chunk, BLOCK):
        pairs = p + lanes
        ids, valid, in_range = _load_ids(ids_ptr, pairs, num_pairs, E)
        hot = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(hot, next_row[None, :], 0), axis=1)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
        row = base + rank
        tl.store(pair_to_row_ptr + pairs, tl.where(valid, row, -1), mask=in_range)
        tl.store(row_to_pair_ptr + row, pairs, mask=valid)
        next_row += tl.sum(hot.to(tl.int32), axis=0)

    if c == 0:
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
            pad_rows = tl.where(j[None, :] < own_pad[:, None], own, tail)
            dst = pad_rows_ptr + experts[:, None] * (PAD - 1) + j[None, :]
            tl.store(dst, pad_rows, mask=emask[:, None] & (j[None, :] < PAD - 1))


@triton.jit
def plan_kernel(
    ids_ptr, part_counts_ptr, sync_ptr,
    counts_ptr, offsets_ptr, pair_to_row_ptr, row_to_pair_ptr, pad_rows_ptr,
    num_pairs, num_rows, num_chunks, chunk, fill_rows,
    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, SUM_ROWS: tl.constexpr,
    PAD: tl.constexpr, PAD_POW2: tl.constexpr,
):
    """The whole plan (see the module docstring). ``sync_ptr``: three int32 zeros (count claims,
    chunks counted, place claims); ``part_counts_ptr``: ``(num_chunks, E_POW2)`` int32 scratch."""
    c = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while c < num_chunks:
        _count_chunk(ids_ptr, part_counts_ptr, row_to_pair_ptr, c, chunk, num_pairs, num_rows, fill_rows,
                     E, E_POW2, BLOCK)
        tl.debug_barrier()  # every thread's stores before the release below
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
        c = tl.atomic_add(sync_ptr, 1, sem="relaxed")

    done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    while done < num_chunks:  # every chunk is claimed: the ones still counting are running
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    tl.debug_barrier()

    c = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed")
    while c < num_chunks:
        _place_chunk(ids_ptr, part_counts_ptr, counts_ptr, offsets_ptr, pair_to_row_ptr, row_to_pair_ptr,
                     pad_rows_ptr, c, num_chunks, chunk, num_pairs, E, E_POW2, BLOCK, SUM_ROWS, PAD, PAD_POW2)
        c = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed")
