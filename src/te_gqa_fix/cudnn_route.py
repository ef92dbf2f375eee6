"""The cuDNN route: find, load and verify a cuDNN build measured right, before TE loads one.

The first ``RTLD_GLOBAL`` copy of a symbol wins, so a build loaded before torch and TE is
the one TE runs. ``auto`` picks among this environment's cuDNN wheels by the measured table
(:mod:`te_gqa_fix.rules`): the newest installed build measured right; only where none is
installed, the newest unmeasured build at or above 9.18, with a WARNING (the post-pass stays
on for it, as the rule keeps it on for every unmeasured build); never a build measured wrong,
nor one below 9.18. ``strict`` loads only what it can vouch for: a build measured right, or
one the user named by its folder. An optional layer, standard library only: the start-up
hook uses it before torch maps any cuDNN.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import site
import sys
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import rules
from ._logging import logger as _log
from ._te import te_cudnn_version
from .errors import (
    CudnnAlreadyLoaded,
    CudnnLoadError,
    CudnnRefused,
    InputError,
    InputTypeError,
    SetupError,
)
from .rules import CUDNN_FIXED
from .settings import parse, shown

#: What users call; the rest is shared with doctor and the start-up hook.
__all__ = ["choose", "find_builds", "route_state", "use_fixed_cudnn"]

#: The first fixed build, as messages write it.
FIXED = rules.version_text(CUDNN_FIXED[:2])
ENV_CUDNN = "TE_GQA_FIX_CUDNN"

#: Wheel layouts below a site folder, in the order TE's own loader searches them.
WHEEL_LAYOUTS = tuple(
    f"nvidia/{p}/lib" for p in "cu13/cudnn cu13 cu12/cudnn cu12 cudnn cuda_cudnn".split()
)
#: Load order: the sub-libraries first; ``libcudnn.so`` (which dlopens them) last.
SUB_LIBRARIES = tuple(
    f"libcudnn_{n}"
    for n in "graph engines_precompiled engines_runtime_compiled heuristic ops cnn adv".split()
)
#: Folders the system loader searches (besides TE's variables and LD_LIBRARY_PATH), and the
#: headers that name a system build's version when its file names do not.
SYSTEM_DIRS = tuple(
    "/usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib "
    "/usr/local/cuda/lib64 /usr/local/cuda/lib".split()
)
SYSTEM_HEADERS = (
    "/usr/include/cudnn_version.h",
    "/usr/include/x86_64-linux-gnu/cudnn_version_v9.h",
)

Version = Tuple[int, ...]
_DOTTED = r"\d+(?:\.\d+)+"


def decode_cudnn_version(encoded: int) -> Tuple[int, int, int]:
    """``cudnnGetVersion()`` -> (major, minor, patch): 9 encodes ``M*10000``, 8 ``M*1000``."""
    major, rest = divmod(int(encoded), 1000 if encoded < 90000 else 10000)
    return (major, *divmod(rest, 100))  # type: ignore[return-value]


def version_str(v: Optional[Sequence[int]]) -> Optional[str]:
    """``(9, 14, 0)`` -> ``"9.14.0"``; None stays None."""
    return None if v is None else ".".join(str(x) for x in v)


def version_tuple(s: Optional[str]) -> Optional[Version]:
    """Every number in ``s`` (``"9.14.0"`` -> ``(9, 14, 0)``); None when there is none."""
    parts = re.findall(r"\d+", s or "")
    return tuple(int(p) for p in parts) if parts else None


@dataclass(frozen=True)
class CudnnBuild:
    """One cuDNN on disk: the folder of ``libcudnn.so.9``; ``origin`` is ``wheel``, ``system``
    or ``given``; ``how`` says where ``version`` came from (nothing is loaded to learn it)."""

    lib_dir: str
    version: Optional[Version]
    origin: str
    how: str
    distribution: Optional[str] = None

    @property
    def fixed(self) -> bool:
        """At or above 9.18 within cuDNN 9: the stale workspace is fixed upstream."""
        return self.version is not None and CUDNN_FIXED <= self.version < (10,)

    @property
    def measured(self) -> str:
        """What the measured table says of this build: ``right`` (its own measurement says
        right up to head dim 128, as :func:`te_gqa_fix.rules.judge` without head dims: no
        stale rows, no zero-length trouble; wrong shapes above 128 are the fallback's),
        ``wrong`` (its own measurement says otherwise), ``unmeasured``, or ``unknown`` (no
        version)."""
        if self.version is None:
            return "unknown"
        m, own = rules.measurement_for(self.version)
        if not own:
            return "unmeasured"
        return "wrong" if m.stale_rows or m.zero_length_wrong else "right"

    @property
    def version_str(self) -> str:
        return version_str(self.version) or "unknown"

    def libraries(self) -> List[str]:
        """The files to load, sub-libraries first and ``libcudnn.so.9`` last."""
        names = (*SUB_LIBRARIES, "libcudnn")
        found = (sorted(glob.glob(os.path.join(self.lib_dir, f"{n}.so.9*"))) for n in names)
        return [min(f, key=len) for f in found if f]  # libcudnn_ops.so.9 over .so.9.19.0


def _build(lib_dir: str, version: Optional[Version], origin: str, how: str, dist=None):
    """A build with its version cut to (major, minor, patch); how "unknown" without one."""
    version = None if version is None else tuple(version[:3])
    return CudnnBuild(lib_dir, version, origin, how if version else "unknown", dist)


def _has_cudnn(lib_dir: str) -> bool:
    return bool(glob.glob(os.path.join(lib_dir, "libcudnn.so.*")))


def _header_version(lib_dir: str, extra: Sequence[str] = ()) -> Optional[Version]:
    """The version in ``include/cudnn_version.h`` beside ``lib_dir``, else in ``extra``."""
    for path in (os.path.join(os.path.dirname(lib_dir), "include", "cudnn_version.h"), *extra):
        try:
            with open(path) as f:
                text = f.read(8192)
        except OSError:
            continue
        found = [re.search(rf"#define\s+CUDNN_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR")]
        patch = re.search(r"#define\s+CUDNN_PATCHLEVEL\s+(\d+)", text)
        if found[0] and found[1]:
            return (int(found[0][1]), int(found[1][1]), int(patch[1]) if patch else 0)
    return None


def _file_name_version(lib_dir: str) -> Optional[Version]:
    """The version in the name ``libcudnn.so.9`` resolves to, else the highest ``libcudnn.so.*``."""

    def named(path: str) -> Optional[Version]:
        m = re.match(rf"libcudnn\.so\.({_DOTTED})$", os.path.basename(os.path.realpath(path)))
        return version_tuple(m[1]) if m else None

    found = [v for v in map(named, glob.glob(f"{lib_dir}/libcudnn.so.*")) if v]
    return named(os.path.join(lib_dir, "libcudnn.so.9")) or max(found, default=None)


def _local_build(lib_dir: str, origin: str, headers: Sequence[str] = ()) -> CudnnBuild:
    """A build outside wheels: its version from the file names, else from a header."""
    version = _file_name_version(lib_dir)
    if version is not None:
        return _build(lib_dir, version, origin, "file name")
    return _build(lib_dir, _header_version(os.path.realpath(lib_dir), headers), origin, "header")


def _wheels(site_dir: str, pattern: str = "nvidia_cudnn*") -> Iterator[Tuple[str, str, str]]:
    """(distribution, version, dist-info folder) of the cuDNN wheels in ``site_dir``."""
    for info in sorted(glob.glob(os.path.join(site_dir, f"{pattern}.dist-info"))):
        m = re.match(rf"(nvidia_cudnn\w*)-({_DOTTED})\.dist-info$", os.path.basename(info))
        if m:
            yield m[1].replace("_", "-"), m[2], info


def _wheel_owner(site_dir: str, lib_dir: str) -> Optional[Tuple[str, Version]]:
    """(distribution, version) of the ``nvidia-cudnn-*`` wheel whose RECORD lists lib_dir."""
    rel = os.path.relpath(lib_dir, site_dir).replace(os.sep, "/") + "/libcudnn"
    for dist, version, info in _wheels(site_dir):
        try:
            with open(os.path.join(info, "RECORD")) as f:
                if any(line.startswith(rel) for line in f):
                    return dist, version_tuple(version)  # type: ignore[return-value]
        except OSError:
            continue
    return None


def _one_per_folder(items: Iterable[Any], folder=lambda x: x) -> List[Any]:
    """``items`` without those whose folder has the real path of an earlier one's."""
    out: Dict[str, Any] = {}
    for x in items:
        out.setdefault(os.path.realpath(folder(x)), x)
    return list(out.values())


def _site_folders(search_path: Any) -> Optional[List[str]]:
    """``search_path`` as a list of folder names (None stays None); an InputTypeError naming
    ``search_path`` for a single str or path (whose characters would read as folders) or
    for an item that is not a path."""
    if search_path is None:
        return None
    what = "a list of site folders (str or os.PathLike)"
    if isinstance(search_path, (str, bytes, os.PathLike)):
        raise InputTypeError(
            f"search_path: expected {what}, got the single {shown(search_path)}: "
            f"wrap one folder in a list ([{shown(search_path)}])"
        )
    try:
        items = list(search_path)
    except TypeError:
        raise InputTypeError(
            f"search_path: expected {what}, got {type(search_path).__name__}"
        ) from None
    folders = [os.fspath(d) if isinstance(d, os.PathLike) else d for d in items]
    bad = next((i for i, d in enumerate(folders) if not isinstance(d, str)), None)
    if bad is not None:
        raise InputTypeError(
            f"search_path[{bad}]: expected a folder (str or os.PathLike), got "
            f"{type(items[bad]).__name__} {shown(items[bad])}"
        )
    return folders


def find_wheel_builds(search_path: Optional[Sequence[str]] = None) -> List[CudnnBuild]:
    """cuDNN builds installed by wheels; nothing is loaded.

    Args:
        search_path: site folders to search (default: ``sys.path`` and the site folders);
            a single str is refused (``TypeError``), not read as one folder per character.

    Returns:
        One build per layout found, its version from the header, dist-info or file name.
    """
    given = _site_folders(search_path)
    dirs = given if given is not None else [p for p in sys.path if p]
    if search_path is None:
        try:
            dirs += [*site.getsitepackages(), site.getusersitepackages()]
        except Exception:  # embedded interpreters and old virtualenvs lack these
            pass
    builds = []
    for site_dir in _one_per_folder(d for d in dirs if isinstance(d, str) and os.path.isdir(d)):
        for layout in WHEEL_LAYOUTS:
            lib_dir = os.path.join(site_dir, *layout.split("/"))
            if not _has_cudnn(lib_dir):
                continue
            owner = _wheel_owner(site_dir, lib_dir)
            version, how = _header_version(lib_dir), "header"
            if version is None and owner is not None:
                version, how = owner[1], "wheel metadata"
            if version is None:
                version, how = _file_name_version(lib_dir), "file name"
            builds.append(_build(lib_dir, version, "wheel", how, owner and owner[0]))
    return builds


def find_system_builds(env: Optional[Dict[str, str]] = None) -> List[CudnnBuild]:
    """cuDNN builds outside wheels: below TE's variables (in TE's order), LD_LIBRARY_PATH and
    the loader's folders; one per real folder."""
    env = dict(os.environ) if env is None else env
    roots = [env[k] for k in ("CUDNN_HOME", "CUDNN_PATH", "CUDA_HOME", "CUDA_PATH") if env.get(k)]
    subs = ("lib64", "lib", "lib/x86_64-linux-gnu", "")
    dirs = [os.path.join(r, s) if s else r for r in roots for s in subs]
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d] + list(SYSTEM_DIRS)
    found = _one_per_folder(filter(_has_cudnn, dirs))
    return [_local_build(d, "system", SYSTEM_HEADERS) for d in found]


