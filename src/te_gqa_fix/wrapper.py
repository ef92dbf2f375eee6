"""The wrapper of TE's ``fused_attn_bwd``: TE's call (or the exact fallback), then the post-pass.

One call, top to bottom (``fused_attn_bwd`` below):

1. the settings, parsed (a typo in any of them raises here, at the first call);
2. the call's metadata -> its :class:`Decision`, made once per call shape and cached: TE's
   call untouched where a measured cuDNN is right (:mod:`.affected`), else post-pass or not,
   the guard's verdict, the fallback's recipes, the post-pass kernel's prepared launches. A
   call returned untouched reads only the facts of that decision;
3. for a call the wrapper acts on, its inputs' metadata (devices, the offsets' dtypes and
   lengths) checked once per value, before TE runs;
4. the guard, where TE's result is wrong beyond any post-pass: the exact fallback
   (:mod:`.fallback`) instead of TE, or an error; never TE's wrong result unless asked;
5. the post-pass (:mod:`.postpass`) on the gradients: a kernel launch prepared once per
   metadata of the inputs and the gradients together, since it reads both (the number of
   sequences is the offsets' length).

Arguments are read by name through the wrapped function's signature: TE's signature drifted
between releases and its call sites mix positional and keyword arguments. No host sync.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import fallback, postpass, settings
from ._logging import log_once, logger
from .masks import KeySpan, key_span
from .stack import affected
from .stack.affected import UnrepairableConfiguration
from .te_names import LAYOUTS
from .validation import check_metadata, shape_of

__all__ = ["MARKER", "call_counts", "is_wrapper", "reset_call_counts", "unwrap", "wrapper_for"]

MARKER = "__te_gqa_fix_wrapper__"


def is_wrapper(fn: object) -> bool:
    """Whether ``fn`` is a te-gqa-fix wrapper."""
    return bool(getattr(fn, MARKER, False))


def unwrap(fn: Callable) -> Callable:
    """``fn`` without our wrappers (never anyone else's)."""
    while is_wrapper(fn):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


_COUNT_NAMES = ("calls", "fixed", "skipped", "passthrough", "fallback")
_CALLS, _FIXED, _SKIPPED, _PASSTHROUGH, _FALLBACK = range(5)
_counts: List[int] = []  # set by reset_call_counts() below


def call_counts() -> Dict[str, int]:
    """Calls through any wrapper since the last reset.

    Returns:
        ``calls``; ``fixed`` (post-pass on TE's output); ``skipped`` (nothing to do: MHA,
        non-THD, one offsets tensor for queries and keys, policy off, fixed cuDNN);
        ``passthrough`` (not understood, logged once); ``fallback`` (the exact fallback
        replaced TE's call).
    """
    return dict(zip(_COUNT_NAMES, _counts))


def reset_call_counts() -> None:
    """Set every count of :func:`call_counts` to 0."""
    _counts[:] = [0] * len(_COUNT_NAMES)


reset_call_counts()


#: What the wrapper reads from every call, in this order. ``dqkv_layout`` (TE >= 2.20)
#: counts only when the call gives it; otherwise ``qkv_layout`` names the gradients' layout.
_NAMES = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded", "attn_mask_type", "window_size", "bottom_right_diagonal",
    "qkv_layout", "dqkv_layout",
)  # fmt: skip


class _Signature:
    """Name-based access to a call's arguments, resolved once per wrapped function."""

    def __init__(self, fn: Callable) -> None:
        self.sig = inspect.signature(fn)
        params = list(self.sig.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise TypeError("a signature with *args or **kwargs cannot be read by name")
        positions = {p.name: i for i, p in enumerate(params) if p.kind != p.KEYWORD_ONLY}
        # A name the signature lacks reads as None (a window_size of None is unbounded).
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        #: For bind(): positional names in order, every name, every default.
        self.order = [p.name for p in params if p.kind != p.KEYWORD_ONLY]
        self.names = frozenset(p.name for p in params)
        self.keywords = frozenset(p.name for p in params if p.kind != p.POSITIONAL_ONLY)
        self.defaults = dict(defaults)
        defaults["dqkv_layout"] = None
        self.slots = [(n, positions.get(n), defaults.get(n)) for n in _NAMES]
        self.fast: Optional[Callable] = None
        self.need = 0
        if all(n in positions for n in _NAMES):  # every argument by position: one C call
            self.fast = operator.itemgetter(*(positions[n] for n in _NAMES))
            self.need = max(positions[n] for n in _NAMES) + 1

    def pick(self, args: Sequence, kwargs: Mapping[str, Any]) -> tuple:
        """The values of :data:`_NAMES` in this call (defaults where not given)."""
        if self.fast is not None and not kwargs and len(args) >= self.need:
            return self.fast(args)
        n_args = len(args)
        return tuple(
            kwargs[n] if n in kwargs else args[i] if i is not None and i < n_args else d
            for n, i, d in self.slots
        )

    def bind(self, args: Sequence, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """Every argument by name, defaults applied (TypeError where TE's call would fail).

        The exact fallback asks once per call it serves, before its first kernel: the common
        case skips ``inspect``'s bind, which is slow on the host, and returns what it would.
        """
        given = self.order[: len(args)]
        if len(args) <= len(self.order) and kwargs.keys() <= self.keywords:
            call = dict(self.defaults)
            call.update(zip(given, args))
            if not kwargs or kwargs.keys().isdisjoint(given):
                call.update(kwargs)
                if len(call) == len(self.names):  # every parameter has a value
                    return call
        bound = self.sig.bind(*args, **kwargs)  # raises the TypeError TE's call would
        bound.apply_defaults()
        return dict(bound.arguments)


#: The gradients' metadata (:func:`_out_key`) -> the post-pass for it: a prepared kernel
#: launch, or None for the PyTorch post-pass.
Launches = Dict[tuple, Optional[postpass.launch.KernelLaunch]]


class Decision:
    """Everything one call shape needs, decided from its metadata at its first call.

    Attributes:
        postpass: zero the dead rows of the gradients (False: TE's output as it is).
        dq_too: dQ is THD, so its dead rows are zeroed as well.
        span: the mask's attended-key rule (:func:`te_gqa_fix.masks.key_span`).
        unrepairable: why TE's result is wrong beyond any post-pass here, or None.
        inputs: the inputs' metadata checked so far (:func:`_inputs_key`) -> the post-pass
            :data:`Launches` prepared for those inputs.
        fallback_recipes: :func:`te_gqa_fix.fallback.call_facts` -> the fallback's recipe, or
            why it declines.
    """

    __slots__ = ("dq_too", "fallback_recipes", "inputs", "postpass", "span", "unrepairable")

    def __init__(
        self,
        postpass: bool,
        dq_too: bool = False,
        span: Optional[KeySpan] = None,
        unrepairable: Optional[str] = None,
    ) -> None:
        self.postpass = postpass
        self.dq_too = dq_too
        self.span = span
        self.unrepairable = unrepairable
        self.inputs: Dict[tuple, Launches] = {}
        self.fallback_recipes: Dict[fallback.CallFacts, Union[fallback.Recipe, str]] = {}


_UNSET = object()
_NOTHING_TO_DO = Decision(False)
_MAX_SHAPES = 256
_Tensor = torch.Tensor


def _passthrough(key: object, msg: str, *args: object) -> None:
    _counts[_PASSTHROUGH] += 1
    msg = "te_gqa_fix: " + msg + "; passed through untouched"
    log_once(("passthrough", key), logging.WARNING, msg, *args)


def _device_index(q: object) -> Optional[int]:
    if type(q) is _Tensor:
        return q.get_device() if q.is_cuda else None  # type: ignore[union-attr]
    device = getattr(q, "device", None)
    return device.index if getattr(device, "type", None) == "cuda" else None


def _head_dims(q: object, v: object) -> Tuple[int, int]:
    """The q/k and v head dims (0 where a shape cannot be read)."""
    sq, sv = shape_of(q), shape_of(v)
    return (int(sq[-1]) if sq else 0), (int(sv[-1]) if sv else 0)


def _call_key(policy: str, dev: Optional[int], picked: tuple) -> Optional[tuple]:
    """Every fact :func:`_decide` reads from a call, or None when q, k or v is not a plain
    tensor (the call is then decided anew). What only the inputs' check reads is keyed
    apart (:func:`_inputs_key`), so a call returned untouched reads nothing more."""
    q, k, v, cu_q, cu_kv, pad_q, pad_kv, mask, window, brd, lay, dlay = picked
    T = _Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    return (
        policy, dev, q.dtype, q.shape, k.shape, v.shape, cu_q is cu_kv, pad_q is pad_kv,
        mask, tuple(window) if type(window) is list else window, brd, lay, dlay,
    )  # fmt: skip


def _inputs_key(picked: tuple) -> Optional[tuple]:
    """What the inputs' check (:func:`_checked_inputs`) reads beyond the call key, and what a
    post-pass launch reads of the offsets (their length, dtype, device, which are None); None
    when a value cannot be keyed (the check then runs on every call)."""
    q, k, v, cu_q, cu_kv, pad_q, pad_kv = picked[:7]
    T = _Tensor
    if not (
        type(q) is T and type(k) is T and type(v) is T and type(cu_q) is T and type(cu_kv) is T
        and (pad_q is None or type(pad_q) is T) and (pad_kv is None or type(pad_kv) is T)
    ):  # fmt: skip
        return None
    return (
        q.device, k.device, v.device,
        cu_q.dtype, cu_q.shape, cu_q.device, cu_kv.dtype, cu_kv.shape, cu_kv.device,
        None if pad_q is None else (pad_q.dtype, pad_q.shape, pad_q.device),
        None if pad_kv is None else (pad_kv.dtype, pad_kv.shape, pad_kv.device),
    )  # fmt: skip


#: The gradient dtypes TE zero-fills in a THD backward before cuDNN writes them.
_FILLED_BY_TE = (torch.float16, torch.bfloat16)


def _self_attention(picked: tuple) -> bool:
    """Whether no row of this call can need the post-pass: queries and keys share their
    offsets tensors, so every sequence has as many queries as keys and each valid key is
    attended by its own position's query (:func:`te_gqa_fix.masks.key_bounds` gives
    ``[0, lk)`` for every mask and window when ``lq == lk``). The bug's rows, keys of a
    sequence without queries, then do not exist, and TE zero-fills every other row (padding,
    tail) of a plain fp16/bf16 THD gradient itself."""
    q, cu_q, cu_kv, pad_q, pad_kv = picked[0], picked[3], picked[4], picked[5], picked[6]
    return cu_q is cu_kv and pad_q is pad_kv and type(q) is _Tensor and q.dtype in _FILLED_BY_TE


def _decide(policy: str, dev: Optional[int], picked: tuple) -> Optional[Decision]:
    """What to do for one call shape, from the facts of its :func:`_call_key` alone; None:
    not understood (logged). A decision that acts on the call has its inputs checked by
    :func:`_checked_inputs` before TE runs.

    Raises ``ValueError`` naming the argument for mask arguments :func:`~.masks.key_span`
    cannot read (never cached).
    """
    q, k, v = picked[:3]
    mask, window, brd, lay, dlay = picked[7:]
    d_qk, d_v = _head_dims(q, v)
    if policy == "auto" and dev is not None and affected.passes_through(dev, d_qk, d_v):
        return _NOTHING_TO_DO  # measured right here: nothing to repair, nothing to guard
    layout_name, layout = ("qkv_layout", lay) if dlay is None else ("dqkv_layout", dlay)
    formats = LAYOUTS.get(layout) if isinstance(layout, str) else None
    if formats is None:
        msg = "%s=%r is not a layout te-gqa-fix knows"
        _passthrough(("layout", layout), msg, layout_name, layout)
        return None
    dq_too, kv_thd = formats
    if not kv_thd:
        return _NOTHING_TO_DO
    unrepairable = None
    if dev is not None and d_qk and d_v:
        unrepairable = affected.why_unrepairable(dev, d_qk, d_v)
    h_q, h_kv = _thd_heads(q, k)
    postpass = policy == "always" or h_q is None or (h_q != h_kv and not _self_attention(picked))
    if not postpass and unrepairable is None:
        return _NOTHING_TO_DO
    return Decision(postpass, dq_too, key_span(mask, window, brd), unrepairable)


def _thd_heads(q: object, k: object) -> Tuple[Optional[int], Optional[int]]:
    """The query and KV heads of THD tensors (None for anything else: the inputs' check
    refuses it)."""
    sq, sk = shape_of(q), shape_of(k)
    h_q = int(sq[1]) if sq and len(sq) == 3 else None
    h_kv = int(sk[1]) if sk and len(sk) == 3 else None
    return h_q, h_kv


def _checked_inputs(decision: Decision, picked: tuple) -> Launches:
    """Check TE's q, k, v and offsets for a call the wrapper acts on, once per metadata
    (:func:`_inputs_key`); ``ValueError`` naming the argument, before TE runs.

    Returns:
        The post-pass launches prepared for inputs of this metadata: a launch reads the
        offsets' length, so launches are never shared between inputs of other metadata.
    """
    key = _inputs_key(picked)
    launches = None if key is None else decision.inputs.get(key)
    if launches is not None:
        return launches
    q, k, v, cu_q, cu_kv, pad_q, pad_kv = picked[:7]
    h_q, h_kv = _thd_heads(q, k)
    names = ("q", "k", "v")
    check_metadata(
        q if decision.dq_too else None, k, v, cu_q, cu_kv, pad_q, pad_kv, h_q, h_kv, names
    )
    launches = {}
    if key is not None:
        _remember(decision.inputs, key, launches)
    return launches


def _remember(cache: Dict[Any, Any], key: object, value: object) -> None:
    """``cache[key] = value``, emptying ``cache`` first when it holds :data:`_MAX_SHAPES`."""
    if len(cache) >= _MAX_SHAPES:
        cache.clear()
    cache[key] = value


def _fallback_recipe(decision: Decision, call: Mapping[str, Any]) -> Union[fallback.Recipe, str]:
    """The fallback's recipe for this call (decided once per :class:`~.fallback.CallFacts`)."""
    facts = fallback.call_facts(call)
    try:
        recipe = decision.fallback_recipes.get(facts)
    except TypeError:  # an unhashable argument: decide without the cache
        return fallback.decide(facts)
    if recipe is None:
        recipe = fallback.decide(facts)
        _remember(decision.fallback_recipes, facts, recipe)
    return recipe


def _guarded(
    decision: Decision, mode: str, sig: _Signature, args: Sequence, kwargs: Mapping
) -> Optional[Any]:
    """For a call TE gets wrong beyond any post-pass, per ``TE_GQA_FIX_GUARD``: the exact
    fallback's output (``fallback``), None for TE's own result (``warn``, once logged, or
    ``off``), or :class:`UnrepairableConfiguration` (``strict``; ``fallback`` where the
    fallback cannot serve the call)."""
    msg = decision.unrepairable
    if mode == "off":
        return None
    if mode == "strict":
        raise UnrepairableConfiguration(msg)
    if mode == "warn":
        log_once(("unrepairable", msg), logging.WARNING, "%s (TE_GQA_FIX_GUARD=warn)", msg)
        return None
    call = sig.bind(args, kwargs)
    recipe = _fallback_recipe(decision, call)
    if isinstance(recipe, str):
        raise UnrepairableConfiguration(
            f"{msg} The exact fallback cannot serve this call: {recipe}. To accept TE's wrong "
            "result knowingly instead, set TE_GQA_FIX_GUARD=warn."
        )
    log_once(
        ("fallback", msg), logging.WARNING,
        "%s te-gqa-fix computes this backward exactly with PyTorch's FlashAttention-2 kernels "
        "instead (slower than a fixed cuDNN; TE_GQA_FIX_CUDNN=auto is the faster remedy)", msg,
    )  # fmt: skip
    return fallback.run(recipe, call)


def _out_key(dq: object, dk: object, dv: object) -> Optional[tuple]:
    """What a kernel launch depends on in the outputs; None for anything but plain tensors."""
    T = _Tensor
    if type(dk) is not T or type(dv) is not T or (dq is not None and type(dq) is not T):
        return None
    key = (dk.shape, dk.stride(), dk.dtype, dk.device, dv.shape, dv.stride(), dv.dtype, dv.device)
    return key if dq is None else (*key, dq.shape, dq.stride(), dq.dtype, dq.device)


def _zero_dead_rows(
    decision: Decision, launches: Launches, offsets: tuple, out: Any, validate: str
) -> bool:
    """The post-pass on ``out`` (TE's or the fallback's); False when ``out`` is not
    gradients it can read (passed through untouched, logged once). ``launches``: those of
    this call's inputs (:func:`_checked_inputs`); ``validate``: ``TE_GQA_FIX_VALIDATE``."""
    if type(out) not in (list, tuple) or len(out) < 3:
        kind = type(out).__name__
        _passthrough(("output", kind), "fused_attn_bwd returned %s, not (dq, dk, dv, ...)", kind)
        return False
    dq = out[0] if decision.dq_too else None
    dk, dv = out[1], out[2]
    key = _out_key(dq, dk, dv)
    kernel_launch = _UNSET if key is None else launches.get(key, _UNSET)
    if kernel_launch is _UNSET:
        try:  # once per metadata of the inputs and the gradients
            check_metadata(dq, dk, dv, *offsets)
        except ValueError as exc:
            _passthrough(("output", str(exc)), "fused_attn_bwd returned gradients it cannot read (%s)", exc)  # fmt: skip
            return False
        kernel_launch = None
        if key is not None:
            kernel_launch = postpass.prepare_kernel(dq, dk, dv, offsets, decision.span)  # type: ignore[arg-type]
            _remember(launches, key, kernel_launch)
    postpass.zero_checked(dq, dk, dv, offsets, decision.span, kernel_launch, validate == "on")  # type: ignore[arg-type]
    return True


def _new_wrapper(original: Callable) -> Callable:
    try:
        sig: Optional[_Signature] = _Signature(original)
        reason = ""
    except (TypeError, ValueError) as exc:
        sig, reason = None, str(exc)
    decisions: Dict[tuple, Decision] = {}

    @functools.wraps(original)
    def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
        _counts[_CALLS] += 1
        policy, guard, validate = settings.per_call()  # a typo in any of them raises here
        if policy == "off":
            _counts[_SKIPPED] += 1
            return original(*args, **kwargs)
        if sig is None:
            msg = "cannot read the signature of %r (%s)"
            _passthrough(("signature", id(original)), msg, original, reason)
            return original(*args, **kwargs)
        picked = sig.pick(args, kwargs)
        dev = _device_index(picked[0])
        key = _call_key(policy, dev, picked)
        try:
            decision = None if key is None else decisions.get(key)
        except TypeError:  # an unhashable argument: decide without the cache
            key, decision = None, None
        if decision is None:
            decision = _decide(policy, dev, picked)
            if decision is None:
                return original(*args, **kwargs)
            if key is not None:
                _remember(decisions, key, decision)
        if decision is _NOTHING_TO_DO:
            _counts[_SKIPPED] += 1
            return original(*args, **kwargs)
        launches = _checked_inputs(decision, picked)
        if decision.unrepairable is not None:
            out = _guarded(decision, guard, sig, args, kwargs)
            if out is not None:
                if _zero_dead_rows(decision, launches, picked[3:7], out, validate):
                    _counts[_FALLBACK] += 1
                return out
        out = original(*args, **kwargs)
        if not decision.postpass:
            _counts[_SKIPPED] += 1
        elif _zero_dead_rows(decision, launches, picked[3:7], out, validate):
            _counts[_FIXED] += 1
        return out

    setattr(fused_attn_bwd, MARKER, True)  # functools.wraps set __wrapped__
    return fused_attn_bwd


_wrappers: Dict[int, Callable] = {}


def wrapper_for(original: Callable) -> Callable:
    """The one wrapper of ``original`` (cached: patch sites and the drop-in share it).

    Args:
        original: TE's ``fused_attn_bwd`` (or a function of the same signature).

    Returns:
        A function with the same signature that returns what ``original`` returns, after
        zeroing in place every row whose true gradient is 0 (see the README's settings).
    """
    original = unwrap(original)
    cached = _wrappers.get(id(original))
    if cached is not None and cached.__wrapped__ is original:  # type: ignore[attr-defined]
        return cached
    wrapper = _wrappers[id(original)] = _new_wrapper(original)
    logger.debug("te_gqa_fix: wrapped %s", getattr(original, "__qualname__", original))
    return wrapper
