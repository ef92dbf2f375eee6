"""Fake cuDNN builds on disk: real shared libraries that answer ``cudnnGetVersion``.

The cuDNN route's claim is about the dynamic loader (the first ``RTLD_GLOBAL`` copy of a
symbol wins), so its tests load real ELF files: each fake build is ``libcudnn.so.9`` (soname
``libcudnn.so.9``, exporting ``cudnnGetVersion`` that returns the build's version) plus the
seven sub-libraries, compiled with the machine's C compiler, laid out like a wheel
(``nvidia/cudnn/lib`` + ``include/cudnn_version.h`` + an ``nvidia_cudnn_cu13-*.dist-info``)
or like a system install (``libcudnn.so.9.14.0``). Loading happens in subprocesses only,
with the one fake TE, torch-free (:func:`loader_te`), loading the "system" build the way
TE's loader does.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

SUB_LIBRARIES = (
    "libcudnn_graph",
    "libcudnn_engines_precompiled",
    "libcudnn_engines_runtime_compiled",
    "libcudnn_heuristic",
    "libcudnn_ops",
    "libcudnn_cnn",
    "libcudnn_adv",
)


def compiler() -> Optional[str]:
    return shutil.which("cc") or shutil.which("gcc")


_compiled: Dict[Tuple[str, str], Path] = {}  # (soname, body) -> a file compiled from them


def _compile(out: Path, soname: str, body: str) -> None:
    done = _compiled.get((soname, body))
    if done is not None and done.is_file():  # the same library again: a copy, not a compile
        shutil.copyfile(done, out)
        return
    src = out.with_suffix(".c")
    src.write_text(body)
    cc = compiler()
    assert cc is not None, "no C compiler"
    subprocess.run(
        [cc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    src.unlink()
    _compiled[(soname, body)] = out


def encode(version: Tuple[int, int, int]) -> int:
    return version[0] * 10000 + version[1] * 100 + version[2]


def write_libs(
    lib_dir: Path, version: Tuple[int, int, int], suffix: str = "9", subs: bool = True
) -> Path:
    """Compile the eight libraries of one build into ``lib_dir`` (file names end in
    ``.so.<suffix>``; ``9.14.0`` gives system-style names, with a ``.so.9`` link); only
    ``libcudnn`` when not ``subs``."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    for name in SUB_LIBRARIES if subs else ():
        _compile(lib_dir / f"{name}.so.{suffix}", f"{name}.so.9", f"int {name}_marker = 1;\n")
    _compile(
        lib_dir / f"libcudnn.so.{suffix}",
        "libcudnn.so.9",
        f"#include <stddef.h>\nsize_t cudnnGetVersion(void) {{ return {encode(version)}; }}\n",
    )
    if suffix != "9":
        for name in (*(SUB_LIBRARIES if subs else ()), "libcudnn"):
            (lib_dir / f"{name}.so.9").symlink_to(f"{name}.so.{suffix}")
    return lib_dir


def header(include: Path, version: Tuple[int, int, int]) -> None:
    include.mkdir(parents=True, exist_ok=True)
    (include / "cudnn_version.h").write_text(
        f"#define CUDNN_MAJOR {version[0]}\n#define CUDNN_MINOR {version[1]}\n"
        f"#define CUDNN_PATCHLEVEL {version[2]}\n"
    )


def wheel_build(
    site_dir: Path,
    version: Tuple[int, int, int],
    layout: str = "nvidia/cudnn/lib",
    how: str = "header",
    dist: str = "nvidia_cudnn_cu13",
) -> Path:
    """A wheel-installed build below ``site_dir``; its version readable by ``how``:
    ``header`` (include/cudnn_version.h), ``metadata`` (dist-info RECORD) or ``none``."""
    lib_dir = write_libs(site_dir / layout, version)
    if how == "header":
        header(lib_dir.parent / "include", version)
    elif how == "metadata":
        info = site_dir / f"{dist}-{'.'.join(map(str, version))}.56.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        records: Sequence[str] = [f"{layout}/{p.name},," for p in sorted(lib_dir.iterdir())]
        (info / "RECORD").write_text("\n".join(records) + "\n")
    return lib_dir


def system_build(root: Path, version: Tuple[int, int, int]) -> Path:
    """A system-style build: ``root/lib/libcudnn.so.9.14.0`` with ``.so.9`` links."""
    return write_libs(root / "lib", version, suffix=".".join(map(str, version)))


def loader_te(root: Path) -> Path:
    """The one fake TE (``fakes.te_package``) as the route's tests need it: importing
    ``transformer_engine`` loads ``$FAKE_TE_SYSTEM_CUDNN`` by path, as TE's loader does, and
    ``get_cudnn_version`` reports what the global scope binds to. Its ``pytorch`` package
    imports nothing more, so a fresh interpreter never loads torch (the route is about the
    loader alone) and starts in a fraction of a second."""
    from fakes import te_package

    te_package.write_fake_te(root, cudnn_version=None)
    init = root / "transformer_engine" / "pytorch" / "__init__.py"
    init.write_text("from .utils import get_cudnn_version  # noqa: F401\n")
    return root


def stub_build(
    lib_dir: Path,
    suffix: str = "9",
    header_version: Optional[Tuple[int, int, int]] = None,
    symbol: bool = True,
) -> Path:
    """A build on disk that can never be loaded: ELF magic, then the exported names a real
    ``libcudnn.so.9`` holds (``cudnnGetVersion`` unless ``symbol`` is False). For the checks
    that must refuse before loading: loading one fails with an OSError of its own. Names end
    in ``.so.<suffix>``, with a ``.so.9`` link when ``suffix`` is a full version."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    for name in (*SUB_LIBRARIES, "libcudnn"):
        exported = b"\0cudnnGetVersion\0" if name == "libcudnn" and symbol else b"\0x\0"
        (lib_dir / f"{name}.so.{suffix}").write_bytes(b"\x7fELF" + b"\0" * 60 + exported)
        if suffix != "9":
            (lib_dir / f"{name}.so.9").symlink_to(f"{name}.so.{suffix}")
    if header_version is not None:
        header(lib_dir.parent / "include", header_version)
    return lib_dir
