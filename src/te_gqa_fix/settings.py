"""Every ``TE_GQA_FIX_*`` setting, read and parsed in one place.

Standard library only: the start-up hook reads its settings here before torch exists. Every
setting takes the same spellings for off (``0``, ``off``, ``false``, ``no``, ``disable``,
``disabled``, empty) and for on (``1``, ``on``, ``true``, ``yes``, ``enable``, ``enabled``:
the setting's default behaviour, or ``on``). An unknown value raises :class:`SettingError`
naming the variable, the value and what is accepted: a typo must never pick a behaviour the
user did not ask for. An unknown ``TE_GQA_FIX_*`` name is reported with the closest known
one (:func:`unknown_names`).
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import SettingError

__all__ = [
    "PER_CALL",
    "SETTINGS",
    "SettingError",
    "describe",
    "get",
    "parse",
    "per_call",
    "shown",
    "unknown_names",
]

PREFIX = "TE_GQA_FIX"
_OFF = ("", "0", "off", "false", "no", "disable", "disabled")
_ON = ("1", "on", "true", "yes", "enable", "enabled")


def _spellings(on: str, **values: Tuple[str, ...]) -> Dict[str, str]:
    """Accepted spellings -> value: the shared off and on spellings, then ``values``."""
    table = {**dict.fromkeys(_OFF, "off"), **dict.fromkeys(_ON, on)}
    for value, names in values.items():
        table.update(dict.fromkeys(names, value))
    return table


#: variable -> (accepted spellings -> parsed value, default, one line on what it does).
#: ``TE_GQA_FIX_CUDNN`` also takes a folder (``/path`` or ``strict:/path``).
SETTINGS: Dict[str, Tuple[Dict[str, str], str, str]] = {
    "TE_GQA_FIX": (
        _spellings("auto", auto=("auto", "gqa"), always=("always", "all")),
        "auto",
        "post-pass policy: auto (GQA/MQA where no measurement says TE is right), always, off",
    ),
    "TE_GQA_FIX_GUARD": (
        _spellings("fallback", fallback=("fallback",), warn=("warn",), strict=("strict",)),
        "fallback",
        "a backward the post-pass cannot repair: fallback (exact recompute), warn, strict, off",
    ),
    "TE_GQA_FIX_VALIDATE": (
        _spellings("on"),
        "off",
        "on: read the offsets in every call and raise there (a host sync; debugging)",
    ),
    "TE_GQA_FIX_AUTOPATCH": (
        _spellings("on", strict=("strict",)),
        "off",
        "start-up hook: install when transformer_engine.pytorch is imported (strict: or fail)",
    ),
    "TE_GQA_FIX_CUDNN": (
        _spellings("auto", auto=("auto",), strict=("strict",)),
        "off",
        "load a cuDNN measured right before torch and TE: auto, strict, FOLDER, strict:FOLDER",
    ),
}
for _table, _default, _ in SETTINGS.values():  # the empty spelling is the default
    _table[""] = _default
del _table, _default


#: How much of a value a message echoes (the start-up hook logs it in every process).
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)``, or where that is long its start and the length: a message never
    echoes a huge value (``'aaaa...'...(100000 chars)``)."""
    if isinstance(value, str):  # its characters are counted, not its repr's
        if len(value) <= SHOWN_CHARS:
            return repr(value)
        return f"{value[:SHOWN_CHARS]!r}...({len(value)} chars)"
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}...({len(text)} chars)"


def parse(name: str, raw: Optional[str]) -> str:
    """The parsed value of setting ``name`` for the raw string ``raw`` (None: unset).

    Args:
        name: one of :data:`SETTINGS`.
        raw: the variable's value as the environment holds it.

    Returns:
        The canonical value (``TE_GQA_FIX_CUDNN`` folders: ``FOLDER`` or ``strict:FOLDER``).

    Raises:
        SettingError: the value is not accepted; the message names variable, value and
            the accepted values.
    """
    spellings, default, _ = SETTINGS[name]
    if raw is None:
        return default
    key = raw.strip().lower()
    value = spellings.get(key)
    if value is not None:
        return value
    if name == "TE_GQA_FIX_CUDNN":
        text = raw.strip()
        folder = text[len("strict:") :] if key.startswith("strict:") else text
        if os.sep in folder or folder.startswith("."):
            return text
    accepted = ", ".join(sorted({repr(s) for s in spellings if s}))
    extra = ", a folder, 'strict:FOLDER'" if name == "TE_GQA_FIX_CUDNN" else ""
    raise SettingError(
        f"{name}={shown(raw)} is not an accepted value; expected one of {accepted}{extra}"
    )


