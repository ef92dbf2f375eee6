"""The drop-in ``fused_attn_bwd``: call TE unchanged, then zero the rows that must be 0.

TE's signature drifted between releases (2.8 has ``dqkv_dtype``; 2.20 has ``o_format``,
``do_format``, ``dqkv_layout``, ``bottom_right_diagonal``, ``cuda_graph``), and TE's own
call sites mix positional and keyword arguments. So arguments are never read by fixed
position: the wrapper reads them by name through the installed function's
``inspect.signature``, resolved once per original into a name -> position table.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

# The guard's module: the C lane reads its cached cuDNN decisions (guard._fixed) by name.
from . import guard as _guard_module
from . import triton_postpass as _tp
from ._logging import log_once, logger
from ._marker import MARKER, is_wrapper, unwrap

# The guard's decisions, read by the fast lane: one dict lookup says "decided, nothing
# to say" without a call (reset_guard clears the same dict).
from .guard import _decisions as _guard_decisions
from .guard import check_head_dims, cudnn_fixed
from .masks import KeySpan, key_span
from .policy import deep_validation_enabled, env_mapping, get_policy
from .postpass import zero_dead_rows_prechecked
from .validation import check_metadata, shape_of

__all__ = [
    "MARKER",
    "call_counts",
    "fused_attn_bwd",
    "is_wrapper",
    "parse_layout",
    "reset_call_counts",
    "unwrap",
    "wrapper_for",
]


_COUNT_NAMES = ("calls", "fixed", "skipped", "passthrough", "fast_lane")
_CALLS, _FIXED, _SKIPPED, _PASSTHROUGH, _FAST_LANE = range(5)
#: One plain list, indexed by the constants above: an item increment is about a third of
#: a Counter's, and the wrapper counts twice per call.
_counts: List[int] = [0, 0, 0, 0, 0]


def call_counts() -> Dict[str, int]:
    """How many calls went through any wrapper: ``calls``, ``fixed`` (post-pass ran),
    ``skipped`` (understood, nothing to do: MHA, non-THD, policy off, fixed cuDNN) and
    ``passthrough`` (not understood; logged once); ``fast_lane``: of all calls, those the
    fast lane served (a shape already seen: see ``_Lane``). Plain Python counters: no
    device work."""
    return dict(zip(_COUNT_NAMES, _counts))


def reset_call_counts() -> None:
    _counts[:] = [0, 0, 0, 0, 0]


_THD_LAYOUTS: Dict[str, Tuple[bool, bool]] = {
    # layout -> (dQ is THD, dK/dV are THD)
    "t3hd": (True, True),
    "th3d": (True, True),
    "thd_t2hd": (True, True),
    "thd_th2d": (True, True),
    "thd_thd_thd": (True, True),
    "thd_bshd_bshd": (True, False),
    "thd_sbhd_sbhd": (True, False),
}
_OTHER_LAYOUTS = {
    "sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
    "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd",
    "sbhd_bshd_bshd", "bshd_sbhd_sbhd", "bhsd_bhsd_bhsd",
}  # fmt: skip


def parse_layout(layout: object) -> Optional[Tuple[bool, bool]]:
    """``(dq_is_thd, dkv_is_thd)`` for a TE layout string; None when not understood."""
    if not isinstance(layout, str):
        return None
    if layout in _THD_LAYOUTS:
        return _THD_LAYOUTS[layout]
    if layout in _OTHER_LAYOUTS:
        return (False, False)
    return None


#: What the hot path reads from every call, in this order (see _Args.picker).
_CALL_ARGS = (
    "k", "v", "layout_name", "layout", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded", "attn_mask_type", "window_size", "bottom_right_diagonal",
)  # fmt: skip


class _Args:
    """Name-based access to one call's arguments, from a signature resolved once."""

    def __init__(self, fn: Callable) -> None:
        sig = inspect.signature(fn)
        self.positions: Dict[str, int] = {}
        self.defaults: Dict[str, Any] = {}
        self.names = set(sig.parameters)
        self.has_dqkv_layout = "dqkv_layout" in self.names
        for i, (name, p) in enumerate(sig.parameters.items()):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"signature has *{name}; cannot bind by name")
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.positions[name] = i
            if p.default is not p.empty:
                self.defaults[name] = p.default
        self.pick_q = self.picker(("q",))
        self.pick_call = self.picker(_CALL_ARGS)

    def get(self, args: Sequence, kwargs: Mapping[str, Any], name: str, default: Any = None):
        if name in kwargs:
            return kwargs[name]
        i = self.positions.get(name)
        if i is not None and i < len(args):
            return args[i]
        return self.defaults.get(name, default)

    def _expr(self, name: str, fallback: str) -> str:
        """Source of one argument's value: keyword, else position, else default."""
        default = f"_d[{name!r}]" if name in self.defaults else fallback
        i = self.positions.get(name)
        if name not in self.names:
            return fallback
        if i is None:
            return f"kwargs.get({name!r}, {default})"
        return f"(kwargs[{name!r}] if {name!r} in kwargs else args[{i}] if na > {i} else {default})"

    def picker(self, names: Sequence[str]) -> Callable[[Sequence, Mapping[str, Any]], tuple]:
        """A function ``(args, kwargs) -> values of names`` compiled for this signature.

        Why generated code: the wrapper reads a dozen arguments on every call; one
        expression per argument with the position baked in is several times cheaper
        than a lookup loop (the same trick Triton uses for its argument binder).
        ``layout`` stands for TE's ``dqkv_layout`` when the call gave one, else
        ``qkv_layout``; ``layout_name`` says which.
        """
        parts = []
        for name in names:
            if name == "layout_name":
                given = "False"
                if self.has_dqkv_layout:
                    i = self.positions.get("dqkv_layout")
                    given = "'dqkv_layout' in kwargs" + (f" or na > {i}" if i is not None else "")
                parts.append(f"('dqkv_layout' if ({given}) else 'qkv_layout')")
            elif name == "layout":
                dq = self._expr("dqkv_layout", "None") if self.has_dqkv_layout else "None"
                qkv = self._expr("qkv_layout", "None")
                given = "False"
                if self.has_dqkv_layout:
                    i = self.positions.get("dqkv_layout")
                    given = "'dqkv_layout' in kwargs" + (f" or na > {i}" if i is not None else "")
                parts.append(f"({dq} if ({given}) else {qkv})")
            else:
                parts.append(self._expr(name, "(-1, -1)" if name == "window_size" else "None"))
        src = (
            "def pick(args, kwargs):\n    na = len(args)\n    return (" + ", ".join(parts) + ",)\n"
        )
        scope: Dict[str, Any] = {"_d": dict(self.defaults)}
        exec(compile(src, f"<te_gqa_fix picker {','.join(names)}>", "exec"), scope)
        return scope["pick"]