def find_builds() -> List[CudnnBuild]:
    """Every cuDNN build on disk: wheels first, then the system's, one per real folder."""
    return _one_per_folder([*find_wheel_builds(), *find_system_builds()], lambda b: b.lib_dir)


def choose(builds: Sequence[CudnnBuild]) -> Optional[CudnnBuild]:
    """The build ``auto`` loads among ``builds``: the newest measured right; where there is
    none, the newest fixed (>= 9.18, cuDNN 9) build that was not measured; never one
    measured wrong. None if there is no such build."""
    newest = lambda b: b.version or ()  # noqa: E731
    right = [b for b in builds if b.fixed and b.measured == "right"]
    unmeasured = [b for b in builds if b.fixed and b.measured == "unmeasured"]
    return max(right or unmeasured, key=newest, default=None)


@dataclass(frozen=True)
class CudnnLibrary:
    """One cuDNN library mapped into the process; ``version`` as precise as known (``"9"``
    when only the file name's major is), ``source`` where it came from."""

    path: str
    name: str
    version: Optional[str]
    source: str


_LIB_RE = re.compile(r"^(libcudnn(?:_[A-Za-z0-9_]+)?)\.so(?:\.(\d+(?:\.\d+)*))?$")


def parse_cudnn_maps(text: str) -> List[CudnnLibrary]:
    """The cuDNN libraries in a ``/proc/<pid>/maps`` text, once each, in first-seen order;
    versions from the file names (``libcudnn_adv.so.9.14.0`` -> 9.14.0)."""
    seen: Dict[str, CudnnLibrary] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        path = (parts[5].strip() if len(parts) == 6 else "").removesuffix(" (deleted)")
        m = _LIB_RE.match(os.path.basename(path))
        if path.startswith("/") and path not in seen and m:
            seen[path] = CudnnLibrary(path, m[1], m[2], "file name")
    return list(seen.values())


