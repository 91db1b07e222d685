"""Every benchmark table and measured figure of the README and the docs, generated from the committed CSVs.

    python benchmarks/tables.py            # rewrite every marked block from its CSV
    python benchmarks/tables.py --check    # exit 1 and list the blocks that differ from their CSV
    python benchmarks/tables.py --print precision.csv    # print one block (a registry key)
    python benchmarks/tables.py --list     # the registry: each key, its function, where it is used

A table sits between two markers in a Markdown file (README.md, docs/**/*.md)::

    <!-- table: precision.csv -->

    | preset | ... |

    <!-- /table -->

and prose that states measured figures the same way, between ``<!-- figures: KEY -->`` and ``<!-- /figures -->``.
The marker names a registry key: a CSV in a wing of ``benchmarks/`` (``claims/``, ``gpu_truth/``, ``calibration/``;
each name is unique across them), optionally followed by a variant name
(``<!-- table: memory_profile.csv highlights -->``). ``REGISTRY`` maps each key to the function that
turns the CSV into the block: ``"module:function"`` (a benchmark module, ``claims.precision``, imported
only when its block is rendered) or a function of this module. A new benchmark's table is one entry.
``--check`` also lists a measured figure typed outside a block in the pages that state results
(:data:`FIGURE_PAGES`): a decimal number with a unit (``3.50×``, ``1.5 min``, ``0.6 GiB``) not marked as a target
(``≤ 1.2×``).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WINGS = ("claims", "gpu_truth", "calibration")  # the folders of benchmarks/ that hold the CSVs
if str(HERE) not in sys.path:  # the benchmarks import the shared tools and each other's wings from here
    sys.path.insert(0, str(HERE))

from bench import Spread, markdown_table, models_by_variant, prose, read_rows  # noqa: E402  (needs the path above)

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
    the CPU (offload is left out: on a CPU device the host is the device, and no GPU has measured its saving); full
    checkpointing's cell adds ``lean``'s where the model has such a row (blocks with a lean recomputation of their
    own). A model timed at a smaller input than its bytes were counted at says so in its label."""
    by_model: dict[str, dict[str, dict[str, str]]] = {}
    for row in read_rows(path):
        by_model.setdefault(row["model"], {})[row["policy"]] = row
    label = importlib.import_module("claims.activation_checkpointing").model_label
    lines = []
    for policies in by_model.values():
        cells = [label(policies["none"]), f"{float(policies['none']['activation_peak_mib']) / 1024:.1f}"]
        for policy in ("full", "selective", "budget=0.5"):
            row = policies[policy]
            cells.append(f"{float(row['reduction']):.1f}× less at {float(row['step_time_ratio']):.2f}× time")
        if "lean" in policies:
            lean = policies["lean"]
            cells[2] += f" (`lean`: {float(lean['reduction']):.1f}× less at {float(lean['step_time_ratio']):.2f}×)"
        lines.append(cells)
    columns = ["model (fp32, CPU)", "activations GiB", "full checkpointing", "selective", "knapsack at ½"]
    return markdown_table(columns, lines)


def gpu_checkpointing_readme(path: Path) -> str:
    """The README's paragraph on checkpointing's time on a GPU: full checkpointing over none as the H200 measured
    it on small steps (``gpu_truth_h200.csv``) and busy ones (``step_time_compute_bound_h200.csv``), and what our
    recomputation costs the host against ``torch.utils.checkpoint`` (``host_overhead.csv``, on the CPU)."""
    small = [
        float(row["ratio"]) for row in read_rows(path) if (row["section"], row["variant"]) == ("step time", "full")
    ]
    busy = [float(row["ratio_over_none"]) for row in _sibling(path, "step_time_compute_bound_h200.csv", "full")]
    host = [float(row["over_torch"]) for row in _sibling(path, "host_overhead.csv", "full")]
    return prose(
        "These ratios are the CPU's, where the arithmetic dominates. On a GPU the host's work (Python, autograd, "
        "dispatch per wrapped block) often sets a step's time: the first CUDA run (NVIDIA H200) measured full "
        f"checkpointing at {min(busy):.2f}–{max(busy):.2f}× on busy steps and up to {max(small):.1f}× on small ones, "
        "with the checkpointing of that day (`torch.utils.checkpoint`); ours now costs the host "
        f"{min(host):.2f}–{max(host):.2f}× what that does (measured on the CPU, where the host's work is the same), "
        "and the planner prices host and device side by side — [checkpointing on a GPU]"
        "(docs/benchmarks.md#checkpointing-on-a-gpu-the-hosts-work-and-the-planner-against-the-h200)."
    )