def _heads(t: object) -> Optional[int]:
    shape = shape_of(t)  # also TE's FP8 storage classes, which have size() but no shape
    return int(shape[-2]) if shape is not None and len(shape) >= 2 else None


_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
_MAX_PLANS = 256


class _Decision:
    """What the wrapper does for one call shape, decided once and reused.

    ``fix`` False means "understood, nothing to do" (MHA under auto, non-THD dK/dV).
    ``guard`` holds ``(device_index, d_qk, d_v)`` for the per-call head-dim guard (a dict
    lookup after its first call), or None. ``launches`` is the Triton launch cache for
    this call shape (None: the PyTorch route).
    """

    __slots__ = ("fix", "fix_q", "guard", "launches", "span")

    def __init__(
        self,
        fix: bool,
        fix_q: bool = False,
        span: Optional[KeySpan] = None,
        guard: Optional[Tuple[int, int, int]] = None,
        launches: Optional[object] = None,
    ) -> None:
        self.fix = fix
        self.fix_q = fix_q
        self.span = span
        self.guard = guard
        self.launches = launches


def _passthrough(key: object, msg: str, *args: object) -> None:
    _counts[_PASSTHROUGH] += 1
    log_once(
        ("passthrough", key),
        logging.WARNING,
        "te_gqa_fix: " + msg + "; passed through untouched",
        *args,
    )


