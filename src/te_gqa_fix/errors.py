"""Every exception te-gqa-fix raises on purpose, under one base class.

Each also subclasses the built-in type it has always been (``ValueError``, ``RuntimeError``,
...), so ``except ValueError`` clauses written before this base existed keep working; catch
:class:`TeGqaFixError` for all of them. Standard library only: the start-up hook imports it
before torch.
"""

from __future__ import annotations

__all__ = [
    "CudnnAlreadyLoaded",
    "CudnnLoadError",
    "CudnnRefused",
    "InputError",
    "InputTypeError",
    "OffsetsError",
    "SettingError",
    "SetupError",
    "TeGqaFixError",
    "UnrepairableConfiguration",
]


class TeGqaFixError(Exception):
    """The base of every exception te-gqa-fix raises on purpose."""


class InputError(TeGqaFixError, ValueError):
    """An argument is malformed; the message names it and what was expected. Raised before
    anything is written."""


class InputTypeError(TeGqaFixError, TypeError):
    """An argument of :func:`te_gqa_fix.use_fixed_cudnn` has the wrong type."""


class OffsetsError(InputError):
    """THD offsets whose values cannot be right (negative, decreasing, a padded segment
    shorter than its valid length, past the buffer). On CUDA it is raised by the next
    post-pass call on that device, or by :func:`te_gqa_fix.check_offset_errors`; the call
    with the bad offsets zeroed nothing."""


class SettingError(InputError):
    """A ``TE_GQA_FIX_*`` variable holds a value that is not one of its accepted values."""


class UnrepairableConfiguration(TeGqaFixError, RuntimeError):
    """TE's backward is wrong on rows that receive attention here, and the guard setting
    forbids (or the exact fallback cannot serve) the call: no gradient is returned."""


class SetupError(TeGqaFixError, ImportError):
    """What te-gqa-fix needs to set itself up is missing: Transformer Engine (the message
    says how to install it), the function to patch, or a strict start-up step."""


class CudnnRefused(TeGqaFixError, LookupError):
    """The cuDNN route will not load a build: none found, not a cuDNN, not one it may load
    (below 9.18, measured wrong, or unmeasured under strict), or its version unreadable."""


class CudnnLoadError(TeGqaFixError, OSError):
    """A cuDNN folder is missing its library, or a library in it cannot be loaded."""


class CudnnAlreadyLoaded(TeGqaFixError, RuntimeError):
    """A cuDNN is already mapped into the process: loading another now would mix builds."""
