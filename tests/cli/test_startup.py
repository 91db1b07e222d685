"""The apps start without torch: `--help`, `--cfg job`, `--info` and shell completion answer before torch loads.

Each check runs in a fresh interpreter (this process has torch loaded long ago) and looks at ``sys.modules``
when it ends.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import TINY_FACE, run_memopt_train, run_python

HEAVY = ("torch", "lightning")  # what an app must not import before its run starts

# app -> (module, a completion query and a suggestion it must give)
HYDRA_APPS = {
    "memopt-train": ("lightning_memopt.cli.train", "memopt-train model=r1", "model=r18"),
    "memopt-plan": ("lightning_memopt.cli.plan", "memopt-plan model=r1", "model=r18"),
    "memopt-profile": ("lightning_memopt.cli.profile", "memopt-profile profile.m", "profile.mode="),
}
ARGPARSE_APPS = {"memopt-export": "lightning_memopt.cli.export", "memopt-pack-faces": "lightning_memopt.cli.pack_faces"}

# Runs an app's entry point as its console script does, then prints the heavy modules it left in sys.modules.
_RUN_APP = """
import atexit, importlib, json, sys
app, module, *args = sys.argv[1:]
atexit.register(lambda: print("\\nHEAVY=" + json.dumps([m for m in {heavy!r} if m in sys.modules]), file=sys.stderr))
sys.argv = [app, *args]
importlib.import_module(module).main()
"""


def run_app(app: str, module: str, args: list[str], cwd: Path) -> tuple[int, str, list[str]]:
    """Exit status, stdout and the heavy modules imported of ``app args`` in a fresh interpreter."""
    result = run_python(["-c", _RUN_APP.format(heavy=HEAVY), app, module, *args], cwd, timeout=120)
    marker = [line for line in result.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker, result.stderr[-3000:]
    return result.returncode, result.stdout, json.loads(marker[-1].removeprefix("HEAVY="))


def imported_heavy(statement: str, cwd: Path) -> list[str]:
    """The heavy modules in ``sys.modules`` after running ``statement`` in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = run_python(["-c", code], cwd, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module",
    [
        "lightning_memopt",
        "lightning_memopt.cli.config",
        "lightning_memopt.cli.errors",
        *(module for module, _, _ in HYDRA_APPS.values()),
        "lightning_memopt.cli.export",
        "lightning_memopt.cli.pack_faces",
    ],
)
def test_importing_an_app_module_imports_neither_torch_nor_lightning(module, tmp_path):
    assert imported_heavy(f"import {module}", tmp_path) == []


@pytest.mark.parametrize("app", sorted(HYDRA_APPS))
def test_help_config_and_completion_of_a_hydra_app_do_not_import_torch(app, tmp_path, monkeypatch):
    module, query, suggestion = HYDRA_APPS[app]
    status, out, heavy = run_app(app, module, ["--help"], tmp_path)
    assert (status, heavy) == (0, []) and "== Configuration groups ==" in out and "model: " in out
    status, out, heavy = run_app(app, module, ["--cfg", "job"], tmp_path)
    assert (status, heavy) == (0, []) and f"task_name: {app.removeprefix('memopt-')}" in out
    status, out, heavy = run_app(app, module, ["--cfg", "hydra", "model=r50"], tmp_path)
    assert (status, heavy) == (0, []) and "model=r50" in out and "job_logging:" in out
    status, out, heavy = run_app(app, module, ["--info"], tmp_path)
    assert (status, heavy) == (0, []) and "Defaults Tree" in out
    with monkeypatch.context() as env:  # what the installed bash function passes
        env.setenv("COMP_LINE", query)
        status, out, heavy = run_app(app, module, ["-sc", "query=bash"], tmp_path)
    assert (status, heavy) == (0, []) and suggestion in out.split()
    status, out, heavy = run_app(app, module, ["-sc", "install=bash"], tmp_path)
    assert (status, heavy) == (0, []) and f"complete -o nospace -o default -F hydra_bash_completion {app}" in out
    assert not list(tmp_path.iterdir()), "no run directory for a question that runs nothing"


@pytest.mark.parametrize("app", ["memopt-export", "memopt-pack-faces"], ids=["export", "pack-faces"])
def test_help_of_an_argparse_app_does_not_import_torch(app, tmp_path):
    status, out, heavy = run_app(app, ARGPARSE_APPS[app], ["--help"], tmp_path)
    assert (status, heavy) == (0, []) and f"usage: {app}" in out


