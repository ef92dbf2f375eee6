"""cuDNN builds: which are on disk, which are mapped into this process, and loading a fixed one.

Why this exists: the bug is cuDNN's, fixed in 9.18. Many affected machines already hold a
fixed cuDNN: torch's CUDA wheels depend on ``nvidia-cudnn-cu12``/``-cu13`` (9.19 next to
torch 2.11), but Transformer Engine loads cuDNN from the system first (CUDNN_HOME,
CUDNN_PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda, then the loader path) and only then from
the wheel, so TE runs the old system copy. Loading the wheel's ``libcudnn*.so.9`` with
``RTLD_GLOBAL`` before torch or TE is imported makes TE run the fixed build: symbols resolve
in the global scope in load order, so the first copy wins and TE's later ``dlopen`` of the
system file changes nothing (measured on the H200: TE then reports 9.19). That is how torch
(``_preload_cuda_deps``) and TE (``_load_cuda_library``) themselves load CUDA libraries.

Standard library only: the start-up hook imports this module before torch, and importing
torch would already map a cuDNN. Nothing is loaded at import.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .affected import CUDNN_FIXED

__all__ = [
    "ENV_CUDNN",
    "CudnnAlreadyLoaded",
    "CudnnBuild",
    "CudnnLibrary",
    "choose_fixed",
    "cuda_major",
    "decode_cudnn_version",
    "find_builds",
    "find_system_builds",
    "find_wheel_builds",
    "load_build",
    "mapped_cudnn_libraries",
    "parse_cudnn_maps",
    "parse_setting",
    "pip_hint",
    "resolve_versions",
    "route_state",
    "te_cudnn_version",
    "use_fixed_cudnn",
    "verify_te_cudnn",
]

ENV_CUDNN = "TE_GQA_FIX_CUDNN"

#: Where cuDNN wheels put their libraries below a site-packages folder, in the order TE's
#: own loader (``transformer_engine/common/__init__.py``) searches them.
WHEEL_LAYOUTS: Tuple[str, ...] = (
    "nvidia/cu13/cudnn/lib",
    "nvidia/cu13/lib",
    "nvidia/cu12/cudnn/lib",
    "nvidia/cu12/lib",
    "nvidia/cudnn/lib",
    "nvidia/cuda_cudnn/lib",
)
#: Load order: every sub-library first, ``libcudnn.so`` last (it dlopens the others by
#: soname, and finds them already loaded).
SUB_LIBRARIES: Tuple[str, ...] = (
    "libcudnn_graph",
    "libcudnn_engines_precompiled",
    "libcudnn_engines_runtime_compiled",
    "libcudnn_heuristic",
    "libcudnn_ops",
    "libcudnn_cnn",
    "libcudnn_adv",
)

Version = Tuple[int, ...]
_log = logging.getLogger("te_gqa_fix")


def decode_cudnn_version(encoded: int) -> Tuple[int, int, int]:
    """``cudnnGetVersion()`` / ``torch.backends.cudnn.version()`` -> (major, minor, patch).

    cuDNN 9 encodes ``major*10000 + minor*100 + patch``, cuDNN 8 ``major*1000 + ...``.
    """
    magnitude = 1000 if encoded < 90000 else 10000
    major, rest = divmod(int(encoded), magnitude)
    minor, patch = divmod(rest, 100)
    return (major, minor, patch)


def _vstr(v: Optional[Sequence[int]]) -> Optional[str]:
    return None if v is None else ".".join(str(x) for x in v)


def _vtuple(s: Optional[str]) -> Optional[Version]:
    if not s:
        return None
    parts = re.findall(r"\d+", s)
    return tuple(int(p) for p in parts) if parts else None


# ----------------------------------------------------------------------------- on disk


@dataclass(frozen=True)
class CudnnBuild:
    """One cuDNN on disk: the folder holding ``libcudnn.so.<major>`` and its sub-libraries.

    ``version`` is ``(major, minor, patch)`` where it could be learned without loading
    anything (header, wheel metadata, file name), else None. ``origin`` is ``wheel`` or
    ``system``; ``how`` says where the version came from.
    """

    lib_dir: str
    version: Optional[Tuple[int, ...]]
    origin: str
    how: str
    distribution: Optional[str] = None

    @property
    def fixed(self) -> bool:
        return self.version is not None and self.version[:3] >= CUDNN_FIXED and self.version[0] == 9

    @property
    def version_str(self) -> str:
        return _vstr(self.version) or "unknown"

    def libraries(self) -> List[str]:
        """The files to load, sub-libraries first and ``libcudnn.so.9`` last."""
        out: List[str] = []
        for name in (*SUB_LIBRARIES, "libcudnn"):
            found = sorted(glob.glob(os.path.join(self.lib_dir, f"{name}.so.9*")))
            if found:
                out.append(min(found, key=len))  # libcudnn_ops.so.9 over .so.9.19.0
        return out


def _header_version(paths: Iterable[str]) -> Optional[Tuple[int, int, int]]:
    for path in paths:
        try:
            with open(path) as f:
                text = f.read(8192)
        except OSError:
            continue
        parts = [re.search(rf"#define\s+CUDNN_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR")]
        patch = re.search(r"#define\s+CUDNN_PATCHLEVEL\s+(\d+)", text)
        if parts[0] and parts[1]:
            return (
                int(parts[0].group(1)),
                int(parts[1].group(1)),
                int(patch.group(1) if patch else 0),
            )
    return None


def _file_name_version(lib_dir: str) -> Optional[Tuple[int, ...]]:
    """The version in the file name that ``libcudnn.so.9`` (the soname TE and torch load)
    resolves to; without that link, the highest versioned ``libcudnn.so.*`` file."""
    pattern = re.compile(r"libcudnn\.so\.(\d+(?:\.\d+)+)$")
    soname = os.path.join(lib_dir, "libcudnn.so.9")
    if os.path.exists(soname):
        m = pattern.match(os.path.basename(os.path.realpath(soname)))
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    best: Optional[Tuple[int, ...]] = None
    for path in glob.glob(os.path.join(lib_dir, "libcudnn.so.*")):
        m = pattern.match(os.path.basename(os.path.realpath(path)))
        if m:
            v = tuple(int(x) for x in m.group(1).split("."))
            best = v if best is None or v > best else best
    return best


def _wheel_owner(site_dir: str, lib_dir: str) -> Optional[Tuple[str, Tuple[int, ...]]]:
    """(distribution, version) of the ``nvidia-cudnn-*`` wheel whose RECORD lists lib_dir."""
    rel = os.path.relpath(lib_dir, site_dir).replace(os.sep, "/") + "/libcudnn"
    for info in sorted(glob.glob(os.path.join(site_dir, "nvidia_cudnn*.dist-info"))):
        m = re.match(r"(nvidia_cudnn[\w]*)-(\d+(?:\.\d+)+)\.dist-info$", os.path.basename(info))
        if not m:
            continue
        try:
            with open(os.path.join(info, "RECORD")) as f:
                if any(line.startswith(rel) for line in f):
                    return m.group(1).replace("_", "-"), tuple(
                        int(x) for x in m.group(2).split(".")
                    )
        except OSError:
            continue
    return None


def _site_dirs(search_path: Optional[Sequence[str]]) -> List[str]:
    if search_path is not None:
        dirs = list(search_path)
    else:
        dirs = [p for p in sys.path if p]
        try:
            import site

            dirs += list(site.getsitepackages())
            user = site.getusersitepackages()
            if isinstance(user, str):
                dirs.append(user)
        except Exception:  # embedded interpreters and old virtualenvs lack these
            pass
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in seen and os.path.isdir(real):
            seen.add(real)
            out.append(d)
    return out


def find_wheel_builds(search_path: Optional[Sequence[str]] = None) -> List[CudnnBuild]:
    """cuDNN builds installed by wheels, in every layout TE's loader knows, on ``sys.path``.

    The version comes from the wheel's own header (``include/cudnn_version.h``), else from
    the ``nvidia_cudnn_*`` dist-info whose RECORD lists the files, else from a versioned
    file name. Nothing is loaded.
    """
    builds: List[CudnnBuild] = []
    for site_dir in _site_dirs(search_path):
        for layout in WHEEL_LAYOUTS:
            lib_dir = os.path.join(site_dir, *layout.split("/"))
            if not glob.glob(os.path.join(lib_dir, "libcudnn.so.*")):
                continue
            include = os.path.join(os.path.dirname(lib_dir), "include")
            owner = _wheel_owner(site_dir, lib_dir)
            version: Optional[Tuple[int, ...]] = _header_version(
                [os.path.join(include, "cudnn_version.h")]
            )
            how = "header"
            if version is None and owner is not None:
                version, how = owner[1][:3], "wheel metadata"
            if version is None:
                version, how = _file_name_version(lib_dir), "file name"
            builds.append(
                CudnnBuild(
                    lib_dir=lib_dir,
                    version=None if version is None else tuple(version[:3]),
                    origin="wheel",
                    how=how if version is not None else "unknown",
                    distribution=None if owner is None else owner[0],
                )
            )
    return builds


#: Folders the system loader and TE's system search look in (besides the env variables).
SYSTEM_DIRS: Tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/lib",
)


def find_system_builds(env: Optional[Dict[str, str]] = None) -> List[CudnnBuild]:
    """cuDNN builds outside wheels: TE's system search roots and the loader's folders."""
    env = dict(os.environ) if env is None else env
    roots = [
        env.get(k) for k in ("CUDNN_HOME", "CUDNN_PATH", "CUDA_HOME", "CUDA_PATH")
    ]  # TE's own order
    dirs: List[str] = []
    for root in [r for r in roots if r]:
        for sub in ("lib64", "lib", os.path.join("lib", "x86_64-linux-gnu"), ""):
            dirs.append(os.path.join(root, sub) if sub else root)
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += list(SYSTEM_DIRS)
    builds: List[CudnnBuild] = []
    seen = set()
    for d in dirs:
        if not glob.glob(os.path.join(d, "libcudnn.so.*")):
            continue
        real = os.path.realpath(d)
        if real in seen:
            continue
        seen.add(real)
        version: Optional[Tuple[int, ...]] = _file_name_version(d)
        how = "file name"
        if version is None:
            parent = os.path.dirname(os.path.realpath(d))
            version = _header_version(
                [
                    os.path.join(parent, "include", "cudnn_version.h"),
                    "/usr/include/cudnn_version.h",
                    "/usr/include/x86_64-linux-gnu/cudnn_version_v9.h",
                ]
            )
            how = "header"
        builds.append(
            CudnnBuild(
                lib_dir=d,
                version=None if version is None else tuple(version[:3]),
                origin="system",
                how=how if version is not None else "unknown",
            )
        )
    return builds


def find_builds(search_path: Optional[Sequence[str]] = None) -> List[CudnnBuild]:
    """Every cuDNN build found on disk: wheels first, then the system's, one per folder."""
    out: List[CudnnBuild] = []
    seen = set()
    for build in (*find_wheel_builds(search_path), *find_system_builds()):
        real = os.path.realpath(build.lib_dir)
        if real not in seen:
            seen.add(real)
            out.append(build)
    return out


