"""Start-up time of the apps: ``--help``, ``--cfg job`` and a shell-completion query, against ``import torch``.

Each command runs as a user runs it (the console script beside this interpreter, in a scratch folder), and
the commands take turns: round after round, every command once, so that a busy machine slows all of them
alike. Figures are medians over the rounds, and each is also quoted as a ratio to the median of
``python -c "import torch"`` measured in the same rounds (the target for ``--help``: at most 1.5×). One more
run of each command with ``PYTHONPROFILEIMPORTTIME=1`` tells whether it imported torch at all.
``python -c "import lightning.pytorch"`` is shown for reference: what every app imported before it
could answer, before the apps imported torch and Lightning only once a run starts.

    python benchmarks/claims/cli_startup.py              # 9 rounds, prints the table, writes cli_startup.csv
    python benchmarks/claims/cli_startup.py --runs 15
    python benchmarks/claims/cli_startup.py --table      # the docs table from the CSV
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

TARGET_RATIO = 1.5  # `--help` within 1.5× of `import torch`
BASELINE = "python -c 'import torch'"


@dataclass(frozen=True)
class Command:
    """One command line: the app (or the interpreter), its arguments and the environment it adds."""

    app: str
    command: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def environment(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **dict(self.env), **extra}


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)


def _script(app: str) -> str:
    """The console script of ``app`` installed beside this interpreter (else found on PATH)."""
    beside = Path(sys.executable).with_name(app)
    found = str(beside) if beside.is_file() else shutil.which(app)
    if found:
        return found
    raise SystemExit(f"cli_startup: no `{app}` beside {sys.executable}: `pip install -e .` first")


def _completion(app: str, line: str) -> Command:
    """What the bash function installed by ``APP -sc install=bash`` runs on <TAB> after ``line``."""
    env = (("COMP_LINE", line), ("COMP_POINT", str(len(line))))
    return Command(app, f"completion `{line}`<TAB>", (_script(app), "-sc", "query=bash"), env)


def commands() -> list[Command]:
    python = sys.executable
    reference = "python -c 'import lightning.pytorch' (reference)"
    listed = [
        Command("python", BASELINE, (python, "-c", "import torch")),
        Command("python", reference, (python, "-c", "import lightning.pytorch")),
    ]
    for app, completion in (
        ("memopt-train", "memopt-train model=r1"),
        ("memopt-plan", "memopt-plan gp"),
        ("memopt-profile", "memopt-profile profile.m"),
    ):
        script = _script(app)
        listed += [
            Command(app, "--help", (script, "--help")),
            Command(app, "--cfg job", (script, "--cfg", "job")),
            _completion(app, completion),
        ]
    train = _script("memopt-train")
    listed += [Command("memopt-train", "--cfg hydra", (train, "--cfg", "hydra"))]
    listed += [Command("memopt-train", "--info", (train, "--info"))]
    listed += [Command(app, "--help", (_script(app), "--help")) for app in ("memopt-export", "memopt-pack-faces")]
    return listed


def run_once(command: Command, cwd: Path) -> float:
    """Wall seconds of one run of ``command``; a failed run stops the benchmark."""
    start = time.perf_counter()
    result = subprocess.run(command.argv, cwd=cwd, env=command.environment(), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"cli_startup: `{command.command}` of {command.app} failed:\n{result.stderr[-2000:]}")
    return seconds


def imports_torch(command: Command, cwd: Path) -> bool:
    """Whether ``command`` imports torch (Python's import-time report, in an extra untimed run)."""
    env = command.environment(PYTHONPROFILEIMPORTTIME="1")
    result = subprocess.run(command.argv, cwd=cwd, env=env, capture_output=True, text=True)
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time")]
    return "torch" in {line.rsplit("|", 1)[-1].strip() for line in lines}


def table(path: Path) -> str:
    """The docs table: median seconds and the ratio to ``import torch`` per app and command."""
    lines = [
        [
            f"`{row['app']}`" if row["app"] != "python" else "",
            row["command"],
            f"{float(row['median_s']):.2f}",
            f"{float(row['ratio_to_import_torch']):.2f}×",
            row["imports_torch"],
        ]
        for row in read_rows(path)
    ]
    return markdown_table(["app", "command", "median s", "÷ `import torch`", "imports torch"], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--runs", type=int, default=9, help="rounds; every command runs once a round")
    args = parser.parse_args()
    listed = commands()
    timings = {command: Timings() for command in listed}
    with tempfile.TemporaryDirectory() as scratch:
        cwd = Path(scratch)
        for command in listed:  # a first run of each, untimed: files in the page cache
            run_once(command, cwd)
        for round_ in range(args.runs):
            order = listed if round_ % 2 == 0 else listed[::-1]  # no command always right after the same one
            for command in order:
                timings[command].seconds.append(run_once(command, cwd))
            print(f"round {round_ + 1}/{args.runs} done", flush=True)
        torch_imported = {command: imports_torch(command, cwd) for command in listed}
    baseline = statistics.median(timings[listed[0]].seconds)
    rows = []
    for command in listed:
        seconds = timings[command].seconds
        median = statistics.median(seconds)
        rows.append(
            {
                "app": command.app,
                "command": command.command,
                "runs": len(seconds),
                "median_s": round(median, 3),
                "min_s": round(min(seconds), 3),
                "max_s": round(max(seconds), 3),
                "ratio_to_import_torch": round(median / baseline, 3),
                "imports_torch": "yes" if torch_imported[command] else "no",
            }
        )
    write_csv(args.csv, rows)
    print(table(Path(args.csv)))
    helps = [row for row in rows if row["command"] == "--help"]
    slow = [row["app"] for row in helps if row["ratio_to_import_torch"] > TARGET_RATIO]
    print(
        f"--help within {TARGET_RATIO}× of `import torch` ({baseline:.2f} s): "
        f"{len(helps) - len(slow)} of {len(helps)} apps" + (f"; not: {', '.join(slow)}" if slow else "")
    )


if __name__ == "__main__":
    main()
