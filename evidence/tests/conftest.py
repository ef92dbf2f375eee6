"""The evidence harness's CPU tests import its scripts from evidence/ (not the library)."""

from __future__ import annotations

import sys
from pathlib import Path

EVIDENCE = Path(__file__).resolve().parents[1]
if str(EVIDENCE) not in sys.path:
    sys.path.insert(0, str(EVIDENCE))
