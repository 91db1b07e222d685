"""Every benchmark table of the README and the docs, generated from the committed CSVs.

    python benchmarks/tables.py            # rewrite every marked table from its CSV
    python benchmarks/tables.py --check    # exit 1 and list the tables that differ from their CSV
    python benchmarks/tables.py --print precision.csv    # print one table (a registry key)
    python benchmarks/tables.py --list     # the registry: each key, its function, where it is used

A table sits between two markers in a Markdown file (README.md, docs/**/*.md)::

    <!-- table: precision.csv -->

    | preset | ... |

    <!-- /table -->

The marker names a registry key: a CSV in ``benchmarks/``, optionally followed by a variant name
(``<!-- table: memory_profile.csv highlights -->``). ``REGISTRY`` maps each key to the function that
turns the CSV into the table: ``"script:function"`` (a benchmark script beside this file, imported
only when its table is rendered) or a function of this module. A new benchmark's table is one entry.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(HERE) not in sys.path:  # the scripts import their sibling ``results``
    sys.path.insert(0, str(HERE))

from results import markdown_table, read_rows  # noqa: E402  (needs the path above)

Renderer = Callable[[Path], str]


def memory_profile_highlights(path: Path) -> str:
    """The README's short table: the largest preset of each family, fp32 and bf16-mixed peaks."""
    rows = {(row["preset"], row["precision"]): row for row in read_rows(path)}
    lines = [
        [
            preset,
            rows[(preset, "fp32")]["batch"],
            f"{float(rows[(preset, 'fp32')]['peak_gib']):.1f}",
            f"{float(rows[(preset, 'bf16-mixed')]['peak_gib']):.1f}",
        ]
        for preset in ("r100", "sapiens_2b", "cotracker2", "cotracker3")
    ]
    return markdown_table(["preset (reference batch)", "batch", "fp32 peak GiB", "bf16-mixed peak GiB"], lines)


def activation_checkpointing_highlights(path: Path) -> str:
    """The README's short table: per model, the activations without checkpointing and what each policy saves on
    the CPU (offload is left out: on a CPU device the host is the device, and no GPU has measured its saving)."""
    by_model: dict[str, dict[str, dict[str, str]]] = {}
    for row in read_rows(path):
        by_model.setdefault(row["model"], {})[row["policy"]] = row
    lines = []
    for model, policies in by_model.items():
        cells = [model, f"{float(policies['none']['activation_peak_mib']) / 1024:.1f}"]
        for policy in ("full", "selective", "budget=0.5"):
            row = policies[policy]
            cells.append(f"{float(row['reduction']):.1f}× less at {float(row['step_time_ratio']):.2f}× time")
        lines.append(cells)
    columns = ["model (fp32, CPU)", "activations GiB", "full checkpointing", "selective", "knapsack at ½"]
    return markdown_table(columns, lines)


# key (a CSV in benchmarks/, optionally a variant) -> the function that renders its table
REGISTRY: dict[str, str | Renderer] = {
    "memory_profile.csv": "memory_profile:table",
    "memory_profile.csv highlights": memory_profile_highlights,
    "memory_monitor_overhead.csv": "memory_profile:overhead_table",
    "model_state.csv": "model_state:table",
    "sharded_cpu_memory.csv": "sharded_cpu_memory:table",
    "activation_checkpointing.csv": "activation_checkpointing:table",
    "activation_checkpointing.csv highlights": activation_checkpointing_highlights,
    "foreign_models.csv": "foreign_models:table",
    "official_checkpoints.csv": "official_checkpoints:table",
    "fake_vs_real.csv": "fake_vs_real:table",
    "precision.csv": "precision:table",  # activations from memory_profile.csv, times from precision.csv
    "adaptive_accumulation.csv": "adaptive_accumulation:table",
    "knn_eval.csv": "knn_eval:table",
    "topo_loss.csv": "topo_loss:table",
    "ddp_compression.csv": "ddp_compression:table",
    "plan_vs_sweep.csv": "plan_vs_sweep:budget_table",
    "exact_resume.csv": "exact_resume:table",
    "bad_inputs.csv": "bad_inputs:table",
    "concurrent_rows.csv": "concurrent_rows:table",
    "cli_startup.csv": "cli_startup:table",
    "compile_budget.csv": "compile_budget:table",
    "gpu_truth.csv": "gpu_truth:table",
    "gpu_truth_h100.csv": "gpu_truth:table",
    "host_overhead.csv": "host_overhead:table",
    "cost_model_h200.csv": "cost_model_h200:table",
    "memory_h200.csv": "memory_h200:table",  # once a GPU session commits it (python benchmarks/gpu_truth.py)
}

MARKER = re.compile(r"<!-- table: (?P<key>[\w.-]+\.csv(?: [\w-]+)?) -->\n(?P<body>.*?)<!-- /table -->", re.S)


