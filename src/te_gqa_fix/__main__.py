"""``python -m te_gqa_fix``: the ``te-gqa-fix`` command line (doctor, plan)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
