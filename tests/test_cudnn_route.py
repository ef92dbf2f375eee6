"""The cuDNN route (``TE_GQA_FIX_CUDNN``, ``te_gqa_fix.use_fixed_cudnn``).

The route's claim is about the dynamic loader: the first ``RTLD_GLOBAL`` copy of a symbol
wins, so a build loaded before TE makes TE run it even though TE later loads the system
copy by path. The route moves TE only onto a build measured right (issue #54): among the
installed wheels the newest measured right; where none is installed, the newest unmeasured
build at or above 9.18 (with a WARNING: the post-pass stays on); never one measured wrong
nor one below 9.18; ``strict`` loads an unmeasured build only from a folder the user names.
These tests build real shared libraries that answer ``cudnnGetVersion``
(tests/fakes/cudnn_builds.py) and load them in fresh interpreters (a library once loaded
stays loaded), with a torch-free fake TE that loads its "system" cuDNN the way TE's loader
does. Refusals come before anything is loaded, so they are tested in this process.
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

from fakes import background
from fakes import cudnn_builds as fb
from fakes.interpreter import PTH, SRC, child_env, probed, python_command, run_code
from te_gqa_fix import cudnn_route, rules
from te_gqa_fix.errors import (
    CudnnAlreadyLoaded,
    CudnnLoadError,
    CudnnRefused,
    InputError,
    InputTypeError,
    SetupError,
)
from te_gqa_fix.settings import shown

ENV = cudnn_route.ENV_CUDNN


@pytest.fixture(autouse=True)
def _fresh_route():
    cudnn_route._reset_route()
    yield
    cudnn_route._reset_route()


def make_builds(base: Path) -> Dict[str, Path]:
    """Wheel sites: 9.14 by header (measured wrong: stale rows), 9.19 by metadata (measured
    right), 9.25 by header in TE's cu13 layout (not measured), one without a version; a
    system build 9.14 with versioned file names."""
    out = {name: base / f"site_{name}" for name in ("old", "fixed", "unmeasured", "anon")}
    out["system"] = base / "sys"
    fb.wheel_build(out["old"], (9, 14, 0), how="header")
    fb.wheel_build(out["fixed"], (9, 19, 0), how="metadata")
    decoy = out["fixed"] / "nvidia_cudnn_cu12-9.10.0.dist-info"  # its RECORD: another folder
    decoy.mkdir()
    (decoy / "RECORD").write_text("nvidia/cudnn/lib64/libcudnn.so.9,,\n")
    (out["fixed"] / "nvidia_cudnn_cu12-9.dist-info").mkdir()  # no dotted version: not a wheel's
    fb.wheel_build(out["unmeasured"], (9, 25, 0), layout=UNMEASURED_LAYOUT, how="header")
    fb.wheel_build(out["anon"], (9, 21, 0), how="none")
    fb.system_build(out["system"], (9, 14, 0))
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """:func:`make_builds`; the tests that use them skip without a C compiler."""
    if fb.compiler() is None:
        pytest.skip("needs a C compiler")
    return make_builds(tmp_path_factory.mktemp("cudnn"))


UNMEASURED_LAYOUT = "nvidia/cu13/cudnn/lib"


def _lib(builds: Dict[str, Path], name: str) -> Path:
    layout = UNMEASURED_LAYOUT if name == "unmeasured" else "nvidia/cudnn/lib"
    return builds[name] / layout


@pytest.fixture
def measured_wrong_925(monkeypatch: pytest.MonkeyPatch) -> rules.Measurement:
    """The table with a measurement of 9.25 that found sequences without queries or keys
    wrong on rows that receive attention (put back after the test)."""
    wrong = rules.Measurement((9, 25, 0), False, frozenset(), rules._ABOVE_128, True)
    table = sorted((*rules.MEASURED, wrong), key=lambda m: m.cudnn)
    monkeypatch.setattr(rules, "MEASURED", tuple(table))
    return wrong


# ----------------------------------------------------------------------------- discovery


def test_discovery_reads_each_layout_and_version_source(builds: Dict[str, Path]) -> None:
    found = cudnn_route.find_wheel_builds(
        [str(builds[k]) for k in ("old", "fixed", "unmeasured", "anon")]
    )
    by_site = {
        name: b
        for b in found
        for name in ("old", "fixed", "unmeasured", "anon")
        if b.lib_dir.startswith(str(builds[name]) + os.sep)
    }
    assert len(found) == 4, found
    assert by_site["old"].version == (9, 14, 0) and by_site["old"].how == "header"
    assert by_site["fixed"].version == (9, 19, 0)
    assert by_site["fixed"].how == "wheel metadata"
    assert by_site["fixed"].distribution == "nvidia-cudnn-cu13"
    assert by_site["unmeasured"].version == (9, 25, 0)
    assert by_site["unmeasured"].lib_dir.endswith(os.path.join(*UNMEASURED_LAYOUT.split("/")))
    anon = by_site["anon"]
    assert anon.version is None and not anon.fixed and anon.version_str == anon.how == "unknown"
    measured = {name: b.measured for name, b in by_site.items()}
    assert measured == dict(old="wrong", fixed="right", unmeasured="unmeasured", anon="unknown")
    assert cudnn_route.choose(found) is by_site["fixed"]  # measured right, over a newer one
    names = [os.path.basename(p) for p in by_site["fixed"].libraries()]  # libcudnn last
    assert names == [f"{n}.so.9" for n in (*fb.SUB_LIBRARIES, "libcudnn")]
    (system,) = cudnn_route.find_system_builds({"CUDNN_HOME": str(builds["system"])})[:1]
    assert (system.version, system.how, system.origin) == ((9, 14, 0), "file name", "system")


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
    found = [(b.lib_dir, b.version) for b in cudnn_route.find_system_builds(env)]
    assert found[:1] == [(str(lib), (9, 14, 0))]


# ----------------------------------------------------------------------------- choosing

V = Tuple[int, ...]


@pytest.mark.parametrize(
    "versions, chosen",
    [([(9, 19, 0), (9, 25, 0)], (9, 19, 0)),  # measured right over a newer unmeasured one
     # Issue #54: torch 2.14.1's 9.24 was measured as 9.19 (right but at q/k 256 with v 128,
     # no trouble with zero-length sequences): beside 9.19 the newer, alone itself.
     ([(9, 19, 0), (9, 24, 0)], (9, 24, 0)), ([(9, 24, 0)], (9, 24, 0)),
     ([(9, 24, 1), (9, 25, 0)], (9, 24, 1)),
     ([(9, 25, 0)], (9, 25, 0)),  # none measured right installed: the newest unmeasured
     ([(9, 18, 0), (9, 25, 0), (9, 21, 3)], (9, 25, 0)),
     ([(9, 19, 2), (9, 14, 0)], (9, 19, 2)),  # a patch release is its minor release's
     ([(9, 27, 0), (9, 19, 0), (9, 30, 0)], (9, 27, 0)),  # the newest measured right
     ([(9, 28, 1), (9, 27, 0), (9, 28, 0)], (9, 28, 1)),
     ([(9, 17, 9)], None), ([(9, 14, 0), (8, 9, 7)], None),  # never below 9.18
     ([(10, 0, 0)], None), ([(10,)], None), ([None], None), ([], None)],
)  # fmt: skip
def test_auto_chooses_the_newest_measured_right_else_unmeasured_from_9_18(
    versions: List[Optional[V]], chosen: Optional[V]
) -> None:
    builds = [
        cudnn_route.CudnnBuild(f"/x/{i}", v, "wheel", "header") for i, v in enumerate(versions)
    ]
    got = cudnn_route.choose(builds)
    assert (got and got.version) == chosen
    assert all(isinstance(hash(b), int) for b in builds)  # frozen, so hashable


def test_auto_never_chooses_a_build_measured_wrong(measured_wrong_925) -> None:
    build = lambda v: cudnn_route.CudnnBuild("/x", v, "wheel", "header")  # noqa: E731
    assert build((9, 25, 0)).measured == "wrong" and build((9, 25, 5)).measured == "wrong"
    assert cudnn_route.choose([build((9, 25, 0))]) is None
    assert cudnn_route.choose([build((9, 25, 0)), build((9, 19, 0))]).version == (9, 19, 0)
    assert cudnn_route.choose([build((9, 25, 0)), build((9, 26, 0))]).version == (9, 26, 0)


@pytest.mark.parametrize(
    "version, fixed",
    [((9, 17, 9), False), ((9, 18, 0), True), ((9, 99, 9), True), ((10, 0, 0), False),
     ((10,), False), ((8, 9, 7), False), (None, False)],
)  # fmt: skip
def test_fixed_means_9_18_or_newer_within_cudnn_9(version, fixed: bool) -> None:
    assert cudnn_route.CudnnBuild("/x", version, "wheel", "header").fixed is fixed


# ----------------------------------------------------------------------------- refusals


class _BytesPath(os.PathLike):
    def __fspath__(self) -> bytes:  # type: ignore[override]
        return b"/opt/cudnn"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(where=None), InputTypeError,
         "where: expected 'auto' or a folder path (str or os.PathLike), got NoneType None"),
        (dict(where=123), InputTypeError, "where: expected 'auto' or a folder path (str or "
         "os.PathLike), got int 123"),
        (dict(search_path="x" * 78), InputTypeError, f"single {'x' * 78!r}: wrap"),  # 80: whole
        (dict(where=b"x" * 78), InputTypeError, f"got bytes {repr(b'x' * 78)[:80]}...(81 chars)"),
        (dict(where=_BytesPath()), InputTypeError, "got _BytesPath"),
        (dict(where=" "), InputError, "where: expected 'auto' or a folder path"),
        (dict(where="strict:/opt/cudnn"), InputError, "'strict' and 'strict:FOLDER' are "
         "TE_GQA_FIX_CUDNN's spellings; here strictness is the strict= keyword (default True): "
         "call use_fixed_cudnn('/opt/cudnn', strict=True)"),
        (dict(where="Strict"), InputError, "call use_fixed_cudnn('auto', strict=True)"),
        (dict(search_path="/usr"), InputTypeError, "search_path: expected a list of site "
         "folders (str or os.PathLike), got the single '/usr': wrap one folder in a list "
         "(['/usr'])"),
        (dict(search_path=5), InputTypeError, "search_path: expected a list of site folders"),
        (dict(search_path=["/usr", None]), InputTypeError, "search_path[1]: expected a folder"),
        (dict(where="/opt/cudnn", search_path=["/usr"]), InputError,
         "search_path is only read for where='auto', not for the folder '/opt/cudnn'"),
        (dict(strict="no"), InputTypeError, "strict: expected a bool, got 'no'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named_before_anything_is_tried(
    kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error) as err:
        cudnn_route.use_fixed_cudnn(**{"strict": False, **kwargs})  # not even strict=False hides it
    assert message in str(err.value)
    assert cudnn_route.route_state()["setting"] is None


@pytest.mark.parametrize("where", ["auto", " AUTO "])
def test_auto_without_a_build_it_may_load_names_versions_seen_and_the_pip_install(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """In any case; search_path and a folder as path objects. The message names the call
    the user made, not the environment variable (issue #53)."""
    fb.stub_build(tmp_path / "site" / "nvidia" / "cudnn" / "lib", header_version=(9, 14, 0))
    found = (
        r"^use_fixed_cudnn\('auto'\) found no cuDNN wheel it may load in this environment .*"
        r"seen: 9\.14\.0 wrong \(.*\)\); "
        + re.escape(f"{rules.pip_hint(rules.newest_right().cudnn)} provides one")
    )
    with pytest.raises(CudnnRefused, match=found) as err:
        cudnn_route.use_fixed_cudnn(where, search_path=[tmp_path / "site"])
    assert ENV not in str(err.value)
    assert cudnn_route.route_state()["setting"] == "use_fixed_cudnn('auto')"
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        got = cudnn_route.use_fixed_cudnn(where, strict=False, search_path=[tmp_path / "site"])
    assert got is None
    assert re.search(found[1:], caplog.text)
    assert re.search(found, cudnn_route.route_state()["error"])
    with pytest.raises(CudnnRefused, match=r"cuDNN 9\.14\.0 in .* is below 9\.18"):
        cudnn_route.use_fixed_cudnn(tmp_path / "site" / "nvidia" / "cudnn")


def test_strict_loads_an_unmeasured_build_only_from_a_folder_named(
    builds: Dict[str, Path],
) -> None:
    """Issue #54: strict refuses 9.25 (not measured) found by ``auto``, and tells the way to
    name it in the words the user asked with; nothing is loaded. (Named, it loads:
    test_the_route_at_start_up.)"""
    site_dir = [str(builds["unmeasured"])]
    lib = str(_lib(builds, "unmeasured"))
    asked = {
        "use_fixed_cudnn('auto')": f"use_fixed_cudnn({shown(lib)})",
        f"{ENV}='strict'": f"{ENV}=strict:{lib}",
    }
    for source, naming in asked.items():
        with pytest.raises(CudnnRefused) as err:
            if source.startswith(ENV):
                cudnn_route.route("auto", True, site_dir, source)
            else:
                cudnn_route.use_fixed_cudnn("auto", search_path=site_dir)
        message = str(err.value)
        assert message.startswith(f"{source}: cuDNN 9.25.0 in {lib} was not measured"), message
        assert f"a folder you name ({naming}); nothing was loaded" in message
        assert cudnn_route.route_state()["loaded"] == ()


def test_a_build_measured_wrong_is_never_loaded(
    builds: Dict[str, Path], caplog: pytest.LogCaptureFixture, measured_wrong_925
) -> None:
    """Issue #54: with 9.25 measured wrong (sequences without queries or keys), neither
    ``auto`` (strict or not) nor its folder named (strict or not) loads it."""
    lib = str(_lib(builds, "unmeasured"))
    with pytest.raises(CudnnRefused, match=r"found no cuDNN wheel it may load .*9\.25\.0 wrong"):
        cudnn_route.use_fixed_cudnn("auto", search_path=[str(builds["unmeasured"])])
    wrong = rf"cuDNN 9\.25\.0 in {re.escape(lib)} was measured wrong .* the route never loads it"
    for strict in (True, False):
        source = f"{ENV}='{'strict:' if strict else ''}{lib}'"
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            try:
                assert cudnn_route.route(lib, strict, None, source) is None and not strict
            except CudnnRefused as exc:
                assert strict and re.search(wrong, str(exc))
        assert re.search(wrong, cudnn_route.route_state()["error"])
        assert cudnn_route.route_state()["loaded"] == ()
    assert re.search(wrong, caplog.text)


def _not_elf(lib: Path) -> None:
    (lib / "libcudnn_ops.so.9").write_text("not an ELF file")


REFUSED = {  # case -> (stub build, error, what the message says)
    "not cuDNN": (dict(header_version=(9, 19, 0), symbol=False), CudnnRefused,
                  r"libcudnn\.so\.9 is not a cuDNN \(it exports no cudnnGetVersion\); nothing "
                  "was loaded"),
    "9.14 by header": (dict(header_version=(9, 14, 0)), CudnnRefused,
                       r"cuDNN 9\.14\.0 in .* \(version from its header\) is below 9\.18 or not "
                       r"cuDNN 9: use_fixed_cudnn\(.*\) loads only builds with the upstream "
                       "fix; nothing was loaded"),
    "9.17.9 by file name": (dict(suffix="9.17.9"), CudnnRefused,
                            r"cuDNN 9\.17\.9 .*file name.* below 9\.18"),
    "cuDNN 10": (dict(header_version=(10, 0, 0)), CudnnRefused, r"cuDNN 10\.0\.0 .* not cuDNN 9"),
    "no version, strict": ({}, CudnnRefused,
                           r"can only be learned by loading it .* nothing was loaded"),
    "a file not ELF": (dict(header_version=(9, 19, 0), edit=_not_elf), CudnnLoadError,
                       r"libcudnn_ops\.so\.9 is not an ELF shared library; nothing of cuDNN 9\.19\.0"),
    "a file that fails to load": (dict(header_version=(9, 19, 0)), CudnnLoadError,
                                  r"could not load .*libcudnn_graph\.so\.9 .*0 of 8 files .*"
                                  "would mix builds"),
    "no cuDNN in the folder": (dict(edit=shutil.rmtree), CudnnLoadError,
                               r"expected a folder holding libcudnn\.so\.9"),
    "no libcudnn.so.9, lenient": (dict(edit=lambda lib: (lib / "libcudnn.so.9").rename(
        lib / "libcudnn.so.8")), CudnnLoadError, r"no libcudnn\.so\.9 in .*given"),
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
            cudnn_route.use_fixed_cudnn(str(tmp_path / "given"))
    else:
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            assert cudnn_route.use_fixed_cudnn(str(tmp_path / "given"), strict=False) is None
        assert [r for r in caplog.records if re.search(message, r.getMessage())]
    state = cudnn_route.route_state()
    assert state["loaded"] == () and re.search(message, state["error"])
    if strict:
        with pytest.raises(SetupError, match=r"^use_fixed_cudnn\(.*\) failed: .*" + message):
            cudnn_route.verify_te_cudnn()
    else:
        assert cudnn_route.verify_te_cudnn() is None and state["verified"] is None


@pytest.mark.parametrize("sub", ["", "lib", "lib64", "lib/x86_64-linux-gnu"])
def test_a_given_folder_or_its_lib_folder(tmp_path: Path, sub: str) -> None:
    lib = fb.stub_build(tmp_path / "cudnn" / sub, suffix="9.19.0.56")  # cut to 3 numbers
    build = cudnn_route._resolve_target(str(tmp_path / "cudnn"), None, "test")
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
    assert cudnn_route._header_version(str(tmp_path / "lib")) == expected


def test_only_a_default_search_adds_site_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    lib = fb.stub_build(tmp_path / "site" / "nvidia" / "cudnn" / "lib", suffix="9.19.0")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path / "site")])
    monkeypatch.setattr(sys, "path", [os.fsencode(tmp_path / "site"), *sys.path])  # skipped
    found = [(b.lib_dir, b.version, b.how, b.origin) for b in cudnn_route.find_wheel_builds()]
    assert (str(lib), (9, 19, 0), "file name", "wheel") in found  # no header, no metadata
    assert cudnn_route.find_wheel_builds([str(tmp_path)]) == []


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
    monkeypatch.setattr(cudnn_route, "open", lambda path: io.StringIO(maps), raising=False)
    monkeypatch.setattr(cudnn_route, "_ctypes_version", lambda path: "9.19.0")
    libs = cudnn_route.mapped_cudnn_libraries()
    assert [(lib.version, lib.source) for lib in libs] == [
        ("9.14", "file name"), ("9.19", "real path"), ("9.19.0", "cudnnGetVersion"),
        ("9", "file name"), ("9.20.0.56", "nvidia-cudnn wheel"),
    ]  # fmt: skip
    assert len(set(libs)) == 5  # frozen, so hashable
    monkeypatch.setattr(cudnn_route, "open", lambda path: open(tmp_path / "none"), raising=False)
    assert cudnn_route.mapped_cudnn_libraries() is None  # maps unreadable