def _guard_dims(
    device_index: Optional[int], q: object, v: object
) -> Optional[Tuple[int, int, int]]:
    """``(device, d_qk, d_v)`` for :func:`check_head_dims`, or None when it cannot apply."""
    if device_index is None:
        return None
    sq, sv = shape_of(q), shape_of(v)
    if sq is not None and sv is not None and len(sq) >= 1 and len(sv) >= 1:
        return (device_index, int(sq[-1]), int(sv[-1]))
    return None


def _device_index(q: object) -> Optional[int]:
    """The CUDA device index of ``q``, or None (CPU, unknown). No torch.device for tensors."""
    if type(q) is _Tensor:
        return q.get_device() if q.is_cuda else None  # type: ignore[union-attr]
    device = getattr(q, "device", None)
    return device.index if device is not None and getattr(device, "type", None) == "cuda" else None


#: The two functions the C lane reads the answers of itself (q's device; the cached
#: cuDNN decision) while this module's globals still name them; where a test or
#: benchmark replaced one, the C lane calls the replacement.
_C_READS = (_device_index, cudnn_fixed)


def _decide(
    binder: _Args,
    args: Sequence,
    kwargs: Mapping[str, Any],
    policy: str,
    device_index: Optional[int],
    q: object,
    layout_name: str,
    layout: object,
    offsets: tuple,
) -> Optional[_Decision]:
    """Decide from metadata alone (no sync) whether and how to post-process this call shape.

    Runs on the first call of each shape (and on every call the cache cannot key); its
    checks raise ``ValueError`` naming the argument, so a bad call is never cached.
    """
    formats = parse_layout(layout)
    if formats is None:
        _passthrough(
            ("layout", layout), "%s=%r is not a layout te-gqa-fix knows", layout_name, layout
        )
        return None
    fix_q, fix_kv = formats
    if not fix_kv:
        return _Decision(False)
    k = binder.get(args, kwargs, "k")
    v = binder.get(args, kwargs, "v")
    guard = _guard_dims(device_index, q, v)
    if guard is not None:
        check_head_dims(*guard)
    h_q, h_kv = _heads(q), _heads(k)
    if policy == "auto" and h_q is not None and h_q == h_kv:
        return _Decision(False, guard=guard)
    check_metadata(q if fix_q else None, k, v, *offsets, h_q, h_kv, names=("q", "k", "v"))
    span = key_span(
        binder.get(args, kwargs, "attn_mask_type"),
        binder.get(args, kwargs, "window_size", (-1, -1)),
        binder.get(args, kwargs, "bottom_right_diagonal"),
    )
    launches = None
    if device_index is not None:
        from . import triton_postpass

        if triton_postpass.available():
            launches = triton_postpass.Launches()
    return _Decision(True, fix_q, span, guard, launches)


def _prepare(
    binder: _Args, args: Sequence, kwargs: Mapping[str, Any], cache: Dict[tuple, _Decision]
) -> Optional[Tuple[_Decision, tuple]]:
    """``(plan, offsets)`` when this call needs the post-pass, else None (counted).

    The hot path: the policy, the fixed-cuDNN pass-through, then one tuple of the call's
    metadata (layout, mask, window, shapes and device indices of q/k/v, dtype/shape/device
    index of each offsets tensor) looked up in ``cache``. Everything ``check_metadata``
    reads is in that tuple, so a hit means this exact metadata was checked before; the
    offsets are new tensors each call, and their metadata is compared on every call.
    Device indices (``get_device``, an int) rather than ``torch.device`` objects: every
    tensor TE accepts is on CUDA, and an index is one C call with no object to build.
    """
    policy = get_policy()
    if policy == "off":
        _counts[_SKIPPED] += 1
        return None
    q = binder.pick_q(args, kwargs)[0]
    device_index = _device_index(q)
    if policy == "auto" and device_index is not None and cudnn_fixed(device_index):
        # cuDNN >= 9.18 initialises the workspace: nothing to repair, nothing to guard.
        _counts[_SKIPPED] += 1
        return None
    k, v, layout_name, layout, cu_q, cu_kv, pad_q, pad_kv, mask, window, brd = binder.pick_call(
        args, kwargs
    )
    offsets = (cu_q, cu_kv, pad_q, pad_kv)
    T = _Tensor
    key: Optional[tuple] = None
    if type(q) is T and type(k) is T and type(v) is T and type(cu_q) is T and type(cu_kv) is T:
        if pad_q is None:
            meta_pq: object = None
        elif type(pad_q) is T:
            meta_pq = (pad_q.dtype, pad_q.shape, pad_q.get_device())
        else:
            meta_pq = T
        if pad_kv is None:
            meta_pk: object = None
        elif pad_kv is pad_q:  # TE's context-parallel paths pass one tensor for both
            meta_pk = True
        elif type(pad_kv) is T:
            meta_pk = (pad_kv.dtype, pad_kv.shape, pad_kv.get_device())
        else:
            meta_pk = T
        if meta_pq is not T and meta_pk is not T:
            key = (
                policy, layout_name, layout, mask,
                tuple(window) if type(window) is list else window, brd,
                q.shape, device_index, k.shape, k.get_device(), v.shape, v.get_device(),
                cu_q.dtype, cu_q.shape, cu_q.get_device(),
                cu_kv.dtype, cu_kv.shape, cu_kv.get_device(), meta_pq, meta_pk,
            )  # fmt: skip
    plan = None
    if key is not None:
        try:
            plan = cache.get(key)
        except TypeError:  # an unhashable argument: decide without the cache
            key = None
    if plan is None:
        plan = _decide(binder, args, kwargs, policy, device_index, q, layout_name, layout, offsets)
        if plan is None:
            return None
        if key is not None:
            if len(cache) >= _MAX_PLANS:
                cache.clear()
            cache[key] = plan
    elif plan.guard is not None:
        check_head_dims(*plan.guard)
    if not plan.fix:
        _counts[_SKIPPED] += 1
        return None
    return plan, offsets


def _apply(plan: _Decision, offsets: tuple, out: object) -> None:
    """Zero the dead rows of TE's outputs: the kernel's cached launch, else the PyTorch
    post-pass (no kernel, kernel declined, ``TE_GQA_FIX_VALIDATE`` on)."""
    if not isinstance(out, (list, tuple)) or len(out) < 3:
        _passthrough(
            ("output", type(out).__name__),
            "fused_attn_bwd returned %s, not (dq, dk, dv, ...)",
            type(out).__name__,
        )
        return
    dq = out[0] if plan.fix_q else None
    dk, dv = out[1], out[2]
    launches = plan.launches
    # The common case in one call: the launch cache (it also raises recorded offset
    # errors first). Deep validation (then the kernel after the checks) and a declined
    # launch (then PyTorch) take the general entry.
    if launches is not None and not deep_validation_enabled():
        if launches.launch(dq, dk, dv, offsets, plan.span):
            _counts[_FIXED] += 1
            return
        launches = None
    zero_dead_rows_prechecked(dq, dk, dv, offsets, plan.span, launches)
    _counts[_FIXED] += 1


#: What the fast lane reads from a call, in this order (see _Lane).
_LANE_ARGS = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded", "attn_mask_type", "window_size", "qkv_layout",
    "bottom_right_diagonal", "dqkv_layout",
)  # fmt: skip
_LANE_REQUIRED = 10  # the first ten; the last two are absent from older TE signatures
#: The same for a call with keyword arguments (TE's context-parallel call sites), read
#: by the binder's picker: TE's layout rule (``layout_name``: which of the two layout
#: arguments was given, and ``layout``: its value) in the two layout slots. A learned
#: entry of a positional call has a layout there, never ``"qkv_layout"`` or
#: ``"dqkv_layout"``, so the two kinds of key cannot meet.
_LANE_ARGS_BY_NAME = (*_LANE_ARGS[:9], "layout_name", "bottom_right_diagonal", "layout")


class _Lane:
    """The wrapper's fast lane: a call shape already decided, checked and launched once
    is served from one dict, keyed on the call's metadata, without the general path.

    Why: the general path resolves the policy, the decision, the launch plan and the
    direct launch in separate steps (each with its own lookups, each reading the same
    tensors' metadata again): about 7 us of Python per call in benchmarks/host_cpu.py,
    on a budget of 15 us that also holds the kernel launch. TE calls ``fused_attn_bwd``
    with every argument by position (its context-parallel paths: the first twelve by
    position, the rest by keyword), the same shapes on every layer and step: the lane
    takes both.

    Where te_gqa_fix.c_launch's module is loaded (Triton 3.5/3.6, a C compiler), the lane
    runs in C (``lane`` in c_launch.c): the same checks in the same order on the same
    objects, TE's call, then ``serve``, reading :attr:`c_state`. It answers "nothing done"
    (:data:`_MISS`: this Python lane then runs as before) or, having called TE, hands a
    call ``serve`` declined back as an :class:`_AfterTE` to :func:`_finish`, the Python
    after TE's call that this lane also runs.

    Per call it checks, in order: ``TE_GQA_FIX`` and ``TE_GQA_FIX_VALIDATE`` are the
    very values it last read (any change clears the lane); q, k, v and the four offsets
    are plain tensors, q on CUDA; the fixed-cuDNN pass-through; the key (every input
    fact the general path's decision depends on, plus the offsets' contiguity); the
    head-dim guard decided with nothing to say. After TE's call: the outputs' key equals
    the one recorded (:func:`te_gqa_fix.triton_postpass.output_key`), no bad offsets are
    pending and the kernel has not been given up; then it launches through
    :func:`te_gqa_fix.triton_postpass._run`, the one direct launch. (The C lane's
    ``serve`` makes the same checks; on the H200 the work right after TE's call costs
    about twice what it costs back to back: benchmarks/wake_split.py.) Anything else takes
    the general path, which also records what the lane may serve next time; outputs of
    new metadata go to the general post-pass and are recorded as well.
    """

    __slots__ = ("c_state", "entries", "env", "need", "pick", "pick_by_name", "snap")

    def __init__(self, binder: _Args, original: Callable) -> None:
        positions = [binder.positions.get(n) for n in _LANE_ARGS]
        self.env = env_mapping()
        if self.env is None or any(i is None for i in positions[:_LANE_REQUIRED]):
            raise LookupError("no fast lane for this signature")
        # An argument this TE does not have reads the mask's position again: a
        # duplicate in the key, never a tensor (a tensor would make every key new).
        mask_at = positions[_LANE_ARGS.index("attn_mask_type")]
        at = [mask_at if i is None else i for i in positions]
        self.pick = operator.itemgetter(*at)
        self.need = max(i for i in positions if i is not None) + 1
        self.pick_by_name = binder.picker(_LANE_ARGS_BY_NAME)
        #: call-shape key -> (decision, guard key, output key, launch plan)
        self.entries: Dict[tuple, tuple] = {}
        #: [lane on (None: settings never read), raw TE_GQA_FIX, raw TE_GQA_FIX_VALIDATE,
        #:  policy is auto], as last read by :meth:`refresh`
        self.snap: List[Any] = [None, None, None, False]
        #: What the C lane reads, in the order of ``S_*`` in c_launch.c: this lane's
        #: containers (never rebound), the modules' globals (read by name per call, as
        #: here), and the functions whose answers it reads itself while this module's
        #: globals still name them (tests replace them).
        self.c_state = (
            self.snap, *self.env, tuple(at), self.need, self.pick_by_name, self.entries,
            globals(), *_C_READS, vars(_guard_module), vars(_tp), original, _MISS, _AfterTE,
        )  # fmt: skip

    def refresh(self) -> None:
        """Re-read both settings if either changed since the last read (then forget
        every entry). The lane is on unless the policy is ``off`` or validation is on."""
        data, key_policy, key_validate = self.env  # type: ignore[misc]
        raw_policy, raw_validate = data.get(key_policy), data.get(key_validate)
        snap = self.snap
        if snap[1] is raw_policy and snap[2] is raw_validate and snap[0] is not None:
            return
        self.entries.clear()
        policy = get_policy()
        on = policy != "off" and not deep_validation_enabled()
        snap[:] = [on, raw_policy, raw_validate, policy == "auto"]

    def learn(self, key: tuple, plan: _Decision, offsets: tuple, out: object) -> None:
        """Record what this call did, if the lane can do the same next time: the post-pass
        by the kernel's armed direct launch, on contiguous offsets."""
        launches = plan.launches
        if not plan.fix or launches is None or not isinstance(out, (list, tuple)):
            return
        if len(out) < 3 or not all(o.is_contiguous() for o in offsets):
            return
        okey = _tp.output_key(out[0] if plan.fix_q else None, out[1], out[2])
        launch = None if okey is None else launches.direct(okey)
        if launch is None:
            return
        if len(self.entries) >= _MAX_PLANS:
            self.entries.clear()
        self.entries[key] = (plan, plan.guard, okey, launch)


def _new_lane(binder: Optional[_Args], original: Callable) -> Optional[_Lane]:
    try:
        return None if binder is None else _Lane(binder, original)
    except LookupError:
        return None


#: The C lane's answer "nothing done": the Python lane runs.
_MISS = object()


class _AfterTE(tuple):
    """The C lane's answer for a call it made TE's call for but did not finish (``serve``
    declined or failed): ``(out, key, entry, exception or None, cu_q, cu_kv, pad_q,
    pad_kv)``, finished by :func:`_finish`."""

    __slots__ = ()


def _finish(
    lane: _Lane, key: tuple, entry: tuple, out: Any, offsets: Tuple[Any, Any, Any, Any]
) -> Any:
    """The fast lane after TE's call, in Python: TE's outputs checked against the
    recorded output key, no bad offsets pending, then the direct launch; anything else
    (new output metadata, a given-up kernel) through the general post-pass, recorded."""
    plan, _, okey, launch = entry
    if type(out) in _SEQUENCES and len(out) > 2:
        dq = out[0] if plan.fix_q else None
        dk, dv = out[1], out[2]
        if _tp.output_key(dq, dk, dv) == okey and not _tp._broken:
            words = launch.words
            if not (words[0] | words[1]):
                try:
                    _tp._run(launch, (dk if dq is None else dq, dk, dv, *offsets))
                    _counts[_FIXED] += 1
                    return out
                except Exception as exc:
                    _tp._give_up(exc)
    _apply(plan, offsets, out)
    lane.learn(key, plan, offsets, out)  # new outputs' plan
    return out


def _new_wrapper(original: Callable) -> Callable:
    """Wrap TE's ``fused_attn_bwd``: same call, same return object, dead rows zeroed.

    Uncached: callers go through :func:`wrapper_for`, so that patch sites and the drop-in
    share one wrapper per original.

    Idempotent: wrapping a wrapper returns it unchanged. ``__wrapped__`` is the original.
    """
    if is_wrapper(original):
        return original
    cache: Dict[tuple, _Decision] = {}
    try:
        binder: Optional[_Args] = _Args(original)
    except (TypeError, ValueError) as exc:
        binder = None
        reason = str(exc)

    lane = _new_lane(binder, original)
    if lane is not None:
        entries, snap, pick, need = lane.entries, lane.snap, lane.pick, lane.need
        pick_by_name, c_state = lane.pick_by_name, lane.c_state
        data, key_policy, key_validate = lane.env  # type: ignore[misc]

    @functools.wraps(original)
    def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
        # The fast lane in C, where its module is loaded (see _Lane).
        c_lane = _tp._c_lane
        if c_lane is not None and lane is not None:
            done = c_lane(c_state, args, kwargs)
            if type(done) is not _AfterTE:
                if done is not _MISS:
                    return done
            else:
                out, key, entry, exc = done[:4]
                if exc is not None:
                    _tp._fast_failed(exc)
                return _finish(lane, key, entry, out, done[4:])  # type: ignore[arg-type]
        _counts[_CALLS] += 1
        if binder is None:
            _passthrough(
                ("signature", id(original)),
                "cannot read the signature of %r (%s)",
                original,
                reason,
            )
            return original(*args, **kwargs)
        key = None
        # The fast lane (see _Lane): all in this one frame, since every call and
        # lookup costs on a path TE takes once per layer and step.
        if lane is not None and snap[0]:
            if data.get(key_policy) is snap[1]:
                if data.get(key_validate) is snap[2]:
                    q, k, v, cu_q, cu_kv, pad_q, pad_kv, mask, window, lay, brd, dlay = (
                        pick(args)
                        if not kwargs and len(args) >= need
                        else pick_by_name(args, kwargs)
                    )
                    T = _Tensor
                    if (
                        type(q) is T and type(k) is T and type(v) is T and type(cu_q) is T
                        and type(cu_kv) is T and type(pad_q) is T and type(pad_kv) is T
                    ):  # fmt: skip
                        dev = _device_index(q)
                        if dev is not None:
                            if snap[3] and cudnn_fixed(dev):
                                _counts[_SKIPPED] += 1
                                _counts[_FAST_LANE] += 1
                                return original(*args, **kwargs)
                            key = (
                                lay, dlay, mask, window, brd, dev, q.shape, k.shape,
                                k.get_device(), v.shape, v.get_device(),
                                cu_q.dtype, cu_q.shape, cu_q.get_device(), cu_q.is_contiguous(),
                                cu_kv.dtype, cu_kv.shape, cu_kv.get_device(),
                                cu_kv.is_contiguous(), pad_q.dtype, pad_q.shape,
                                pad_q.get_device(), pad_q.is_contiguous(), pad_kv is pad_q,
                                pad_kv.dtype, pad_kv.shape, pad_kv.get_device(),
                                pad_kv.is_contiguous(),
                            )  # fmt: skip
                            try:
                                entry = entries.get(key)
                            except TypeError:  # an unhashable argument: the general path
                                entry = key = None
                            if entry is not None and (
                                entry[1] is None or _guard_decisions.get(entry[1], 0) is None
                            ):
                                _counts[_FAST_LANE] += 1
                                out = original(*args, **kwargs)
                                return _finish(lane, key, entry, out, (cu_q, cu_kv, pad_q, pad_kv))
        if lane is not None:
            lane.refresh()
        decided = _prepare(binder, args, kwargs, cache)
        out = original(*args, **kwargs)
        if decided is not None:
            _apply(decided[0], decided[1], out)
            if key is not None:
                lane.learn(key, decided[0], decided[1], out)  # type: ignore[union-attr]
        return out

    setattr(fused_attn_bwd, MARKER, True)
    fused_attn_bwd.__wrapped__ = original  # type: ignore[attr-defined]
    return fused_attn_bwd


_wrappers: Dict[int, Callable] = {}
_te_module: Optional[ModuleType] = None


def wrapper_for(original: Callable) -> Callable:
    """The one wrapper of ``original`` (cached, so patch sites and the drop-in share it)."""
    original = unwrap(original)
    cached = _wrappers.get(id(original))
    if cached is not None and cached.__wrapped__ is original:  # type: ignore[attr-defined]
        return cached
    wrapper = _new_wrapper(original)
    _wrappers[id(original)] = wrapper
    logger.debug(
        "te_gqa_fix: wrapped %s.%s",
        getattr(original, "__module__", "?"),
        getattr(original, "__qualname__", "?"),
    )
    return wrapper


def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_bwd``.

    Takes exactly what the installed TE's function takes (TE 2.8 to 2.20, positional or
    keyword), calls it unchanged and returns what it returned, after zeroing in place
    every dK/dV (and dQ) row whose true gradient is 0 on THD layouts with h_q != h_kv
    (``TE_GQA_FIX=always``: MHA too; ``off``: pure pass-through). No host sync.

    Raises ImportError (with how to install) when Transformer Engine is missing.
    """
    global _te_module
    if _te_module is None:
        from .te_compat import import_fused_attn_module

        _te_module = import_fused_attn_module()
    from .te_compat import find_original

    wrapper = wrapper_for(find_original(_te_module))
    fused_attn_bwd.__wrapped__ = wrapper.__wrapped__  # type: ignore[attr-defined]
    return wrapper(*args, **kwargs)