def choose_fixed(builds: Sequence[CudnnBuild]) -> Optional[CudnnBuild]:
    """The newest fixed (>= 9.18) cuDNN 9 build among ``builds``; None if there is none."""
    fixed = [b for b in builds if b.fixed]
    return max(fixed, key=lambda b: b.version or ()) if fixed else None


def cuda_major() -> Optional[int]:
    """The CUDA major version this environment's wheels are built for (no import).

    From torch's local version (``2.11.0+cu130`` -> 13), else from TE's or the CUDA
    runtime wheel's distribution name (``transformer_engine_cu12`` -> 12).
    """
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - python < 3.8
        return None
    try:
        m = re.search(r"\+cu(\d+?)(\d)$", metadata.version("torch"))
        if m:
            return int(m.group(1))
    except Exception:
        pass
    for dist in (
        "transformer_engine_cu13",
        "nvidia-cuda-runtime-cu13",
        "nvidia-cuda-runtime",
        "transformer_engine_cu12",
        "nvidia-cuda-runtime-cu12",
    ):
        try:
            version = metadata.version(dist)
        except Exception:
            continue
        m = re.search(r"cu(\d+)$", dist)
        if m:
            return int(m.group(1))
        major = _vtuple(version)
        return major[0] if major else None
    return None


def pip_hint(major: Optional[int] = None) -> str:
    """The exact ``pip install`` that brings a fixed cuDNN for this CUDA major version."""
    major = cuda_major() if major is None else major
    if major in (12, 13):
        return f"pip install 'nvidia-cudnn-cu{major}>=9.18'"
    return "pip install 'nvidia-cudnn-cu12>=9.18' (CUDA 12) or 'nvidia-cudnn-cu13>=9.18' (CUDA 13)"