@pytest.mark.parametrize(
    "offset, found", [((1 << 20) - 5, True), ((63 << 20) + 9, True), ((64 << 20) + 9, False)]
)
def test_exported_names_within_the_first_64_mib(tmp_path: Path, offset: int, found: bool) -> None:
    """Across a 1 MiB chunk, and not past 64 MiB (sparse files)."""
    with open(tmp_path / "lib.so", "wb") as f:
        f.write(b"\x7fELF")
        f.seek(offset)
        f.write(b"\0cudnnGetVersion\0")
    names = cudnn_route._elf_symbols(str(tmp_path / "lib.so"), (b"cudnnGetVersion", b"x"))
    assert names == ({b"cudnnGetVersion"} if found else set())


@pytest.mark.parametrize(
    "answer, said", [(None, "cudnnGetVersion of {} failed"), ("9.14.0", "{} reports cuDNN 9.14.0")]
)
def test_a_loaded_build_that_answers_wrong_is_refused(
    monkeypatch: pytest.MonkeyPatch, answer: Optional[str], said: str
) -> None:
    """libcudnn.so.9, loaded last, is the file asked and named; the way out names how the
    build was asked for."""
    monkeypatch.setattr(cudnn_route, "_ctypes_version", {"/x/libcudnn.so.9": answer}.__getitem__)
    build = cudnn_route.CudnnBuild("/x", (9, 19, 0) if answer else None, "given", "header")
    with pytest.raises(CudnnRefused, match=re.escape(said.format("/x/libcudnn.so.9"))) as err:
        cudnn_route._check_loaded(build, ["/x/libcudnn_ops.so.9", "/x/libcudnn.so.9"], "ASKED")
    assert str(err.value).endswith("so start a new process without ASKED")


