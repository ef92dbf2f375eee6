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
from typing import Any, Dict, Literal, Optional, Tuple

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


_encoded: dict[str, object] = {}


def read_env(name: str) -> str:
    """``os.environ.get(name, "")`` without its cost on the hot path.

    ``os.environ.get`` of an unset variable raises and catches a KeyError inside (about
    1 us); the wrapper reads two variables on every call. This looks the encoded name up
    in the mapping's own dict; any surprise (another platform's ``os.environ``, a
    replaced mapping) falls back to ``os.environ.get``.
    """
    env = os.environ
    try:
        key = _encoded.get(name)
        if key is None:
            key = _encoded[name] = env.encodekey(name)  # type: ignore[attr-defined]
        value = env._data.get(key)  # type: ignore[attr-defined]
        return "" if value is None else env.decodevalue(value)  # type: ignore[attr-defined]
    except Exception:
        return env.get(name, "")


def env_mapping() -> Optional[Tuple[Dict[Any, Any], Any, Any]]:
    """``(dict, encoded TE_GQA_FIX, encoded TE_GQA_FIX_VALIDATE)``: the dict behind
    ``os.environ`` and the keys both settings are stored under, or None where
    ``os.environ`` is not the POSIX mapping.

    Why: the wrapper's fast lane re-checks on every call that neither setting changed
    since it last read them, by the identity of the stored values (two dict lookups,
    no decoding); any change sends the call through :func:`get_policy` and
    :func:`deep_validation_enabled` again.
    """
    env = os.environ
    try:
        data = env._data  # type: ignore[attr-defined]
        encode = env.encodekey  # type: ignore[attr-defined]
        key_policy, key_validate = encode(ENV_POLICY), encode(ENV_VALIDATE)
    except Exception:
        return None
    return (data, key_policy, key_validate) if isinstance(data, dict) else None


def get_policy() -> Policy:
    """Return the active policy; an unknown value falls back to ``auto`` and is logged once."""
    raw = read_env(ENV_POLICY)
    value = _ALIASES.get(raw) or _ALIASES.get(raw.strip().lower())
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
    raw = read_env(ENV_VALIDATE)
    return bool(raw) and raw.strip().lower() in {"1", "true", "yes", "on"}