@dataclass(frozen=True)
class Marked:
    """One marked table in a Markdown file."""

    path: Path
    line: int
    key: str
    body: str

    def where(self) -> str:
        return _location(self.path, self.line)


def _location(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}:{line}"


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def documents(root: Path = REPO_ROOT) -> list[Path]:
    """The Markdown files whose tables are generated: the README and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def renderer(key: str, registry: dict[str, str | Renderer] | None = None) -> Renderer:
    """The function that renders the table of ``key``; a ``"script:function"`` entry is imported now."""
    registry = REGISTRY if registry is None else registry
    if key not in registry:
        raise KeyError(f"no table is registered as {key!r}; registered: {', '.join(registry)}")
    entry = registry[key]
    if callable(entry):
        return entry
    script, function = entry.split(":")
    return getattr(_benchmark_script(script), function)


def _benchmark_script(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py``, loaded by its path: a module of the same name elsewhere on
    ``sys.path`` (``tests/foreign_models.py``) is never taken for it."""
    qualified = f"benchmarks.{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


def csv_path(key: str, benchmarks: Path = HERE) -> Path:
    """The CSV a key names (its first word), in ``benchmarks``."""
    return benchmarks / key.split()[0]


def render(key: str, benchmarks: Path = HERE, registry: dict[str, str | Renderer] | None = None) -> str:
    """The Markdown table of ``key``, from its CSV."""
    return renderer(key, registry)(csv_path(key, benchmarks)).strip()


def marked_tables(paths: Iterable[Path]) -> list[Marked]:
    """Every marked table in ``paths``, in order."""
    found = []
    for path in paths:
        text = path.read_text()
        for match in MARKER.finditer(text):
            found.append(Marked(path, _line(text, match.start()), match["key"], match["body"]))
    return found


def _block(key: str, table: str) -> str:
    return f"<!-- table: {key} -->\n\n{table}\n\n<!-- /table -->"


def stale(paths: Iterable[Path] | None = None, **options) -> list[str]:
    """``path:line key`` of every marked table that differs from what its CSV gives (or cannot be rendered)."""
    differing = []
    rendered: dict[str, str] = {}
    for table in marked_tables(documents() if paths is None else paths):
        try:
            expected = rendered.setdefault(table.key, render(table.key, **options))
        except (KeyError, OSError) as error:
            differing.append(f"{table.where()} {table.key}: {_reason(error)}")
            continue
        if table.body.strip() != expected:
            differing.append(f"{table.where()} {table.key}")
    return differing


def rewrite(paths: Iterable[Path] | None = None, **options) -> tuple[list[str], list[str]]:
    """Rewrite every marked table in ``paths`` from its CSV: ``path:line key`` of those that changed, and of those
    that could not be rendered (an unknown key, a missing CSV), which are left as they are."""
    changed: list[str] = []
    failed: list[str] = []
    for path in documents() if paths is None else paths:
        text = path.read_text()

        def replace(match: re.Match[str], path: Path = path, text: str = text) -> str:
            where = f"{_location(path, _line(text, match.start()))} {match['key']}"
            try:
                table = render(match["key"], **options)
            except (KeyError, OSError) as error:
                failed.append(f"{where}: {_reason(error)}")
                return match[0]
            if match["body"].strip() != table:
                changed.append(where)
            return _block(match["key"], table)

        new = MARKER.sub(replace, text)
        if new != text:
            path.write_text(new)
    return changed, failed


def _reason(error: Exception) -> str:
    return error.args[0] if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="list the tables that differ; exit 1 if any")
    action.add_argument("--print", metavar="KEY", help="print the table of one registry key")
    action.add_argument("--list", action="store_true", help="list the registry and where each table is used")
    args = parser.parse_args(argv)
    if args.print:
        try:
            print(render(args.print))
        except KeyError as error:
            parser.exit(2, f"tables.py: `--print`: {_reason(error)}\n")
        return 0
    if args.list:
        used: dict[str, list[str]] = {}
        for table in marked_tables(documents()):
            used.setdefault(table.key, []).append(table.where())
        for key, entry in REGISTRY.items():
            name = entry if isinstance(entry, str) else f"tables:{entry.__name__}"
            print(f"{key:<42}{name:<44}{', '.join(used.get(key, ['(not used)']))}")
        return 0
    if args.check:
        differing = stale()
        for line in differing:
            print(f"differs from its CSV: {line}")
        total = len(marked_tables(documents()))
        print(f"{len(differing)} of {total} tables differ" if differing else f"all {total} tables match their CSVs")
        return 1 if differing else 0
    changed, failed = rewrite()
    for line in changed:
        print(f"rewrote {line}")
    for line in failed:
        print(f"could not render {line}")
    print(f"{len(changed)} tables rewritten" if changed else "every table already matched its CSV")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