_parsed: Dict[Tuple[str, object], str] = {}

#: os.environ's own store and each setting's key in it (CPython and PyPy keep a dict in
#: ``_data``): ``.get`` there costs no KeyError for an unset variable, unlike ``Mapping.get``.
_ENVIRON = os.environ
_STORE = getattr(_ENVIRON, "_data", None)
_STORE_KEYS: Dict[str, object] = (
    {n: _ENVIRON.encodekey(n) for n in SETTINGS} if type(_STORE) is dict else {}  # type: ignore[attr-defined]
)


def _raw(name: str, env: Mapping[str, str]) -> object:
    """``name``'s raw value in ``env`` (os.environ: read from its own store)."""
    if env is _ENVIRON and name in _STORE_KEYS:
        return _STORE.get(_STORE_KEYS[name])  # type: ignore[union-attr]
    return env.get(name)


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The parsed value of ``name`` now (cached per raw value: a dict lookup per call).

    Args:
        name: one of :data:`SETTINGS`.
        environ: the environment to read (default ``os.environ``).

    Returns:
        The canonical value; raises :class:`SettingError` for an unknown one.
    """
    raw = _raw(name, os.environ if environ is None else environ)
    value = _parsed.get((name, raw))
    if value is None:
        text = _ENVIRON.decodevalue(raw) if isinstance(raw, bytes) else raw  # type: ignore[attr-defined]
        value = _parsed[(name, raw)] = parse(name, text)  # type: ignore[arg-type]
    return value


def unknown_names(environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, Optional[str]]]:
    """``TE_GQA_FIX*`` variables that are set but are no setting, each with the closest known
    name (None where none is close): ``TE_GQA_FIX_GAURD`` -> ``TE_GQA_FIX_GUARD``.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``[(name, closest or None)]``, sorted by name.
    """
    env = os.environ if environ is None else environ
    names = sorted(n for n in env if n.upper().startswith(PREFIX) and n not in SETTINGS)
    return [(n, next(iter(_closest(n.upper())), None)) for n in names]


def _closest(name: str) -> List[str]:
    """The known name most like ``name`` (upper case, any case matches), if any is as
    like it as a letter dropped, doubled or swapped makes it: the shared prefix alone is
    no likeness (``TE_GQA_FIX_RECORD`` is like no setting)."""
    return difflib.get_close_matches(name, SETTINGS, 1, 0.85)


def describe(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Dict[str, object]]:
    """Every setting with its raw value, parsed value (or error) and meaning, for ``doctor``.

    Returns:
        ``{name: {"raw": str | None, "value": str | None, "error": str | None, "help": str}}``.
    """
    env = os.environ if environ is None else environ
    out: Dict[str, Dict[str, object]] = {}
    for name, (_, _, text) in SETTINGS.items():
        raw = env.get(name)
        try:
            out[name] = {"raw": raw, "value": parse(name, raw), "error": None, "help": text}
        except SettingError as exc:
            out[name] = {"raw": raw, "value": None, "error": str(exc), "help": text}
    return out


#: What the wrapper reads at every call, in this order.
PER_CALL = ("TE_GQA_FIX", "TE_GQA_FIX_GUARD", "TE_GQA_FIX_VALIDATE")
_PER_CALL_KEYS = tuple(_STORE_KEYS[n] for n in PER_CALL) if _STORE_KEYS else None
_per_call: Dict[tuple, Tuple[str, ...]] = {}


def per_call() -> Tuple[str, ...]:
    """:data:`PER_CALL`, parsed from ``os.environ`` now: three reads and one dict lookup
    per call (cached per raw values). The first call with a typo in any of them raises
    :class:`SettingError`; the first call logs, once, every unknown ``TE_GQA_FIX*`` name."""
    if _PER_CALL_KEYS is None:
        raw = tuple([_raw(n, _ENVIRON) for n in PER_CALL])
    else:  # three dict reads, no Python frame
        read, (policy, guard, validate) = _STORE.get, _PER_CALL_KEYS  # type: ignore[union-attr]
        raw = (read(policy), read(guard), read(validate))
    values = _per_call.get(raw)
    if values is None:
        values = tuple([get(n) for n in PER_CALL])
        if not _per_call:
            _warn_unknown_names()
        _per_call[raw] = values
    return values


def _warn_unknown_names() -> None:
    from ._logging import log_once

    for name, closest in unknown_names():
        hint = f"; did you mean {closest}?" if closest else ""
        msg = "%s is not a te-gqa-fix setting (ignored)%s"
        log_once(("unknown-setting", name), logging.WARNING, msg, name, hint)