def test_a_new_process_has_no_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's record as a process starts with it, and as _reset_route leaves it."""
    spec = importlib.util.spec_from_file_location(
        "te_gqa_fix._cudnn_route_copy", cudnn_route.__file__
    )
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)  # type: ignore[union-attr]
    spec.loader.exec_module(fresh)  # type: ignore[union-attr]
    cudnn_route._route.update(setting="auto", strict=True, loaded=("x",), seen=("y",), warning="w")
    cudnn_route._reset_route()
    none = dict.fromkeys(
        ("setting", "chosen", "chosen_version", "chosen_measured", "error", "warning",
         "te_cudnn", "verified")
    )  # fmt: skip
    expected = {**none, "strict": False, "loaded": (), "seen": ()}
    assert cudnn_route.route_state() == fresh.route_state() == expected


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
    assert cudnn_route._file_name_version(str(tmp_path)) == expected


@pytest.mark.parametrize(
    "te, strict, outcome",
    [((9, 19, 0), True, True), ((9, 19, 1), True, SetupError), ((9, 19, 1), False, False),
     ((9, 18, 0), False, False), (None, True, SetupError), (None, False, False)],
)  # fmt: skip
def test_verify_compares_major_minor_and_patch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, te, strict: bool, outcome
) -> None:
    """A mismatch fails TE's import when strict, else it is logged (TE imported through the
    route: test_the_route_at_start_up)."""
    build = cudnn_route.CudnnBuild("/x", (9, 19, 0), "wheel", "header")
    cudnn_route._route.update(
        chosen=build, loaded=("/x/libcudnn.so.9",), strict=strict, setting=f"{ENV}='auto'"
    )
    monkeypatch.setattr(cudnn_route, "te_cudnn_version", lambda: te)
    runs = ".".join(map(str, te or ())) or "unknown"
    said = rf"^{ENV}='auto' loaded cuDNN 9\.19\.0 from /x, but Transformer Engine runs cuDNN {runs}"
    if outcome is SetupError:
        with pytest.raises(SetupError, match=said):
            cudnn_route.verify_te_cudnn()
    else:
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            assert cudnn_route.verify_te_cudnn() is outcome
        said = said[1:] + "; the post-pass still guards"
        assert bool(re.search(said, caplog.text)) is not outcome
    assert cudnn_route.route_state()["verified"] is (outcome is True)


