"""The cuDNN route (TE_GQA_FIX_CUDNN, ``te_gqa_fix.use_fixed_cudnn``) and the affected rule.

The route's claim is about the dynamic loader: the first ``RTLD_GLOBAL`` copy of a symbol
wins, so a fixed cuDNN loaded before TE makes TE run it even though TE later loads the
system copy by path. These tests build real shared libraries that answer
``cudnnGetVersion`` (tests/fakes/cudnn_builds.py) and load them in fresh interpreters (a
library once loaded stays loaded), with a torch-free fake TE that loads its "system" cuDNN
the way TE's loader does.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import logging
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from fakes import cudnn_builds as fb
from fakes.interpreter import PTH, SRC, child_env, probed, run_code
from te_gqa_fix.stack import affected, cudnn
from te_gqa_fix.stack.versions import RuntimeFacts


@pytest.fixture(autouse=True)
def _fresh_route():
    cudnn._reset_route()
    yield
    cudnn._reset_route()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """Four wheel sites (9.14 by header, 9.19 by metadata, 9.20 in TE's cu13 layout, one
    without a version) and a system build 9.14 with versioned file names; the tests that
    load them skip without a C compiler."""
    if fb.compiler() is None:
        pytest.skip("needs a C compiler")
    base = tmp_path_factory.mktemp("cudnn")
    out = {name: base / f"site_{name}" for name in ("old", "fixed", "newest", "anon")}
    out["system"] = base / "sys"
    fb.wheel_build(out["old"], (9, 14, 0), how="header")
    fb.wheel_build(out["fixed"], (9, 19, 0), how="metadata")
    decoy = out["fixed"] / "nvidia_cudnn_cu12-9.10.0.dist-info"  # its RECORD: another folder
    decoy.mkdir()
    (decoy / "RECORD").write_text("nvidia/cudnn/lib64/libcudnn.so.9,,\n")
    (out["fixed"] / "nvidia_cudnn_cu12-9.dist-info").mkdir()  # no dotted version: not a wheel's
    fb.wheel_build(out["newest"], (9, 20, 1), layout="nvidia/cu13/cudnn/lib", how="header")
    fb.wheel_build(out["anon"], (9, 21, 0), how="none")
    fb.system_build(out["system"], (9, 14, 0))
    return out


# ----------------------------------------------------------------------------- discovery


def test_discovery_reads_each_layout_and_version_source(builds: Dict[str, Path]) -> None:
    found = cudnn.find_wheel_builds([str(builds[k]) for k in ("old", "fixed", "newest", "anon")])
    by_site = {
        f"site_{name}": b
        for b in found
        for name in ("old", "fixed", "newest", "anon")
        if b.lib_dir.startswith(str(builds[name]) + os.sep)
    }
    assert len(found) == 4, found
    assert by_site["site_old"].version == (9, 14, 0) and by_site["site_old"].how == "header"
    assert by_site["site_fixed"].version == (9, 19, 0)
    assert by_site["site_fixed"].how == "wheel metadata"
    assert by_site["site_fixed"].distribution == "nvidia-cudnn-cu13"
    assert by_site["site_newest"].version == (9, 20, 1)
    assert by_site["site_newest"].lib_dir.endswith(os.path.join("nvidia", "cu13", "cudnn", "lib"))
    anon = by_site["site_anon"]
    assert anon.version is None and not anon.fixed and anon.version_str == anon.how == "unknown"
    assert [b.fixed for b in found].count(True) == 2
    assert cudnn.choose_fixed(found).version == (9, 20, 1)  # the newest fixed
    names = [os.path.basename(p) for p in by_site["site_fixed"].libraries()]  # libcudnn last
    assert names == [f"{n}.so.9" for n in (*fb.SUB_LIBRARIES, "libcudnn")]
    (system,) = cudnn.find_system_builds({"CUDNN_HOME": str(builds["system"])})[:1]
    assert (system.version, system.how, system.origin) == ((9, 14, 0), "file name", "system")
    assert cudnn.choose_fixed([b for b in found if b.version != (9, 20, 1)]).version == (9, 19, 0)


@pytest.mark.parametrize(
    "var, sub",
    [("CUDNN_PATH", "lib64"), ("CUDA_HOME", ""), ("CUDA_PATH", "lib/x86_64-linux-gnu"),
     ("LD_LIBRARY_PATH", "any")],
)  # fmt: skip
def test_system_builds_below_te_variables_and_ld_library_path(
    tmp_path: Path, var: str, sub: str
) -> None:
    lib = fb.stub_build(tmp_path / sub, suffix="9.14.0")
    env = {var: f"::{lib}" if var == "LD_LIBRARY_PATH" else str(tmp_path)}
    found = [(b.lib_dir, b.version) for b in cudnn.find_system_builds(env)]
    assert found[:1] == [(str(lib), (9, 14, 0))]


class _BytesPath(os.PathLike):
    def __fspath__(self) -> bytes:  # type: ignore[override]
        return b"/opt/cudnn"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(where=None), TypeError,
         "where: expected 'auto' or a folder path (str or os.PathLike), got NoneType None"),
        (dict(where=123), TypeError, "where: expected 'auto' or a folder path (str or "
         "os.PathLike), got int 123"),
        (dict(search_path="x" * 78), TypeError, f"single {'x' * 78!r}: wrap"),  # 80: whole
        (dict(where=b"x" * 78), TypeError, f"got bytes {repr(b'x' * 78)[:80]}...(81 chars)"),
        (dict(where=_BytesPath()), TypeError, "got _BytesPath"),
        (dict(where=" "), ValueError, "where: expected 'auto' or a folder path"),
        (dict(where="strict:/opt/cudnn"), ValueError, "'strict' and 'strict:FOLDER' are "
         "TE_GQA_FIX_CUDNN's spellings; here strictness is the strict= keyword (default True): "
         "call use_fixed_cudnn('/opt/cudnn', strict=True)"),
        (dict(where="Strict"), ValueError, "call use_fixed_cudnn('auto', strict=True)"),
        (dict(search_path="/usr"), TypeError, "search_path: expected a list of site folders "
         "(str or os.PathLike), got the single '/usr': wrap one folder in a list (['/usr'])"),
        (dict(search_path=5), TypeError, "search_path: expected a list of site folders"),
        (dict(search_path=["/usr", None]), TypeError, "search_path[1]: expected a folder"),
        (dict(where="/opt/cudnn", search_path=["/usr"]), ValueError,
         "search_path is only read for where='auto', not for the folder '/opt/cudnn'"),
        (dict(strict="no"), TypeError, "strict: expected a bool, got 'no'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named_before_anything_is_tried(
    kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error) as err:
        cudnn.use_fixed_cudnn(**{"strict": False, **kwargs})  # not even strict=False hides it
    assert message in str(err.value)
    assert cudnn.route_state()["setting"] is None


@pytest.mark.parametrize("where", ["auto", " AUTO "])
def test_auto_without_a_fixed_build_names_versions_seen_and_the_pip_install(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """In any case; search_path and a folder as path objects."""
    fb.stub_build(tmp_path / "site" / "nvidia" / "cudnn" / "lib", header_version=(9, 14, 0))
    found = r"auto found no cuDNN >= 9\.18 .*seen: 9\.14\.0 \(.*\); pip install " + re.escape(
        "'nvidia-cudnn-cu12>=9.18' (CUDA 12) or 'nvidia-cudnn-cu13>=9.18' (CUDA 13) provides one"
    )
    with pytest.raises(LookupError, match=found):
        cudnn.use_fixed_cudnn(where, search_path=[tmp_path / "site"])
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        assert cudnn.use_fixed_cudnn(where, strict=False, search_path=[tmp_path / "site"]) is None
    assert re.search(found, caplog.text) and re.search(found, cudnn.route_state()["error"])
    with pytest.raises(cudnn.CudnnRefused, match=r"cuDNN 9\.14\.0 in .* not a fixed build"):
        cudnn.use_fixed_cudnn(tmp_path / "site" / "nvidia" / "cudnn")


def _not_elf(lib: Path) -> None:
    (lib / "libcudnn_ops.so.9").write_text("not an ELF file")


REFUSED = {  # case -> (stub build, error, what the message says)
    "not cuDNN": (dict(header_version=(9, 19, 0), symbol=False), cudnn.CudnnRefused,
                  r"libcudnn\.so\.9 is not a cuDNN \(it exports no cudnnGetVersion\); nothing was loaded"),
    "9.14 by header": (dict(header_version=(9, 14, 0)), cudnn.CudnnRefused,
                       r"cuDNN 9\.14\.0 in .* \(version from its header\) is not a fixed build.*"
                       "nothing was loaded"),
    "9.17.9 by file name": (dict(suffix="9.17.9"), cudnn.CudnnRefused,
                            r"cuDNN 9\.17\.9 .*file name.* not a fixed build"),
    "cuDNN 10": (dict(header_version=(10, 0, 0)), cudnn.CudnnRefused, r"cuDNN 10\.0\.0 .* not a fixed"),
    "no version, strict": ({}, cudnn.CudnnRefused,
                           r"can only be learned by loading it .* nothing was loaded"),
    "a file not ELF": (dict(header_version=(9, 19, 0), edit=_not_elf), OSError,
                       r"libcudnn_ops\.so\.9 is not an ELF shared library; nothing of cuDNN 9\.19\.0"),
    "a file that fails to load": (dict(header_version=(9, 19, 0)), OSError,
                                  r"could not load .*libcudnn_graph\.so\.9 .*0 of 8 files .*"
                                  "would mix builds"),
    "no cuDNN in the folder": (dict(edit=shutil.rmtree), FileNotFoundError,
                               r"expected a folder holding libcudnn\.so\.9"),
    "no libcudnn.so.9, lenient": (dict(edit=lambda lib: (lib / "libcudnn.so.9").rename(
        lib / "libcudnn.so.8")), FileNotFoundError, r"no libcudnn\.so\.9 in .*given"),
}  # fmt: skip


@pytest.mark.parametrize(
    "case, strict",
    [(c, s) for c in REFUSED for s in (True, False)
     if (s or "strict" not in c) and not (s and "lenient" in c)],
)  # fmt: skip
def test_a_build_known_wrong_is_refused_before_it_is_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str, strict: bool
) -> None:
    """Stubs (ELF magic, then the exported names): loading one would fail with an error of
    its own, so each message shows the refusal came first. Not strict: the same reason is
    logged at WARNING, and nothing is loaded either (a build of unknown version is loaded,
    then asked: test_a_version_learned_by_loading_is_checked). Strict, TE's import then
    fails with the reason; otherwise there is nothing to compare TE's cuDNN with."""
    stub, error, message = REFUSED[case]
    stub = dict(stub)
    edit = stub.pop("edit", None)
    lib = fb.stub_build(tmp_path / "given" / "lib", **stub)
    if edit:
        edit(lib)
    if strict:
        with pytest.raises(error, match=message):
            cudnn.use_fixed_cudnn(str(tmp_path / "given"))
    else:
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            assert cudnn.use_fixed_cudnn(str(tmp_path / "given"), strict=False) is None
        assert [r for r in caplog.records if re.search(message, r.getMessage())]
    assert cudnn.route_state()["loaded"] == () and re.search(message, cudnn.route_state()["error"])
    if strict:
        with pytest.raises(ImportError, match=r"\(strict\) failed: .*" + message):
            cudnn.verify_te_cudnn()
    else:
        assert cudnn.verify_te_cudnn() is None and cudnn.route_state()["verified"] is None


