"""Routers, the sync-free dispatch plan, permute/quantize and combine (see DESIGN.md)."""
