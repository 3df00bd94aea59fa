"""Fused Triton FP8 quantization kernels, one file per family.

Every kernel reproduces :mod:`moe_fp8.quant.reference` bit for bit (same FP8 bytes, same fp32
scales), on the GPU and in the CPU interpreter: scales come from ``fp8_scales`` and values from
``fp8_quantize`` (:mod:`moe_fp8.quant.triton_helpers`). The launchers here take already-validated
tensors; the public, validated entry points are the custom ops in :mod:`moe_fp8.quant.ops`.

* :mod:`.rowwise`: one scale per row (activations, grad_output, the forward expert layout);
* :mod:`.colwise`: one scale per column of each row group, written transposed (the dgrad expert
  layout, the wgrad operands over jagged token groups, optionally padded);
* :mod:`.blockwise`: 1 x 128 / 128 x 128 block scales;
* :mod:`.tensorwise`: one scale for the whole tensor.
"""
