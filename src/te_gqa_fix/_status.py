"""``te_gqa_fix.status()``: is the fix active in this process, and what has it done?

``te-gqa-fix doctor`` answers from a process of its own, where a training script's
``install()`` never ran; this answers inside the process that trains: the cuDNN TE runs,
whether the fix is installed and where, which post-pass CUDA calls get, the guard, and what
the calls so far did. It reads what is loaded already: it never imports TE or torch.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from . import __version__, _te, rules, settings

__all__ = ["Status", "status"]


@dataclass
class Status:
    """What te-gqa-fix does in this process (:func:`status`); ``str()`` prints it readably.

    Attributes:
        version: te-gqa-fix's version.
        te: the installed Transformer Engine's version (None: not installed).
        te_imported: ``transformer_engine.pytorch`` is imported in this process.
        cudnn: the cuDNN TE runs (None: TE not imported, or it cannot say).
        gpu: the current CUDA device's compute capability (None: torch or CUDA not loaded).
        verdict: :func:`te_gqa_fix.rules.judge`'s status for head dims up to 128 here.
        wrong_above_128: head dims above 128 where TE is wrong on live rows here (q/k, v).
        installed: every call of TE's backward gets the fix (:func:`te_gqa_fix.is_installed`).
        sites: the call sites install() rebound that hold the wrapper.
        unreached: TE's own call sites that do not call the wrapper.
        activated_by: the setting that installed it at start-up (None: install() or not).
        postpass: ``triton`` or ``pytorch``: what CUDA calls get (None: not known yet).
        postpass_why: why CUDA calls get the PyTorch post-pass.
        settings: every ``TE_GQA_FIX_*`` setting's value (or its error).
        unknown_settings: ``TE_GQA_FIX*`` names that are no setting, with the closest one.
        calls: :func:`te_gqa_fix.call_counts` (empty: no wrapper was made yet).
        cudnn_route: what ``TE_GQA_FIX_CUDNN`` / ``use_fixed_cudnn`` did (empty: unused).
    """

    version: str
    te: Optional[str]
    te_imported: bool
    cudnn: Optional[str]
    gpu: Optional[str]
    verdict: str
    wrong_above_128: List[str]
    installed: bool
    sites: List[str]
    unreached: List[str]
    activated_by: Optional[str]
    postpass: Optional[str]
    postpass_why: Optional[str]
    settings: Dict[str, str]
    unknown_settings: List[str]
    calls: Dict[str, int]
    cudnn_route: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """The status as plain JSON-ready values."""
        return asdict(self)

    def __str__(self) -> str:
        calls = ", ".join(f"{k} {v}" for k, v in self.calls.items()) or "none"
        rows = [
            ("te-gqa-fix", self.version),
            (
                "Transformer Engine",
                f"{self.te or 'not installed'}"
                + ("" if self.te_imported else " (not imported yet)"),
            ),
            ("cuDNN (TE runs)", self.cudnn or "unknown"),
            ("GPU", self.gpu or "unknown"),
            (
                "verdict",
                self.verdict
                + (
                    f"; wrong on live rows at {', '.join(self.wrong_above_128)}"
                    if self.wrong_above_128
                    else ""
                ),
            ),
            ("fix", "ACTIVE" if self.installed else "NOT active"),
            ("sites", ", ".join(self.sites) or "none"),
        ]
        if self.unreached:
            rows.append(("NOT reached", ", ".join(self.unreached)))
        if self.activated_by:
            rows.append(("activated by", self.activated_by))
        post = self.postpass or "not known yet"
        rows.append(
            ("post-pass on CUDA", post + (f" ({self.postpass_why})" if self.postpass_why else ""))
        )
        rows += [(name, value) for name, value in self.settings.items()]
        if self.unknown_settings:
            rows.append(("unknown settings", ", ".join(self.unknown_settings)))
        rows.append(("calls so far", calls))
        if self.cudnn_route.get("setting"):
            route = self.cudnn_route
            done = (
                f"loaded cuDNN {route.get('chosen_version')} ({route.get('chosen_measured')})"
                if route.get("loaded")
                else f"nothing loaded: {route.get('error')}"
            )
            rows.append(("cuDNN route", f"{route['setting']}: {done}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _gpu() -> Optional[tuple]:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability())
    except Exception:  # a broken CUDA setup: unknown
        pass
    return None


def status() -> Status:
    """What te-gqa-fix does in this process: the in-process answer to ``te-gqa-fix doctor``.

    Returns:
        A :class:`Status` (``print()`` it, or ``.as_dict()``). Imports neither TE nor torch:
        what is not loaded yet reads as unknown.
    """
    hook = sys.modules.get("_te_gqa_fix_autopatch")  # loaded where a start-up file ran it
    cudnn = _te.te_cudnn_version()
    capability = _gpu()
    verdict = rules.judge(capability, cudnn)
    m = verdict.judged_as
    wrong = sorted(f"{a}" if a == b else f"{a}/{b}" for a, b in (m.wrong if m else ()))
    installed, sites, unreached = False, [], []
    if "te_gqa_fix.patch" in sys.modules:
        from . import patch

        installed = patch.is_installed()
        sites = patch.installed_sites()
        unreached = patch.unreached_call_sites()
    impl: Optional[str] = None
    why: Optional[str] = None
    if "torch" in sys.modules:
        from . import postpass

        impl, why = postpass.implementation()
    described = settings.describe()
    route = sys.modules.get("te_gqa_fix.cudnn_route")
    wrapper = sys.modules.get("te_gqa_fix.wrapper")  # no call went through one without it
    return Status(
        version=__version__,
        te=_te.te_version(),
        te_imported=_te.TE_PYTORCH in sys.modules,
        cudnn=None if cudnn is None else rules.version_text(cudnn),
        gpu=None if capability is None else f"sm{capability[0]}{capability[1]}",
        verdict=verdict.status,
        wrong_above_128=wrong,
        installed=installed,
        sites=sites,
        unreached=unreached,
        activated_by=hook.state().get("activated_by") if hook is not None else None,
        postpass=impl,
        postpass_why=why,
        settings={
            n: str(d["value"] if d["error"] is None else f"ERROR: {d['error']}")
            for n, d in described.items()
        },
        unknown_settings=[
            f"{n} (did you mean {c}?)" if c else n for n, c in settings.unknown_names()
        ],
        calls=wrapper.call_counts() if wrapper is not None else {},
        cudnn_route=route.route_state() if route is not None else {},
    )