def precision_h200(path: Path) -> str:
    """The docs' sentence on bf16-mixed's step time on the H200, over 32-true's: at the sizes that keep the GPU busy
    (``step_time_compute_bound_h200.csv``) and at the reduced ones (``gpu_truth_h200.csv``)."""
    variant = "bf16-mixed (32-true = 1)"
    busy = [row for row in read_rows(path) if row["variant"] == variant]
    small = [row for row in _sibling(path, "gpu_truth_h200.csv", variant) if row["section"] == "step time"]
    return prose(
        "The first CUDA run (NVIDIA H200, forward + backward) measured bf16-mixed at "
        + ", ".join(f"{float(row['ratio_over_none']):.2f}× ({row['case']})" for row in busy)
        + " of 32-true's step time where the GPU is busy, and "
        + ", ".join(f"{float(row['ratio']):.2f}× ({row['case']})" for row in small)
        + " at the reduced sizes."
    )


def memory_h200_readme(path: Path) -> str:
    """The README's sentence on the H200's memory: how many steps are predicted within the tolerance, now and
    before the CUDA autocast lists and workspaces, and which are not."""
    rows = read_rows(path)
    reduced = [row for row in rows if "reference batch" not in row["case"]]
    reference = [row for row in rows if "reference batch" in row["case"]]
    now, then = _spread(reduced, "deviation_now"), _spread(reduced, "deviation_then")
    left = [row for row in reduced if abs(float(row["deviation_now"])) > now.tolerance]
    return prose(
        "A prediction for a GPU follows CUDA's autocast op lists and counts the cuBLAS and cuDNN workspaces the "
        f"allocator holds: of the {len(reduced)} reduced-size steps the H200 measured, {now.within} are now "
        f"predicted within {now.tolerance:.0%} of `max_memory_allocated` ({then.within} before; the {len(left)} left "
        f"are {_spread(left, 'deviation_now').range()} off: {models_by_variant(left)}), and "
        f"{_spread(reference, 'deviation_now').of()} reference batches ({_spread(reference, 'deviation_then').within} "
        "before) — [memory on the H200](docs/benchmarks.md#memory-predictions-for-cuda-against-the-h200)."
    )


def gpu_truth_readme(path: Path) -> str:
    """The README's sentence on the H100's run: its predictions against its allocator (the misses named, or said
    to be the H200's), its reference batches, and whether its step times were measured."""
    from lightning_memopt.planner.space import DEFAULT_SAFETY_MARGIN

    rows = read_rows(path)
    predicted = [row for row in rows if row["section"] == "prediction"]
    reference = _spread([row for row in rows if row["section"] == "reference batch"], "deviation")
    spread = _spread(predicted, "deviation")
    missed = [row for row in predicted if row["passed"] == "no"]
    h200 = [row for row in read_rows(_beside(path, "memory_h200.csv")) if "reference batch" not in row["case"]]
    h200_missed = {(row["case"], row["variant"]) for row in h200 if abs(float(row["deviation_now"])) > spread.tolerance}
    if {(row["case"], row["variant"]) for row in missed} == h200_missed:
        misses = f"the same {len(missed)} rows as the H200's"
    else:
        misses = f"missed: {models_by_variant(missed)}"
    failed = [row for row in rows if (row["section"], row["case"]) == ("step time", "the section failed")]
    times = (
        f"its step-time section stopped on an error it found ({failed[0]['variant']}, fixed since), so no GPU "
        "speed figure is claimed yet"
        if failed
        else "its step times are in the run's tables"
    )
    return prose(
        f"An H100 then ran the same predictions against its own allocator: {spread.of()} within "
        f"{spread.tolerance:.0%} ({misses}), {reference.of()} reference batches within {reference.range()}, the "
        f"planner's safety margin (now {DEFAULT_SAFETY_MARGIN:.0%}) from the smallest device each step ran on; "
        f"{times} — [the H100 run](docs/benchmarks.md#the-h100-run-2026-11-27)."
    )


def _sibling(path: Path, name: str, variant: str) -> list[dict[str, str]]:
    """The rows of ``variant`` in the CSV ``name`` (beside ``path``, else in its wing)."""
    return [row for row in read_rows(_beside(path, name)) if row["variant"] == variant]


