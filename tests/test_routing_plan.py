"""Dispatch plan: invariants, Triton == torch reference, padding, dropped ids, edge sizes, bad input."""

from __future__ import annotations

import pytest
import torch

import moe_fp8.routing.plan as plan_mod
from moe_fp8.routing import DispatchPlan, make_dispatch_plan, padded_num_rows
from moe_fp8.routing.reference import dispatch_plan_reference

# Against the references: with CPU tensors the kernels run only in the interpreter (elsewhere the
# module would fall back to the reference itself and the comparison would prove nothing).
pytestmark = pytest.mark.interpreter

KINDS = ("balanced", "skewed", "empty", "one")


def random_topk_ids(T, E, k, kind, seed=0, dtype=torch.int64):
    """``(T, k)`` distinct expert ids per token, drawn so that the load is balanced / skewed / has
    empty experts / sends every token's first slot to one expert."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        p = torch.ones(E)
    elif kind == "skewed":
        p = torch.rand(E, generator=g) ** 4 + 1e-3
    elif kind == "empty":
        p = torch.ones(E)
        p[torch.randperm(E, generator=g)[: max(0, min(E - k, E // 2))]] = 0
    else:
        p = torch.ones(E)
    if not T:
        return torch.empty(0, k, dtype=dtype)
    ids = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])
    if kind == "one" and T:
        hot = int(torch.randint(E, (1,), generator=g))
        for t in range(T):  # slot 0 -> hot expert, keep the ids distinct
            row = ids[t].tolist()
            if hot in row:
                row.remove(hot)
            else:
                row.pop()
            ids[t] = torch.tensor([hot] + row)
    return ids.to(dtype)


def check_plan_invariants(plan: DispatchPlan, ids: torch.Tensor, E: int, P: int, Z: bool = False):
    """``Z``: the plan was made with ``empty_group_rows``."""
    T, k = ids.shape
    N, M = T * k, padded_num_rows(T * k, E, P, Z)
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    for t in plan[:6]:  # views of one buffer, each 16-byte aligned (the grouped GEMMs take offsets)
        assert t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() % 16 == 0
    assert plan.num_rows == M and plan.pad_rows.numel() == (P - 1 + Z) * E and plan.top_k == k
    counts = torch.bincount(flat[valid], minlength=E)
    assert torch.equal(plan.counts.long(), counts)
    # the weight gradient's groups: each padded to a multiple of P, an empty expert's P rows its own
    sizes = torch.diff(plan.wgrad_offsets.long(), prepend=torch.zeros(1, dtype=torch.long))
    assert (sizes >= 0).all(), "offsets must be non-decreasing"
    least = counts.clamp_min(P) if Z else counts
    assert (sizes % P == 0).all() and (sizes >= least).all() and (sizes - least < P).all()
    if Z:  # the forward's groups: an empty expert's rows join the next non-empty group
        assert (sizes > 0).all()
        want = [max([int(plan.wgrad_offsets[h]) for h in range(e + 1) if counts[h] > 0], default=0) for e in range(E)]
        assert plan.offsets.tolist() == want
    else:
        assert plan.wgrad_offsets is plan.offsets
    # every valid (token, slot) pair exactly once, in its expert's group, in increasing pair order
    p2r = plan.pair_to_row.long()
    assert (p2r[~valid] == -1).all()
    rows = p2r[valid]
    assert rows.unique().numel() == rows.numel() and (rows >= 0).all() and (rows < M).all()
    pairs = torch.arange(N)[valid]
    assert torch.equal(plan.row_to_pair.long()[rows], pairs)
    starts = plan.wgrad_offsets.long() - sizes
    for e in range(E):
        group = plan.row_to_pair.long()[starts[e] : starts[e] + counts[e]]
        assert (flat[group] == e).all() and (torch.diff(group) > 0).all(), "stable, expert-sorted"
    # padding rows: exactly the rows no pair uses (when nothing is dropped), all marked -1
    pad = plan.pad_rows.long()
    assert pad.unique().numel() == pad.numel() and (plan.row_to_pair.long()[pad] == -1).all()
    if valid.all():
        assert torch.equal(torch.sort(torch.cat([rows, pad])).values, torch.arange(M))
    assert (plan.row_to_pair >= -1).all() and (plan.row_to_pair < N).all()


@pytest.mark.parametrize("Z", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("E,k,P", [(8, 2, 1), (8, 2, 16), (64, 6, 16), (256, 8, 16), (5, 3, 4)])
def test_plan_matches_reference_and_invariants(kind, E, k, P, Z, monkeypatch):
    monkeypatch.setattr(plan_mod, "multiprocessor_count", lambda device: 3)  # up to 24 chunks of pairs
    monkeypatch.setattr(plan_mod, "_SCAN", 4)  # exercise the scan's carry across steps
    ids = random_topk_ids(97, E, k, kind, seed=E * 7 + P)
    plan = make_dispatch_plan(ids, E, pad_multiple=P, empty_group_rows=Z)
    check_plan_invariants(plan, ids, E, P, Z)
    ref = dispatch_plan_reference(ids, E, P, Z)
    for name, got, want in zip(DispatchPlan._fields, plan, ref):
        assert torch.equal(got, want), name
    if Z:
        assert plan.num_rows == 97 * k + P * E
    else:
        assert torch.equal(ref[5], ref[1])  # without empty_group_rows the reference's two offsets agree
        ref = ref[:5] + (ref[1],)
    check_plan_invariants(DispatchPlan(*ref, k, P), ids, E, P, Z)


@pytest.mark.slow(6)
@pytest.mark.parametrize("P", [1, 16])
def test_plan_many_experts_not_a_power_of_two(monkeypatch, P):
    """E = 600: one-hot tiles of 16 pairs x 1024 lanes (424 of them masked), several chunks, the
    per-expert scan carried over several steps."""
    monkeypatch.setattr(plan_mod, "_SCAN", 2)
    ids = random_topk_ids(12, 600, 8, "skewed", seed=11)  # 96 pairs: 6 chunks, a 3-step scan
    plan = make_dispatch_plan(ids, 600, pad_multiple=P)
    check_plan_invariants(plan, ids, 600, P)
    for name, got, want in zip(DispatchPlan._fields, plan, dispatch_plan_reference(ids, 600, P)):
        assert torch.equal(got, want), name


def test_plan_int32_ids_duplicates_and_determinism():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (300, 4), generator=g, dtype=torch.int32)  # duplicates within a token too
    a = make_dispatch_plan(ids, 6, pad_multiple=8)
    b = make_dispatch_plan(ids, 6, pad_multiple=8)
    check_plan_invariants(a, ids, 6, 8)
    for x, y in zip(a[:5], b[:5]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("Z", [False, True])
@pytest.mark.parametrize("P", [1, 16])
def test_out_of_range_ids_are_dropped(P, Z):
    ids = random_topk_ids(40, 8, 3, "balanced", seed=9)
    ids[3, 1] = -1
    ids[7, 0] = 8
    ids[11, 2] = 1000
    ids[ids == 5] = -1  # and expert 5 gets no pair
    plan = make_dispatch_plan(ids, 8, pad_multiple=P, empty_group_rows=Z)
    check_plan_invariants(plan, ids, 8, P, Z)
    assert plan.pair_to_row[3 * 3 + 1] == -1 and plan.pair_to_row[7 * 3] == -1
    assert int(plan.counts.sum()) == int(((ids >= 0) & (ids < 8)).sum()) and plan.counts[5] == 0
    ref = dispatch_plan_reference(ids, 8, P, Z)
    for got, want in zip(plan, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("Z", [False, True])
@pytest.mark.parametrize("T", [0, 1])
@pytest.mark.parametrize("P", [1, 16])
def test_zero_and_one_token(T, P, Z):
    ids = random_topk_ids(T, 4, 2, "balanced", seed=T)
    plan = make_dispatch_plan(ids, 4, pad_multiple=P, empty_group_rows=Z)
    check_plan_invariants(plan, ids, 4, P, Z)
    assert plan.num_rows == 2 * T + 4 * (P - 1 + Z)
    for name, got, want in zip(DispatchPlan._fields, plan, dispatch_plan_reference(ids, 4, P, Z)):
        assert torch.equal(got, want), name


def test_reference_fallback_packs_the_same_layout(monkeypatch):
    """Without a Triton device (no interpreter) the reference's tensors go into the same packed
    buffer: same values, same alignment."""
    ids = random_topk_ids(33, 5, 3, "skewed", seed=5)
    want = make_dispatch_plan(ids, 5, pad_multiple=4)
    monkeypatch.setattr(plan_mod, "use_triton", lambda kernel, t: False)
    got = make_dispatch_plan(ids, 5, pad_multiple=4)
    check_plan_invariants(got, ids, 5, 4)
    for name, a, b in zip(DispatchPlan._fields[:5], got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("Z", [False, True])
def test_traces_under_torch_compile(Z):
    """One opaque custom-op node whose fake kernel has the packed buffer's shape; the views are
    split off outside it."""
    ids = random_topk_ids(29, 6, 2, "empty", seed=2)
    compiled = torch.compile(lambda i: tuple(make_dispatch_plan(i, 6, pad_multiple=16, empty_group_rows=Z)[:6]),
                             backend="aot_eager", fullgraph=True)
    for name, a, b in zip(DispatchPlan._fields, compiled(ids),
                          make_dispatch_plan(ids, 6, pad_multiple=16, empty_group_rows=Z)):
        assert torch.equal(a, b), name


def test_single_expert_everything_to_it():
    ids = torch.zeros(50, 1, dtype=torch.long)
    plan = make_dispatch_plan(ids, 1, pad_multiple=16)
    assert plan.counts.tolist() == [50] and plan.offsets.tolist() == [64]
    assert torch.equal(plan.pair_to_row, torch.arange(50, dtype=torch.int32))
    assert sorted(plan.pad_rows.tolist()) == list(range(50, 65))


def test_bad_input():
    ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="topk_ids"):
        make_dispatch_plan(ids.float(), 4)
    with pytest.raises(ValueError, match="topk_ids"):
        make_dispatch_plan(ids.view(-1), 4)
    with pytest.raises(ValueError, match="topk_ids"):
        make_dispatch_plan(torch.zeros(4, 0, dtype=torch.long), 4)  # no slots
    with pytest.raises(ValueError, match="num_experts"):
        make_dispatch_plan(ids, 0)
    with pytest.raises(ValueError, match="pad_multiple"):
        make_dispatch_plan(ids, 4, pad_multiple=0)
    with pytest.raises(TypeError, match="empty_group_rows"):
        make_dispatch_plan(ids, 4, empty_group_rows=1)


def test_more_slots_than_experts():
    """k > E (the slots of other ranks' experts dropped, as on an expert-parallel rank): the plan
    equals the reference."""
    ids = torch.tensor([[0, -1, 5, 1], [7, 1, -1, 0], [-1, -1, -1, -1]])
    got = make_dispatch_plan(ids, 2)
    want = dispatch_plan_reference(ids, 2, 1)
    assert [t.tolist() for t in (got.counts, got.offsets, got.pair_to_row, got.row_to_pair)] == \
        [t.tolist() for t in want[:4]]
