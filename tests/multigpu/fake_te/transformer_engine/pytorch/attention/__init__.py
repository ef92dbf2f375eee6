"""Fake ``transformer_engine.pytorch.attention``."""

from .dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention"]
