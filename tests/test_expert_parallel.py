"""Expert parallelism on gloo (CPU): process groups of 2, 3 and 4 ranks against one process.

The scenarios (``ep_workers``) run inside one spawn of 4 processes: uniform routing with a dropped
pair, every token to one rank, a rank with no tokens, every rank but one empty; BF16 and FP8
dispatch; the identity round trip; two runs bitwise equal; FP8 rows as received == quantized
after receipt; the full FP8MoE (router, shared expert) sharded; converted Hugging Face Qwen3-MoE and
OLMoE models sharded. A hang fails by the gloo timeout.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rank_spawn import spawn
from moe_fp8.parallel import ExpertParallelExperts, destination_plan, destination_ranks, dispatch_bytes_per_row
from moe_fp8.parallel import expert_parallel_moe

WORLD = 4


@pytest.mark.slow(12)
def test_expert_parallel_gloo_2_3_4_ranks(tmp_path):
    spawn("ep_workers", WORLD, WORLD, str(tmp_path / "init"))


def test_destination_ranks_against_a_loop():
    """Each token's distinct destination ranks, increasing along the row, -1 in min(k, W) - their
    number columns; ids outside [0, E) go nowhere. The plan over them sends each token to each rank
    once, grouped by rank, tokens in order."""
    gen = torch.Generator().manual_seed(0)
    for world, el, k in ((1, 8, 4), (3, 2, 4), (4, 1, 2), (8, 2, 3), (2, 3, 1)):
        E = world * el
        ids = torch.randint(-1, E + 1, (37, k), generator=gen)
        got = destination_ranks(ids, el, world)
        assert got.dtype == torch.int32 and got.shape == (37, min(k, world))
        for t in range(37):
            want = sorted({int(i) // el for i in ids[t] if 0 <= i < E})
            row = got[t].tolist()
            assert [r for r in row if r >= 0] == want and row.count(-1) == min(k, world) - len(want), (world, k, t)
        plan = destination_plan(ids, el, world)
        assert plan.counts.tolist() == [int((got == d).sum()) for d in range(world)]
        n = int(plan.counts.sum())
        tokens = plan.row_to_pair[:n].long() // plan.top_k
        want = [t for d in range(world) for t in range(37) if d in got[t].tolist()]
        assert tokens.tolist() == want
    assert destination_ranks(torch.empty(0, 2, dtype=torch.int64), 2, 2).shape == (0, 2)


def test_needs_a_process_group():
    with pytest.raises(ValueError, match="group"):
        ExpertParallelExperts(4, 32, 32)
    with pytest.raises(ValueError, match="group"):
        expert_parallel_moe(32, 32, 4, 2, dispatch="fp8")


def test_bytes_per_row():
    H = 7168
    assert dispatch_bytes_per_row(H, "fp8") / dispatch_bytes_per_row(H, "bf16") == (H + 4) / (2 * H)
    assert dispatch_bytes_per_row(H, "fp8", top_k=8) / dispatch_bytes_per_row(H, "bf16", top_k=8) < 0.51
    with pytest.raises(ValueError, match="dispatch"):
        dispatch_bytes_per_row(H, "fp4")


def _run_module(module: str, *args: str, ranks: int | None = None) -> None:
    """``python -m module args`` (under ``torchrun --nproc-per-node ranks`` when given) on CPU kernels'
    torch references, from the repository root; fails the test with its output on a non-zero exit."""
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks else []
    run = subprocess.run([sys.executable, *launcher, "-m", module, *args], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def test_benchmark_quick_on_cpu(tmp_path):
    """``python -m moe_fp8.bench.expert_parallel --quick`` runs end to end (gloo, world size 1; routing
    kernels' torch references) and its EP layers equal the plain layer."""
    _run_module("moe_fp8.bench.expert_parallel", "--quick", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "expert_parallel.json").read_text())["rows"]
    assert [r["layer"] for r in rows] == ["FP8MoE", "FP8MoE, fp8_saved_input", "EP, bf16 dispatch", "EP, fp8 dispatch",
                                          "EP, bf16 dispatch, sync-free", "EP, fp8 dispatch, sync-free"]
    assert all(r["equal_to_plain"] for r in rows)
    assert (tmp_path / "expert_parallel.md").stat().st_size > 0


