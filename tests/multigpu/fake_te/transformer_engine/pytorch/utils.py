"""Fake ``transformer_engine.pytorch.utils``."""

from typing import Tuple


def get_cudnn_version() -> Tuple[int, int, int]:
    return (9, 14, 0)