def test_the_console_script_answers_help_without_torch(tmp_path):
    script = Path(sys.executable).with_name("memopt-train")
    if not script.is_file():
        pytest.skip("memopt-train is not installed beside this interpreter")
    result = run_python(["-X", "importtime", str(script), "--help"], tmp_path, timeout=120)
    assert result.returncode == 0 and "== Configuration groups ==" in result.stdout, result.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")
    }
    assert "lightning_memopt.cli.train" in imported and not imported & set(HEAVY)


@pytest.mark.slow
def test_lightning_learns_the_strategy_names_whichever_is_imported_first(tmp_path):
    assert (
        imported_heavy("import lightning_memopt\nassert 'lightning_memopt.strategies' not in sys.modules", tmp_path)
        == []
    )
    check = (
        "import warnings\nwarnings.simplefilter('error', UserWarning)\n{first}\n{second}\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "names = ('ddp_memopt', 'ddp_powersgd', 'ddp_fp16_compress', 'ddp_bf16_compress', 'fsdp_memopt')\n"
        "assert all(name in StrategyRegistry for name in names), sorted(StrategyRegistry)\n"
        "import lightning.pytorch as pl\n"
        "trainer = pl.Trainer(strategy='ddp_powersgd', accelerator='cpu', devices=1, logger=False)\n"
        "assert type(trainer.strategy).__name__ == 'MemoptDDPStrategy', trainer.strategy"
    )
    orders = (
        ("import lightning_memopt", "import lightning"),
        ("import lightning", "import lightning_memopt"),
        # a module of the package that loads Lightning while it is itself half imported (found by CI's run)
        ("import lightning_memopt.checkpointing", "pass"),
        ("import lightning_memopt.callbacks", "pass"),
    )
    for first, second in orders:
        assert imported_heavy(check.format(first=first, second=second), tmp_path) == ["torch", "lightning"]
    # Lightning alone does not know them: the names come from this package
    alone = "from lightning.pytorch.strategies import StrategyRegistry\nassert 'ddp_powersgd' not in StrategyRegistry"
    assert imported_heavy(alone, tmp_path) == ["torch", "lightning"]


def test_the_public_names_are_listed_and_resolve_and_others_are_attribute_errors(tmp_path):
    statement = (
        "import lightning_memopt\n"
        "assert set(lightning_memopt.__all__) <= set(dir(lightning_memopt)), dir(lightning_memopt)\n"
        "try:\n"
        "    lightning_memopt.no_such_name\n"
        "except AttributeError as error:\n"
        "    assert str(error) == \"module 'lightning_memopt' has no attribute 'no_such_name'\"\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
        "assert not hasattr(lightning_memopt, 'MemoryMonitorr') and lightning_memopt.__version__\n"
    )
    assert imported_heavy(statement, tmp_path) == []  # an unknown name imports nothing
    statement += (
        "from lightning_memopt import *\n"
        "from lightning_memopt.callbacks import MemoryMonitor as direct\n"
        "assert MemoryMonitor is direct and callable(plan) and 'r18' in list_models()\n"
        "from lightning_memopt import train\n"  # a submodule, not a public name
        "assert train.__name__ == 'lightning_memopt.train'\n"
    )
    assert imported_heavy(statement, tmp_path) == ["torch", "lightning"]


def test_telling_a_bad_input_from_a_fault_does_not_import_torch(tmp_path):
    statement = (
        "from lightning_memopt.cli.errors import describe, _input_error\n"
        "assert describe(ValueError('`batch_size` must be ≥ 1')) == '`batch_size` must be ≥ 1'\n"
        "assert _input_error(KeyError('x'), building=False) is None\n"
    )
    assert imported_heavy(statement, tmp_path) == []


def test_lightning_log_lines_reach_the_job_log_once_each(tmp_path):
    result = run_memopt_train([*TINY_FACE, "logger=none"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (log,) = tmp_path.glob("logs/train/runs/*/train.log")  # Hydra's job log: <run dir>/<job name>.log
    text = log.read_text()
    console = result.stdout + result.stderr
    for line in (
        "GPU available: False",  # Lightning's, at Trainer construction
        "`Trainer.fit` stopped: `max_steps=2` reached.",  # Lightning's, at the end of the fit
        "memopt-train: model=FaceRecognitionModule data=SyntheticFaceDataModule",  # ours, with rank_zero_info
    ):
        assert text.count(line) == 1, text
        assert console.count(line) == 1, console[-3000:]
