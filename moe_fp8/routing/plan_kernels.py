"""Triton kernel of the dispatch plan: a stable counting sort of the (token, slot) pairs by expert.

One launch, no host sync, every size static. The ``N`` pairs are cut into ``NC`` contiguous
chunks of ``chunk`` pairs (``chunk`` a multiple of ``BLOCK``). Three phases, each handing out its
work items through an atomic work counter (programs claim items until none is left), each but
the first starting once the previous one is done (a *done* counter, ``release`` after a CTA
barrier by every finished item, read with ``acquire``):

1. *count* (item: a chunk): chunk ``c``'s per-expert counts, column ``c`` of ``part_counts (E,
   NC)``; the chunk's share of ``row_to_pair`` is set to -1 (the value of padding rows), so no
   separate fill runs.
2. *scan* (item: an expert): exclusive prefix sum of the expert's row of ``part_counts`` (in
   place: the expert's pairs in earlier chunks) and its total.
3. *place* (item: a chunk): the totals give the padded group starts; walking the chunk block by
   block, a pair's row is ``group start + pairs of its expert before it``, written to both maps.
   Whoever places chunk 0 also writes counts, offsets (and the weight gradient's offsets) and the
   list of padding rows.

A wait cannot deadlock however few programs are resident: a program waits only once every item
of the phase has been claimed, so the items it waits for belong to programs that are running
(the Triton interpreter, which runs programs one after another, has program 0 do all the work).

Pairs whose expert id lies outside ``[0, E)`` are dropped: they get row -1 and no group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant.kernels.common import max_combine

__all__ = ["SYNC_SLOTS", "plan_kernel"]

# int32 counters at the head of the scratch (five used; eight keep part_counts 16-byte aligned)
SYNC_SLOTS = tl.constexpr(8)


@triton.jit
def _valid_ids(ids, in_range, E: tl.constexpr):
    """``ids`` (loaded, -1 out of range) as int32, -1 for an invalid id; and which are valid.

    The callers load the ids themselves: torch's analysis of which arguments a traced kernel
    writes follows a stored pointer's offsets back through calls, not through loads, so ids
    loaded inside a helper would count ``ids_ptr`` as written."""
    valid = in_range & (ids >= 0) & (ids < E)
    return tl.where(valid, ids, -1).to(tl.int32), valid


@triton.jit
def _count_chunk(ids_ptr, part_counts_ptr, row_to_pair_ptr, c, num_chunks, chunk, num_pairs, num_rows, fill_rows,
                 E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Column ``c`` of ``part_counts``: chunk ``c``'s pairs per expert; rows ``[c, c+1) * fill_rows``
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
        pairs = p + lanes
        in_range = pairs < num_pairs
        ids, valid = _valid_ids(tl.load(ids_ptr + pairs, mask=in_range, other=-1), in_range, E)
        hist += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(part_counts_ptr + experts * num_chunks + c, hist, mask=experts < E)


@triton.jit
def _scan_expert(part_counts_ptr, totals_ptr, e, num_chunks, SCAN: tl.constexpr):
    """Row ``e`` of ``part_counts`` replaced by its exclusive prefix sum; its sum to ``totals[e]``."""
    row = part_counts_ptr + e * num_chunks
    carry = tl.sum(tl.zeros([SCAN], dtype=tl.int32), axis=0)
    for start in range(0, num_chunks, SCAN):
        idx = start + tl.arange(0, SCAN)
        m = idx < num_chunks
        n = tl.load(row + idx, mask=m, other=0, volatile=True)
        tl.store(row + idx, carry + tl.cumsum(n, axis=0) - n, mask=m)
        carry += tl.sum(n, axis=0)
    tl.store(totals_ptr + e, carry)


@triton.jit
def _wait_until(done_ptr, n):
    """Spin until the counter at ``done_ptr`` reaches ``n`` (``acquire``), then sync the CTA."""
    seen = tl.atomic_add(done_ptr, 0, sem="acquire")
    while seen < n:
        seen = tl.atomic_add(done_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _place_chunk(ids_ptr, part_counts_ptr, totals_ptr, counts_ptr, offsets_ptr, pair_to_row_ptr, row_to_pair_ptr,
                 pad_rows_ptr, wgrad_offsets_ptr, c, num_chunks, chunk, num_pairs,
                 E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, PAD: tl.constexpr,
                 OWN: tl.constexpr, OWN_POW2: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Rows of chunk ``c``'s pairs (both maps); for ``c == 0`` also counts, offsets and padding rows.
    ``EMPTY_ROWS``: an expert without pairs gets ``PAD`` rows (the weight gradient's groups)."""
    experts = tl.arange(0, E_POW2)
    emask = experts < E
    counts = tl.load(totals_ptr + experts, mask=emask, other=0, volatile=True)
    earlier = tl.load(part_counts_ptr + experts * num_chunks + c, mask=emask, other=0, volatile=True)
    padded = (counts + (PAD - 1)) // PAD * PAD
    if EMPTY_ROWS:
        padded = tl.where(emask, tl.maximum(padded, PAD), 0)
    group_end = tl.cumsum(padded, axis=0)
    group_start = group_end - padded

    lanes = tl.arange(0, BLOCK)
    next_row = group_start + earlier  # per expert: the row of its next pair
    start = c * chunk
    for p in range(start, start + chunk, BLOCK):
        pairs = p + lanes
        in_range = pairs < num_pairs
        ids, valid = _valid_ids(tl.load(ids_ptr + pairs, mask=in_range, other=-1), in_range, E)
        hot = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(hot, next_row[None, :], 0), axis=1)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
        row = base + rank
        tl.store(pair_to_row_ptr + pairs, tl.where(valid, row, -1), mask=in_range)
        tl.store(row_to_pair_ptr + row, pairs, mask=valid)
        next_row += tl.sum(hot.to(tl.int32), axis=0)

    if c == 0:
        tl.store(counts_ptr + experts, counts, mask=emask)
        if EMPTY_ROWS:
            # forward groups: an empty expert's rows join the next non-empty group (or lie past the last)
            tl.store(offsets_ptr + experts, tl.associative_scan(tl.where(counts > 0, group_end, 0), 0, max_combine),
                     mask=emask)
            tl.store(wgrad_offsets_ptr + experts, group_end, mask=emask)
        else:
            tl.store(offsets_ptr + experts, group_end, mask=emask)
        if OWN > 0:
            # Expert e owns OWN padding rows: its own group's tail, then its share of the rows
            # past the last group (shares in expert order tile [group_end[-1], num_rows)).
            own_pad = padded - counts
            pads_before = group_start - (tl.cumsum(counts, axis=0) - counts)
            used = tl.sum(padded, axis=0)
            j = tl.arange(0, OWN_POW2)
            own = (group_start + counts)[:, None] + j[None, :]
            tail = (used + experts * OWN - pads_before - own_pad)[:, None] + j[None, :]
            pad_rows = tl.where(j[None, :] < own_pad[:, None], own, tail)
            dst = pad_rows_ptr + experts[:, None] * OWN + j[None, :]
            tl.store(dst, pad_rows, mask=emask[:, None] & (j[None, :] < OWN))


