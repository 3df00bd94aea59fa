"""Scenarios of the FSDP2 + expert-parallel CPU test, run inside ``torch.multiprocessing`` workers (gloo).

Every rank builds the same single-process model from one seed; ``parallelize`` shards a copy over
the mesh and trains it, each rank on its slice of the global batch (every rank is a data-parallel
rank), and rank 0 alone trains the reference, a copy in that process only, on the concatenated
global batch with the mean loss. After every backward each gradient of the parallel model, gathered
whole, is compared with the reference's; after training, each parameter's total update.

The two are not bitwise equal: per-rank partial sums (the expert layer's per-rank partial outputs
are rounded to bf16 before they are added, FSDP adds per-rank gradients) and, in FP8 recipes, the
weight-gradient quantization groups (the token columns of each rank's batch, not of the global
batch) differ. The bounds (norm-relative, per parameter): ``BOUND`` of each recipe, about 3x the
largest error measured; an expert gradient off by the ep size (2 or 4) is 50-300% off, one that
misses another rank's tokens 30-70%, and a forward that reads last step's FP8 weights differs
by the whole update. AdamW's step ``lr * m / (sqrt(v) + eps)`` is ``lr * sign(g)`` at the first step
where ``|g| >> eps``: not continuous in a gradient element whose sign is within its error. The
training runs take ``eps`` = ``EPS``, about the gradients' RMS (0.8-2e-3 here), so that an update's
error follows its gradient's and the same bound holds for the updates.

The FP8 weight cache is checked apart, bit for bit: a parallelized model with the cache trains
exactly as one without it (same steps, same outputs at every micro-batch), and its caches hit
within a step (gradient accumulation) and miss after each optimizer step. So is the FP8
all-gather of the expert weights (``fp8_all_gather``): bitwise the training without it.
"""

from __future__ import annotations

import copy
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from moe_fp8 import FP8GroupedExperts, hf
from moe_fp8.parallel import checkpoint, parallelize
from moe_fp8.parallel.fp8_all_gather import Fp8AllGatherWeight, all_gather_bytes
from moe_fp8.parallel.fsdp import _placement_api
from moe_fp8.routing import RouterConfig
from moe_fp8.testing import TinyMoELM, lm_loss

TIMEOUT = datetime.timedelta(seconds=120)
#: where the models train and which grouped GEMM they use (``multi_gpu_workers`` sets "cuda" and None)
DEVICE, BACKEND = "cpu", "emulated"
LR, EPS = 1e-3, 1e-3
PER_RANK, SEQ, VOCAB = 2, 9, 64
#: norm-relative error bounds of a gradient and of a parameter's total update, per recipe
BOUND = {"bf16": 2e-2, "rowwise": 0.15}
#: ... and of the parameters' total updates after training apart (routing decisions may part too)
TRAJECTORY_BOUND = {"bf16": 5e-2, "rowwise": 0.3}
WRAPPED = "_checkpoint_wrapped_module."


def tiny_lm(recipe: str, router: RouterConfig | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyMoELM(VOCAB, 32, 32, 2, router=router, recipe=recipe, backend=BACKEND, device=DEVICE)


def hf_model(family: str, convert: bool = True, meta: bool = False) -> torch.nn.Module:
    """A tiny Hugging Face model of ``family`` (converted by ``hf.convert``), built on ``DEVICE``, or on
    the meta device with ``meta`` (no values)."""
    import transformers  # noqa: PLC0415  (optional dependency, installed for the tests)

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  vocab_size=VOCAB, tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, **common)
        with torch.device("meta" if meta else "cpu"):
            model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                            rope_scaling=None, **common)
        with torch.device("meta" if meta else "cpu"):
            model = transformers.DeepseekV3ForCausalLM(cfg)
    model = model.to("meta" if meta else DEVICE)
    if not convert:
        return model
    return hf.convert(model, backend=BACKEND, min_expert_size=0, min_fp8_wgrad_size=0, min_dense_size=0)


