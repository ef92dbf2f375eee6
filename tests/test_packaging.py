"""What the built wheel and sdist ship, and what a fresh install of the wheel offers.

The wheel is built in-process with hatchling (the build backend) and installed with pip into
a folder of its own; a subprocess without site-packages then imports it from there alone.
"""

from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hatchling.builders.wheel import WheelBuilder

    out = tmp_path_factory.mktemp("dist")
    return Path(
        next(iter(WheelBuilder(str(ROOT)).build(directory=str(out), versions=["standard"])))
    )


def _version() -> str:
    text = (ROOT / "src" / "te_gqa_fix" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M)[1]  # type: ignore[index]


def test_the_wheel_ships_the_package_start_up_files_license_and_typing(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = f"te_gqa_fix-{_version()}.dist-info"
    for name in (
        "te_gqa_fix/__init__.py",
        "te_gqa_fix/py.typed",
        "_te_gqa_fix_autopatch.py",
        "te_gqa_fix_autopatch.pth",
        "te_gqa_fix_autopatch.start",
        f"{dist_info}/licenses/LICENSE",
    ):
        assert name in names, name
    assert not [n for n in names if n.startswith(("tests/", "evidence/", "benchmarks/"))]
    assert "te_gqa_fix/testing.py" not in names  # the test harness lives in tests/
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA"))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["Version"] == _version()
    # Issue #53: the .start file sits next to the .pth at the root of site-packages, as the
    # hook module does, each byte for byte as in src (what they say: tests/test_startup.py).
    top = {n for n in names if "/" not in n}
    assert top == {
        "te_gqa_fix_autopatch.pth",
        "te_gqa_fix_autopatch.start",
        "_te_gqa_fix_autopatch.py",
    }
    for name in top:
        assert zipfile.ZipFile(wheel).read(name) == (ROOT / "src" / name).read_bytes(), name


def test_the_sdist_ships_the_license(tmp_path: Path) -> None:
    from hatchling.builders.sdist import SdistBuilder

    sdist = next(iter(SdistBuilder(str(ROOT)).build(directory=str(tmp_path))))
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    assert any(n.endswith("/LICENSE") for n in names)
    assert any(n.endswith("/CHANGELOG.md") for n in names)


def test_a_fresh_install_of_the_wheel_offers_the_version_and_every_exception(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        check=True,
    )  # fmt: skip
    probe = (
        "import json, sys, os\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "import te_gqa_fix\n"
        "from te_gqa_fix import (TeGqaFixError, InputError, InputTypeError, OffsetsError,\n"
        "    SettingError, UnrepairableConfiguration, SetupError, CudnnRefused,\n"
        "    CudnnLoadError, CudnnAlreadyLoaded)\n"
        "errors = [InputError, InputTypeError, OffsetsError, SettingError,\n"
        "    UnrepairableConfiguration, SetupError, CudnnRefused, CudnnLoadError,\n"
        "    CudnnAlreadyLoaded]\n"
        "assert all(issubclass(e, TeGqaFixError) for e in errors)\n"
        "assert issubclass(InputError, ValueError) and issubclass(SetupError, ImportError)\n"
        "pkg = os.path.dirname(te_gqa_fix.__file__)\n"
        "print(json.dumps({'version': te_gqa_fix.__version__, 'file': te_gqa_fix.__file__,\n"
        "    'typed': os.path.isfile(os.path.join(pkg, 'py.typed')),\n"
        "    'torch': 'torch' in sys.modules}))\n"
    )
    # -S: no site-packages, so the editable checkout cannot answer for the wheel.
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe], capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    got = json.loads(out.stdout)
    assert got["file"].startswith(str(target))
    assert got == {**got, "version": _version(), "typed": True, "torch": False}
    licenses = list(target.glob("te_gqa_fix-*.dist-info/licenses/LICENSE"))
    assert licenses and "Apache License" in licenses[0].read_text()