@pytest.mark.parametrize("sub", ["", "lib", "lib64", "lib/x86_64-linux-gnu"])
def test_a_given_folder_or_its_lib_folder(tmp_path: Path, sub: str) -> None:
    lib = fb.stub_build(tmp_path / "cudnn" / sub, suffix="9.19.0.56")  # cut to 3 numbers
    build = cudnn._resolve_target(str(tmp_path / "cudnn"), None)
    assert build.lib_dir == str(lib).rstrip(os.sep) and build.version == (9, 19, 0)
    assert build.origin == "given"


HEAD = "#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 19\n"


@pytest.mark.parametrize(
    "text, expected",
    [(HEAD, (9, 19, 0)), (HEAD.split("\n")[0], None), (HEAD.split("\n")[1], None),
     ("\n" * (8193 - len(HEAD) - 27) + HEAD + "#define CUDNN_PATCHLEVEL 17", (9, 19, 1))],
    ids=["no patch level", "no minor", "no major", "8 KiB read: 17 straddles byte 8192"],
)  # fmt: skip
def test_header_version(tmp_path: Path, text: str, expected: Optional[Tuple[int, ...]]) -> None:
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cudnn_version.h").write_text(text)
    assert cudnn._header_version(str(tmp_path / "lib")) == expected


def test_only_a_default_search_adds_site_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    lib = fb.stub_build(tmp_path / "site" / "nvidia" / "cudnn" / "lib", suffix="9.19.0")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path / "site")])
    monkeypatch.setattr(sys, "path", [os.fsencode(tmp_path / "site"), *sys.path])  # skipped
    found = [(b.lib_dir, b.version, b.how, b.origin) for b in cudnn.find_wheel_builds()]
    assert (str(lib), (9, 19, 0), "file name", "wheel") in found  # no header, no metadata
    assert cudnn.find_wheel_builds([str(tmp_path)]) == []


