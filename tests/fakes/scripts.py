"""Import a script of this repository (not part of any package) by its path.

The CPU tests of ``evidence/multigpu/cp_check.py`` and the Megatron
check test what those scripts compute before they ever reach a GPU machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Union


def load_script(name: str, path: Union[str, Path]) -> ModuleType:
    """The script at ``path`` as module ``name``, executed once per process (kept in
    ``sys.modules``, where dataclasses and pickling look modules up)."""
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod
