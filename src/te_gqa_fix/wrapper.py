"""The wrapper of TE's ``fused_attn_bwd``: key -> decision -> TE or the fallback -> post-pass.

One call, top to bottom (``fused_attn_bwd`` in :func:`_new_wrapper`):

1. the settings, parsed (a typo in any of them raises here, at the first call);
2. the call key -> its :class:`Decision`, made once per call shape by :mod:`.rules` and
   cached: pass through (a measured cuDNN is right, MHA, self-attention with one offsets
   tensor, ...), TE then the post-pass, the exact fallback then the post-pass, or an error.
   A call passed through reads nothing more;
3. for a call the wrapper acts on, the inputs key -> its :class:`Prepared`: the inputs
   checked once, before TE runs, and what acting on them needs (the post-pass launches per
   gradient metadata, the fallback's recipe);
4. TE's backward, or the exact fallback (:mod:`.fallback`, imported at the first call that
   needs it), or :class:`~te_gqa_fix.errors.UnrepairableConfiguration`;
5. the post-pass (:mod:`.postpass`) on the gradients: one prepared kernel launch.

TE's signature drifted between releases (2.8 has ``dqkv_dtype``; 2.20 has ``o_format``,
``do_format``, ``dqkv_layout``, ``bottom_right_diagonal``) and its call sites mix positional
and keyword arguments, so arguments are read by name through the wrapped function's own
signature (:class:`Signature`, once per wrapped function).

A repeat call enters this module, :mod:`.settings` and :mod:`.postpass` (and the fallback
where it runs). No host sync.

:func:`wrapper_for` is the one documented hook for code that wraps a function of TE's
signature itself (the benchmarks time it around a stub).
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import _te, checks, postpass, rules, settings
from ._logging import log_once, logger
from ._te import LAYOUTS, SYMBOL, Args, FallbackArgs
from .errors import InputError, UnrepairableConfiguration
from .masks import KeySpan, key_span

__all__ = [
    "Signature",
    "call_counts",
    "chain",
    "fused_attn_bwd",
    "is_wrapper",
    "reset_call_counts",
    "unwrap",
    "wrapper_for",
]

MARKER = "__te_gqa_fix_wrapper__"


def is_wrapper(fn: object) -> bool:
    """Whether ``fn`` is a te-gqa-fix wrapper."""
    return bool(getattr(fn, MARKER, False))


def unwrap(fn: Callable) -> Callable:
    """``fn`` without te-gqa-fix's wrappers on top (anyone else's stay)."""
    while is_wrapper(fn):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


#: How many ``__wrapped__`` links :func:`chain` follows (a guard against cycles).
MAX_CHAIN = 32


def chain(fn: object) -> List[Any]:
    """``fn`` and every function below it through ``__wrapped__`` (``functools.wraps``
    wrappers, ours and anyone's), outermost first: the last is the function that wraps
    nothing, TE's own."""
    links = [fn]
    while len(links) < MAX_CHAIN:
        inner = getattr(links[-1], "__wrapped__", None) if callable(links[-1]) else None
        if inner is None or any(inner is x for x in links):
            break
        links.append(inner)
    return links


# -------------------------------------------------------------------------- arguments
_new_tuple = tuple.__new__  # a NamedTuple from a tuple in field order, without a Python frame


class _Reader:
    """Reads the fields of one NamedTuple of TE's argument names from calls of one signature."""

    __slots__ = ("_cls", "_fast", "_need", "_slots", "_tail")

    def __init__(self, cls: type, params: Mapping[str, inspect.Parameter]) -> None:
        names = cls._fields  # type: ignore[attr-defined]
        plist = list(params.values())
        positions = {p.name: i for i, p in enumerate(plist) if p.kind != p.KEYWORD_ONLY}
        defaults = {p.name: p.default for p in plist if p.default is not p.empty}
        defaults.pop("dqkv_layout", None)  # left out: qkv_layout names it (see Args)
        self._cls = cls
        self._slots = [(n, positions.get(n), defaults.get(n)) for n in names]
        self._fast: Optional[Callable[[tuple], tuple]] = None
        self._need = 0
        self._tail: tuple = ()
        present = [n for n in names if n in params]
        if all(n in positions for n in present):
            # A call that passes every present name by position: one C call. Names the
            # signature lacks index into a tail of Nones appended to the arguments.
            absent = [n for n in names if n not in params]
            self._tail = (None,) * len(absent)
            where = {n: -(len(absent) - i) for i, n in enumerate(absent)}
            self._fast = operator.itemgetter(
                *(positions[n] if n in positions else where[n] for n in names)
            )
            self._need = max((positions[n] for n in present), default=-1) + 1

    def read(self, args: Sequence, kwargs: Dict[str, Any]) -> Any:
        if self._fast is not None and not kwargs and len(args) >= self._need:
            return _new_tuple(self._cls, self._fast(tuple(args) + self._tail))
        n_args = len(args)
        return _new_tuple(
            self._cls,
            [
                kwargs[n] if n in kwargs else args[i] if i is not None and i < n_args else d
                for n, i, d in self._slots
            ],
        )


class Signature:
    """Name-based access to the arguments of calls to one function (TE's signature).

    Attributes:
        pick: ``pick(args, kwargs)``, the :class:`~te_gqa_fix._te.Args` of one call (what
            every call reads), defaults where not given.
        pick_all: ``pick_all(args, kwargs)``, its :class:`~te_gqa_fix._te.FallbackArgs`
            (what the fallback reads too).
        has_right_bound: TE >= 2.12 passes a right window bound to cuDNN with every mask.
    """

    def __init__(self, fn: Callable) -> None:
        """Read ``fn``'s signature.

        Args:
            fn: the function whose calls are read (its ``__wrapped__`` chain is followed).

        Raises:
            TypeError: a signature with ``*args`` or ``**kwargs`` (not readable by name).
        """
        params = inspect.signature(fn).parameters
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
            raise TypeError("a signature with *args or **kwargs cannot be read by name")
        self.has_right_bound = "bottom_right_diagonal" in params
        self.pick: Callable[[Sequence, Dict[str, Any]], Args] = _Reader(Args, params).read
        self.pick_all: Callable[[Sequence, Dict[str, Any]], FallbackArgs] = _Reader(
            FallbackArgs, params
        ).read


# ----------------------------------------------------------------------------- counts
_COUNT_NAMES = ("calls", "fixed", "skipped", "passthrough", "fallback")
_CALLS, _FIXED, _SKIPPED, _PASSTHROUGH, _FALLBACK = range(5)
_counts: List[int] = [0] * len(_COUNT_NAMES)


def call_counts() -> Dict[str, int]:
    """Calls through any wrapper since the last reset.

    Returns:
        ``calls``; ``fixed`` (post-pass on TE's output); ``skipped`` (nothing to do: MHA,
        non-THD, one offsets tensor for queries and keys, policy off, a cuDNN measured
        right); ``passthrough`` (not understood, logged once); ``fallback`` (the exact
        fallback replaced TE's call).
    """
    return dict(zip(_COUNT_NAMES, _counts))


def reset_call_counts() -> None:
    """Set every count of :func:`call_counts` to 0."""
    _counts[:] = [0] * len(_COUNT_NAMES)


# -------------------------------------------------------------------------- decisions
class Prepared:
    """What acting on inputs of one metadata needs, made at their first call.

    Attributes:
        launches: the gradients' metadata (:func:`_out_key`) -> the post-pass kernel launch
            for it (None: the PyTorch post-pass). A launch reads the offsets' length, so it
            is never shared between inputs of other metadata.
        recipe: the fallback's recipe for these inputs, or why it declines them (fallback
            decisions only; None until the first call).
    """

    __slots__ = ("launches", "recipe")

    def __init__(self) -> None:
        self.launches: Dict[tuple, Optional[postpass.KernelLaunch]] = {}
        self.recipe: Any = None


class Decision:
    """Everything one call shape needs, decided from its call key at its first call.

    Attributes:
        action: :func:`te_gqa_fix.rules.decide`'s action.
        passes: TE's call untouched, nothing more read.
        dq_too: dQ is THD, so its dead rows are zeroed as well.
        span: the mask's attended-key rule (:func:`te_gqa_fix.masks.key_span`).
        message: why TE is wrong here (actions ``fallback``, ``raise``, ``warn``).
        fallback: the fallback module, for ``fallback`` actions.
        prepared: the inputs key (:func:`_inputs_key`) -> :class:`Prepared`.
    """

    __slots__ = ("action", "dq_too", "fallback", "message", "passes", "prepared", "span")

    def __init__(
        self,
        action: rules.Action,
        dq_too: bool = False,
        span: Optional[KeySpan] = None,
        message: str = "",
    ) -> None:
        self.action = action
        self.passes = action.run == "te" and not action.zero
        self.dq_too = dq_too
        self.span = span
        self.message = message
        self.fallback: Any = None
        self.prepared: Dict[tuple, Prepared] = {}


_MAX_SHAPES = 256
_Tensor = torch.Tensor
_MISS = object()


def _remember(cache: Dict[Any, Any], key: object, value: object) -> None:
    """``cache[key] = value``, emptying ``cache`` first when it holds :data:`_MAX_SHAPES`."""
    if len(cache) >= _MAX_SHAPES:
        cache.clear()
    cache[key] = value


def _passthrough(key: object, msg: str, *args: object) -> None:
    _counts[_PASSTHROUGH] += 1
    log_once(("passthrough", key), logging.WARNING, msg + "; passed through untouched", *args)


def _device_index(q: object) -> Optional[int]:
    if type(q) is _Tensor:
        return q.get_device() if q.is_cuda else None  # type: ignore[union-attr]
    device = getattr(q, "device", None)
    return device.index if getattr(device, "type", None) == "cuda" else None


def _call_key(policy: str, guard: str, a: Args) -> Optional[tuple]:
    """Every fact :func:`_decide` reads from a call: its scalars and the q/k/v shapes; None
    when q, k or v is not a plain tensor (the call is decided anew). What only acting calls
    read is keyed apart (:func:`_inputs_key`), so a call passed through reads nothing more."""
    q, k, v, window = a.q, a.k, a.v, a.window_size
    T = _Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    try:
        shapes = (q.shape, k.shape, v.shape)
    except RuntimeError:  # a nested tensor has no shape: the input gate refuses it
        return None
    return (
        policy, guard, q.get_device() if q.is_cuda else None, q.dtype, shapes,
        a.cu_seqlens_q is a.cu_seqlens_kv, a.cu_seqlens_q_padded is a.cu_seqlens_kv_padded,
        a.attn_mask_type, tuple(window) if type(window) is list else window,
        a.bottom_right_diagonal, a.qkv_layout, a.dqkv_layout,
    )  # fmt: skip


def _same_memory(a: object, b: object) -> bool:
    return a is b or (
        type(a) is _Tensor
        and type(b) is _Tensor
        and a.data_ptr() == b.data_ptr()  # type: ignore[union-attr]
        and a.shape == b.shape  # type: ignore[union-attr]
        and a.stride() == b.stride()  # type: ignore[union-attr]
    )


def _inputs_key(a: Union[Args, FallbackArgs]) -> Optional[tuple]:
    """What the inputs' check reads beyond the call key, and what a post-pass launch reads
    of the offsets. None when a value cannot be keyed (the check then runs on every call)."""
    q, k, v, cu_q, cu_kv, pad_q, pad_kv = (
        a.q, a.k, a.v, a.cu_seqlens_q, a.cu_seqlens_kv, a.cu_seqlens_q_padded,
        a.cu_seqlens_kv_padded,
    )  # fmt: skip
    T = _Tensor
    if not (
        type(cu_q) is T and type(cu_kv) is T
        and (pad_q is None or type(pad_q) is T) and (pad_kv is None or type(pad_kv) is T)
    ):  # fmt: skip
        return None
    return (
        q.device, k.device, v.device,
        cu_q.dtype, cu_q.shape, cu_q.device, cu_kv.dtype, cu_kv.shape, cu_kv.device,
        None if pad_q is None else (pad_q.dtype, pad_q.shape, pad_q.device),
        None if pad_kv is None else (pad_kv.dtype, pad_kv.shape, pad_kv.device),
    )  # fmt: skip


def _fallback_inputs_key(a: FallbackArgs) -> Optional[tuple]:
    """:func:`_inputs_key`, and every other fact the fallback's recipe reads: the scalars
    the call key leaves out, the metadata of ``k``, ``v`` (their dtypes), ``d_o``, ``o`` and
    TE's softmax statistics, and which offsets share memory."""
    key = _inputs_key(a)
    if key is None:
        return None
    T = _Tensor
    cu_q, cu_kv, pad_q, pad_kv = (
        a.cu_seqlens_q, a.cu_seqlens_kv, a.cu_seqlens_q_padded, a.cu_seqlens_kv_padded,
    )  # fmt: skip
    aux = a.aux_ctx_tensors
    stats = aux[0] if type(aux) in (list, tuple) and aux else None
    extra = []
    for t in (a.k, a.v, a.d_o, a.o, stats):
        extra.append((t.dtype, t.shape, t.device) if type(t) is T else type(t))
    # What the recipe reads of the offsets' memory (the same tensor, as TE passes them, costs
    # no data_ptr read): one for q and kv, one padded, each side's sequences back to back.
    one_offsets = cu_q is cu_kv or _same_memory(cu_q, cu_kv)
    one_padded = pad_q is pad_kv or _same_memory(pad_q, pad_kv)
    back_q = pad_q is None or pad_q is cu_q or _same_memory(pad_q, cu_q)
    back_kv = pad_kv is None or pad_kv is cu_kv or _same_memory(pad_kv, cu_kv)
    return (
        *key, *extra, one_offsets, one_padded, back_q, back_kv,
        a.o_format, a.do_format, a.dropout, a.attn_bias_type, a.softmax_type,
        a.deterministic, a.fake_dtype, a.dqkv_dtype,
        a.s_quantizer is None and a.dp_quantizer is None and a.dqkv_quantizer is None,
        type(a.max_seqlen_q) is int and type(a.max_seqlen_kv) is int,
    )  # fmt: skip


def _shape(t: object) -> Optional[tuple]:
    return checks.shape_of(t)


#: The gradient dtypes TE zero-fills in a THD backward before cuDNN writes them.
_FILLED_BY_TE = (torch.float16, torch.bfloat16)

#: (device index) -> (compute capability, the cuDNN TE runs), read once per process.
_stack: Dict[int, Tuple[Optional[Tuple[int, ...]], Optional[Tuple[int, int, int]]]] = {}


def stack_facts(
    device_index: int,
) -> Tuple[Optional[Tuple[int, ...]], Optional[Tuple[int, int, int]]]:
    """The GPU's compute capability and the cuDNN TE runs, host reads only (cached)."""
    facts = _stack.get(device_index)
    if facts is None:
        capability = tuple(torch.cuda.get_device_capability(device_index))
        facts = _stack[device_index] = (capability, _te.te_cudnn_version())
    return facts


def _decide(policy: str, guard: str, a: Args) -> Optional[Decision]:
    """The :class:`Decision` for one call shape, from the facts of its call key alone;
    None: not understood (logged). Malformed mask arguments give the conservative span
    (TE validated them), logged once."""
    layout_name, layout = (
        ("qkv_layout", a.qkv_layout) if a.dqkv_layout is None else ("dqkv_layout", a.dqkv_layout)
    )
    formats = LAYOUTS.get(layout) if isinstance(layout, str) else None
    if formats is None:
        msg = "%s=%r is not a layout te-gqa-fix knows"
        _passthrough(("layout", layout), msg, layout_name, layout)
        return None
    dq_too, kv_thd = formats
    sq, sk, sv = _shape(a.q), _shape(a.k), _shape(a.v)
    d_qk, d_v = (int(sq[-1]) if sq else 0), (int(sv[-1]) if sv else 0)
    h_q = int(sq[1]) if sq and len(sq) == 3 else None
    h_kv = int(sk[1]) if sk and len(sk) == 3 else None
    dev = _device_index(a.q)
    capability, cudnn = stack_facts(dev) if dev is not None else (None, None)
    verdict = rules.judge(capability, cudnn, d_qk or None, d_v or None)
    shape = rules.CallShape(
        kv_thd=kv_thd,
        gqa=h_q is None or h_kv is None or h_q != h_kv,
        shared_offsets=h_q is not None
        and a.cu_seqlens_q is a.cu_seqlens_kv
        and a.cu_seqlens_q_padded is a.cu_seqlens_kv_padded,
        filled_by_te=type(a.q) is _Tensor and a.q.dtype in _FILLED_BY_TE,
    )
    action = rules.decide(verdict, shape, policy, guard)
    if action.run == "te" and not action.zero:
        return Decision(action)
    message = ""
    if verdict.status == "live_rows_wrong":
        message = _wrong_here(capability, cudnn, d_qk, d_v)
    decision = Decision(
        action, dq_too, key_span(a.attn_mask_type, a.window_size, a.bottom_right_diagonal), message
    )
    if action.run == "fallback":
        from . import fallback

        decision.fallback = fallback
    return decision


def _wrong_here(capability, cudnn, d_qk: int, d_v: int) -> str:
    """Why TE's result is wrong beyond any post-pass here, and the remedies (no disk read:
    ``doctor`` says what this machine has)."""
    shape = f"{d_qk}" if d_qk == d_v else f"{d_qk} (q/k) / {d_v} (v)"
    cap = capability or (0, 0)
    build = (
        f"cuDNN {rules.version_text(cudnn)}"
        if cudnn is not None
        else "a cuDNN whose version TE does not report (judged as the oldest measured build, "
        f"{rules.version_text(rules.MEASURED[0].cudnn)})"
    )
    right = rules.newest_right(d_qk, d_v).cudnn
    return (
        f"Transformer Engine's THD attention backward with head dim {shape} on "
        f"sm{cap[0]}{cap[1]} with {build} returns wrong gradients on rows that receive "
        f"attention; a post-pass cannot repair this. Remedy: run TE on cuDNN "
        f"{rules.version_text(right[:2])} or newer, which was measured right there: "
        f"TE_GQA_FIX_CUDNN=auto loads an installed one ({rules.pip_hint(right)} installs "
        f"one); `te-gqa-fix doctor --head-dim {d_qk}` says what this machine has."
    )


def _prepared(decision: Decision, a: Union[Args, FallbackArgs]) -> Prepared:
    """The :class:`Prepared` of this call's inputs: checked once per inputs key before TE
    runs (:class:`~te_gqa_fix.errors.InputError` naming the argument). ``a``: the call's
    :class:`FallbackArgs` where the fallback runs, else its :class:`Args`."""
    if decision.fallback is not None:
        key = _fallback_inputs_key(a)  # type: ignore[arg-type]
    else:
        key = _inputs_key(a)
    try:
        found = None if key is None else decision.prepared.get(key)
    except TypeError:  # an unhashable argument: checked and prepared without the cache
        key, found = None, None
    if found is not None:
        return found
    sq, sk = _shape(a.q), _shape(a.k)
    checks.gradients(
        a.q if decision.dq_too else None, a.k, a.v, a.cu_seqlens_q, a.cu_seqlens_kv,
        a.cu_seqlens_q_padded, a.cu_seqlens_kv_padded,
        int(sq[1]) if sq and len(sq) == 3 else None, int(sk[1]) if sk and len(sk) == 3 else None,
        ("q", "k", "v"),
    )  # fmt: skip
    found = Prepared()
    if key is not None:
        _remember(decision.prepared, key, found)
    return found


def _fallback(
    decision: Decision, prepared: Prepared, a: FallbackArgs, has_right_bound: bool
) -> Any:
    """The exact fallback's output for this call; UnrepairableConfiguration where it
    declines the call."""
    recipe = prepared.recipe
    if recipe is None:
        recipe = prepared.recipe = decision.fallback.decide(a, has_right_bound)
        if not isinstance(recipe, str):
            log_once(
                ("fallback", decision.message), logging.WARNING,
                "%s te-gqa-fix computes this backward exactly with PyTorch's FlashAttention-2 "
                "kernels instead (slower than a cuDNN measured right: TE_GQA_FIX_CUDNN=auto)",
                decision.message,
            )  # fmt: skip
    if isinstance(recipe, str):
        raise UnrepairableConfiguration(
            f"{decision.message} The exact fallback cannot serve this call: {recipe}. To "
            "accept TE's wrong result knowingly instead, set TE_GQA_FIX_GUARD=warn."
        )
    return decision.fallback.run(recipe, a)


def _out_key(dq: object, dk: object, dv: object) -> Optional[tuple]:
    """What a kernel launch depends on in the gradients; None for anything but plain tensors."""
    T = _Tensor
    if type(dk) is not T or type(dv) is not T or (dq is not None and type(dq) is not T):
        return None
    key = (dk.shape, dk.stride(), dk.dtype, dk.device, dv.shape, dv.stride(), dv.dtype, dv.device)
    return key if dq is None else (*key, dq.shape, dq.stride(), dq.dtype, dq.device)


def _check_outputs(dq: Any, dk: Any, dv: Any, offsets: tuple) -> None:
    """The gate of ``zero_dead_rows`` on TE's (or the fallback's) gradients: readable THD
    tensors, no two rows sharing memory (InputError otherwise)."""
    checks.gradients(dq, dk, dv, *offsets)
    named = []
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        data = None if t is None else checks.writable_rows(t, name)
        if data is not None:
            checks.rows_disjoint(name, data)
        named.append((name, data))
    checks.disjoint(named)


def _zero(
    decision: Decision, prepared: Prepared, a: Union[Args, FallbackArgs], out: Any, validate: str
) -> bool:
    """The post-pass on ``out`` (TE's or the fallback's); False when ``out`` is not
    gradients it can zero (passed through untouched, logged once)."""
    if type(out) not in (list, tuple) or len(out) < 3:
        kind = type(out).__name__
        _passthrough(("output", kind), "fused_attn_bwd returned %s, not (dq, dk, dv, ...)", kind)
        return False
    dq = out[0] if decision.dq_too else None
    dk, dv = out[1], out[2]
    offsets = (a.cu_seqlens_q, a.cu_seqlens_kv, a.cu_seqlens_q_padded, a.cu_seqlens_kv_padded)
    key = _out_key(dq, dk, dv)
    launch = _MISS if key is None else prepared.launches.get(key, _MISS)
    if launch is _MISS:  # once per metadata of the inputs and the gradients
        try:
            _check_outputs(dq, dk, dv, offsets)
        except InputError as exc:
            msg = "fused_attn_bwd returned gradients the post-pass cannot zero (%s)"
            _passthrough(("output", str(exc)), msg, exc)
            return False
        launch = postpass.prepare(dq, dk, dv, offsets, decision.span)  # type: ignore[arg-type]
        if key is not None:
            _remember(prepared.launches, key, launch)
    postpass.zero(dq, dk, dv, offsets, decision.span, launch, validate == "on")  # type: ignore[arg-type]
    return True


def _new_wrapper(original: Callable) -> Callable:
    try:
        sig: Optional[Signature] = Signature(original)
        reason = ""
    except (TypeError, ValueError) as exc:
        sig, reason = None, str(exc)
    decisions: Dict[tuple, Decision] = {}
    has_right_bound = sig is not None and sig.has_right_bound

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
        a = sig.pick(args, kwargs)
        key = _call_key(policy, guard, a)
        try:
            decision = None if key is None else decisions.get(key)
        except TypeError:  # an unhashable argument: decide without the cache
            key, decision = None, None
        if decision is None:
            decision = _decide(policy, guard, a)
            if decision is None:
                return original(*args, **kwargs)
            if key is not None:
                _remember(decisions, key, decision)
        if decision.passes:
            _counts[_SKIPPED] += 1
            return original(*args, **kwargs)
        run = decision.action.run
        if run == "fallback":
            every = sig.pick_all(args, kwargs)
            prepared = _prepared(decision, every)
            out = _fallback(decision, prepared, every, has_right_bound)
            if _zero(decision, prepared, every, out, validate):
                _counts[_FALLBACK] += 1
            return out
        prepared = _prepared(decision, a)
        if run == "raise":
            raise UnrepairableConfiguration(f"{decision.message} (TE_GQA_FIX_GUARD=strict)")
        if run == "warn":
            msg = "%s (TE_GQA_FIX_GUARD=warn: TE's result is returned)"
            log_once(("unrepairable", decision.message), logging.WARNING, msg, decision.message)
        out = original(*args, **kwargs)
        if not decision.action.zero:
            _counts[_SKIPPED] += 1
        elif _zero(decision, prepared, a, out, validate):
            _counts[_FIXED] += 1
        return out

    setattr(fused_attn_bwd, MARKER, True)  # functools.wraps set __wrapped__
    return fused_attn_bwd


_wrappers: Dict[int, Callable] = {}


def wrapper_for(original: Callable) -> Callable:
    """The one wrapper of ``original`` (cached: patch sites and the drop-in share it).

    Args:
        original: TE's ``fused_attn_bwd``, or a function of the same signature (another
            library's ``functools.wraps`` wrapper of it included).

    Returns:
        A function with the same signature that returns what ``original`` returns, after
        zeroing in place every row whose true gradient is 0 (see the README's settings).
    """
    original = unwrap(original)
    cached = _wrappers.get(id(original))
    if cached is not None and cached.__wrapped__ is original:  # type: ignore[attr-defined]
        return cached
    wrapper = _wrappers[id(original)] = _new_wrapper(original)
    logger.debug("wrapped %s", getattr(original, "__qualname__", original))
    return wrapper


# ---------------------------------------------------------------------------- drop-in
#: (TE's module dict, what it held under fused_attn_bwd, the function the drop-in calls).
_drop_in: Optional[Tuple[Dict[str, Any], object, Callable]] = None


def _resolve_drop_in() -> Tuple[Dict[str, Any], object, Callable]:
    global _drop_in
    module = _te.fused_attn_module()
    held = getattr(module, SYMBOL, None)
    if held is None:
        raise _te.missing_symbol(module)
    # Installed (ours somewhere in its chain): TE's module already calls the wrapper.
    target = held if any(is_wrapper(x) for x in chain(held)) else wrapper_for(held)
    _drop_in = (vars(module), held, target)
    _te.warn_if_unvalidated()
    return _drop_in


def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for TE's ``fused_attn_bwd`` (TE 2.8 to 2.20, positional or keyword).

    Calls the installed TE's function through the wrapper and returns what it returns,
    with every row whose true gradient is 0 zeroed in place; no host sync. TE's function
    is looked up once, and again only when TE's module holds another one (an install, an
    uninstall, a reload).

    Raises:
        SetupError: Transformer Engine is missing (an ImportError saying how to install it).
    """
    resolved = _drop_in
    if resolved is None or resolved[0].get(SYMBOL) is not resolved[1]:
        resolved = _resolve_drop_in()
    return resolved[2](*args, **kwargs)