def _ctypes_version(path: str) -> Optional[str]:
    """``cudnnGetVersion`` of an already loaded ``libcudnn.so*``; never loads a new one (None
    where the platform has no ``RTLD_NOLOAD``)."""
    try:
        mode = os.RTLD_NOLOAD | os.RTLD_LAZY
        fn = ctypes.CDLL(path, mode=mode).cudnnGetVersion
        fn.restype = ctypes.c_size_t
        return version_str(decode_cudnn_version(int(fn())))
    except Exception:
        return None


def resolve_versions(libs: Sequence[CudnnLibrary]) -> List[CudnnLibrary]:
    """Make versions precise where the file name gives only the major (wheels name their
    files ``libcudnn*.so.9``): from the real path, the loaded library, then the wheel."""
    return [_precise(lib) for lib in libs]


def _precise(lib: CudnnLibrary) -> CudnnLibrary:
    if len(version_tuple(lib.version) or ()) >= 2:
        return lib
    m = _LIB_RE.match(os.path.basename(os.path.realpath(lib.path)))
    if m and len(version_tuple(m[2]) or ()) >= 2:
        return replace(lib, version=m[2], source="real path")
    found = _ctypes_version(lib.path) if lib.name == "libcudnn" else None
    if found:
        return replace(lib, version=found, source="cudnnGetVersion")
    site_dir, nvidia, _ = lib.path.rpartition(f"{os.sep}nvidia{os.sep}")
    if nvidia:  # the wheel installed in the site folder above nvidia/
        found = next((v for _, v, _ in _wheels(site_dir, "nvidia_cudnn_cu*-*")), None)
    return replace(lib, version=found, source="nvidia-cudnn wheel") if found else lib


