"""``parallelize`` on one GPU (NCCL, world size 1, a 1 x 1 mesh): 5 AdamW steps of a parallelized
model equal the same model trained without it, eagerly, with activation checkpointing, and with
every block compiled by Inductor (``fullgraph=True``); the FP8 weight cache too; and with
``fp8_all_gather`` the same as without (the CUDA quantizers and GEMMs on the gathered operands)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from moe_fp8 import hf  # noqa: E402
from moe_fp8.parallel import parallelize  # noqa: E402
from moe_fp8.parallel.fp8_all_gather import Fp8AllGatherWeight, all_gather_bytes  # noqa: E402
from moe_fp8.testing import TinyMoELM, lm_loss  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_shard", "ep"))
    dist.destroy_process_group()


def _tiny():
    torch.manual_seed(0)
    return TinyMoELM(VOCAB, 256, 256, 2, recipe="rowwise", device="cuda", dtype=torch.bfloat16)


def _deepseek_v3():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=64, kv_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, rope_scaling=None, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    return hf.convert(model, min_expert_size=0, min_fp8_wgrad_size=0, min_dense_size=0)


def _logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def _train(model, steps=5, accumulate=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(steps):
        for a in range(accumulate):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(a == accumulate - 1)
            ids = torch.randint(0, VOCAB, (4, 129), device="cuda", generator=gen)
            loss = lm_loss(_logits(model, ids), ids) / accumulate
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _params(model):
    return {n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()}


def _compile_blocks(model):
    for block in (model.layers if hasattr(model, "layers") else model.model.layers):
        block.compile(fullgraph=True)


@pytest.mark.parametrize("build", [_tiny, _deepseek_v3], ids=["tiny", "deepseek_v3"])
@pytest.mark.parametrize("how", ["eager", "checkpointed", "compiled", "cached"])
def test_parallelized_equals_one_gpu(mesh, build, how):
    base = build()
    plain = copy.deepcopy(base)
    if how == "compiled":
        _compile_blocks(plain)
    options = dict(activation_checkpoint=how == "checkpointed", compile=how == "compiled", cache_weights=how == "cached")
    model = parallelize(base, mesh, **options)
    want, got = _train(plain), _train(model)
    p_want, p_got = _params(plain), _params(model)
    diffs = {n: (p_got[n].float() - p_want[n].float()).abs().max().item() for n in p_want}
    worst = max(diffs, key=diffs.get)
    print(f"{build.__name__} {how}: losses {got[-2:]} vs {want[-2:]}; max parameter diff {diffs[worst]:.3g} ({worst})")
    if how == "compiled":  # the same graphs either way, FSDP's copies around them: equal up to Inductor's choices
        assert max(abs(a - b) for a, b in zip(got, want)) < 2e-2
        assert diffs[worst] < 1e-2
    else:  # world size 1: FSDP copies parameters and gradients, nothing else changes
        assert got == want
        assert diffs[worst] == 0.0, worst


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
def test_fp8_all_gather_equals_plain_gather(mesh, checkpointed, monkeypatch):
    """World size 1: FSDP "gathers" by copying the packed FP8 bytes and scales; 5 steps of 2
    micro-batches equal the same parallelized model without the option, bit for bit, and every
    micro-batch moved the bytes ``all_gather_bytes`` says (uint8: the packed FP8 and fp32)."""
    sizes = []
    pre_all_gather = Fp8AllGatherWeight.fsdp_pre_all_gather

    def recording(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
        sizes.extend((t.dtype, t.numel()) for t in inputs)
        return inputs, metadata

    monkeypatch.setattr(Fp8AllGatherWeight, "fsdp_pre_all_gather", recording)
    base = _tiny()
    plain = parallelize(copy.deepcopy(base), mesh, activation_checkpoint=checkpointed)
    model = parallelize(base, mesh, activation_checkpoint=checkpointed, fp8_all_gather=True)
    want, got = _train(plain), _train(model)
    assert got == want
    p_want, p_got = _params(plain), _params(model)
    assert all(torch.equal(p_got[n], p_want[n]) for n in p_want)
    assert {d for d, _ in sizes} == {torch.uint8}
    assert sum(n for _, n in sizes) == 10 * all_gather_bytes(model)["fp8"]  # 5 steps x 2 micro-batches