# ----------------------------------------------------------------------------- mapped


@dataclass(frozen=True)
class CudnnLibrary:
    """One cuDNN shared library mapped into the process.

    ``version`` is as precise as could be learned (``"9.14.0"``, or ``"9"`` when only the
    file name's major is known); ``source`` says where it came from.
    """

    path: str
    name: str
    version: Optional[str]
    source: str


_LIB_RE = re.compile(r"^(libcudnn(?:_[A-Za-z0-9_]+)?)\.so(?:\.(\d+(?:\.\d+)*))?$")


def parse_cudnn_maps(text: str) -> List[CudnnLibrary]:
    """The cuDNN libraries in a ``/proc/<pid>/maps`` text, in first-seen order.

    Each library appears once (maps lists one line per mapped segment). Versions come from
    the file names (``libcudnn_adv.so.9.14.0`` -> 9.14.0; ``libcudnn.so.9`` -> 9).
    """
    seen: Dict[str, CudnnLibrary] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if not path.startswith("/") or path in seen:
            continue
        m = _LIB_RE.match(os.path.basename(path))
        if m is None:
            continue
        seen[path] = CudnnLibrary(
            path=path, name=m.group(1), version=m.group(2), source="file name"
        )
    return list(seen.values())


def _wheel_version(path: str) -> Optional[str]:
    """Version of the ``nvidia-cudnn-cu*`` wheel that owns ``path`` (its dist-info name)."""
    parts = path.split(os.sep)
    if "nvidia" not in parts:
        return None
    idx = len(parts) - 1 - parts[::-1].index("nvidia")
    site_dir = os.sep.join(parts[:idx])
    for info in sorted(glob.glob(os.path.join(site_dir, "nvidia_cudnn_cu*-*.dist-info"))):
        m = re.search(r"-(\d+(?:\.\d+)+)\.dist-info$", info)
        if m:
            return m.group(1)
    return None