def mapped_cudnn_libraries(resolve: bool = True) -> Optional[List[CudnnLibrary]]:
    """The cuDNN libraries mapped into this process, or None where maps is unreadable."""
    try:
        with open("/proc/self/maps") as f:
            libs = parse_cudnn_maps(f.read())
    except OSError:
        return None
    return resolve_versions(libs) if resolve else libs


#: What the route did in this process (doctor and tests read it through route_state).
_START = dict(
    setting=None, strict=False, chosen=None, error=None, warning=None, te_cudnn=None, verified=None
)
_route: Dict[str, Any] = {**_START, "loaded": (), "seen": ()}


def route_state() -> Dict[str, object]:
    """A plain copy of what the route did: setting, strict, the chosen folder and version,
    files loaded, versions seen, error, the cuDNN TE reported, and whether they matched."""
    chosen = _route["chosen"]
    return {
        **_route,
        "chosen": chosen and chosen.lib_dir,
        "chosen_version": chosen and chosen.version_str,
        "chosen_measured": chosen and chosen.measured,
    }


def _reset_route() -> None:
    """Forget the route (tests only; loaded libraries stay loaded)."""
    _route.update(_START, loaded=(), seen=())


def parse_setting(value: Optional[str]) -> Tuple[Optional[str], bool]:
    """``TE_GQA_FIX_CUDNN``'s value -> ``(target, strict)``.

    Args:
        value: the raw value (None: unset); parsed by :func:`te_gqa_fix.settings.parse`.

    Returns:
        ``(None, False)`` for off, ``("auto", strict)`` for auto/strict, ``(FOLDER, strict)``
        for a folder or ``strict:FOLDER``; raises :class:`~te_gqa_fix.settings.SettingError`.
    """
    parsed = parse(ENV_CUDNN, value)
    if parsed in ("off", "auto", "strict"):
        return {"off": None, "auto": "auto", "strict": "auto"}[parsed], parsed == "strict"
    if parsed.lower().startswith("strict:"):
        return parsed[len("strict:") :], True
    return parsed, False