@triton.jit
def plan_kernel(
    ids_ptr, scratch_ptr, out_ptr,
    num_pairs, num_rows, num_chunks, chunk, fill_rows,
    E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr,
    PAD: tl.constexpr, OWN: tl.constexpr, OWN_POW2: tl.constexpr, EMPTY_ROWS: tl.constexpr,
):
    """The whole plan (see the module docstring).

    ``scratch_ptr``: int32 zeros, ``SYNC_SLOTS`` work / done counters (count claims, chunks
    counted, scan claims, experts scanned, place claims), then ``part_counts (E, num_chunks)`` and
    ``totals (E,)``. ``out_ptr``: the packed int32 outputs, each piece starting at a multiple of 4
    elements (16 bytes): ``offsets (E)``, ``counts (E)``, ``pair_to_row (num_pairs)``,
    ``row_to_pair (num_rows)``, ``pad_rows (OWN*E)`` and with ``EMPTY_ROWS`` ``wgrad_offsets (E)``
    (see ``plan.packed_sizes``); ``OWN``: the padding rows each expert owns.
    """
    sync_ptr = scratch_ptr
    part_counts_ptr = scratch_ptr + SYNC_SLOTS
    totals_ptr = part_counts_ptr + E * num_chunks
    e4: tl.constexpr = (E + 3) // 4 * 4
    offsets_ptr = out_ptr
    counts_ptr = out_ptr + e4
    pair_to_row_ptr = out_ptr + 2 * e4
    # 16-byte aligned pieces; the hint is on the pointer, which is a tensor even where torch's
    # analysis of the traced kernel passes the sizes as constexprs
    row_to_pair_ptr = tl.multiple_of(pair_to_row_ptr + (num_pairs + 3) // 4 * 4, 16)
    pad_rows_ptr = tl.multiple_of(row_to_pair_ptr + (num_rows + 3) // 4 * 4, 16)
    wgrad_offsets_ptr = pad_rows_ptr + (OWN * E + 3) // 4 * 4

    c = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while c < num_chunks:
        _count_chunk(ids_ptr, part_counts_ptr, row_to_pair_ptr, c, num_chunks, chunk, num_pairs, num_rows,
                     fill_rows, E, E_POW2, BLOCK)
        tl.debug_barrier()  # every thread's stores before the release below
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
        c = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    _wait_until(sync_ptr + 1, num_chunks)  # every chunk is claimed: the ones still counting are running

    e = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed")
    while e < E:
        _scan_expert(part_counts_ptr, totals_ptr, e, num_chunks, SCAN)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 3, 1, sem="release")
        e = tl.atomic_add(sync_ptr + 2, 1, sem="relaxed")
    _wait_until(sync_ptr + 3, E)

    c = tl.atomic_add(sync_ptr + 4, 1, sem="relaxed")
    while c < num_chunks:
        _place_chunk(ids_ptr, part_counts_ptr, totals_ptr, counts_ptr, offsets_ptr, pair_to_row_ptr,
                     row_to_pair_ptr, pad_rows_ptr, wgrad_offsets_ptr, c, num_chunks, chunk, num_pairs, E, E_POW2,
                     BLOCK, PAD, OWN, OWN_POW2, EMPTY_ROWS)
        c = tl.atomic_add(sync_ptr + 4, 1, sem="relaxed")
