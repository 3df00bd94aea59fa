import pytest
import torch

import moe_fp8
from moe_fp8.quant import formats
from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ, E5M2, FORMATS, detect_format, resolve_format
from moe_fp8.quant.recipes import RECIPES, Float8Recipe, get_recipe


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_format_constants_match_torch(fmt):
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.max == info.max
    assert 2.0**fmt.min_normal_exp == info.tiny
    # The smallest subnormal is one quantum of the subnormal grid.
    smallest = torch.tensor(2.0**-fmt.subnormal_quantum_exp).to(fmt.torch_dtype)
    assert smallest.float().item() == 2.0**-fmt.subnormal_quantum_exp
    half = torch.tensor(2.0 ** -(fmt.subnormal_quantum_exp + 1) * 0.99).to(fmt.torch_dtype)
    assert half.float().item() == 0.0


def test_public_names():
    assert moe_fp8.Float8Format is formats.Float8Format
    assert moe_fp8.detect_format is detect_format


def test_resolve_format_forms():
    assert resolve_format("e4m3fnuz") is E4M3FNUZ
    assert resolve_format("float8_e5m2") is E5M2
    assert resolve_format(torch.float8_e4m3fn) is E4M3FN
    assert resolve_format(E4M3FNUZ) is E4M3FNUZ
    with pytest.raises(ValueError, match="fmt: expected one of"):
        resolve_format("e4m3")
    with pytest.raises(TypeError, match="fmt: expected an FP8 torch dtype"):
        resolve_format(torch.bfloat16)
    with pytest.raises(TypeError, match="fmt: expected Float8Format"):
        resolve_format(448)


def _fake_rocm(monkeypatch, arch: str):
    class Props:
        gcnArchName = arch

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("gfx942:sramecc+:xnack-", E4M3FNUZ),
        ("gfx940", E4M3FNUZ),
        ("gfx941:sramecc+", E4M3FNUZ),
        ("gfx950:sramecc+:xnack-", E4M3FN),
        ("gfx90a", E4M3FN),
        ("gfx1201", E4M3FN),
    ],
)
def test_detect_format_rocm(monkeypatch, arch, expected):
    monkeypatch.delenv(formats.FORMAT_ENV_VAR, raising=False)
    _fake_rocm(monkeypatch, arch)
    assert detect_format("cuda:0") is expected
    assert detect_format(torch.device("cuda")) is expected


def test_detect_format_cuda_and_cpu(monkeypatch):
    monkeypatch.delenv(formats.FORMAT_ENV_VAR, raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert detect_format("cuda:0") is E4M3FN
    assert detect_format("cpu") is E4M3FN


def test_detect_format_overrides(monkeypatch):
    _fake_rocm(monkeypatch, "gfx942")
    monkeypatch.setenv(formats.FORMAT_ENV_VAR, "e4m3fn")
    assert detect_format("cuda:0") is E4M3FN  # env beats platform
    assert detect_format("cuda:0", fmt="e4m3fnuz") is E4M3FNUZ  # argument beats env
    monkeypatch.setenv(formats.FORMAT_ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=formats.FORMAT_ENV_VAR):
        detect_format("cuda:0")


def test_recipes():
    assert set(RECIPES) == {"rowwise", "rowwise_gw_hp", "tensorwise", "blockwise", "bf16"}
    assert get_recipe("rowwise").fp8_wgrad and not get_recipe("rowwise_gw_hp").fp8_wgrad
    assert not get_recipe("bf16").is_fp8
    assert all(RECIPES[name].pow2_scales for name in ("rowwise", "rowwise_gw_hp", "tensorwise"))
    assert not get_recipe("rowwise", pow2_scales=False).pow2_scales
    assert RECIPES["rowwise"].pow2_scales  # the override does not mutate the table
    custom = Float8Recipe("mine", "rowwise", fp8_wgrad=True, grad_format="e5m2")
    assert get_recipe(custom) is custom
    with pytest.raises(ValueError, match="recipe: expected one of"):
        get_recipe("fp4")
    with pytest.raises(TypeError, match="recipe"):
        get_recipe(3)
