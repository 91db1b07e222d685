"""A regular (non-editable) install ships the config tree: memopt-train works outside the checkout."""

import shutil
import subprocess
import sys
import venv

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