def load_build(build: CudnnBuild) -> Tuple[str, ...]:
    """Load ``build`` with ``RTLD_GLOBAL``; return the files loaded.

    Raises:
        CudnnAlreadyLoaded: another cuDNN is mapped into the process.
        CudnnLoadError: no ``libcudnn.so.9`` in the folder, or a file that cannot be loaded.
    """
    want = os.path.realpath(build.lib_dir)
    libs = mapped_cudnn_libraries(resolve=False) or []
    foreign = [m.path for m in libs if os.path.dirname(os.path.realpath(m.path)) != want]
    if foreign:
        raise CudnnAlreadyLoaded(
            f"a cuDNN is already loaded in this process ({', '.join(foreign[:3])}"
            f"{' ...' if len(foreign) > 3 else ''}), so cuDNN {build.version_str} from "
            f"{build.lib_dir} can no longer take effect: load it before torch and Transformer "
            f"Engine are imported (first thing in the program, or set {ENV_CUDNN}=auto in the "
            "environment so the start-up hook does it)"
        )
    files = build.libraries()
    if not any(os.path.basename(f).startswith("libcudnn.so") for f in files):
        raise CudnnLoadError(f"no libcudnn.so.9 in {build.lib_dir}")
    for path in files:
        if _elf_symbols(path, ()) is None:
            raise CudnnLoadError(
                f"{path} is not an ELF shared library; nothing of cuDNN {build.version_str} in "
                f"{build.lib_dir} was loaded: fix or remove that folder"
            )
    for i, path in enumerate(files):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise CudnnLoadError(
                f"could not load {path} ({exc}); {i} of {len(files)} files of cuDNN "
                f"{build.version_str} are loaded, so this process would mix builds: fix or "
                "remove that folder, or unset the setting"
            ) from exc
    return tuple(files)


