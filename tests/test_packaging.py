"""Packaging: a regular install works outside the checkout; the sdist and the wheel carry what a release needs."""

import configparser
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile

import pytest

from tests.helpers import REPO_ROOT, TINY_FACE


@pytest.mark.slow
def test_non_editable_install_runs_memopt_train_from_any_directory(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(
        REPO_ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", "logs", "outputs", "*.egg-info", "build", "__pycache__"),
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert any(name.endswith(".dist-info/licenses/LICENSE") for name in archive.namelist())
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", *wheels.glob("*.whl")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    shutil.rmtree(source)  # the installed copy must not need the checkout
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    result = subprocess.run(
        [env_dir / "bin" / "memopt-train", *TINY_FACE],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memopt-train summary" in result.stdout + result.stderr
    located = subprocess.run(
        [python, "-c", "import lightning_memopt.cli.config as c; print(c.config_dir())"],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert located.startswith(str(env_dir)) and located.endswith("lightning_memopt/conf")


def test_setup_cfg_lists_every_package_of_the_library():
    """setup.cfg names packages one by one (conf/ is mapped in): a new sub-package must be added there."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    on_disk = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for init in (REPO_ROOT / "lightning_memopt").rglob("__init__.py")
    }
    assert on_disk | {"lightning_memopt.conf"} == listed


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    return config


def test_every_classifier_is_a_valid_trove_classifier():
    trove = pytest.importorskip("trove_classifiers")
    classifiers = [line.strip() for line in _setup_cfg()["metadata"]["classifiers"].splitlines() if line.strip()]
    assert classifiers
    assert [c for c in classifiers if c not in trove.classifiers] == []


def test_metadata_names_the_license_file_and_the_project_urls():
    metadata = _setup_cfg()["metadata"]
    assert metadata["license"] == "Apache-2.0"
    assert metadata["license_files"].split() == ["LICENSE"]
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    urls = dict(
        (part.strip() for part in line.split("=", 1)) for line in metadata["project_urls"].splitlines() if line.strip()
    )
    assert set(urls) == {"Documentation", "Source", "Changelog", "Issues"}
    assert all(url.startswith("https://github.com/lightning-memopt/lightning-memopt") for url in urls.values())
    assert (REPO_ROOT / "CHANGELOG.md").read_text().count("## [Unreleased]") == 1


def test_sdist_carries_tests_configs_and_docs_and_the_wheel_built_from_it_the_license(tmp_path):
    """``python -m build`` makes the sdist, then the wheel from the unpacked sdist: both must be complete."""
    pytest.importorskip("build")
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(
        REPO_ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", "logs", "outputs", "*.egg-info", "build", "dist", "__pycache__"),
    )
    dist = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    expected = {"LICENSE", "CHANGELOG.md", "README.md", "mkdocs.yml", "tests/conftest.py", "conf/train.yaml"}
    expected |= {
        "docs/index.md",
        "benchmarks/tables.py",
        "benchmarks/claims/precision.csv",
        "benchmarks/README.md",
        ".ci/run",
    }
    assert expected <= names, sorted(expected - names)
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        wheel_names = archive.namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in wheel_names)
    assert "lightning_memopt/conf/train.yaml" in wheel_names