def test_mapped_versions_from_the_file_name_real_path_cudnn_get_version_or_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only libcudnn is asked its version (as if loaded); only a library below nvidia/ takes
    the version of the wheel in the site folder above (here also the working folder)."""
    (tmp_path / "libcudnn_cnn.so.9").symlink_to("libcudnn_cnn.so.9.19")
    (tmp_path / "nvidia_cudnn_cu13-9.20.0.56.dist-info").mkdir()
    monkeypatch.chdir(tmp_path)
    names = ["libcudnn_adv.so.9.14", "libcudnn_cnn.so.9", "libcudnn.so.9", "libcudnn_ops.so.9",
             "nvidia/cudnn/lib/libcudnn_graph.so.9"]  # fmt: skip
    maps = "".join(f"7f-7f r-xp 0 08:01 1 {tmp_path / n}\n" for n in names)
    monkeypatch.setattr(cudnn, "open", lambda path: io.StringIO(maps), raising=False)
    monkeypatch.setattr(cudnn, "_ctypes_version", lambda path: "9.19.0")
    libs = cudnn.mapped_cudnn_libraries()
    assert [(lib.version, lib.source) for lib in libs] == [
        ("9.14", "file name"), ("9.19", "real path"), ("9.19.0", "cudnnGetVersion"),
        ("9", "file name"), ("9.20.0.56", "nvidia-cudnn wheel"),
    ]  # fmt: skip
    assert len(set(libs)) == 5  # frozen, so hashable
    monkeypatch.setattr(cudnn, "open", lambda path: open(tmp_path / "none"), raising=False)
    assert cudnn.mapped_cudnn_libraries() is None  # maps unreadable


@pytest.mark.parametrize(
    "offset, found", [((1 << 20) - 5, True), ((63 << 20) + 9, True), ((64 << 20) + 9, False)]
)
def test_exported_names_within_the_first_64_mib(tmp_path: Path, offset: int, found: bool) -> None:
    """Across a 1 MiB chunk, and not past 64 MiB (sparse files)."""
    with open(tmp_path / "lib.so", "wb") as f:
        f.write(b"\x7fELF")
        f.seek(offset)
        f.write(b"\0cudnnGetVersion\0")
    names = cudnn._elf_symbols(str(tmp_path / "lib.so"), (b"cudnnGetVersion", b"x"))
    assert names == ({b"cudnnGetVersion"} if found else set())


@pytest.mark.parametrize(
    "answer, said", [(None, "cudnnGetVersion of {} failed"), ("9.14.0", "{} reports cuDNN 9.14.0")]
)
def test_a_loaded_build_that_answers_wrong_is_refused(
    monkeypatch: pytest.MonkeyPatch, answer: Optional[str], said: str
) -> None:
    """libcudnn.so.9, loaded last, is the file asked and named."""
    monkeypatch.setattr(cudnn, "_ctypes_version", {"/x/libcudnn.so.9": answer}.__getitem__)
    build = cudnn.CudnnBuild("/x", (9, 19, 0) if answer else None, "given", "header")
    with pytest.raises(cudnn.CudnnRefused, match=re.escape(said.format("/x/libcudnn.so.9"))):
        cudnn._check_loaded(build, ["/x/libcudnn_ops.so.9", "/x/libcudnn.so.9"])


def test_a_new_process_has_no_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's record as a process starts with it, and as _reset_route leaves it."""
    spec = importlib.util.spec_from_file_location("te_gqa_fix.stack._cudnn_copy", cudnn.__file__)
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)  # type: ignore[union-attr]
    spec.loader.exec_module(fresh)  # type: ignore[union-attr]
    cudnn._route.update(setting="auto", strict=True, loaded=("x",), seen=("y",))
    cudnn._reset_route()
    none = dict.fromkeys(("setting", "chosen", "chosen_version", "error", "te_cudnn", "verified"))
    expected = {**none, "strict": False, "loaded": (), "seen": ()}
    assert cudnn.route_state() == fresh.route_state() == expected