#: Bytes of a library scanned for its exported names (cuDNN's ``libcudnn.so.9`` is a small
#: shim: its dynamic string table lies well inside this).
_SCAN_BYTES = 64 << 20


def _elf_symbols(path: str, names: Sequence[bytes]) -> Optional[set]:
    """Which of ``names`` occur as NUL-terminated strings in the ELF file ``path`` (its
    dynamic string table holds every exported name); None when ``path`` is not an ELF file
    or cannot be read. Nothing is loaded."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                return None
            found: set = set()
            tail = b""
            if not names:
                return found
            for _ in range(_SCAN_BYTES >> 20):
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                data = tail + chunk
                found.update(n for n in names if b"\0" + n + b"\0" in data)
                tail = data[-256:]
            return found
    except OSError:
        return None


def _resolve_target(target: str, search_path: Optional[Sequence[str]], source: str) -> CudnnBuild:
    if target == "auto":
        builds = find_wheel_builds(search_path)
        _route["seen"] = tuple(f"{b.version_str} {b.measured} ({b.lib_dir})" for b in builds)
        chosen = choose(builds)
        if chosen is None:
            want = rules.newest_right().cudnn
            raise CudnnRefused(
                f"{source} found no cuDNN wheel it may load in this environment (a build "
                f"measured right, else an unmeasured one >= {FIXED}; seen: "
                f"{', '.join(_route['seen']) or 'none'}); {rules.pip_hint(want)} provides one"
            )
        return chosen
    subs = [os.path.join(target, s) for s in ("lib", "lib64", "lib/x86_64-linux-gnu")]
    lib_dir = next((d for d in (target, *subs) if _has_cudnn(d)), None)
    if lib_dir is None:
        raise CudnnLoadError(
            f"{source}: expected a folder holding libcudnn.so.9 (or its lib/ or lib64/), found none"
        )
    real = os.path.realpath(lib_dir)
    site_dir, nvidia, _ = real.rpartition(f"{os.sep}nvidia{os.sep}")  # a wheel's own folder
    builds = [*(find_wheel_builds([site_dir]) if nvidia else ()), *find_builds()]
    known = (b for b in builds if os.path.realpath(b.lib_dir) == real)
    return next(known, None) or _local_build(lib_dir, "given")


def _refusal(build: CudnnBuild, source: str) -> Optional[str]:
    """Why the route must not load ``build`` whatever strict says, or None."""
    if build.version is None:
        return None
    if not build.fixed:
        return (
            f"cuDNN {build.version_str} in {build.lib_dir} (version from its {build.how}) is "
            f"below {FIXED} or not cuDNN 9: {source} loads only builds with the upstream fix"
        )
    if build.measured == "wrong":
        return (
            f"cuDNN {build.version_str} in {build.lib_dir} was measured wrong "
            "(docs/validation.md): the route never loads it"
        )
    return None


def _check_before_loading(build: CudnnBuild, strict: bool, named: bool, source: str) -> None:
    """Refuse, before anything is loaded, a build known to be wrong (always) or, when
    ``strict``, one whose version cannot be read without loading it, or one not measured
    that the user did not name by its folder."""
    why = _refusal(build, source)
    if why is not None:
        raise CudnnRefused(f"{why}; nothing was loaded")
    main = next((f for f in build.libraries() if os.path.basename(f).startswith("libcudnn.so")), "")
    symbols = _elf_symbols(main, (b"cudnnGetVersion",)) if main else None
    if symbols is not None and not symbols:
        raise CudnnRefused(
            f"{main} is not a cuDNN (it exports no cudnnGetVersion); nothing was loaded: "
            f"point {source} at a cuDNN {FIXED} or newer"
        )
    if not strict:
        return
    if build.version is None:
        raise CudnnRefused(
            f"{source}: the version of the cuDNN in {build.lib_dir} can only be learned by "
            "loading it (no version in its file names, no include/cudnn_version.h, no wheel "
            f"metadata), and strict loads only a build whose version it knows; nothing was "
            "loaded: name a folder whose version can be read, or drop strict to load it and "
            "check cudnnGetVersion"
        )
    if build.measured == "unmeasured" and not named:
        raise CudnnRefused(
            f"{source}: cuDNN {build.version_str} in {build.lib_dir} was not measured, and "
            "strict loads an unmeasured build only from a folder you name "
            f"({_naming(source, build.lib_dir)}); nothing was loaded. "
            f"{rules.pip_hint(rules.newest_right().cudnn)} installs one measured right"
        )


def _naming(source: str, folder: str) -> str:
    """How the user who asked as ``source`` names ``folder`` strictly: the setting's
    ``strict:FOLDER``, or the function's folder argument (it refuses ``strict:``)."""
    if source.startswith(ENV_CUDNN):
        return f"{ENV_CUDNN}=strict:{folder}"
    return f"use_fixed_cudnn({shown(folder)})"