def _beside(path: Path, name: str) -> Path:
    """The CSV ``name`` beside ``path`` where there is one (a test's folder), else in its wing of benchmarks/."""
    return path.with_name(name) if path.with_name(name).is_file() else csv_path(name)


def _spread(rows: list[dict[str, str]], column: str) -> Spread:
    from gpu_truth.memory import PREDICTION_TOLERANCE  # imports torch: only when a GPU table is rendered

    return Spread(tuple(float(row[column]) for row in rows), PREDICTION_TOLERANCE)


# key (a CSV in a wing, optionally a variant) -> the function that renders its table or figures
REGISTRY: dict[str, str | Renderer] = {
    "memory_profile.csv": "claims.memory_profile:table",
    "memory_profile.csv highlights": memory_profile_highlights,
    "memory_monitor_overhead.csv": "claims.memory_profile:overhead_table",
    "model_state.csv": "claims.model_state:table",
    "sharded_cpu_memory.csv": "claims.sharded_cpu_memory:table",
    "activation_checkpointing.csv": "claims.activation_checkpointing:table",
    "activation_checkpointing.csv highlights": activation_checkpointing_highlights,
    "foreign_models.csv": "claims.foreign_models:table",
    "official_checkpoints.csv": "claims.official_checkpoints:table",
    "fake_vs_real.csv": "claims.fake_vs_real:table",
    "precision.csv": "claims.precision:table",  # activations from memory_profile.csv, times from precision.csv
    "adaptive_accumulation.csv": "claims.adaptive_accumulation:table",
    "knn_eval.csv": "claims.knn_eval:table",
    "topo_loss.csv": "claims.topo_loss:table",
    "ddp_compression.csv": "claims.ddp_compression:table",
    "plan_vs_sweep.csv": "claims.plan_vs_sweep:budget_table",
    "measured_plan.csv": "claims.measured_plan:table",
    "exact_resume.csv": "claims.exact_resume:table",
    "bad_inputs.csv": "claims.bad_inputs:table",
    "concurrent_rows.csv": "claims.concurrent_rows:table",
    "cli_startup.csv": "claims.cli_startup:table",
    "compile_budget.csv": "claims.compile_budget:table",
    "checkpoint_exactness.csv": "claims.checkpoint_exactness:table",
    "compiled_plan.csv": "claims.compiled_plan:table",
    "gpu_truth.csv": "gpu_truth.harness:table",
    "gpu_truth_h100.csv": "gpu_truth.harness:table",
    "host_overhead.csv": "claims.host_overhead:table",
    "cost_model_h200.csv": "calibration.cost_model_h200:table",
    "host_twin.csv": "calibration.host_twin:table",
    "device_work.csv": "claims.device_work:table",
    "memory_h200.csv": "calibration.memory_h200:table",  # a GPU session's (python benchmarks/gpu_truth.py)
    # figures in prose
    "activation_checkpointing.csv targets": "claims.activation_checkpointing:targets",
    "compile_budget.csv targets": "claims.compile_budget:targets",
    "compiled_plan.csv targets": "claims.compiled_plan:targets",
    "cost_model_h200.csv summary": "calibration.cost_model_h200:summary",
    "host_twin.csv summary": "calibration.host_twin:summary",
    "host_overhead.csv prices": "claims.host_overhead:prices",
    "plan_vs_sweep.csv targets": "claims.plan_vs_sweep:targets",
    "measured_plan.csv targets": "claims.measured_plan:targets",
    "fake_vs_real.csv summary": "claims.fake_vs_real:summary",
    "memory_h200.csv summary": "calibration.memory_h200:summary",
    "gpu_truth_h100.csv summary": "gpu_truth.harness:summary",
    "step_time_compute_bound_h200.csv precision": precision_h200,
    "gpu_truth_h200.csv readme": gpu_checkpointing_readme,
    "memory_h200.csv readme": memory_h200_readme,
    "gpu_truth_h100.csv readme": gpu_truth_readme,
}

