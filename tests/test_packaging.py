"""What is installed is the product (issue 44 item 15, review 2026-11-27 finding 10): the wheel holds
the library, its Prefect flows and tasks (and `examples`, which the tool-calling example's
documented run imports), never `infra`, and the demo prompts as package data that config/bundled.py
finds from wherever the wheel is installed. Built offline from a copy of the project's files."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("generation_core", "flows", "tasks")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel --no-deps` over a copy of the project (infra/ and tests/ included, so the wheel
    leaves them out by its own rules), offline, into a temporary folder."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy(REPO / "pyproject.toml", source)
    for folder in (*PRODUCT, "examples", "infra", "tests"):
        shutil.copytree(REPO / folder, source / folder, ignore=IGNORED)
    dist = tmp_path_factory.mktemp("dist")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet"]
    subprocess.run([*pip, "--wheel-dir", str(dist), str(source)], check=True, timeout=240)
    (built,) = dist.glob("genrun-*.whl")
    return built


def _source_files(package: str) -> set[str]:
    root = REPO / package
    return {
        str(path.relative_to(REPO))
        for path in root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.mark.timeout(300)
def test_the_wheel_holds_the_product_packages_and_every_file_they_need(wheel):
    """Issue 44 item 15: before, the wheel had `infra` as a package and no demo prompts (they lay
    in examples/data, found through the checkout's folder): a wheel install ran no demo."""
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {*PRODUCT, "examples"}
    # Every file of the product, its package data included (a folder without __init__.py, or a
    # data file package-data misses, would be left out of the wheel and found only in a checkout).
    for package in PRODUCT:
        assert {name for name in names if name.startswith(f"{package}/")} == _source_files(package)
    assert "generation_core/config/demo_prompts.parquet" in names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "genrun = flows.cli:run" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.timeout(300)
def test_the_demo_prompts_are_found_from_the_installed_wheel(wheel, tmp_path):
    """Issue 44 item 15: the default `data.train_files` (${genrun:bundled_prompts}) resolves to the
    prompts inside the installed package, the same bytes as the project's, with no checkout near."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # The unpacked wheel first on the path: it wins over the editable install of this checkout.
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import generation_core\n"
        "from generation_core.config import bundled\n"
        "from generation_core.config.loading import load_config\n"
        "print(generation_core.__file__)\n"
        "print(bundled.BUNDLED_PROMPTS)\n"
        "print(load_config([]).data.train_files)\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = subprocess.run(
        [sys.executable, "-c", probe, str(site)], cwd=elsewhere, capture_output=True, text=True, timeout=120
    )
    assert found.returncode == 0, found.stderr
    package, prompts, train_files = found.stdout.split()
    installed = site / "generation_core" / "config" / "demo_prompts.parquet"
    assert package == str(site / "generation_core" / "__init__.py")
    assert prompts == train_files == str(installed)
    assert installed.read_bytes() == (REPO / "generation_core" / "config" / "demo_prompts.parquet").read_bytes()
