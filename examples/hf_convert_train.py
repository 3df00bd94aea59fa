"""Drop-in Hugging Face conversion: build a (tiny) ``DeepseekV3ForCausalLM``, convert its MoE experts
and dense linears to FP8 with one ``moe_fp8.hf.convert`` call, print its report, check that it
computes the same function, and train it for a few steps.

    python examples/hf_convert_train.py        # needs transformers: pip install -e '.[hf]'

For a real model, load it with ``from_pretrained`` instead of building it from a config; the
conversion is the same call (keep the default size rules: ``hf.convert`` then converts only the
experts and linears large enough for FP8 to pay).
``python -m moe_fp8.demo`` is the full version of this script.
"""

import copy

import torch

from moe_fp8 import hf
from moe_fp8.testing import sqnr


def main() -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = None if device == "cuda" else "emulated"
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=None,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                           rope_scaling=None, routed_scaling_factor=1.0)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(device, torch.bfloat16)
    original = copy.deepcopy(model)

    # experts: FP8 grouped GEMMs; attention, shared experts: FP8Linear (size rules off: this model is tiny)
    hf.convert(model, recipe="rowwise", backend=backend, min_dense_size=0, min_expert_size=0,
               min_fp8_wgrad_size=0)
    print(model.model.layers[0])
    print(model.fp8_conversion_report)

    ids = torch.randint(0, 256, (4, 64), device=device)
    with torch.no_grad():
        print(f"logits SQNR, converted vs original: {sqnr(original(ids).logits, model(ids).logits):.1f} dB")

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(5):
        loss = model(input_ids=ids, labels=ids).loss  # the usual Hugging Face training step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
