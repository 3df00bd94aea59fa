"""Scenarios of the expert-parallel CPU test, run inside ``torch.multiprocessing`` workers (gloo).

One spawn of 4 processes serves process groups of 2, 3 and 4 ranks (``new_group``), to pay the
start-up once. Every rank builds every scenario's data from the same seed, keeps its own tokens,
and compares against one process holding every token (an ``FP8GroupedExperts`` / ``FP8MoE``
with the same weights). A token visits each rank of its experts once and comes back as the sum of
that rank's experts' outputs, rounded to bf16: the reference runs each rank's experts alone on
every token and sums those partial results in rank order in fp32, as the EP combine does.
"""

from __future__ import annotations

import contextlib
import copy
import datetime

import torch
import torch.distributed as dist

import moe_fp8.parallel.experts as ep_experts
from moe_fp8 import FP8GroupedExperts, FP8MoE
from moe_fp8.parallel import ExpertParallelExperts, RowsAllToAll, all_to_all_rows, destination_plan, exchange_counts
from moe_fp8.parallel.fp8_rows import FP8RowsAllToAll
from moe_fp8.parallel import expert_parallel_from, expert_parallel_moe, shard_experts
from moe_fp8.quant import quantize_rowwise
from moe_fp8.routing import combine, permute, permute_quantize

from no_gradient import NoGradient

H, I, K = 32, 32, 2
TIMEOUT = datetime.timedelta(seconds=60)
BACKEND = "emulated"  # the grouped GEMM of the CPU FP8MoE tests (exact reference backend)


def layer_grads(layer, x: torch.Tensor, dy: torch.Tensor):
    """``(out, dx, {name: grad})`` of one forward+backward of ``layer`` on a fresh copy of ``x``."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}

def replay_on_new_input(layer, static_x: torch.Tensor) -> torch.Tensor:
    """Capture ``layer``'s no-grad forward on ``static_x`` in a CUDA graph (after a warm-up on a
    side stream), refill ``static_x`` with new random values and replay; returns the graph's output."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
    return static_out


def _dirty_allocator() -> None:
    """Fill and free a large block so that an uninitialised result cannot pass as zeros."""
    junk = torch.full((1 << 20,), float("nan"))
    del junk


def _ids(gen: torch.Generator, T: int, lo: int, hi: int) -> torch.Tensor:
    """``(T, K)`` distinct expert ids per token in ``[lo, hi)``."""
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    return torch.stack([torch.randperm(hi - lo, generator=gen)[:K] + lo for _ in range(T)])


def scenarios(world: int, E: int):
    """``name -> (tokens per rank, ids of every token (sum T, K))``."""
    gen = torch.Generator().manual_seed(world)
    el = E // world
    out = {}
    ts = [5 + r for r in range(world)]
    ids = _ids(gen, sum(ts), 0, E)
    ids[1, 1] = -1  # a dropped pair (an id outside [0, E))
    out["uniform"] = (ts, ids)
    ts = [4] * world
    out["all_to_one_rank"] = (ts, _ids(gen, sum(ts), (world - 1) * el, world * el))
    ts = [6] * world
    ids = _ids(gen, sum(ts), 0, E)
    ids[2, 0] = E  # a dropped pair
    out["equal_tokens"] = (ts, ids)
    out["no_tokens_anywhere"] = ([0] * world, _ids(gen, 0, 0, E))
    ts = [0] + [3] * (world - 1)
    out["rank_with_no_tokens"] = (ts, _ids(gen, sum(ts), 0, E))
    ts = [0] * (world - 1) + [7]
    out["all_but_one_rank_empty"] = (ts, _ids(gen, sum(ts), 0, E))
    return out


def _run(experts, x, ids, w, dy, on_input: bool = False):
    """Forward + backward: ``(out, grad x, grad weights, grad gate_up_proj, grad down_proj)``;
    ``on_input``: ``w`` scales the expert inputs (Llama 4) and the combine takes unit weights."""
    experts.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = experts(x, ids, None, input_scales=w) if on_input else experts(x, ids, w)
    out.backward(dy)
    return out.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad


_WHAT = ("out", "grad x", "grad weights", "grad W gate_up_proj", "grad W down_proj")


def _check_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got is not None, f"{name}: no gradient"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{name}: max abs diff {(got.float() - want.float()).abs().max().item()}"


def _sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _reference(full, x, ids, w, dy, world: int, on_input: bool = False):
    """What the EP layer computes, from one process: ``(out, grad x, grad w, grad W1, grad W2)``.
    Outputs and input gradients: each rank's experts alone (other ids dropped) on every token, the
    partial results summed in rank order in fp32; router-weight and expert-weight gradients: the
    single process's (each comes from one expert, on one rank)."""
    whole = _run(full, x, ids, w, dy, on_input)
    el = full.num_experts // world
    parts = [_run(full, x, torch.where((ids >= d * el) & (ids < (d + 1) * el), ids, -1), w, dy, on_input)
             for d in range(world)]
    return (_sum_in_rank_order([p[0] for p in parts]), _sum_in_rank_order([p[1] for p in parts])) + whole[2:]


@contextlib.contextmanager
def _recorded_plans():
    """The dispatch plans the expert-parallel layer makes inside the block (its module's
    ``make_dispatch_plan`` wrapped)."""
    plans, make_plan = [], ep_experts.make_dispatch_plan
    ep_experts.make_dispatch_plan = lambda *a, **kw: plans.append(make_plan(*a, **kw)) or plans[-1]
    try:
        yield plans
    finally:
        ep_experts.make_dispatch_plan = make_plan


def check_experts(group, world: int, rank: int, recipe: str) -> None:
    """EP experts (both dispatch modes; sync-free too where every rank has the same T) == the
    one-process reference, bitwise, in every scenario;
    experts without tokens get exact zero gradients; two runs bitwise equal (uniform routing)."""
    E = 2 * world
    torch.manual_seed(0)
    full = FP8GroupedExperts(E, H, I, recipe=recipe, backend=BACKEND).to(torch.bfloat16)
    # FP8 dispatch sends FP8 rows only: its first GEMM saves them, as fp8_saved_input does in one process
    full_fp8_in = copy.deepcopy(full)
    full_fp8_in.fp8_saved_input = recipe != "bf16"
    dispatches = ("bf16", "fp8") if recipe != "bf16" else ("bf16",)
    shards = {d: ExpertParallelExperts.from_full(full, group, d) for d in dispatches}
    static = {f"{d} sync-free": ExpertParallelExperts.from_full(full, group, d, sync_free=True) for d in dispatches}
    lo, hi = rank * E // world, (rank + 1) * E // world
    with _recorded_plans() as plans:  # the local plans: every local expert keeps a weight-gradient row
        for name, (ts, ids) in scenarios(world, E).items():
            # the sync-free dispatch takes the same T on every rank
            layers = {**shards, **static} if len(set(ts)) == 1 else shards
            gen = torch.Generator().manual_seed(1)
            n = sum(ts)
            x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
            w = torch.rand(n, K, generator=gen)
            dy = torch.randn(n, H, generator=gen).to(torch.bfloat16)
            refs = {"bf16": _reference(full, x, ids, w, dy, world),
                    "fp8": _reference(full_fp8_in, x, ids, w, dy, world)}
            a, b = sum(ts[:rank]), sum(ts[: rank + 1])
            for dispatch, shard in layers.items():
                _dirty_allocator()
                got = _run(shard, x[a:b], ids[a:b], w[a:b], dy[a:b])
                tag = f"world={world} rank={rank} {recipe} {dispatch} {name}"
                ref = refs[dispatch[:4].strip()]
                for what, g, r in zip(("out", "grad x", "grad weights"), got[:3], ref[:3]):
                    _check_equal(f"{tag}: {what}", g, r[a:b])
                _check_equal(f"{tag}: grad gate_up_proj", got[3], ref[3][lo:hi])
                _check_equal(f"{tag}: grad down_proj", got[4], ref[4][lo:hi])
                wgrad_offsets = plans[-1].wgrad_offsets
                sizes = torch.diff(wgrad_offsets, prepend=wgrad_offsets.new_zeros(1))
                assert (sizes > 0).all(), f"{tag}: a weight-gradient group without rows: {sizes.tolist()}"
                routed = torch.zeros(E, dtype=torch.bool)
                routed[ids[(ids >= 0) & (ids < E)]] = True
                for e in range(hi - lo):
                    if not routed[lo + e]:
                        assert not got[3][e].any() and not got[4][e].any(), f"{tag}: expert {lo + e} has no tokens"
                if name in ("uniform", "equal_tokens") and dispatch.startswith("fp8"):
                    with torch.no_grad():  # the FP8 rows alone travel
                        _check_equal(f"{tag}: out without grad", shard(x[a:b], ids[a:b], w[a:b]), ref[0][a:b])
                    again = _run(shard, x[a:b], ids[a:b], w[a:b], dy[a:b])
                    for g1, g2 in zip(got, again):
                        assert torch.equal(g1, g2), f"{tag}: two runs differ"
                    try:
                        shard(x[a:b], ids[a:b], None, input_scales=w[a:b])
                    except ValueError as e:
                        assert "input_scales" in str(e), str(e)
                    else:
                        raise AssertionError(f"{tag}: no ValueError for FP8 dispatch with input scales")
                if name in ("uniform", "equal_tokens") and dispatch.startswith("bf16"):
                    on_input = _run(shard, x[a:b], ids[a:b], w[a:b], dy[a:b], on_input=True)
                    for what, g, r in zip(_WHAT, on_input, _reference(full, x, ids, w, dy, world, on_input=True)):
                        want = r[lo:hi] if what.startswith("grad W") else r[a:b]
                        _check_equal(f"{tag} input scales: {what}", g, want)


