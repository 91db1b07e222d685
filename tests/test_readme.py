"""The README's commands are the ones CI runs, and its Python example works."""

import re

from tests.helpers import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def _fenced(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    first_screen = _fenced("bash")[0]
    test_line = next(line for line in first_screen.splitlines() if "pytest" in line)
    test_command = test_line.split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines
    assert "memopt-train" in first_screen.splitlines()[1]


def test_python_example_runs_when_shrunk(tmp_path, monkeypatch):
    example = _fenced("python")[0]
    shrunk = (
        example.replace('backbone="r18"', 'backbone="iresnet_tiny", backbone_options={"input_size": 32}')
        .replace("image_size=112", "image_size=32")
        .replace("max_steps=20", "max_steps=2")
        .replace('precision="bf16-mixed",', 'precision="bf16-mixed", logger=False, enable_checkpointing=False,')
    )
    assert shrunk != example
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(shrunk, "README.md", "exec"), namespace)
    assert namespace["summary"].summary.steps == 2
    assert sum(p.numel() for p in namespace["r200"].parameters()) == 118_833_920


def test_ci_fails_when_pip_check_fails():
    ci_lines = [line.split("#")[0].strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert "set -euo pipefail" in ci_lines
    assert "python -m pip check" in ci_lines  # whole: nothing like `|| true` after it
