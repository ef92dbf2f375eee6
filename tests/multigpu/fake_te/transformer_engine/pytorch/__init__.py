"""Fake ``transformer_engine.pytorch`` (see the package docstring)."""

from .attention import DotProductAttention
from .utils import get_cudnn_version

__all__ = ["DotProductAttention", "get_cudnn_version"]
