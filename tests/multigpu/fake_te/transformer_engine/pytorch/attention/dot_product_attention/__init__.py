"""Fake ``transformer_engine.pytorch.attention.dot_product_attention``."""

from .dot_product_attention import DotProductAttention, _attention_backends

__all__ = ["DotProductAttention", "_attention_backends"]
