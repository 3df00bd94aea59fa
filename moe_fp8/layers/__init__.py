"""FP8MoE, FP8Linear and converters (see DESIGN.md)."""