@pytest.mark.parametrize(
    "names, link, expected",
    [
        (["9.14.0", "9.19.0"], None, (9, 19, 0)),  # no libcudnn.so.9: the highest
        (["9.10.0", "9.9.0"], None, (9, 10, 0)),  # compared as numbers, not as text
        (["9.19.0", "9.14.0"], "9.14.0", (9, 14, 0)),  # the soname link, not a stale copy
    ],
)
def test_file_name_version(
    tmp_path: Path, names: List[str], link: Optional[str], expected: Tuple[int, ...]
) -> None:
    for name in names:
        (tmp_path / f"libcudnn.so.{name}").write_bytes(b"")
    if link:
        (tmp_path / "libcudnn.so.9").symlink_to(f"libcudnn.so.{link}")
    assert cudnn._file_name_version(str(tmp_path)) == expected


@pytest.mark.parametrize(
    "version, fixed",
    [((9, 17, 9), False), ((9, 18, 0), True), ((9, 99, 9), True), ((10, 0, 0), False),
     ((10,), False), ((8, 9, 7), False), (None, False)],
)  # fmt: skip
def test_fixed_means_9_18_or_newer_within_cudnn_9(version, fixed: bool) -> None:
    build = cudnn.CudnnBuild("/x", version, "wheel", "header")
    assert build.fixed is fixed and isinstance(hash(build), int)  # frozen, so hashable
    assert cudnn.choose_fixed([build]) is (build if fixed else None)