def _ctypes_version(path: str) -> Optional[str]:
    """``cudnnGetVersion`` of an already loaded ``libcudnn.so*`` (never loads a new one)."""
    try:
        mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
        lib = ctypes.CDLL(path, mode=mode)
        fn = lib.cudnnGetVersion
        fn.restype = ctypes.c_size_t
        return _vstr(decode_cudnn_version(int(fn())))
    except Exception:
        return None


def resolve_versions(libs: Sequence[CudnnLibrary]) -> List[CudnnLibrary]:
    """Make versions precise where the file name gives only the major (pip wheels name
    their files ``libcudnn*.so.9``): ask the loaded library, then the owning wheel."""
    out = []
    for lib in libs:
        v = _vtuple(lib.version)
        if v is not None and len(v) >= 2:
            out.append(lib)
            continue
        real = os.path.realpath(lib.path)
        m = _LIB_RE.match(os.path.basename(real))
        if m and m.group(2) and len(_vtuple(m.group(2)) or ()) >= 2:
            out.append(CudnnLibrary(lib.path, lib.name, m.group(2), "real path"))
            continue
        found = _ctypes_version(lib.path) if lib.name == "libcudnn" else None
        if found:
            out.append(CudnnLibrary(lib.path, lib.name, found, "cudnnGetVersion"))
            continue
        wheel = _wheel_version(lib.path)
        if wheel:
            out.append(CudnnLibrary(lib.path, lib.name, wheel, "nvidia-cudnn wheel"))
            continue
        out.append(lib)
    return out


def mapped_cudnn_libraries(
    maps_path: str = "/proc/self/maps", resolve: bool = True
) -> Optional[List[CudnnLibrary]]:
    """The cuDNN libraries mapped into this process, or None where maps is unreadable."""
    try:
        with open(maps_path) as f:
            text = f.read()
    except OSError:
        return None
    libs = parse_cudnn_maps(text)
    return resolve_versions(libs) if resolve else libs


# ----------------------------------------------------------------------------- loading


class CudnnAlreadyLoaded(RuntimeError):
    """A cuDNN is already mapped into the process: loading another now would mix builds."""


@dataclass
class _Route:
    """What the cuDNN route did in this process (for doctor, the guard and the tests)."""

    setting: Optional[str] = None
    strict: bool = False
    chosen: Optional[CudnnBuild] = None
    loaded: List[str] = field(default_factory=list)
    seen: List[str] = field(default_factory=list)
    error: Optional[str] = None
    te_cudnn: Optional[str] = None
    verified: Optional[bool] = None


_route = _Route()


def route_state() -> Dict[str, object]:
    """A plain-value copy of what the route did: setting, chosen build, loaded files,
    versions seen, error, the cuDNN TE reported after import and whether it matched."""
    r = _route
    return {
        "setting": r.setting,
        "strict": r.strict,
        "chosen": None if r.chosen is None else r.chosen.lib_dir,
        "chosen_version": None if r.chosen is None else r.chosen.version_str,
        "loaded": list(r.loaded),
        "seen": list(r.seen),
        "error": r.error,
        "te_cudnn": r.te_cudnn,
        "verified": r.verified,
    }


