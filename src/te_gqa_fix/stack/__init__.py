"""What this stack is, and whether it is affected.

- :mod:`.versions`: the running torch, GPU, Transformer Engine and the cuDNN TE runs.
- :mod:`.cudnn`: cuDNN builds on disk and in the process; loading a fixed one first (the
  ``TE_GQA_FIX_CUDNN`` route). Standard library only, for the start-up hook.
- :mod:`.affected`: the measured rule per cuDNN build, and the guard's verdicts.

Importing this package imports none of them, so the start-up hook pays only for
:mod:`.cudnn`.
"""