def _check_loaded(build: CudnnBuild, files: Sequence[str], source: str) -> CudnnBuild:
    """``build`` with the version the loaded ``libcudnn.so.9`` reports; ``CudnnRefused``
    (saying it is loaded now) when that is unknown, differs from what was read on disk, or
    may not be loaded."""
    found = version_tuple(_ctypes_version(files[-1]))  # (major, minor, patch) or None
    loaded = f"it is loaded in this process now, so start a new process without {source}"
    if found is None:
        raise CudnnRefused(f"cudnnGetVersion of {files[-1]} failed; {loaded}")
    if build.version is not None and found != build.version:
        raise CudnnRefused(
            f"{files[-1]} reports cuDNN {version_str(found)}, not the {build.version_str} "
            f"its {build.how} names; {loaded}"
        )
    build = replace(build, version=found, how=build.how if build.version else "cudnnGetVersion")
    why = _refusal(build, source)
    if why is not None:
        raise CudnnRefused(f"{why} (learned by loading it); {loaded}")
    return build


def _where(where: Any) -> str:
    """``use_fixed_cudnn``'s ``where`` as ``"auto"`` or a folder; InputTypeError/InputError
    naming ``where`` otherwise. A str is ``auto`` in any case (as the setting); a path object
    is always a folder."""
    what = "'auto' or a folder path (str or os.PathLike)"
    if isinstance(where, os.PathLike):
        folder = os.fspath(where)
        if isinstance(folder, str) and folder:
            return folder
    if not isinstance(where, str):
        raise InputTypeError(
            f"use_fixed_cudnn: where: expected {what}, got {type(where).__name__} {shown(where)}"
        )
    key = where.strip().lower()
    if key == "auto":
        return "auto"
    if key == "strict" or key.startswith("strict:"):
        folder = where.strip()[len("strict:") :] or "auto"
        raise InputError(
            f"use_fixed_cudnn: where={shown(where)}: 'strict' and 'strict:FOLDER' are "
            f"{ENV_CUDNN}'s spellings; here strictness is the strict= keyword (default "
            f"True): call use_fixed_cudnn({shown(folder)}, strict=True)"
        )
    if not key:
        raise InputError(f"use_fixed_cudnn: where: expected {what}, got {shown(where)}")
    return where