def test_scaling_benchmark_quick_on_two_cpu_ranks(tmp_path):
    """``torchrun --nproc-per-node 2 -m moe_fp8.bench.ep_scaling --quick`` runs end to end on gloo: every
    layer timed, the dispatch's bytes to the other rank counted (FP8 rows about half of BF16's, the
    sync-free dispatch sends every token), the all-to-all alone timed."""
    _run_module("moe_fp8.bench.ep_scaling", "--quick", "--out", str(tmp_path), ranks=2)
    rows = {r["layer"]: r for r in json.loads((tmp_path / "ep_scaling_dsv3_w2.json").read_text())["rows"]}
    assert list(rows) == ["one GPU, all experts", "one GPU, all experts, bf16 recipe", "EP, bf16 recipe",
                          "EP, bf16 dispatch", "EP, fp8 dispatch", "EP, bf16 dispatch, sync-free",
                          "EP, fp8 dispatch, sync-free", "all-to-all alone"]
    assert all(r["step_ms"] > 0 for r in rows.values())
    H, K, T = 64, 2, 64  # the --quick shapes
    bf16, fp8 = rows["EP, bf16 dispatch"]["sent_bytes"], rows["EP, fp8 dispatch"]["sent_bytes"]
    assert bf16 > 0 and fp8 * dispatch_bytes_per_row(H, "bf16", top_k=K) == bf16 * dispatch_bytes_per_row(H, "fp8", top_k=K)
    assert rows["EP, fp8 dispatch, sync-free"]["sent_bytes"] == T * dispatch_bytes_per_row(H, "fp8", top_k=K)
    md = (tmp_path / "ep_scaling_dsv3_w2.md").read_text()
    ratio = dispatch_bytes_per_row(H, "fp8", top_k=K) / dispatch_bytes_per_row(H, "bf16", top_k=K)
    assert f"| FP8 dispatch bytes / BF16 dispatch bytes | {ratio:.3f} | <= 0.51 |" in md, md
    assert "speed over the EP BF16-recipe layer" in md


def test_parallel_step_benchmark_quick_on_two_cpu_ranks(tmp_path):
    """``torchrun --nproc-per-node 2 -m moe_fp8.bench.parallel_step --quick``: the weak-scaling step of
    the CPU stand-in DeepSeek-V3 on a 1 x 2 mesh, both recipes (FP8 dispatch for the fp8 one), writes
    its report; with the same weights and batches the variants' first losses agree."""
    _run_module("moe_fp8.bench.parallel_step", "--quick", "--recipes", "fp8", "bf16", "--dispatch", "fp8",
                "--out", str(tmp_path), ranks=2)
    rows = json.loads((tmp_path / "parallel_step_dsv3_w2_ep2.json").read_text())["rows"]
    assert [(r["recipe"], r["variant"]) for r in rows] == [(rc, v) for rc in ("fp8", "bf16") for v in ("fsdp", "fsdp+ac")]
    for recipe in ("fp8", "bf16"):
        first = [r["losses"] for r in rows if r["recipe"] == recipe]
        assert first[0] == first[1] and all(4.0 < v < 7.0 for v in first[0])
    assert all(r["step_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0 for r in rows)


def test_weak_scaling_table_from_the_reports(tmp_path):
    """``parallel_step --weak-scaling`` tabulates tokens/s per GPU of each W-GPU report over the same
    (recipe, variant) on one GPU; variants the one-GPU run lacks, and reports of other model sizes,
    are left out; a missing one-GPU report is named."""
    from moe_fp8.bench import parallel_step

    def report(stem, env, rows):
        (tmp_path / f"{stem}.json").write_text(json.dumps(dict(env=env, rows=rows)))

    with pytest.raises(FileNotFoundError, match="parallel_step_dsv3_gpu.json"):
        parallel_step.weak_scaling(tmp_path, "dsv3")
    env = dict(layers=4, tokens_per_rank="8 x 1024", dispatch="fp8")
    report("parallel_step_dsv3_gpu", dict(env, world_size=1, ep=1),
           [dict(recipe="fp8", variant="fsdp", tokens_per_s_per_gpu=1000.0),
            dict(recipe="bf16", variant="fsdp", tokens_per_s_per_gpu=800.0)])
    with pytest.raises(FileNotFoundError, match="no parallel_step_dsv3_w"):
        parallel_step.weak_scaling(tmp_path, "dsv3")
    report("parallel_step_dsv3_w4_ep4", dict(env, world_size=4, ep=4, layers=2),  # another model size: left out
           [dict(recipe="fp8", variant="fsdp", tokens_per_s_per_gpu=1.0)])
    report("parallel_step_dsv3_w8_ep8", dict(env, world_size=8, ep=8),
           [dict(recipe="fp8", variant="fsdp", tokens_per_s_per_gpu=870.0),
            dict(recipe="fp8", variant="fsdp+ac", tokens_per_s_per_gpu=700.0)])
    report("parallel_step_dsv3_w2_ep2", dict(env, world_size=2, ep=2),
           [dict(recipe="bf16", variant="fsdp", tokens_per_s_per_gpu=760.0)])
    rows = parallel_step.weak_scaling(tmp_path, "dsv3")
    assert [(r["recipe"], r["world_size"], r["efficiency"]) for r in rows] == [("bf16", 2, pytest.approx(0.95)),
                                                                               ("fp8", 8, pytest.approx(0.87))]
    _run_module("moe_fp8.bench.parallel_step", "--weak-scaling", "--out", str(tmp_path))
    md = (tmp_path / "parallel_step_dsv3_weak_scaling.md").read_text()
    assert "| fp8 | fsdp | 8 | 8 | 870 | 87% |" in md, md