def batches(dp: int, steps: int, accumulate: int, seed: int = 1) -> torch.Tensor:
    """``(steps, accumulate, dp * PER_RANK, SEQ)`` token ids: the global micro-batches."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, accumulate, dp * PER_RANK, SEQ), generator=gen)


def logits_of(model, ids):
    out = model(ids.to(DEVICE))
    return out.logits if hasattr(out, "logits") else out


def _name(n: str) -> str:
    return n.replace(WRAPPED, "")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gradients(model, micro_batches: torch.Tensor, parallel: bool = False) -> dict:
    """``{name: whole gradient}`` (gathered on every rank) of the mean loss over ``micro_batches
    (A, B, S)``, accumulated over its ``A`` micro-batches (FSDP reduces at the last one)."""
    accumulate = micro_batches.shape[0]
    for a in range(accumulate):
        if parallel:
            model.set_requires_gradient_sync(a == accumulate - 1)
        ids = micro_batches[a].to(DEVICE)
        (lm_loss(logits_of(model, ids), ids) / accumulate).backward()
    return {_name(n): _full(p.grad).clone() for n, p in model.named_parameters()}


def train(model, data: torch.Tensor, rows: slice, first: int = 0, steps: int | None = None, optimizer=None,
          parallel: bool = False, probe=None, check=None):
    """AdamW steps ``[first, first + steps)`` on ``data[:, :, rows]``; returns the optimizer. With
    ``probe`` (a single-process copy), before each step: ``probe`` takes ``model``'s parameters and
    ``check(step, gradients of model, gradients of probe on the whole data[step])`` runs."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    steps = data.shape[0] - first if steps is None else steps
    for s in range(first, first + steps):
        if probe is not None:
            whole = [_full(p.detach()) for p in model.parameters()]  # a collective: every rank
            if _leads():
                with torch.no_grad():
                    for q, w in zip(probe.parameters(), whole):
                        q.copy_(w)
                probe.zero_grad()
                want = gradients(probe, data[s])
        got = gradients(model, data[s, :, rows], parallel)
        if probe is not None and _leads():
            check(s, got, want)
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    denom = want.float().norm()
    diff = (got.float() - want.float()).norm()
    return float("inf") if denom == 0 and diff > 0 else (0.0 if denom == 0 else float(diff / denom))


