"""``python -m moe_fp8.demo``: a small DeepSeek-V3-style MoE language model trained in BF16 and in
FP8 side by side, on the Python standard library's own sources (byte level).

The model is a Hugging Face ``DeepseekV3ForCausalLM`` converted with ``moe_fp8.hf.convert``.
Files: ``corpus`` (data), ``model`` (config, conversion), ``train`` (loop), ``report`` (table,
samples, plot), ``__main__`` (command line).
"""
