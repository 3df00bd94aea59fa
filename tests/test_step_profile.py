"""The step profile of the whole-model benchmark: kernels sorted into categories, and the allocator's
history replayed to the allocations alive at the peak."""

import os

import pytest
import torch

from moe_fp8.bench import step_profile


def test_library_kernels_are_known_by_name():
    """Every kernel the library launches is found under its own category; helpers imported into
    another module count once, where they are defined."""
    import moe_fp8.hf  # noqa: F401 - loads the layers, the optimizer and their kernels
    import moe_fp8.optim  # noqa: F401

    names = step_profile.library_kernel_names()
    assert names["_grouped_mm_2d3d_kernel"] == names["_grouped_mm_2d2d_kernel"] == "moe_fp8 GEMM"
    assert names["_rowwise_kernel"] == names["_swiglu_quant_kernel"] == "moe_fp8 quantization"
    assert names["combine_backward_kernel"] == names["plan_kernel"] == "moe_fp8 routing (plan, permute, combine)"
    assert names["_adamw_quantize_kernel"] == "moe_fp8 optimizer"
    assert names["to_fp8"] == "moe_fp8 quantization"  # used by the optimizer's kernel, defined with the quantizers


@pytest.mark.parametrize("name, category", [
    ("_colwise_kernel", "moe_fp8 quantization"),
    ("_colwise_kernel_0d1d2de", "moe_fp8 quantization"),  # an older Triton's specialization suffix
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "Inductor fused (triton_*)"),
    ("triton_poi_fused_silu_mul_3", "Inductor fused (triton_*)"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off",
     "GEMM FP8 (cuBLAS / CUTLASS)"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<float_e4m3_t>>", "GEMM FP8 (cuBLAS / CUTLASS)"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "GEMM (cuBLAS / CUTLASS)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize256x128x64", "GEMM (cuBLAS / CUTLASS)"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer and clipping"),
    ("Memcpy DtoD (Device -> Device)", "copy and memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "ATen elementwise and reductions"),
    ("aten::_scaled_mm", "GEMM FP8 (cuBLAS / CUTLASS)"),  # CPU operators (the smoke run)
    ("aten::mm", "GEMM (cuBLAS / CUTLASS)"),
    ("aten::mm_backward_extra", "other"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_categories(name, category):
    assert step_profile.kernel_category(name, step_profile.library_kernel_names()) == category


def test_summarize_adds_time_per_category_and_kernel():
    events = [("_rowwise_kernel", 100.0), ("triton_poi_fused_0", 50.0), ("_rowwise_kernel", 300.0),
              ("nvjet_tst_x", 2000.0), ("mystery", 1.0)]
    s = step_profile.summarize(events, {"_rowwise_kernel": "moe_fp8 quantization"}, top=3)
    assert s["kernels"] == 5 and s["total_ms"] == pytest.approx(2.451)
    assert list(s["ms"]) == ["GEMM (cuBLAS / CUTLASS)", "moe_fp8 quantization", "Inductor fused (triton_*)", "other"]
    assert s["ms"]["moe_fp8 quantization"] == pytest.approx(0.4)
    assert s["top"][1] == ["_rowwise_kernel", "moe_fp8 quantization", 2, pytest.approx(0.4)]
    assert len(s["top"]) == 3
    assert [k[0] for k in s["by_kernel"]] == ["nvjet_tst_x", "_rowwise_kernel", "triton_poi_fused_0", "mystery"]


def _frame(path, line: int, name: str = "f") -> dict:
    return dict(filename=str(path), line=line, name=name)


def test_replay_peak_finds_the_live_set_at_the_highest_point(tmp_path):
    """Allocations alive at the peak, by the first frame outside torch; frees before and after the
    peak are followed; a block freed only by ``free_completed`` counts as freed there."""
    model = tmp_path / "model.py"
    model.write_text("x = 1\nbuf1 = empty_strided_cuda((8192, 14336))\nh = torch.mm(a, b)\n")
    generated = tmp_path / "torchinductor_user" / "ab" / "cabc.py"
    generated.parent.mkdir(parents=True)
    generated.write_text("buf12 = empty_strided_cuda((4096, 4096), (4096, 1))\n")
    torch_frame = _frame(os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"), 10)
    gib = 2**30
    trace = [
        dict(action="alloc", addr=1, size=gib, frames=[torch_frame, _frame(model, 3)]),
        dict(action="alloc", addr=2, size=2 * gib, frames=[_frame(generated, 1)]),
        dict(action="free_requested", addr=2, size=2 * gib, frames=[]),
        dict(action="free_completed", addr=2, size=2 * gib, frames=[]),  # already counted at the request
        dict(action="alloc", addr=3, size=gib // 2, frames=[_frame(model, 2)]),
        dict(action="alloc", addr=4, size=gib // 2, frames=[_frame(model, 2)]),
        dict(action="alloc", addr=5, size=3 * gib // 2, frames=[_frame(generated, 1)]),
        dict(action="free_completed", addr=5, size=3 * gib // 2, frames=[]),
        dict(action="alloc", addr=6, size=gib // 4, frames=[]),
        dict(action="segment_alloc", addr=100, size=8 * gib, frames=[]),
    ]
    r = step_profile.replay_peak(trace, base=3 * gib)
    assert r["before_gib"] == 3.0 and r["peak_gib"] == pytest.approx(6.5)  # 3 + 1 + 1 + 1.5 (addrs 1, 3, 4, 5)
    sites = {site: (count, size) for site, count, size in r["sites"]}
    assert sites == {"model.py:3 h = torch.mm(a, b)": (1, 1.0),
                     "model.py:2 buf1 = empty_strided_cuda((8192, 14336))": (2, 1.0),
                     "inductor cabc.py:1 buf12 = empty_strided_cuda((4096, 4096), (4096, 1))": (1, 1.5)}
    assert [s[2] for s in r["sites"]] == sorted((s[2] for s in r["sites"]), reverse=True)
    assert r["files"] == [["model.py", 3, 2.0], ["inductor cabc.py", 1, 1.5]]
    assert r["all_sites"] == r["sites"]  # fewer sites than top
    assert step_profile.replay_peak(trace, base=3 * gib, top=1)["all_sites"] == r["sites"]


def test_kernel_time_on_the_cpu_counts_operators():
    """Off CUDA the profile sorts CPU operators' self time (a smoke run of the same path)."""
    a = torch.randn(256, 256)

    def step():
        for _ in range(3):
            (a @ a).relu_()

    s = step_profile.kernel_time(step, cuda=False)
    assert s["device"] == "cpu" and s["kernels"] >= 6 and s["total_ms"] > 0
    assert any(name == "aten::mm" and calls == 3 for name, _, calls, _ in s["top"]), s["top"]
    assert s["ms"]["GEMM (cuBLAS / CUTLASS)"] > 0


@pytest.mark.gpu
def test_peak_allocations_match_the_allocator_gpu():
    """On CUDA the replayed peak is the allocator's, and the largest live block is named by the
    line of this file that made it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    keep = []

    def step():
        a = torch.empty(256, 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB, alive at the peak
        b = torch.empty(64, 2**20, dtype=torch.uint8, device="cuda")
        keep.append(torch.empty(32, 2**20, dtype=torch.uint8, device="cuda"))
        del a, b

    r = step_profile.peak_allocations(step)
    assert r["peak_gib"] == pytest.approx(r["max_allocated_gib"], abs=1e-3)
    assert r["peak_gib"] - r["before_gib"] == pytest.approx(352 / 1024, abs=1e-3)
    site, count, gib = r["sites"][0]
    assert site.startswith("test_step_profile.py:") and "256, 2**20" in site and gib == pytest.approx(0.25)


@pytest.mark.gpu
def test_kernel_time_sorts_a_step_of_ours_and_torch_gpu():
    """On CUDA: a rowwise quantization (the library's Triton kernel) and a BF16 matmul land in
    their categories, once per launch, and no annotation range is counted as a kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moe_fp8.quant import quantize_rowwise

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.profiler.record_function("an annotation"):
            for _ in range(2):
                quantize_rowwise(a)
                a @ a

    step()  # compiles the kernel
    s = step_profile.kernel_time(step, cuda=True)
    assert s["device"] == "cuda" and s["ms"]["moe_fp8 quantization"] > 0, s
    gemm = sum(ms for cat, ms in s["ms"].items() if cat.startswith("GEMM"))
    assert gemm > s["ms"]["moe_fp8 quantization"], s  # a 4096^3 matmul outlasts one read of a
    assert not any(name == "an annotation" for name, *_ in s["top"]), s["top"]
    assert [calls for name, _, calls, _ in s["top"] if name == "_rowwise_kernel"] == [2], s["top"]