def _reset_route() -> None:
    """Forget the route (tests only; loaded libraries stay loaded)."""
    global _route
    _route = _Route()


def parse_setting(value: Optional[str]) -> Tuple[Optional[str], bool]:
    """``TE_GQA_FIX_CUDNN`` -> ``(target, strict)``; target None means off.

    ``off``/``0``/unset: off. ``auto``: the newest fixed wheel build. ``strict``: ``auto``,
    and a failure makes ``import transformer_engine.pytorch`` fail. A directory (or
    ``strict:DIR``): that build.
    """
    raw = (value or "").strip()
    low = raw.lower()
    if low in ("", "0", "off", "false", "no", "disable", "disabled"):
        return None, False
    if low in ("auto", "1", "on", "yes", "true"):
        return "auto", False
    if low == "strict":
        return "auto", True
    if low.startswith("strict:"):
        return raw[len("strict:") :], True
    return raw, False


def load_build(build: CudnnBuild) -> List[str]:
    """Load ``build`` into the global symbol scope (``RTLD_GLOBAL``); return the files loaded.

    Refuses with :class:`CudnnAlreadyLoaded` when another cuDNN is already mapped into the
    process (by then the first copy already owns the symbols). Files of this build that are
    already mapped are loaded again with ``RTLD_GLOBAL`` (harmless, and it promotes a
    privately mapped copy into the global scope). Raises ``FileNotFoundError`` when the
    folder holds no ``libcudnn.so.9``, and ``OSError`` naming the file when one cannot be
    loaded (the files before it stay loaded: the process should not go on to import TE).
    """
    mapped = mapped_cudnn_libraries(resolve=False) or []
    want = os.path.realpath(build.lib_dir)
    foreign = [m.path for m in mapped if os.path.dirname(os.path.realpath(m.path)) != want]
    if foreign:
        raise CudnnAlreadyLoaded(
            f"te_gqa_fix: a cuDNN is already loaded in this process ({', '.join(foreign[:3])}"
            f"{' ...' if len(foreign) > 3 else ''}), so cuDNN {build.version_str} from "
            f"{build.lib_dir} can no longer take effect: load it before torch and Transformer "
            f"Engine are imported (first thing in the program, or set {ENV_CUDNN}=auto in the "
            "environment so the start-up hook does it)"
        )
    files = build.libraries()
    if not any(os.path.basename(f).startswith("libcudnn.so") for f in files):
        raise FileNotFoundError(f"te_gqa_fix: no libcudnn.so.9 in {build.lib_dir}")
    for i, path in enumerate(files):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise OSError(
                f"te_gqa_fix: could not load {path} ({exc}); {i} of {len(files)} files of "
                f"cuDNN {build.version_str} are loaded, so this process would mix builds: "
                "fix or remove that folder, or unset the setting"
            ) from exc
    return files


def _resolve_target(target: str, search_path: Optional[Sequence[str]]) -> CudnnBuild:
    if target == "auto":
        builds = find_wheel_builds(search_path)
        _route.seen = [f"{b.version_str} ({b.lib_dir})" for b in builds]
        chosen = choose_fixed(builds)
        if chosen is None:
            seen = ", ".join(_route.seen) or "none"
            raise LookupError(
                f"te_gqa_fix: {ENV_CUDNN}=auto found no cuDNN >= 9.18 in this environment's "
                f"cuDNN wheels (seen: {seen}); {pip_hint()} provides one"
            )
        return chosen
    lib_dir = target
    if not glob.glob(os.path.join(lib_dir, "libcudnn.so.*")):
        for sub in ("lib", "lib64", os.path.join("lib", "x86_64-linux-gnu")):
            if glob.glob(os.path.join(target, sub, "libcudnn.so.*")):
                lib_dir = os.path.join(target, sub)
                break
    if not glob.glob(os.path.join(lib_dir, "libcudnn.so.*")):
        raise FileNotFoundError(
            f"te_gqa_fix: {ENV_CUDNN}={target!r}: expected a folder holding libcudnn.so.9 "
            "(or its lib/ or lib64/), found none"
        )
    for build in (*find_wheel_builds(), *find_system_builds()):
        if os.path.realpath(build.lib_dir) == os.path.realpath(lib_dir):
            return build
    version = _file_name_version(lib_dir) or _header_version(
        [os.path.join(os.path.dirname(lib_dir), "include", "cudnn_version.h")]
    )
    return CudnnBuild(lib_dir, version, "given", "file name" if version else "unknown")


