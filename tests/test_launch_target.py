"""Launch configuration by target: the interpreter's for CPU tensors, a GPU's inside
``configure_launches_for`` (how the offline compile check records what that GPU would launch)."""

import torch

from moe_fp8.grouped_gemm.triton_configs import SCALE_ROWWISE, config_2d2d, config_2d3d
from moe_fp8.kernel_backend import LaunchTarget, configure_launches_for, launch_target
from moe_fp8.quant.kernels.common import hardware_cast_is_exact, multiprocessor_count

CPU = torch.device("cpu")
H200 = LaunchTarget("cuda", (9, 0), 132)
MI300X = LaunchTarget("hip", "gfx942", 304)


def test_cpu_tensors_configure_for_the_interpreter():
    assert launch_target(CPU) == LaunchTarget("interpreter")
    assert config_2d3d(4096, 7168, 8, SCALE_ROWWISE, CPU).block_m == 16
    assert not hardware_cast_is_exact(CPU)


def test_configured_target_decides_tiles_casts_and_multiprocessors():
    with configure_launches_for(H200):
        assert launch_target(CPU) is H200 and H200.is_sm90()
        assert (config_2d3d(4096, 7168, 8, SCALE_ROWWISE, CPU).block_n, config_2d2d(4096, 7168, 8, 1, CPU).block_n) \
            == (256, 256)
        assert hardware_cast_is_exact(CPU) and multiprocessor_count(CPU) == 132
        with configure_launches_for(MI300X):  # nested: the innermost wins
            assert config_2d3d(4096, 7168, 8, SCALE_ROWWISE, CPU).block_k == 64
            assert not hardware_cast_is_exact(CPU) and multiprocessor_count(CPU) == 304
        assert launch_target(CPU) is H200
    assert launch_target(CPU).kind == "interpreter"
