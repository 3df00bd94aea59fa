"""Integrations of moe_fp8 with training frameworks.

Each submodule is imported on its own (``import moe_fp8.integrations.torchtitan``) and needs its
framework only when used: importing this package imports no framework.
"""