def use_fixed_cudnn(
    where: str = "auto", *, strict: bool = True, search_path: Optional[Sequence[str]] = None
) -> Optional[CudnnBuild]:
    """Make Transformer Engine run a fixed cuDNN: call first thing, before torch or TE.

    ``where`` is ``"auto"`` (the newest cuDNN >= 9.18 among this environment's cuDNN wheels)
    or a folder. Loads it with ``RTLD_GLOBAL`` so that TE, whatever it loads later, binds to
    it. Returns the build loaded.

    With ``strict`` (the default for a direct call) every failure raises: no fixed build
    (``LookupError``, with the ``pip install`` that provides one), a folder without cuDNN
    (``FileNotFoundError``), a cuDNN already mapped into the process
    (:class:`CudnnAlreadyLoaded`: too late, torch or TE came first). Without ``strict`` (the
    start-up hook's ``TE_GQA_FIX_CUDNN=auto``) the failure is logged once at WARNING and None
    is returned. A build that is not >= 9.18 is loaded as asked, with a warning.
    """
    _route.setting = where
    _route.strict = strict
    try:
        build = _resolve_target(where, search_path)
        _route.chosen = build
        if not build.fixed:
            _log.warning(
                "te_gqa_fix: %s=%s: cuDNN %s in %s is not known to be fixed (9.18 or newer)",
                ENV_CUDNN,
                where,
                build.version_str,
                build.lib_dir,
            )
        _route.loaded = load_build(build)
        if build.version is None:  # a folder that names no version: ask the loaded library
            found = _ctypes_version(os.path.join(build.lib_dir, "libcudnn.so.9"))
            if found:
                build = CudnnBuild(build.lib_dir, _vtuple(found), build.origin, "cudnnGetVersion")
                _route.chosen = build
        _route.error = None
    except (LookupError, OSError, CudnnAlreadyLoaded) as exc:
        _route.error = str(exc)
        if strict:
            raise
        _log.warning("%s; Transformer Engine keeps the cuDNN it finds itself", exc)
        return None
    _log.info(
        "te_gqa_fix: loaded cuDNN %s from %s (%s=%s)",
        build.version_str,
        build.lib_dir,
        ENV_CUDNN,
        where,
    )
    return build


def te_cudnn_version() -> Optional[Tuple[int, int, int]]:
    """The cuDNN Transformer Engine runs, from TE itself; None when TE cannot say.

    Needs ``transformer_engine.pytorch`` imported (it loads TE's extension); never imports it
    (None before), since importing TE is what picks its cuDNN.
    """
    if "transformer_engine.pytorch" not in sys.modules:
        return None
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        return tuple(int(x) for x in get_cudnn_version())[:3]  # type: ignore[return-value]
    except Exception:
        pass
    try:
        import transformer_engine_torch as tex

        return decode_cudnn_version(int(tex.get_cudnn_version()))
    except Exception:
        return None


def verify_te_cudnn(strict: Optional[bool] = None) -> Optional[bool]:
    """After ``transformer_engine.pytorch`` is imported: does TE run the chosen build?

    Returns True/False, or None when the route chose nothing. A mismatch (or a version TE
    does not report) is logged once at WARNING; with ``strict`` it raises ImportError.
    """
    strict = _route.strict if strict is None else strict
    if _route.chosen is None or not _route.loaded:
        if strict and _route.error:  # the strict route failed earlier: never go on silently
            raise ImportError(f"te_gqa_fix: {ENV_CUDNN} (strict) failed: {_route.error}")
        return None
    te = te_cudnn_version()
    _route.te_cudnn = _vstr(te)
    want = _route.chosen.version
    ok = te is not None and want is not None and tuple(te) == tuple(want[:3])
    _route.verified = ok
    if not ok:
        msg = (
            f"te_gqa_fix: {ENV_CUDNN} loaded cuDNN {_route.chosen.version_str} from "
            f"{_route.chosen.lib_dir}, but Transformer Engine runs cuDNN "
            f"{_vstr(te) or 'unknown'}"
        )
        if strict:
            raise ImportError(msg)
        _log.warning("%s; the post-pass still guards head dims up to 128", msg)
    return ok
