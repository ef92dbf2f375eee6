"""Fake ``transformer_engine.pytorch.cpp_extensions``: re-exports by name, as TE does."""

from .fused_attn import fused_attn_bwd

__all__ = ["fused_attn_bwd"]
