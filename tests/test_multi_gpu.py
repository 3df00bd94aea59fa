"""Expert parallelism and FSDP2 on 2 or more GPUs, one NCCL rank each (``multi_gpu_workers``), on
every GPU of the machine up to 8; skipped below 2.

* the expert-parallel layer equals the single-GPU layer on the same weights and global batch: BF16
  and FP8 dispatch, uneven token counts and an empty rank, skewed routing, the sync-free dispatch,
  and the sync-free forward replayed from a CUDA graph;
* ``parallelize`` (FSDP2 + expert parallelism) trains as one GPU does on the global batch, on every
  ``(dp_shard, ep)`` mesh the GPU count allows."""

import pytest
import torch

from rank_spawn import spawn

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("scenario", ["layer", "models"])
def test_on_gpus_equals_one_gpu(tmp_path, scenario):
    spawn("multi_gpu_workers", _gpus(), _gpus(), str(tmp_path / "init"), scenario)