def test_te_cudnn_version_never_imports_te(fake_te: Path) -> None:
    assert cudnn_route.te_cudnn_version() is None
    assert "transformer_engine.pytorch" not in sys.modules
    importlib.import_module("transformer_engine.pytorch")
    assert cudnn_route.te_cudnn_version() == (9, 14, 0)


@pytest.mark.parametrize(
    "value, expected",
    [(None, (None, False)), ("", (None, False)), ("off", (None, False)), ("0", (None, False)),
     ("disabled", (None, False)), ("auto", ("auto", False)), (" AUTO ", ("auto", False)),
     ("1", ("auto", False)), ("enable", ("auto", False)), ("Enabled", ("auto", False)),
     ("strict", ("auto", True)), ("/opt/cudnn", ("/opt/cudnn", False)),
     ("strict:/opt/cudnn", ("/opt/cudnn", True)), ("./cudnn", ("./cudnn", False))],
)  # fmt: skip
def test_parse_setting(value: Optional[str], expected: Tuple[Optional[str], bool]) -> None:
    assert cudnn_route.parse_setting(value) == expected


# ----------------------------------------------------------------------------- loading


def python_env(env: Dict[str, str]) -> Dict[str, str]:
    """The environment of :func:`run_python`."""
    first = env.pop("PYTHONPATH_FIRST", "")
    return child_env(first, SRC, drop=("TE_GQA_FIX", "FAKE_TE"), **env)