MARKER = re.compile(
    r"<!-- (?P<kind>table|figures): (?P<key>[\w.-]+\.csv(?: [\w-]+)?) -->\n(?P<body>.*?)<!-- /(?P=kind) -->", re.S
)
FIGURE_PAGES = ("README.md", "docs/benchmarks.md")  # the pages that state results: no figure typed outside a block
# a decimal with a unit of measurement, unless a target (after ≤ ≥ < >): 3.50×, 1.5 min, 0.6 GiB, 12.5 %
TYPED_FIGURE = re.compile(r"(?<![≤≥<>\d.])(?<![≤≥<>] )\d+\.\d+ ?(?:×|%|[KMG]iB\b|GB\b|ms\b|s\b|min\b|minutes\b)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


@dataclass(frozen=True)
class Marked:
    """One marked block (a table, or prose with figures) in a Markdown file."""

    path: Path
    line: int
    kind: str
    key: str
    body: str

    def where(self) -> str:
        return _location(self.path, self.line)


def _location(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}:{line}"


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def documents(root: Path = REPO_ROOT) -> list[Path]:
    """The Markdown files whose blocks are generated: the README and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def renderer(key: str, registry: dict[str, str | Renderer] | None = None) -> Renderer:
    """The function that renders the block of ``key``; a ``"script:function"`` entry is imported now."""
    registry = REGISTRY if registry is None else registry
    if key not in registry:
        raise KeyError(f"no table is registered as {key!r}; registered: {', '.join(registry)}")
    entry = registry[key]
    if callable(entry):
        return entry
    module, function = entry.split(":")
    return getattr(importlib.import_module(module), function)


def csv_path(key: str, benchmarks: Path = HERE) -> Path:
    """The CSV a key names (its first word): in the wing of ``benchmarks`` that holds it, else in ``benchmarks``."""
    name = key.split()[0]
    return next((benchmarks / wing / name for wing in WINGS if (benchmarks / wing / name).is_file()), benchmarks / name)


def render(key: str, benchmarks: Path = HERE, registry: dict[str, str | Renderer] | None = None) -> str:
    """The Markdown block of ``key`` (a table, or prose with figures), from its CSV."""
    return renderer(key, registry)(csv_path(key, benchmarks)).strip()


def marked_tables(paths: Iterable[Path]) -> list[Marked]:
    """Every marked block in ``paths``, in order."""
    found = []
    for path in paths:
        text = path.read_text()
        for match in MARKER.finditer(text):
            found.append(Marked(path, _line(text, match.start()), match["kind"], match["key"], match["body"]))
    return found


def _block(kind: str, key: str, body: str) -> str:
    return f"<!-- {kind}: {key} -->\n\n{body}\n\n<!-- /{kind} -->"


def typed_figures(paths: Iterable[Path] | None = None) -> list[str]:
    """``path:line figure`` of every measured figure typed outside a marked block (and outside code) in ``paths``:
    a decimal number with a unit that no target sign precedes. Such a figure goes stale unseen; generate it."""
    found = []
    for path in [REPO_ROOT / page for page in FIGURE_PAGES] if paths is None else paths:
        text = path.read_text()
        for match in TYPED_FIGURE.finditer(_CODE.sub(_blanked, MARKER.sub(_blanked, text))):
            found.append(f"{_location(path, _line(text, match.start()))} {match[0]}")
    return found


def _blanked(match: re.Match[str]) -> str:
    """The match with all but its line breaks made spaces: what follows keeps its offset and line."""
    return re.sub(r"[^\n]", " ", match[0])


def stale(paths: Iterable[Path] | None = None, **options) -> list[str]:
    """``path:line key`` of every marked block that differs from what its CSV gives (or cannot be rendered)."""
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
    """Rewrite every marked block in ``paths`` from its CSV: ``path:line key`` of those that changed, and of those
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
            return _block(match["kind"], match["key"], table)

        new = MARKER.sub(replace, text)
        if new != text:
            path.write_text(new)
    return changed, failed


def _reason(error: Exception) -> str:
    return error.args[0] if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--check",
        action="store_true",
        help="list the blocks that differ and the figures typed outside one; exit 1 if any",
    )
    action.add_argument("--print", metavar="KEY", help="print the block of one registry key")
    action.add_argument("--list", action="store_true", help="list the registry and where each block is used")
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
        differing, typed = stale(), typed_figures()
        for line in differing:
            print(f"differs from its CSV: {line}")
        for line in typed:
            print(f"a figure typed outside a generated block: {line}")
        total = len(marked_tables(documents()))
        print(f"{len(differing)} of {total} blocks differ" if differing else f"all {total} blocks match their CSVs")
        return 1 if differing or typed else 0
    changed, failed = rewrite()
    for line in changed:
        print(f"rewrote {line}")
    for line in failed:
        print(f"could not render {line}")
    print(f"{len(changed)} blocks rewritten" if changed else "every block already matched its CSV")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