@pytest.mark.parametrize(
    "te, strict, outcome",
    [((9, 19, 0), True, True), ((9, 19, 1), True, ImportError), ((9, 19, 1), False, False),
     ((9, 18, 0), False, False), (None, True, ImportError), (None, False, False)],
)  # fmt: skip
def test_verify_compares_major_minor_and_patch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, te, strict: bool, outcome
) -> None:
    """A mismatch fails TE's import when strict, else it is logged (TE imported through the
    route: test_auto_loads_the_fixed_build_before_te_and_te_runs_it)."""
    build = cudnn.CudnnBuild("/x", (9, 19, 0), "wheel", "header")
    cudnn._route.update(chosen=build, loaded=("/x/libcudnn.so.9",), strict=strict)
    monkeypatch.setattr(cudnn, "te_cudnn_version", lambda: te)
    runs = ".".join(map(str, te or ())) or "unknown"
    said = rf"loaded cuDNN 9\.19\.0 from /x, but Transformer Engine runs cuDNN {runs}"
    if outcome is ImportError:
        with pytest.raises(ImportError, match=said):
            cudnn.verify_te_cudnn()
    else:
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            assert cudnn.verify_te_cudnn() is outcome
        assert bool(re.search(said + "; the post-pass still guards", caplog.text)) is not outcome
    assert cudnn.route_state()["verified"] is (outcome is True)


def test_te_cudnn_version_never_imports_te(fake_te: Path) -> None:
    assert cudnn.te_cudnn_version() is None and "transformer_engine.pytorch" not in sys.modules
    importlib.import_module("transformer_engine.pytorch")
    assert cudnn.te_cudnn_version() == (9, 14, 0)


@pytest.mark.parametrize(
    "value, expected",
    [(None, (None, False)), ("", (None, False)), ("off", (None, False)), ("0", (None, False)),
     ("auto", ("auto", False)), (" AUTO ", ("auto", False)), ("1", ("auto", False)),
     ("strict", ("auto", True)), ("/opt/cudnn", ("/opt/cudnn", False)),
     ("strict:/opt/cudnn", ("/opt/cudnn", True)), ("./cudnn", ("./cudnn", False))],
)  # fmt: skip
def test_parse_setting(value: Optional[str], expected: Tuple[Optional[str], bool]) -> None:
    assert cudnn.parse_setting(value) == expected


# ----------------------------------------------------------------------------- loading