def run_python(code: str, env: Dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in ``tmp_path`` that processes no installed start-up
    file, ``src`` importable (after the paths of ``env["PYTHONPATH_FIRST"]``), no
    TE_GQA_FIX* or FAKE_TE* variable but ``env``'s."""
    return run_code(code, python_env(env), tmp_path, no_site=True)


GLOBAL_VERSION = (
    "import ctypes\n"
    "fn = ctypes.CDLL(None).cudnnGetVersion; fn.restype = ctypes.c_size_t\n"
    "print('GLOBAL', fn())\n"
)


@pytest.mark.parametrize("preload", [True, False])
def test_the_first_global_copy_wins(builds: Dict[str, Path], tmp_path: Path, preload: bool) -> None:
    """What the route relies on: loaded first, the build answers even after the system copy
    is loaded by path, as TE's loader does; without it the system copy does."""
    system = builds["system"] / "lib" / "libcudnn.so.9"
    code = (
        "import ctypes, os\n"
        + (
            "from te_gqa_fix.cudnn_route import use_fixed_cudnn\n"
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
    fixed = _lib(builds, "fixed")
    files = [str(fixed / f"{n}.so.9") for n in ("libcudnn", *fb.SUB_LIBRARIES[:3])]
    code = (
        "import ctypes\nfrom te_gqa_fix import cudnn_route\n"
        "from te_gqa_fix.errors import CudnnAlreadyLoaded\n"
        f"print('ASKED', cudnn_route._ctypes_version({files[0]!r}))\n"
        f"for path in {files!r}:\n"
        "    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)\n"
        "    if path != " + repr(files[0]) + ":\n"
        "        try:\n"
        f"            cudnn_route.use_fixed_cudnn({str(_lib(builds, 'unmeasured'))!r})\n"
        "        except CudnnAlreadyLoaded as exc:\n"
        "            print('REFUSED', str(exc).split('), so')[0])\n"
        f"print('ASKED', cudnn_route._ctypes_version({files[0]!r}))\n"
        f"cudnn_route.use_fixed_cudnn({str(fixed)!r})\nprint('SAME OK')\n"
    )
    proc = run_python(code, {}, tmp_path)
    refused = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED")]
    shown = [(r.count(str(fixed)), r.endswith(" ...")) for r in refused]
    assert shown == [(2, False), (3, False), (3, True)], proc.stdout + proc.stderr
    assert "ASKED None" in proc.stdout and "ASKED 9.19.0" in proc.stdout
    assert "SAME OK" in proc.stdout
    assert issubclass(CudnnAlreadyLoaded, RuntimeError)


@pytest.mark.skipif(fb.compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize(
    "version, suffix, strict, printed",
    [
        # no version on disk: loaded (not strict), then asked; not measured: said so
        ((9, 21, 0), "9", False, "VERSION (9, 21, 0) cudnnGetVersion 9.21.0 unmeasured "
         "{asked} loaded cuDNN 9.21.0 from {lib}, a build that was not "
         "measured: the post-pass stays on for it"),
        ((9, 14, 0), "9", False, "NONE cuDNN 9.14.0 in {lib} (version from its cudnnGetVersion) "
         "is below 9.18 or not cuDNN 9: {asked} loads only builds with the "
         "upstream fix (learned by loading it); it is loaded in this process now, so start a "
         "new process without {asked}"),
        # a file name that lies: found out once loaded, said so
        ((9, 14, 0), "9.19.0", True, "RAISED {lib}/libcudnn.so.9 reports cuDNN 9.14.0, not the "
         "9.19.0 its file name names; it is loaded in this process now"),
    ],
)  # fmt: skip
def test_a_version_learned_by_loading_is_checked(
    tmp_path: Path, version: Tuple[int, int, int], suffix: str, strict: bool, printed: str
) -> None:
    lib = fb.write_libs(tmp_path / "given" / "lib", version, suffix=suffix, subs=False)
    code = (
        "import logging, sys\nfrom te_gqa_fix import cudnn_route\n"
        "logging.basicConfig(stream=sys.stdout, format='WARN %(message)s')\n"
        "try:\n"
        f"    b = cudnn_route.use_fixed_cudnn({str(lib.parent)!r}, strict={strict})\n"
        "except LookupError as exc:\n    print('RAISED', exc)\nelse:\n"
        "    state = cudnn_route.route_state()\n"
        "    print(*(('VERSION', b.version, b.how, state['chosen_version'], "
        "state['chosen_measured'], state['warning']) if b else ('NONE', state['error'])))\n"
    )
    proc = run_python(code, {}, tmp_path)
    asked = f"use_fixed_cudnn({shown(str(lib.parent))})"
    assert printed.format(lib=lib, asked=asked) in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- start-up hook


def _hook_env(builds: Dict[str, Path], tmp_path: Path, wheels: tuple, **env: str) -> Dict[str, str]:
    fake = fb.loader_te(tmp_path / "fake_te")
    site_dir = tmp_path / "site_dir"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(PTH, site_dir / PTH.name)
    return {
        # wheel builds are on sys.path, as an environment's site-packages is
        "PYTHONPATH_FIRST": os.pathsep.join([str(fake), *(str(builds[w]) for w in wheels)]),
        "FAKE_TE_SYSTEM_CUDNN": str(builds["system"] / "lib" / "libcudnn.so.9"),
        "SITE_DIR": str(site_dir),
        **env,
    }


PROBE = (
    "import os, site, sys, json, logging\n"
    "logging.basicConfig(level=logging.INFO, format='LOG %(levelname)s %(message)s', stream=sys.stdout)\n"
    "site.addsitedir(os.environ['SITE_DIR'])\n"
    "early = {m: m in sys.modules for m in ('_te_gqa_fix_autopatch', 'te_gqa_fix.settings', "
    "'te_gqa_fix.cudnn_route', 'torch')}\n"
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
    "route = sys.modules['te_gqa_fix.cudnn_route'].route_state() "
    "if 'te_gqa_fix.cudnn_route' in sys.modules else None\n"
    "print('PROBE' + json.dumps(dict(early=early, early_maps=early_maps, te=te, err=err, "
    "maps=mapped(), route=route)))\n"
)

#: (TE_GQA_FIX_CUDNN, the wheel sites installed) -> the cuDNN TE runs, whether the route
#: warns that the post-pass stays on. "{unmeasured}": 9.25's folder.
AT_START_UP = [
    ("auto", ("fixed", "unmeasured"), (9, 19, 0), False),
    ("strict", ("fixed", "unmeasured"), (9, 19, 0), False),
    ("auto", ("unmeasured",), (9, 25, 0), True),
    ("strict:{unmeasured}", ("unmeasured",), (9, 25, 0), True),
    ("{unmeasured}", ("fixed", "unmeasured"), (9, 25, 0), True),
]


@pytest.mark.parametrize(
    "value, wheels, runs, warns",
    AT_START_UP,
    ids=["auto", "strict", "auto-unmeasured", "strict:folder", "folder"],
)
def test_the_route_at_start_up(
    builds: Dict[str, Path], tmp_path: Path, value, wheels, runs, warns
) -> None:
    """Issue #54: ``auto`` moves TE onto 9.19 (measured right), not onto the newer 9.25
    (not measured); where 9.25 is the only build installed, ``auto`` loads it with a
    WARNING that the post-pass stays on; a folder named loads it (strict too)."""
    value = value.format(unmeasured=_lib(builds, "unmeasured"))
    proc = run_python(PROBE, _hook_env(builds, tmp_path, wheels, **{ENV: value}), tmp_path)
    _routed_at_start_up(proc, builds, value, runs, warns)


def _start_route_and_patch(folder: Path) -> Optional[background.Job]:
    """``TE_GQA_FIX_CUDNN=enable`` with ``TE_GQA_FIX_AUTOPATCH=1``, both wheel sites
    installed: the patch hook imports torch (seconds), so this child starts when
    collection ends (tests/fakes/background.py)."""
    if fb.compiler() is None:
        return None
    builds = make_builds(folder / "builds")  # compiled once: the fixture then copies them
    env = {ENV: "enable", "TE_GQA_FIX_AUTOPATCH": "1"}
    env = python_env(_hook_env(builds, folder, ("fixed", "unmeasured"), **env))
    cmd, env = python_command(PROBE, env, no_site=True)
    return background.Job(cmd, folder, timeout=300, env=env, cwd=str(folder))


background.STARTERS["route_and_patch"] = _start_route_and_patch


@pytest.fixture(scope="module")
def route_and_patch() -> Tuple[subprocess.CompletedProcess, Dict[str, Path]]:
    job = background.get("route_and_patch")
    if job is None:
        pytest.skip("needs a C compiler")
    proc = job.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, {name: job.folder / "builds" / f"site_{name}" for name in ("fixed", "unmeasured")}


def test_the_route_at_start_up_with_the_patch_too(route_and_patch) -> None:
    """With the patch as well, as a job that wants both (the patch hook fires on a fake TE
    without the symbol), the route still loads its build before TE."""
    proc, builds = route_and_patch
    _routed_at_start_up(proc, builds, "enable", (9, 19, 0), False)


def _routed_at_start_up(
    proc: subprocess.CompletedProcess, builds: Dict[str, Path], value: str, runs, warns: bool
) -> None:
    """What :data:`PROBE` saw of the route set to ``value``: TE runs ``runs`` from the site
    it was loaded from, said as ``warns`` says."""
    out = probed(proc)
    # At start-up only the stdlib hook and the settings are imported, nothing is loaded yet.
    assert out["early"] == {
        "_te_gqa_fix_autopatch": True,
        "te_gqa_fix.settings": True,
        "te_gqa_fix.cudnn_route": False,
        "torch": False,
    }
    assert out["early_maps"] == []
    assert out["te"] == list(runs), proc.stdout + proc.stderr
    route = out["route"]
    assert route["chosen_version"] == cudnn_route.version_str(runs)
    assert route["verified"] is True and route["te_cudnn"] == cudnn_route.version_str(runs)
    assert route["setting"] == f"{ENV}={shown(value)}"
    assert route["chosen_measured"] == ("unmeasured" if warns else "right")
    site_dir = builds["unmeasured" if runs == (9, 25, 0) else "fixed"]
    assert all(p.startswith(str(site_dir)) for p in out["maps"] if "sys" not in p)
    if warns:
        assert "the post-pass stays on" in route["warning"]
        assert f"LOG WARNING {route['warning']}" in proc.stdout
    else:
        assert route["warning"] is None
        assert "LOG INFO loaded cuDNN 9.19.0" in proc.stdout


@pytest.mark.parametrize("wheels", [("old",), ("unmeasured",)])
def test_strict_failure_stays_a_failure_on_every_import(
    builds: Dict[str, Path], tmp_path: Path, wheels: tuple
) -> None:
    """A strict route that failed once must not let a retried import go on silently; the
    error names the setting as the user gave it (issue #53), and strict refuses 9.25, not
    measured, found by auto (issue #54)."""
    env = _hook_env(builds, tmp_path, wheels, **{ENV: "strict"})
    code = (
        "import os, site\nsite.addsitedir(os.environ['SITE_DIR'])\n"
        "for attempt in (1, 2):\n"
        "    try:\n"
        "        import transformer_engine.pytorch\n"
        "    except ImportError as exc:\n"
        "        print('RAISED', attempt, repr(str(exc)))\n"
        "    else:\n"
        "        print('IMPORTED', attempt)\n"
    )
    proc = run_python(code, env, tmp_path)
    raised = [ln for ln in proc.stdout.splitlines() if ln.startswith("RAISED")]
    assert len(raised) == 2, proc.stdout + proc.stderr
    why = "found no cuDNN wheel it may load" if wheels == ("old",) else "was not measured"
    for line in raised:
        assert f"{ENV}='strict'" in line and why in line and "auto'" not in line, line
        assert "pip install" in line


def test_auto_with_no_build_it_may_load_logs_and_te_keeps_its_cudnn(
    builds: Dict[str, Path], tmp_path: Path
) -> None:
    """Strict: test_strict_failure_stays_a_failure_on_every_import."""
    env = _hook_env(builds, tmp_path, ("old",), **{ENV: "auto"})
    proc = run_python(PROBE, env, tmp_path)
    assert probed(proc)["te"] == [9, 14, 0]
    assert f"{ENV}='auto' found no cuDNN wheel it may load" in proc.stdout
    assert "9.14.0 wrong" in proc.stdout
