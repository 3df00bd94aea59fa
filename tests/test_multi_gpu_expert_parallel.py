"""Expert parallelism on 2 or more GPUs, one NCCL rank each (``multi_gpu_workers``): the layer equals
the single-GPU layer on the same weights and global batch, with BF16 and FP8 dispatch, skewed
routing, an empty rank and the sync-free dispatch, and the sync-free forward replays from a CUDA
graph. Runs on every GPU of the machine, up to 8; skipped below 2."""

import pytest
import torch

from rank_spawn import spawn

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
def test_expert_parallel_layer_on_gpus_equals_one_gpu(tmp_path):
    spawn("multi_gpu_workers", _gpus(), _gpus(), str(tmp_path / "init"))