def route(
    target: str, strict: bool, search_path: Optional[Sequence[str]], source: str
) -> Optional[CudnnBuild]:
    """Find, check and load the build ``target`` names (``"auto"`` or a folder).

    Args:
        target, strict, search_path: as :func:`use_fixed_cudnn` takes them, checked.
        source: how the user asked, as messages name it (``TE_GQA_FIX_CUDNN=strict``,
            ``use_fixed_cudnn('auto')``).

    Returns:
        The build loaded, or None where it failed and ``strict`` is False (logged).
    """
    _route.update(setting=source, strict=strict, error=None, warning=None)
    try:
        build = _route["chosen"] = _resolve_target(target, search_path, source)
        _check_before_loading(build, strict, target != "auto", source)
        files = _route["loaded"] = load_build(build)
        build = _route["chosen"] = _check_loaded(build, files, source)
    except (LookupError, OSError, CudnnAlreadyLoaded) as exc:
        _route["error"] = str(exc)
        if strict:
            raise
        _log.warning("%s; Transformer Engine keeps the cuDNN it finds itself", exc)
        return None
    if build.measured != "right":
        _route["warning"] = (
            f"{source} loaded cuDNN {build.version_str} from {build.lib_dir}, a build that was "
            "not measured: the post-pass stays on for it, and rows that receive attention are "
            "trusted as on the newest measured build below it; `te-gqa-fix doctor` says more"
        )
        _log.warning("%s", _route["warning"])
    else:
        _log.info("loaded cuDNN %s from %s (%s)", build.version_str, build.lib_dir, source)
    return build


def use_fixed_cudnn(
    where: Union[str, os.PathLike[str]] = "auto",
    *,
    strict: bool = True,
    search_path: Optional[Sequence[str]] = None,
) -> Optional[CudnnBuild]:
    """Make Transformer Engine run a cuDNN measured right: call first thing, before torch
    or TE are imported.

    Args:
        where: ``"auto"`` (any case: among this environment's cuDNN wheels, the newest
            build measured right; where none is installed, the newest unmeasured build at
            or above 9.18, with a WARNING) or a folder (str or ``os.PathLike``).
            ``"strict:FOLDER"`` is refused with an InputError (strictness is ``strict=``).
        strict: raise on failure (:class:`~te_gqa_fix.errors.CudnnRefused`,
            :class:`~te_gqa_fix.errors.CudnnLoadError`,
            :class:`~te_gqa_fix.errors.CudnnAlreadyLoaded`), and load only a build whose
            version is known before loading and that was measured right, or was named by
            its folder; otherwise log the failure at WARNING and return None. Either way a
            build below 9.18, or measured wrong, is never loaded.
        search_path: site folders for ``"auto"`` (default: ``sys.path``); a list, never a
            single str.

    Returns:
        The build loaded (``RTLD_GLOBAL``, so TE binds to it whatever it loads later).

    Raises:
        InputTypeError, InputError: bad arguments, whatever ``strict`` says, first.
    """
    target = _where(where)
    if not isinstance(strict, bool):
        raise InputTypeError(f"use_fixed_cudnn: strict: expected a bool, got {shown(strict)}")
    folders = _site_folders(search_path)
    if folders is not None and target != "auto":
        raise InputError(
            "use_fixed_cudnn: search_path is only read for where='auto', not for the folder "
            f"{shown(target)}"
        )
    return route(target, strict, folders, f"use_fixed_cudnn({shown(target)})")


def verify_te_cudnn() -> Optional[bool]:
    """After ``transformer_engine.pytorch`` is imported: does TE run the chosen build?

    Returns:
        True/False, or None when the route chose nothing. A mismatch, or a failed route,
        raises SetupError when the route is strict; a mismatch is logged otherwise.
    """
    strict, chosen = _route["strict"], _route["chosen"]
    if chosen is None or not _route["loaded"]:
        if strict and _route["error"]:  # a strict route that failed must never go on silently
            raise SetupError(f"{_route['setting']} failed: {_route['error']}")
        return None
    te = te_cudnn_version()
    _route["te_cudnn"] = version_str(te)
    ok = _route["verified"] = te is not None and te == chosen.version
    if not ok:
        msg = (
            f"{_route['setting']} loaded cuDNN {chosen.version_str} from {chosen.lib_dir}, "
            f"but Transformer Engine runs cuDNN {version_str(te) or 'unknown'}"
        )
        if strict:
            raise SetupError(msg)
        _log.warning("%s; the post-pass still guards what it can", msg)
    return ok