def compare(tag: str, got: dict, want: dict, bound: float) -> None:
    assert got.keys() == want.keys(), f"{tag}: names {sorted(got.keys() ^ want.keys())}"
    errors = {n: _rel(got[n], want[n]) for n in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= bound, f"{tag}: {worst} off by {errors[worst]:.3g} (bound {bound}); all: {errors}"


def compare_updates(tag: str, model, ref, start: dict, bound: float) -> None:
    """Checked on rank 0, the one that trained ``ref``; every rank gathers ``model``'s parameters."""
    got = {_name(n): _full(p.detach()) - start[_name(n)] for n, p in model.named_parameters()}
    if _leads():
        want = {n: p.detach() - start[n] for n, p in ref.named_parameters()}
        compare(tag, got, want, bound)


def _leads() -> bool:
    """Rank 0 trains the single-process references and checks; every rank takes part in the
    collectives that gather the parallel model's tensors. A failed check ends rank 0, and
    ``torch.multiprocessing.spawn`` then ends the others."""
    return dist.get_rank() == 0


def save_whole(path: str, model, optimizer=None) -> dict:
    """DCP checkpoint of ``model`` (and ``optimizer``) at ``path``; rank 0 also writes the whole
    parameters (returned) to ``path + "_params.pt"``."""
    checkpoint.save(path, model, optimizer)
    whole = {_name(n): _full(p.detach()) for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(whole, path + "_params.pt")
    return whole


def run_case(tag: str, build, recipe: str, mesh_shape: tuple, names: tuple, *, dispatch="bf16", steps=3,
             accumulate=1, prepare=None, save_to: str | None = None, **options) -> None:
    """Train ``build()`` on the mesh and alone; compare every step's gradients and the updates;
    save the parallel model to ``save_to`` (see :func:`save_whole`)."""
    mesh = init_device_mesh(DEVICE, mesh_shape, mesh_dim_names=names)
    rank, dp = dist.get_rank(), dist.get_world_size()
    full = build()
    if prepare is not None:
        prepare(full)
    ref = copy.deepcopy(full)
    if dispatch == "fp8":  # FP8 dispatch saves the FP8 rows for the weight gradient: so must the reference
        for m in ref.modules():
            if isinstance(m, FP8GroupedExperts):
                m.fp8_saved_input = True
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model = parallelize(full, mesh, dispatch=dispatch, **options)
    data = batches(dp, steps, accumulate)
    train(model, data, slice(rank * PER_RANK, (rank + 1) * PER_RANK), parallel=True, probe=copy.deepcopy(ref),
          check=lambda s, got, want: compare(f"{tag} step {s} grads", got, want, BOUND[recipe]))
    if _leads():
        train(ref, data, slice(None))
    compare_updates(f"{tag} updates", model, ref, start, TRAJECTORY_BOUND[recipe])
    if save_to is not None:
        save_whole(save_to, model)


def _silence_last_ep_rank(ep: int):
    """A DeepSeek-style router bias that routes no token to the last ep rank's experts."""

    def prepare(model) -> None:
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                E = m.e_score_correction_bias.numel()
                m.e_score_correction_bias[E - E // ep:] = -1e4

    return prepare


def checkpoint_round_trip(tmp: str, recipe: str = "rowwise") -> None:
    """3 steps on (dp_shard 2, ep 2) with FP8 dispatch and the weight cache, DCP save (model +
    AdamW) to ``tmp/step3``, 2 more steps; a model with other values in every parameter loads it on
    the same layout and its 2 steps equal the uninterrupted ones bit for bit (no FP8 copy of the
    old weights survives the load); (dp_shard 4, ep 1) resumes too (:func:`resume`)."""
    rank = dist.get_rank()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    data = resume_data()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    model = parallelize(tiny_lm(recipe), mesh, dispatch="fp8", cache_weights=True)
    optimizer = train(model, data, rows, 0, 3, parallel=True)
    path = os.path.join(tmp, "step3")
    whole = save_whole(path, model, optimizer)
    train(model, data, rows, 3, 2, optimizer, parallel=True)
    uninterrupted = {n: _full(p.detach()) for n, p in model.named_parameters()}
    other_values = tiny_lm(recipe)
    for p in other_values.parameters():
        p.data.uniform_(-1, 1)
    again = parallelize(other_values, mesh, dispatch="fp8", cache_weights=True)
    logits_of(again, data[0, 0, rows])  # fills the FP8 weight cache with the old weights
    opt_again = torch.optim.AdamW(again.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    checkpoint.load(path, again, opt_again)
    for n, p in again.named_parameters():
        assert torch.equal(_full(p.detach()), whole[n]), f"checkpoint: {n} not restored"
    train(again, data, rows, 3, 2, opt_again, parallel=True)
    for n, p in again.named_parameters():
        assert torch.equal(_full(p.detach()), uninterrupted[n]), f"resumed (same layout): {n} differs"
    resume(tmp, (4, 1), ("dp_shard", "ep"), recipe)


def resume_data() -> torch.Tensor:
    """The global batches of :func:`checkpoint_round_trip`: 5 steps of 8 sequences."""
    return batches(4, 5, 1, seed=3)


def resume(tmp: str, mesh_shape: tuple, names: tuple, recipe: str = "rowwise") -> None:
    """Load ``tmp/step3`` (model + AdamW) on this layout, train steps 3 and 4 of :func:`resume_data`
    (each rank its share of the same global batch): the parameters' updates equal 5 single-process
    steps within the bound."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    data = resume_data()
    per_rank = data.shape[2] // dp
    ref = tiny_lm(recipe)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    if _leads():
        train(ref, data, slice(None))
    model = parallelize(tiny_lm(recipe), init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    checkpoint.load(os.path.join(tmp, "step3"), model, optimizer)
    train(model, data, slice(rank * per_rank, (rank + 1) * per_rank), 3, 2, optimizer, parallel=True)
    compare_updates(f"resumed on {dict(zip(names, mesh_shape))}", model, ref, start, TRAJECTORY_BOUND[recipe])


def cache_never_stale() -> None:
    """With and without the FP8 weight cache, 3 AdamW steps (lr 0.05: a stale FP8 copy would be far
    off) of 2 micro-batches on (dp_shard 2, ep 2): outputs and parameters bitwise equal throughout;
    each entry misses once per step and hits at the second micro-batch (its weights gathered anew),
    except in the first step, whose first micro-batch keeps nothing (two misses). The model without
    it keeps amaxes alone, keyed on the same sharded state (served where the GEMMs quantize the
    weight themselves, not on this backend)."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    models = [parallelize(tiny_lm("rowwise"), mesh, cache_weights=c) for c in (True, False)]
    # foreach: the step writes the DTensors' local shards (their version counters, not the wrappers')
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, eps=EPS, foreach=True) for m in models]
    data = batches(dp, 3, 2, seed=5)
    caches = [c for m in models[0].modules() if isinstance(m, FP8GroupedExperts) for c in m._caches]
    for s in range(3):
        misses = sum(c.misses for c in caches)
        for a in range(2):
            ids = data[s, a, rank * PER_RANK:(rank + 1) * PER_RANK]
            outs = []
            for m in models:
                m.set_requires_gradient_sync(a == 1)
                logits = logits_of(m, ids)
                (lm_loss(logits, ids) / 2).backward()
                outs.append(logits.detach())
            assert torch.equal(*outs), f"cache: step {s} micro-batch {a}: logits differ from the uncached model"
        want = len(caches) * (2 if s == 0 else 1)
        assert sum(c.misses for c in caches) - misses == want, f"cache: step {s}: expected {want} misses"
        for o in opts:
            o.step()
            o.zero_grad()
    assert all(c.hits == 2 for c in caches), f"cache: expected a hit at the second micro-batch of steps 2, 3: {caches}"
    amax_caches = [c for m in models[1].modules() if isinstance(m, FP8GroupedExperts) for c in m._caches]
    assert amax_caches and not any(c.copies for c in amax_caches)
    assert all(c.source_stamp is not None for c in amax_caches), "cache: the amax-only caches are not keyed"
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(_full(p.detach()), _full(q.detach())), f"cache: {n} differs from the uncached model"


def fp8_all_gather_exact(tmp: str) -> None:
    """With and without ``fp8_all_gather``, 2 AdamW steps of 2 micro-batches on (dp_shard 2, ep 2): BF16
    dispatch; FP8 dispatch with activation checkpointing and BF16 parameters (``mp_policy``). Outputs,
    gradients and parameters bitwise equal throughout; the pre-all-gather hooks returned FP8 bytes
    and fp32 scales only, as many as ``all_gather_bytes`` says; the state dict holds plain tensors of
    the parameters' dtype, and its DCP checkpoint loads into a model of other values bit for bit."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    gathered = []  # (dtype, bytes) of every all-gather input the hooks returned on this rank
    pre_all_gather = Fp8AllGatherWeight.fsdp_pre_all_gather

    def recording(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.extend((t.dtype, t.numel() * t.element_size()) for t in inputs)
        return inputs, metadata

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases = {"bf16-dispatch": dict(dispatch="bf16"),
             "fp8-dispatch checkpointed bf16-params": dict(dispatch="fp8", activation_checkpoint=True, mp_policy=bf16)}
    Fp8AllGatherWeight.fsdp_pre_all_gather = recording
    try:
        for tag, options in cases.items():
            gathered.clear()
            models = [parallelize(tiny_lm("rowwise"), mesh, fp8_all_gather=f, **options) for f in (True, False)]
            opts = [torch.optim.AdamW(m.parameters(), lr=0.05, eps=EPS) for m in models]
            data = batches(dp, 2, 2, seed=7)
            for s in range(2):
                for a in range(2):
                    outs = []
                    for m in models:
                        m.set_requires_gradient_sync(a == 1)
                        logits = logits_of(m, data[s, a, rows])
                        (lm_loss(logits, data[s, a, rows]) / 2).backward()
                        outs.append(logits.detach())
                    assert torch.equal(*outs), f"fp8_all_gather {tag}: step {s} micro-batch {a}: logits differ"
                for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
                    assert torch.equal(_full(p.grad), _full(q.grad)), f"fp8_all_gather {tag}: step {s}: {n}.grad"
                for o in opts:
                    o.step()
                    o.zero_grad()
            for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
                assert torch.equal(_full(p.detach()), _full(q.detach())), f"fp8_all_gather {tag}: {n} differs"
            kinds = {d for d, _ in gathered}
            assert kinds == {torch.float8_e4m3fn, torch.float32}, f"fp8_all_gather {tag}: gathered {gathered}"
            # each rank sends 1 / dp_shard of every gather: whole rounds of all_gather_bytes, one per
            # micro-batch, and one more where FSDP gathers again for a checkpointed recompute (torch
            # 2.9 does for all but the last micro-batch, torch 2.13 for none)
            per_round = all_gather_bytes(models[0])["fp8"]
            rounds, rest = divmod(2 * sum(b for _, b in gathered), per_round)
            assert rest == 0 and 4 <= rounds <= 8, f"fp8_all_gather {tag}: {gathered}: not 4-8 rounds of {per_round} bytes"
            assert rounds == 4 or options.get("activation_checkpoint"), f"fp8_all_gather {tag}: {rounds} rounds"
    finally:
        Fp8AllGatherWeight.fsdp_pre_all_gather = pre_all_gather
    for key, value in models[0].state_dict().items():  # the experts' weights: plain fp32 shards
        assert type(value._local_tensor) is torch.Tensor and value.dtype == torch.float32, f"fp8_all_gather: {key}"
    path = os.path.join(tmp, "fp8_all_gather")
    whole = save_whole(path, models[0])
    other = tiny_lm("rowwise")
    for p in other.parameters():
        p.data.uniform_(-1, 1)
    other = parallelize(other, mesh, dispatch="fp8", activation_checkpoint=True, mp_policy=bf16, fp8_all_gather=True)
    checkpoint.load(path, other)
    for n, p in other.named_parameters():
        assert torch.equal(_full(p.detach()), whole[_name(n)]), f"fp8_all_gather: {n} not restored"
    ids = data[0, 0, rows]
    assert torch.equal(logits_of(other, ids), logits_of(models[0], ids)), "fp8_all_gather: loaded model differs"


def four_ranks(tmp: str) -> None:
    names = ("dp_shard", "ep")
    cache_never_stale()
    fp8_all_gather_exact(tmp)
    dsv3_router = RouterConfig(8, 2, "sigmoid", renormalize=True, use_correction_bias=True)
    run_case("tiny rowwise 2x2 bf16-dispatch accumulate=2", lambda: tiny_lm("rowwise"), "rowwise", (2, 2),
             names, steps=3, accumulate=2)
    run_case("tiny rowwise 1x4 fp8-dispatch empty ep rank", lambda: tiny_lm("rowwise", dsv3_router), "rowwise",
             (1, 4), names, dispatch="fp8", steps=2, prepare=_silence_last_ep_rank(4))
    run_case("tiny bf16 4x1", lambda: tiny_lm("bf16"), "bf16", (4, 1), names, steps=2)
    run_case("qwen3_moe rowwise 2x2 fp8-dispatch", lambda: hf_model("qwen3_moe"), "rowwise", (2, 2), names,
             dispatch="fp8", steps=2, save_to=os.path.join(tmp, "qwen3_moe"))
    run_case("deepseek_v3 rowwise 2x2 bf16-dispatch", lambda: hf_model("deepseek_v3"), "rowwise", (2, 2), names,
             steps=2, save_to=os.path.join(tmp, "deepseek_v3"))
    compiled = dict(sync_free=True, activation_checkpoint=True, compile={"backend": "aot_eager"})
    if _placement_api() is not None:
        run_case("tiny rowwise 2x2 checkpointed compiled sync-free", lambda: tiny_lm("rowwise"), "rowwise", (2, 2),
                 names, steps=2, **compiled)
    else:  # torch < 2.13: the experts are FSDP units of their own, whose hooks a block's full graph cannot hold
        mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=names)
        try:
            parallelize(tiny_lm("rowwise"), mesh, **compiled)
        except ValueError as e:
            assert "needs torch >= 2.13" in str(e), e
        else:
            raise AssertionError("compile with ep > 1 on torch < 2.13: expected a ValueError")
    checkpoint_round_trip(tmp)


def eight_ranks(tmp: str) -> None:
    run_case("tiny rowwise 2x2x2 (HSDP) fp8-dispatch accumulate=2", lambda: tiny_lm("rowwise"), "rowwise", (2, 2, 2),
             ("dp_replicate", "dp_shard", "ep"), dispatch="fp8", steps=3, accumulate=2)
    run_case("deepseek_v3 rowwise 2x4 bf16-dispatch", lambda: hf_model("deepseek_v3"), "rowwise", (2, 4),
             ("dp_shard", "ep"), steps=2)
    resume(tmp, (2, 2, 2), ("dp_replicate", "dp_shard", "ep"))  # a checkpoint of 4 ranks


def built_on_meta(tmp: str) -> None:
    """A model too large for one device: built and converted on the meta device, parallelized there
    (dp_shard 1 x ep 2), ``to_empty`` on the device, its non-persistent buffers (rotary tables) made
    again, the 4-rank spawn's DCP checkpoint of a converted Hugging Face model loaded: every
    parameter equals the saved whole one, and the logits those of one process holding them."""
    mesh = init_device_mesh(DEVICE, (1, 2), mesh_dim_names=("dp_shard", "ep"))
    ids = batches(1, 1, 1, seed=5)[0, 0]
    for family in ("qwen3_moe", "deepseek_v3"):
        whole = torch.load(os.path.join(tmp, f"{family}_params.pt"))
        model = parallelize(hf_model(family, meta=True), mesh)
        assert all(p.is_meta for p in model.parameters())
        model.to_empty(device=DEVICE)
        ref = hf_model(family)
        with torch.no_grad():
            made = dict(ref.named_buffers())
            for n, b in model.named_buffers():
                b.copy_(made[_name(n)])
            for n, p in ref.named_parameters():
                p.copy_(whole[n])
        checkpoint.load(os.path.join(tmp, family), model)
        for n, p in model.named_parameters():
            assert torch.equal(_full(p.detach()), whole[_name(n)]), f"{family} built on meta: {n} not loaded"
        got, want = logits_of(model, ids), logits_of(ref, ids)
        assert _rel(got, want) <= 1e-2, f"{family} built on meta: logits off by {_rel(got, want):.3g}"


SCENARIOS = {"four_ranks": four_ranks, "eight_ranks": eight_ranks, "built_on_meta": built_on_meta}


def worker(rank: int, world: int, init_file: str, scenario: str, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    SCENARIOS[scenario](tmp)
    dist.destroy_process_group()