def run_python(code: str, env: Dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in ``tmp_path``, ``src`` importable (after the paths
    of ``env["PYTHONPATH_FIRST"]``), no TE_GQA_FIX* or FAKE_TE* variable but ``env``'s."""
    first = env.pop("PYTHONPATH_FIRST", "")
    return run_code(code, child_env(first, SRC, drop=("TE_GQA_FIX", "FAKE_TE"), **env), tmp_path)


GLOBAL_VERSION = (
    "import ctypes\n"
    "fn = ctypes.CDLL(None).cudnnGetVersion; fn.restype = ctypes.c_size_t\n"
    "print('GLOBAL', fn())\n"
)


@pytest.mark.parametrize("preload", [True, False])
def test_the_first_global_copy_wins(builds: Dict[str, Path], tmp_path: Path, preload: bool) -> None:
    """What the route relies on: loaded first, the fixed build answers even after the
    system copy is loaded by path, as TE's loader does; without it the system copy does."""
    system = builds["system"] / "lib" / "libcudnn.so.9"
    code = (
        "import ctypes, os\n"
        + (
            f"from te_gqa_fix.stack.cudnn import use_fixed_cudnn\n"
            f"b = use_fixed_cudnn('auto', search_path=[{str(builds['fixed'])!r}])\n"
            if preload
            else ""
        )
        + f"ctypes.CDLL({str(system)!r}, mode=ctypes.RTLD_GLOBAL)\n"
        + GLOBAL_VERSION
    )
    proc = run_python(code, {}, tmp_path)
    assert f"GLOBAL {91900 if preload else 91400}" in proc.stdout


def test_refuses_once_a_cudnn_is_loaded(builds: Dict[str, Path], tmp_path: Path) -> None:
    """Three files of another build are named, a fourth as "..."; the same build twice is
    fine; asking a library its version never loads it."""
    fixed = builds["fixed"] / "nvidia" / "cudnn" / "lib"
    files = [str(fixed / f"{n}.so.9") for n in ("libcudnn", *fb.SUB_LIBRARIES[:3])]
    code = (
        "import ctypes\nfrom te_gqa_fix.stack import cudnn\n"
        f"print('ASKED', cudnn._ctypes_version({files[0]!r}))\n"
        f"for path in {files!r}:\n"
        "    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)\n"
        "    if path != " + repr(files[0]) + ":\n"
        "        try:\n"
        f"            cudnn.use_fixed_cudnn('auto', search_path=[{str(builds['newest'])!r}])\n"
        "        except cudnn.CudnnAlreadyLoaded as exc:\n"
        "            print('REFUSED', str(exc).split('), so')[0])\n"
        f"print('ASKED', cudnn._ctypes_version({files[0]!r}))\n"
        f"cudnn.use_fixed_cudnn({str(fixed)!r})\nprint('SAME OK')\n"
    )
    proc = run_python(code, {}, tmp_path)
    refused = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED")]
    shown = [(r.count(str(fixed)), r.endswith(" ...")) for r in refused]
    assert shown == [(2, False), (3, False), (3, True)]
    assert "ASKED None" in proc.stdout and "ASKED 9.19.0" in proc.stdout
    assert "SAME OK" in proc.stdout


@pytest.mark.skipif(fb.compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize(
    "version, suffix, strict, printed",
    [
        # no version on disk: loaded (not strict), then asked
        ((9, 21, 0), "9", False, "VERSION (9, 21, 0) cudnnGetVersion 9.21.0"),
        ((9, 14, 0), "9", False, "NONE te_gqa_fix: cuDNN 9.14.0 in {lib} (version from its cudnnGetVersion) "
         "is not a fixed build: the route loads cuDNN 9.18 or newer within cuDNN 9 (learned by "
         "loading it); it is loaded in this process now"),
        # a file name that lies: found out once loaded, said so
        ((9, 14, 0), "9.19.0", True, "RAISED te_gqa_fix: {lib}/libcudnn.so.9 reports cuDNN "
         "9.14.0, not the 9.19.0 its file name names; it is loaded in this process now"),
    ],
)  # fmt: skip
def test_a_version_learned_by_loading_is_checked(
    tmp_path: Path, version: Tuple[int, int, int], suffix: str, strict: bool, printed: str
) -> None:
    lib = fb.write_libs(tmp_path / "given" / "lib", version, suffix=suffix, subs=False)
    code = (
        "import logging, sys\nfrom te_gqa_fix.stack import cudnn\n"
        "logging.basicConfig(stream=sys.stdout, format='WARN %(message)s')\n"
        "try:\n"
        f"    b = cudnn.use_fixed_cudnn({str(lib.parent)!r}, strict={strict})\n"
        "except LookupError as exc:\n    print('RAISED', exc)\nelse:\n"
        "    state = cudnn.route_state()\n"
        "    print(*(('VERSION', b.version, b.how, state['chosen_version']) if b else "
        "('NONE', state['error'])))\n"
    )
    proc = run_python(code, {}, tmp_path)
    assert printed.format(lib=lib) in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- start-up hook


def _hook_env(builds: Dict[str, Path], tmp_path: Path, wheel: str, **env: str) -> Dict[str, str]:
    fake = fb.loader_te(tmp_path / "fake_te")
    site_dir = tmp_path / "site_dir"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(PTH, site_dir / PTH.name)
    return {
        # a wheel build is on sys.path, as an environment's site-packages is
        "PYTHONPATH_FIRST": os.pathsep.join([str(fake), str(builds[wheel])]),
        "FAKE_TE_SYSTEM_CUDNN": str(builds["system"] / "lib" / "libcudnn.so.9"),
        "SITE_DIR": str(site_dir),
        **env,
    }


PROBE = (
    "import os, site, sys, json, logging\n"
    "logging.basicConfig(level=logging.INFO, format='LOG %(levelname)s %(message)s', stream=sys.stdout)\n"
    "site.addsitedir(os.environ['SITE_DIR'])\n"
    "early = {m: m in sys.modules for m in ('_te_gqa_fix_autopatch', 'te_gqa_fix.settings', "
    "'te_gqa_fix.stack.cudnn', 'torch')}\n"
    "def mapped():\n"
    "    return sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libcudnn.so' in l})\n"
    "early_maps = mapped()\n"
    "err = None\n"
    "try:\n"
    "    import transformer_engine.pytorch\n"
    "    from transformer_engine.pytorch.utils import get_cudnn_version\n"
    "    te = list(get_cudnn_version())\n"
    "except ImportError as exc:\n"
    "    te, err = None, str(exc)\n"
    "route = sys.modules['te_gqa_fix.stack.cudnn'].route_state() if 'te_gqa_fix.stack.cudnn' in sys.modules "
    "else None\n"
    "print('PROBE' + json.dumps(dict(early=early, early_maps=early_maps, te=te, err=err, "
    "maps=mapped(), route=route)))\n"
)


@pytest.mark.parametrize("value", ["auto", "strict", "auto, and TE_GQA_FIX_AUTOPATCH=1"])
def test_auto_loads_the_fixed_build_before_te_and_te_runs_it(
    builds: Dict[str, Path], tmp_path: Path, value: str
) -> None:
    """With the patch too, as a job that wants both (the patch hook fires on a fake TE
    without the symbol), the route still loads the fixed build before TE."""
    both = {"TE_GQA_FIX_AUTOPATCH": "1"} if "AUTOPATCH" in value else {}
    env = _hook_env(builds, tmp_path, "fixed", **{cudnn.ENV_CUDNN: value.split(",")[0], **both})
    proc = run_python(PROBE, env, tmp_path)
    out = probed(proc)
    # At start-up only the stdlib hook and the settings are imported, nothing is loaded yet.
    assert out["early"] == {
        "_te_gqa_fix_autopatch": True,
        "te_gqa_fix.settings": True,
        "te_gqa_fix.stack.cudnn": False,
        "torch": False,
    }
    assert out["early_maps"] == []
    assert out["te"] == [9, 19, 0], proc.stdout + proc.stderr
    assert out["route"]["chosen_version"] == "9.19.0"
    assert out["route"]["verified"] is True and out["route"]["te_cudnn"] == "9.19.0"
    assert any("site_fixed" in p for p in out["maps"])
    assert "loaded cuDNN 9.19.0" in proc.stdout


def test_auto_with_no_fixed_build_logs_and_te_keeps_its_cudnn(
    builds: Dict[str, Path], tmp_path: Path
) -> None:
    """Strict: test_strict_failure_stays_a_failure_on_every_import."""
    env = _hook_env(builds, tmp_path, "old", **{cudnn.ENV_CUDNN: "auto"})
    proc = run_python(PROBE, env, tmp_path)
    assert probed(proc)["te"] == [9, 14, 0]
    assert "found no cuDNN >= 9.18" in proc.stdout and "9.14.0" in proc.stdout


def test_strict_failure_stays_a_failure_on_every_import(
    builds: Dict[str, Path], tmp_path: Path
) -> None:
    """A strict route that failed once must not let a retried import go on silently."""
    env = _hook_env(builds, tmp_path, "old", **{cudnn.ENV_CUDNN: "strict"})
    code = (
        "import os, site\nsite.addsitedir(os.environ['SITE_DIR'])\n"
        "for attempt in (1, 2):\n"
        "    try:\n"
        "        import transformer_engine.pytorch\n"
        "    except ImportError as exc:\n"
        "        print('RAISED', attempt, 'found no cuDNN >= 9.18' in str(exc), 'pip' in str(exc))\n"
        "    else:\n"
        "        print('IMPORTED', attempt)\n"
    )
    proc = run_python(code, env, tmp_path)
    assert "RAISED 1 True True" in proc.stdout and "RAISED 2 True True" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------- the rule


H, OLD = (9, 0), (9, 14, 0)


@pytest.mark.parametrize(
    "capability, cudnn_v, dims, status",
    [(H, OLD, (None, None), "affected"), (H, OLD, (128, 128), "affected"),
     (H, OLD, (64, 64), "affected"), (H, OLD, (192, 128), "affected"),  # MLA: clean on 9.14
     (H, OLD, (192, 192), "unrepairable"), (H, OLD, (256, 256), "unrepairable"),
     (H, OLD, (256, 128), "unrepairable"), (H, OLD, (128, 256), "unrepairable"),
     (H, (9, 17, 9), (64, 64), "affected"), (H, (8, 9, 7), (None, None), "affected"),
     # Between measured builds: the older one's live rows, the post-pass on dead rows.
     (H, (9, 18, 0), (None, None), "affected"), (H, (9, 18, 0), (256, 256), "unrepairable"),
     (H, (9, 19, 0), (256, 256), "not_affected"), (H, (9, 19, 2), (None, None), "not_affected"),
     (H, (9, 19, 0), (256, 128), "unrepairable"), (H, (9, 22, 0), (128, 128), "affected"),
     (H, (9, 22, 0), (256, 256), "affected"), (H, (9, 22, 0), (256, 128), "unrepairable"),
     (H, (9, 27, 0), (256, 128), "not_affected"),
     (H, (9, 31, 0), (256, 128), "not_affected"),  # newer: judged as the newest measured
     ((8, 0), OLD, (256, 256), "not_affected"), ((10, 0), OLD, (256, 256), "not_affected"),
     ((10, 0), (9, 10, 0), (None, None), "not_affected"), (None, OLD, (256, 256), "unknown"),
     (H, None, (256, 256), "unknown"), (H, None, (None, None), "unknown")],
)  # fmt: skip
def test_rule_table(monkeypatch: pytest.MonkeyPatch, capability, cudnn_v, dims, status) -> None:
    """The verdict (saying so where the build was not measured), and where it is
    unrepairable a message naming the configuration and the remedy (no fixed build installed
    here: the pip install of the newest build measured right)."""
    v = affected.verdict(capability, cudnn_v, *dims)
    assert v.status == status and v.reasons
    measured = None in (capability, cudnn_v) or capability[0] != 9 or cudnn_v[:2] in (
        (9, 14), (9, 19), (9, 27))  # fmt: skip
    assert ("not measured" in " ".join(v.reasons)) is not measured, v.reasons
    _facts(monkeypatch, capability, cudnn_v)
    assert affected.cudnn_fixed(0) is (cudnn_v is not None and cudnn_v >= (9, 18))
    monkeypatch.setattr(affected, "find_wheel_builds", lambda search_path=None: [])
    msg = affected.why_unrepairable(0, *dims) if dims[0] else None
    assert (msg is not None) is (status == "unrepairable")
    if msg is not None:
        assert f"head dim {dims[0]}" in msg and "sm90" in msg
        assert f"cuDNN {'.'.join(map(str, cudnn_v))}" in msg
        assert "pip install 'nvidia-cudnn-cu12>=9.27'" in msg, msg


def _facts(monkeypatch: pytest.MonkeyPatch, capability, cudnn_v) -> None:
    monkeypatch.setattr(
        affected, "runtime_facts", lambda index=None: RuntimeFacts(capability, cudnn_v)
    )


def test_remedy_names_the_installed_fixed_build(monkeypatch: pytest.MonkeyPatch) -> None:
    _facts(monkeypatch, (9, 0), (9, 14, 0))
    build = cudnn.CudnnBuild("/env/site-packages/nvidia/cudnn/lib", (9, 19, 0), "wheel", "header")
    monkeypatch.setattr(affected, "find_wheel_builds", lambda search_path=None: [build])
    msg = affected.why_unrepairable(0, 256, 256)
    assert msg is not None and "TE_GQA_FIX_CUDNN=auto" in msg
    assert "cuDNN 9.19.0 is installed at /env/site-packages/nvidia/cudnn/lib" in msg
    msg = affected.why_unrepairable(0, 256, 128)  # 9.19 is wrong there too: not the remedy
    assert msg is not None and "nvidia-cudnn-cu13>=9.27" in msg and "installed" not in msg
