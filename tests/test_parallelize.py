"""``moe_fp8.parallel.parallelize`` (FSDP2 + expert parallelism on a DeviceMesh) on gloo, CPU.

Three spawns (``fsdp_workers``): 4 ranks (dp_shard x ep = 2 x 2, 1 x 4, 4 x 1; own model, converted
Qwen3-MoE and DeepSeek-V3; BF16 and FP8 dispatch; an ep rank without tokens; gradient
accumulation; activation checkpointing + per-block compile; the FP8 weight cache; the FP8
all-gather of the expert weights, bitwise against the same model without it; DCP save, resume
in the same and in another layout), 8 ranks (HSDP 2 x 2 x 2, DeepSeek-V3 at 2 x 4, and loading
the 4-rank checkpoint: another world size) and 2 ranks (the converted Hugging Face models'
checkpoints loaded into models built, converted and parallelized on the meta device). Then, in
this process, the checkpoint loads into a single-process model and into the unconverted Hugging
Face model's keys."""

import os

import pytest
import torch

import fsdp_workers
from rank_spawn import spawn
from moe_fp8.parallel import ParallelLayout, parallelize

pytestmark = pytest.mark.slow(85)


def _spawn(scenario: str, world: int, tmp: str) -> None:
    spawn("fsdp_workers", world, world, os.path.join(tmp, f"init_{scenario}"), scenario, tmp)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """The 4-rank spawn's directory (its DCP checkpoint after 3 steps and the whole parameters)."""
    tmp = str(tmp_path_factory.mktemp("parallel"))
    _spawn("four_ranks", 4, tmp)
    return tmp


def test_four_ranks(checkpoint_dir):
    assert os.path.exists(os.path.join(checkpoint_dir, "step3_params.pt"))


def test_eight_ranks_and_another_world_size(checkpoint_dir):
    _spawn("eight_ranks", 8, checkpoint_dir)


def test_model_built_on_meta_loads_the_checkpoint(checkpoint_dir):
    _spawn("built_on_meta", 2, checkpoint_dir)


def test_checkpoint_loads_into_one_process(checkpoint_dir):
    from moe_fp8.parallel import checkpoint

    model = fsdp_workers.tiny_lm("rowwise")
    for p in model.parameters():
        torch.nn.init.uniform_(p.data, -1, 1)  # nothing left from the seed
    checkpoint.load(os.path.join(checkpoint_dir, "step3"), model)
    want = torch.load(os.path.join(checkpoint_dir, "step3_params.pt"))
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for n, p in got.items():
        assert torch.equal(p.detach(), want[n]), n


def test_checkpoint_keys_are_the_unconverted_models(checkpoint_dir):
    """A converted Hugging Face model's checkpoint (written by the 4-rank spawn) loads into the
    unconverted model of the same config by its own keys, strictly."""
    from moe_fp8.parallel import checkpoint

    for family in ("qwen3_moe", "deepseek_v3"):
        plain = fsdp_workers.hf_model(family, convert=False)
        for p in plain.parameters():
            torch.nn.init.uniform_(p.data, -1, 1)
        checkpoint.load(os.path.join(checkpoint_dir, family), plain)
        want = torch.load(os.path.join(checkpoint_dir, f"{family}_params.pt"))
        got = plain.state_dict()
        for n, t in want.items():
            assert torch.equal(got[n], t), f"{family}: {n}"


def test_layout_errors():
    class FakeMesh:
        pass

    with pytest.raises(TypeError, match="DeviceMesh"):
        ParallelLayout(FakeMesh())
    with pytest.raises(TypeError, match="nn.Module"):
        parallelize(object(), FakeMesh())
