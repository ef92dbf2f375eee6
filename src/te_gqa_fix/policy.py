"""When the post-pass applies, read from ``TE_GQA_FIX``.

* unset / ``auto`` (default): THD dK/dV with ``h_q != h_kv`` (GQA/MQA), the only case
  where cuDNN sums never-written workspace partials into dK/dV;
* ``always``: MHA too (belt and braces; MHA is measured correct);
* ``off``: the wrapper is a pure pass-through (the call still goes to TE unchanged).

The variable is read on every call (a dict lookup) so a launcher can flip it without
re-importing anything.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

from ._logging import log_once

Policy = Literal["auto", "always", "off"]

ENV_POLICY = "TE_GQA_FIX"
ENV_VALIDATE = "TE_GQA_FIX_VALIDATE"

_ALIASES: dict[str, Policy] = {
    "": "auto",
    "auto": "auto",
    "on": "auto",
    "1": "auto",
    "gqa": "auto",
    "always": "always",
    "all": "always",
    "off": "off",
    "0": "off",
    "false": "off",
    "no": "off",
    "disable": "off",
    "disabled": "off",
}


def get_policy() -> Policy:
    """Return the active policy; an unknown value falls back to ``auto`` and is logged once."""
    raw = os.environ.get(ENV_POLICY, "")
    value = _ALIASES.get(raw.strip().lower())
    if value is None:
        log_once(
            ("policy", raw),
            logging.WARNING,
            "%s=%r is not one of auto, always, off; using 'auto'",
            ENV_POLICY,
            raw,
        )
        return "auto"
    return value


def deep_validation_enabled() -> bool:
    """``TE_GQA_FIX_VALIDATE=1`` turns on checks that sync the host (debugging only)."""
    return os.environ.get(ENV_VALIDATE, "").strip().lower() in {"1", "true", "yes", "on"}
