"""Test helpers: a brute-force oracle, fake TE functions and a fake TE package.

Nothing here imports Transformer Engine; everything runs on CPU.
"""