def check_fp8_rows_equal_quantize_after_receipt(group, world: int, rank: int) -> None:
    """The FP8 token rows as received == the rowwise quantization of the BF16 rows as received
    (bitwise), and the received rows == every token with an expert on this rank, in (source rank,
    token) order: each once."""
    E = 2 * world
    el = E // world
    ts, ids = scenarios(world, E)["uniform"]
    x = (torch.randn(sum(ts), H, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    a, b = sum(ts[:rank]), sum(ts[: rank + 1])
    route = destination_plan(ids[a:b], el, world)
    splits = exchange_counts(route.counts, group).wait()
    rows = all_to_all_rows(permute(x[a:b], route), splits.send, splits.recv, group)
    q, scale = permute_quantize(x[a:b], route, torch.float8_e4m3fn)
    q = all_to_all_rows(q.view(torch.uint8), splits.send, splits.recv, group)
    scale = all_to_all_rows(scale, splits.send, splits.recv, group)
    q_ref, scale_ref = quantize_rowwise(rows, torch.float8_e4m3fn)
    assert torch.equal(q, q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    mine = ((ids >= rank * el) & (ids < (rank + 1) * el)).any(1)
    assert torch.equal(rows, x[mine]), f"world={world} rank={rank}: received rows"
    # no gradient reaches the received rows (the op after them gives none): zeros still travel home,
    # so every rank enters the backward's exchange, and x's gradient is zero
    xr = x[a:b].clone().requires_grad_()
    stand_in, _ = FP8RowsAllToAll.apply(xr, permute_quantize(xr.detach(), route, torch.float8_e4m3fn)[0], route,
                                        splits.send, splits.recv, group)
    NoGradient.apply(stand_in).sum().backward()
    assert xr.grad is not None and not xr.grad.any(), f"world={world} rank={rank}: gradient without rows"


def check_round_trip(group, world: int, rank: int) -> None:
    """Dispatch then return with unit weights gives each token times its number of destination
    ranks exactly, and its gradient likewise."""
    E = 2 * world
    el = E // world
    for ts, ids in scenarios(world, E).values():
        gen = torch.Generator().manual_seed(3)
        n = sum(ts)
        x, dy = torch.randn(n, H, generator=gen).to(torch.bfloat16), torch.randn(n, H, generator=gen).to(torch.bfloat16)
        a, b = sum(ts[:rank]), sum(ts[: rank + 1])
        ids = ids[a:b]
        x = x[a:b].clone().requires_grad_()
        route = destination_plan(ids, el, world)
        splits = exchange_counts(route.counts, group).wait()
        rows = RowsAllToAll.apply(permute(x, route), splits.send, splits.recv, group)
        back = RowsAllToAll.apply(rows, splits.recv, splits.send, group, route.num_rows)
        out = combine(back, route, None)
        out.backward(dy[a:b])
        valid = (ids >= 0) & (ids < E)
        ranks = torch.stack([(valid & (ids // el == d)).any(1) for d in range(world)], 1).sum(1, keepdim=True)
        assert torch.equal(out, (ranks * x.float()).to(x.dtype).detach()), f"world={world} rank={rank}: round trip"
        assert torch.equal(x.grad, (ranks * dy[a:b].float()).to(x.dtype)), f"world={world} rank={rank}: gradient"


class _RankOrderExperts(torch.nn.Module):
    """One process's experts computed as the EP layer sums them: each rank's experts alone on every
    token, the partial results summed in rank order in fp32."""

    def __init__(self, experts, world: int) -> None:
        super().__init__()
        self.inner, self.world = experts, world

    def forward(self, x, ids, weights, input_scales=None):
        el = self.inner.num_experts // self.world
        parts = [self.inner(x, torch.where((ids >= d * el) & (ids < (d + 1) * el), ids, -1), weights,
                            input_scales=input_scales) for d in range(self.world)]
        return _sum_in_rank_order(parts)


def check_layer(group, world: int, rank: int, dispatch: str, E: int) -> None:
    """``expert_parallel_from(FP8MoE)`` with ``E`` experts with its own router and shared expert == the
    full layer on every token (its experts summed in rank order): output and expert gradients
    bitwise, the input gradient up to the order its bf16 terms are summed in (a few ulps). The replicated parameters
    (router, shared expert) see this rank's tokens only: their gradients == the full layer's on
    those tokens alone, bitwise; the router's summed over the ranks == the full layer's up to
    summation order."""
    torch.manual_seed(4)
    full = FP8MoE(H, I, E, K, shared_expert_hidden_size=16, backend=BACKEND).to(torch.bfloat16)
    ep = expert_parallel_from(full, group, dispatch)
    full.experts.fp8_saved_input = dispatch == "fp8"  # what FP8 dispatch implies
    full.experts = _RankOrderExperts(full.experts, world)
    ts = [3 + 2 * r for r in range(world)]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(ts), H, generator=gen).to(torch.bfloat16)
    dy = torch.randn(sum(ts), H, generator=gen).to(torch.bfloat16)
    a, b = sum(ts[:rank]), sum(ts[: rank + 1])

    out_all, gx_all, g_all = layer_grads(full, x, dy)
    _, _, g_local = layer_grads(full, x[a:b], dy[a:b])
    out, gx, g = layer_grads(ep, x[a:b], dy[a:b])
    tag = f"world={world} rank={rank} layer {dispatch}"
    _check_equal(f"{tag}: out", out, out_all[a:b])
    torch.testing.assert_close(gx, gx_all[a:b], rtol=2**-6, atol=2**-7, msg=lambda m: f"{tag}: grad x: {m}")
    lo, hi = rank * E // world, (rank + 1) * E // world
    for n, grad in g.items():
        if n.startswith("experts."):
            _check_equal(f"{tag}: grad {n}", grad, g_all[n.replace("experts.", "experts.inner.")][lo:hi])
        else:
            _check_equal(f"{tag}: grad {n} (this rank's tokens)", grad, g_local[n])
    router = g["router.weight"].float()
    dist.all_reduce(router, group=group)
    torch.testing.assert_close(router, g_all["router.weight"].float(), rtol=2e-2, atol=2e-3, msg=tag)


def check_hf_model(group, world: int, rank: int, dispatch: str, family: str = "qwen3_moe") -> None:
    """A converted Hugging Face model (Qwen3-MoE, or OLMoE: a family converted through its standard
    experts) sharded by ``shard_experts`` == the converted model on every rank's tokens (logits and
    expert gradients, up to the per-rank rounding of the partial sums); bad arguments raise
    ``ValueError``. A family this transformers lacks is skipped."""
    import transformers  # noqa: PLC0415  (an optional dependency, installed for the tests)

    from moe_fp8 import hf  # noqa: PLC0415

    torch.manual_seed(7)
    sizes = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, head_dim=16, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=96)
    if family == "olmoe":
        sizes["intermediate_size"] = 32
    try:
        cfg = transformers.AutoConfig.for_model(family, **sizes)
    except (KeyError, ValueError):
        return
    full = hf.convert(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16), backend=BACKEND,
                      min_expert_size=0, min_fp8_wgrad_size=0)
    ep = shard_experts(copy.deepcopy(full), group, dispatch)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 96, (2 * world, 8), generator=gen)
    dy = torch.randn(2 * world, 8, 96, generator=gen)
    a, b = 2 * rank, 2 * rank + 2
    tag = f"world={world} rank={rank} hf {family} {dispatch}"
    if dispatch == "fp8":  # what FP8 dispatch implies for the reference
        for m in full.modules():
            if isinstance(m, FP8GroupedExperts):
                m.fp8_saved_input = True
    logits_all = full(ids).logits
    (logits_all.float() * dy).sum().backward()
    logits = ep(ids[a:b]).logits
    (logits.float() * dy[a:b]).sum().backward()
    torch.testing.assert_close(logits.float(), logits_all[a:b].float(), rtol=2e-2, atol=2e-2,
                               msg=lambda m: f"{tag}: logits: {m}")
    grads = dict(full.named_parameters())
    for n, p in ep.named_parameters():
        if ".experts." in n:
            lo, hi = rank * p.shape[0], (rank + 1) * p.shape[0]
            # norm-relative, about 3x the largest error measured (2.8%): the per-rank bf16 partial sums
            # upstream flip FP8 roundings of the weight gradient's operands. An expert gradient scaled by
            # the ep size or missing a rank's tokens is 30% off or more.
            got, want = p.grad.float(), grads[n].grad[lo:hi].float()
            err = float((got - want).norm() / want.norm())
            assert err <= 0.1, f"{tag}: {n}: off by {err:.3g} in norm (bound 0.1)"
    for bad in (ep, torch.nn.Linear(4, 4)):
        try:
            shard_experts(bad, group)
        except ValueError as e:
            assert "experts" in str(e) or "FP8GroupedExperts" in str(e), str(e)
        else:
            raise AssertionError(f"{tag}: no ValueError")


def check_checkpoint(group, world: int, rank: int, dispatch: str) -> None:
    """``checkpoint=True`` gives the same bits, and its backward runs the same three all-to-alls as
    without it (no count exchange, no routing, no host copy again); the forward's all-to-alls."""
    E = 2 * world
    torch.manual_seed(0)
    full = FP8GroupedExperts(E, H, I, backend=BACKEND).to(torch.bfloat16)
    ts, ids = scenarios(world, E)["uniform"]
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(sum(ts), H, generator=gen).to(torch.bfloat16), torch.rand(sum(ts), K, generator=gen)
    a, b = sum(ts[:rank]), sum(ts[: rank + 1])
    calls = []
    a2a = dist.all_to_all_single

    def counted(*args, **kw):
        calls.append(torch.is_grad_enabled())
        return a2a(*args, **kw)

    results = {}
    dist.all_to_all_single = counted
    try:
        for ckpt in (False, True):
            shard = ExpertParallelExperts.from_full(full, group, dispatch, checkpoint=ckpt)
            xs, ws = x[a:b].clone().requires_grad_(), w[a:b].clone().requires_grad_()
            out = shard(xs, ids[a:b], ws)
            n_forward = len(calls)
            out.backward(torch.ones_like(out))
            results[ckpt] = (out.detach(), xs.grad, ws.grad, shard.gate_up_proj.grad, shard.down_proj.grad,
                             len(calls) - n_forward)
            # counts, ids, rows (BF16, or FP8 bytes with their scales in the fp32 columns), fp32 columns, return
            assert n_forward == 5, (dispatch, n_forward)
            calls.clear()
        with torch.no_grad():
            shard(x[a:b], ids[a:b], w[a:b])
        assert len(calls) == 5, (dispatch, len(calls))
    finally:
        dist.all_to_all_single = a2a
    for g1, g2 in zip(results[False][:5], results[True][:5]):
        assert torch.equal(g1, g2), f"world={world} rank={rank} {dispatch}: checkpoint changes the result"
    assert results[True][5] == results[False][5] == 3, results  # rows, fp32 columns, return


def check_construction(group, world: int) -> None:
    """``expert_parallel_moe`` holds ``E / W`` experts and runs; bad arguments raise ``ValueError``."""
    moe = expert_parallel_moe(H, I, 2 * world, K, group=group, dispatch="fp8", sync_free=True, backend=BACKEND,
                              shared_expert_hidden_size=16).to(torch.bfloat16)
    assert isinstance(moe, FP8MoE) and isinstance(moe.experts, ExpertParallelExperts)
    assert moe.experts.gate_up_proj.shape == (2, 2 * I, H) and moe.experts.down_proj.shape == (2, H, I)
    assert (moe.experts.dispatch, moe.experts.sync_free, moe.experts.backend) == ("fp8", True, BACKEND)
    assert moe.shared_experts is not None
    x = torch.randn(3, 2, H).to(torch.bfloat16)
    assert moe(x).shape == x.shape
    for call, what in (
        (lambda: ExpertParallelExperts(world + 1, H, I, group=group), "num_experts"),
        (lambda: ExpertParallelExperts(world, H, I, group=group, dispatch="int8"), "dispatch"),
        (lambda: ExpertParallelExperts(world, H, I, group=group, dispatch="fp8", recipe="bf16"), "dispatch"),
        (lambda: expert_parallel_moe(H, I, world + 1, K, group=group), "num_experts"),
        (lambda: expert_parallel_moe(H, I, world, K, group=group, dispatch="fp8", recipe="bf16"), "dispatch"),
    ):
        try:
            call()
        except ValueError as e:
            assert what in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError for a bad {what}")


def worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    groups = {w: dist.new_group(list(range(w)), timeout=TIMEOUT) for w in range(2, world)}
    groups[world] = dist.group.WORLD
    for w, group in groups.items():
        if rank < w:
            check_construction(group, w)
            check_round_trip(group, w, rank)
            check_fp8_rows_equal_quantize_after_receipt(group, w, rank)
            check_experts(group, w, rank, "rowwise")
            check_layer(group, w, rank, "fp8", 2 * w)
        if rank >= w:  # outside the group
            try:
                ExpertParallelExperts(2 * w, H, I, group=group)
            except ValueError as e:
                assert "not a member" in str(e), str(e)
            else:
                raise AssertionError("no ValueError outside the group")
        if rank < w == 3:
            check_checkpoint(group, w, rank, "fp8")
        if rank < w and w in (2, 4):  # Qwen3-MoE's 8 experts over 2 and 4 ranks
            check_hf_model(group, w, rank, "bf16" if w == 2 else "fp8")
        if rank < w == 2:
            check_hf_model(group, w, rank, "fp8", "olmoe")
            check_checkpoint(group, w, rank, "bf16")
            check_experts(group, w, rank, "bf16")
            check_experts(group, w, rank, "rowwise_gw_hp")  # what hf.convert gives small FP8 experts
            check_layer(group, w, rank, "bf16", w)  # one expert per rank
        dist.barrier()  # the ranks outside the group wait here
    dist.destroy_process_group()
