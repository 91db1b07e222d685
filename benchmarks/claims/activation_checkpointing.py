"""Activation peak and step time with each checkpointing policy, for r100, sapiens_0.3b and cotracker3.

    python benchmarks/claims/activation_checkpointing.py [--only r100,cotracker3] [--rounds 2]
                                                  [--policies offload,budget=0.5]
                                                  [--csv benchmarks/claims/activation_checkpointing.csv]

``--policies`` measures those rows again (beside ``none``, the baseline of the ratios) and keeps the CSV's
other rows as they were.

Bytes: one fp32 forward + backward counted by the project's MemoryTracker under FakeTensorMode
(nothing allocated; the same ops as a real step, so the same bytes). The activation peak is the
step's peak minus parameters, gradients (allocated up front, so they stay constant) and the
batch: the most memory the step's activations and temporaries hold at once. Offloaded
activations are host memory and are reported apart.

Time: real CPU steps of every policy interleaved in one process, ``--rounds`` times each after one
untimed warm-up step per policy; the fastest step of each policy over the fastest without
checkpointing.

``budget=0.5`` is the checkpointing knapsack (``plan_checkpointing``) asked for half the activation peak
without checkpointing: per block keep / selective / full / offload, the fastest set within that budget as
priced for this CPU (measured by ``measure_cpu``), so the choice is the one a user of this machine would get.
CoTracker3 is timed at 384 tracks (its bytes are counted at 768): a real fp32 step
at 768 tracks holds about 21 GB of activations, more than a 24 GB CPU machine has free.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, prose, read_rows, write_csv
from torch import nn

from lightning_memopt.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from lightning_memopt.memory import profile_step
from lightning_memopt.models import create_model
from lightning_memopt.planner import plan_checkpointing

POLICIES: dict[str, Any] = {
    "none": None,
    "full": "preset",
    "every_n=2": {"every_n": 2},
    "selective": "selective",
    "offload": "offload",
    "lean": "lean",  # full, by the blocks' own memory-lean recomputation where they have one (Sapiens's head)
}
KNAPSACK_BUDGET = 0.5  # the knapsack at selective's target: half the activations
FULL_TARGETS = {"r100": 3.0, "sapiens_0.3b": 5.0, "cotracker3": 2.5}  # full checkpointing's reduction, at most:
FULL_TIME_TARGET = 1.45  # … this step time
SELECTIVE_TARGET = (2.0, 1.2)  # selective, or the knapsack at its memory: reduction at least, step time at most
_MIB = 2**20


@dataclass
class Case:
    """One model at its reference input: how to build it, a batch, and a scalar loss of its output."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, ...]]
    loss: Callable[[Any], torch.Tensor]
    timing_batch: Callable[[], tuple[torch.Tensor, ...]] | None = None  # a smaller batch where a real step won't fit
    timing_note: str = ""


def _tracking_loss(output: Any) -> torch.Tensor:
    return output.window_tracks.square().mean() + output.window_visibility.mean() + output.window_confidence.mean()


def _tracking_clip(tracks: int = 768, frames: int = 16, size: tuple[int, int] = (384, 512)) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    video = torch.rand(1, frames, 3, *size, generator=generator) * 255
    positions = torch.rand(1, tracks, 2, generator=generator) * torch.tensor([size[1] - 1, size[0] - 1])
    query_frames = torch.randint(0, frames, (1, tracks, 1), generator=generator).float()
    return video, torch.cat([query_frames, positions], dim=-1)


CASES = {
    "r100": Case(
        "r100 (batch 64, 112²)",
        lambda: create_model("r100"),
        lambda: (torch.randn(64, 3, 112, 112),),
        lambda output: output.square().mean(),
    ),
    "sapiens_0.3b": Case(
        "sapiens_0.3b (512×384, batch 1)",
        lambda: create_model("sapiens_0.3b"),
        lambda: (torch.randn(1, 3, 512, 384),),
        lambda output: output.square().mean(),
    ),
    "cotracker3": Case(
        "cotracker3 (768 tracks, 384×512, window 16)",
        lambda: create_model("cotracker3"),
        _tracking_clip,
        _tracking_loss,
        timing_batch=lambda: _tracking_clip(tracks=384),
        timing_note="timed at 384 tracks: a real fp32 step at 768 needs ~21 GB of activations",
    ),
}


def _loss_fn(case: Case) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]:
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return case.loss(model(*batch))

    return loss_fn


def policies_of(case: Case) -> tuple[dict[str, Any], str]:
    """The fixed policies and the knapsack's choice at :data:`KNAPSACK_BUDGET` for ``case``, and that choice."""
    choice = plan_checkpointing(case.build, case.batch(), KNAPSACK_BUDGET, loss_fn=_loss_fn(case))
    chosen = Counter(choice.modes.values())
    described = "knapsack: " + ", ".join(f"{mode} ×{count}" for mode, count in sorted(chosen.items()))
    return {**POLICIES, f"budget={KNAPSACK_BUDGET}": choice.policy()}, described


def activation_peak(case: Case, policy: Any) -> tuple[int, int]:
    """(activation peak, peak offloaded host bytes) of one forward + backward, counted in fake mode."""

    def prepare(model: nn.Module) -> None:
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        if policy is not None:
            apply_activation_checkpointing(model, policy)

    profile = profile_step(
        case.build,
        case.batch(),
        loss_fn=_loss_fn(case),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        mode="fake",
        steps=1,
        prepare_model=prepare,
    )
    static = sum(profile.breakdown[key] for key in ("parameters", "gradients", "inputs", "optimizer_state"))
    return profile.peak_bytes - static, profile.offloaded_bytes


def step_times(case: Case, policies: dict[str, Any], rounds: int) -> dict[str, float]:
    """The fastest real CPU step of each policy, the policies interleaved round by round."""
    torch.manual_seed(0)
    model = case.build()
    batch = (case.timing_batch or case.batch)()
    times: dict[str, list[float]] = {name: [] for name in policies}
    for round_index in range(rounds + 1):
        for name, policy in policies.items():
            remove_activation_checkpointing(model)
            if policy is not None:
                apply_activation_checkpointing(model, policy)
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            case.loss(model(*batch)).backward()
            if round_index:  # round 0 warms up every policy
                times[name].append(time.perf_counter() - started)
    return {name: min(values) for name, values in times.items()}


def measure(key: str, rounds: int, wanted: list[str] | None = None) -> list[dict]:
    """The rows of ``key``: every policy, or ``none`` and ``wanted``."""
    case = CASES[key]
    policies, chosen = policies_of(case)
    if wanted is not None:
        policies = {name: policy for name, policy in policies.items() if name == "none" or name in wanted}
    peaks = {name: activation_peak(case, policy) for name, policy in policies.items()}
    times = step_times(case, policies, rounds) if rounds else {}
    baseline_bytes = peaks["none"][0]
    rows = []
    for name in policies:
        activation, host = peaks[name]
        rows.append(
            {
                "model": case.name,
                "policy": name,
                "activation_peak_mib": activation / _MIB,
                "reduction": baseline_bytes / activation,
                "offloaded_mib": host / _MIB,
                "step_time_ratio": times[name] / times["none"] if times else float("nan"),
                "step_seconds": times.get(name, float("nan")),
                "note": "; ".join(filter(None, (chosen if name.startswith("budget") else "", case.timing_note))),
            }
        )
    return rows


_POLICY_LABELS = {
    "none": "none",
    "full": "full (`preset`)",
    f"budget={KNAPSACK_BUDGET}": f"knapsack at {KNAPSACK_BUDGET}",
}


def model_label(row: dict[str, str]) -> str:
    """The row's model at the input its bytes were counted at, and the smaller one its times were taken at (the
    note's ``timed at …``), if any."""
    timed = [part.split(":")[0] for part in row["note"].split("; ") if part.startswith("timed at ")]
    return f"{row['model'][:-1]}; {timed[0]})" if timed else row["model"]


def table(path: Path) -> str:
    """The docs' table from the CSV: one row per model and policy; full and selective in bold (the targets)."""
    lines, previous = [], None
    for row in read_rows(path):
        model = model_label(row).replace(" (", ", ").rstrip(")")
        policy = row["policy"]
        bold = "**" if policy in ("full", "lean", "selective") or policy.startswith("budget") else ""
        offloaded = float(row["offloaded_mib"])
        lines.append(
            [
                model if model != previous else "",
                _POLICY_LABELS.get(policy, f"`{policy}`"),
                f"{float(row['activation_peak_mib']):.1f}",
                f"{bold}{float(row['reduction']):.2f}×{bold}",
                f"{offloaded:.1f}" if offloaded else "0",
                f"{bold}{float(row['step_time_ratio']):.2f}{bold}",
            ]
        )
        previous = model
    columns = ["model", "policy", "activation peak MiB", "reduction", "offloaded MiB", "step time ×"]
    return markdown_table(columns, lines)


def targets(path: Path) -> str:
    """The docs' targets, each met or missed per model, from the CSV."""
    full = ", ".join(f"≥ {target:g}× on {model}" for model, target in FULL_TARGETS.items())
    reduction, time_ratio = SELECTIVE_TARGET
    lines = [
        f"Targets: full checkpointing (plain, or lean where a model's blocks have a lean path) {full} at ≤ "
        f"{FULL_TIME_TARGET}× step time; selective, or the knapsack at "
        f"selective's memory, ≥ {reduction:g}× at ≤ {time_ratio}× (CPU step times):",
        "",
    ]
    rows = read_rows(path)
    unchecked = {row["model"]: float(row["activation_peak_mib"]) for row in rows if row["policy"] == "none"}
    knapsack = f"budget={KNAPSACK_BUDGET}"
    for policy in ("full", "lean", "selective", knapsack):  # lean: full by a block's own lean path, where it has one
        met, missed = [], []
        for row in (row for row in rows if row["policy"] == policy):
            model = row["model"].split()[0]
            whole = policy in ("full", "lean")
            least = FULL_TARGETS[model] if whole else reduction
            slowest = FULL_TIME_TARGET if whole else time_ratio
            figure = f"{float(row['reduction']):.2f}× at {float(row['step_time_ratio']):.2f}×"
            if policy == knapsack:  # its choice, and its peak against the budget it was planned for
                chosen = row["note"].split("; ")[0].removeprefix("knapsack: ")
                budget = KNAPSACK_BUDGET * unchecked[row["model"]]
                figure += f"; {chosen}: {float(row['activation_peak_mib']):.1f} MiB, budget {budget:.1f} MiB"
            fits = float(row["reduction"]) >= least and float(row["step_time_ratio"]) <= slowest
            (met if fits else missed).append(f"{model} ({figure})")
        verdicts = [f"{word} on {', '.join(models)}" for word, models in (("met", met), ("missed", missed)) if models]
        if not verdicts:
            continue
        lines.append(f"- **{_POLICY_LABELS.get(policy, f'`{policy}`')}**: {'; '.join(verdicts)}.")
    return prose(*lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per policy (0: bytes only)")
    every = [*POLICIES, f"budget={KNAPSACK_BUDGET}"]
    parser.add_argument("--policies", help=f"comma-separated subset of {', '.join(every)}: only those rows again")
    args = parser.parse_args()
    keys = args.only.split(",")
    unknown = sorted(set(keys) - set(CASES))
    if unknown:
        parser.error(f"unknown --only entries {unknown}; valid choices: {', '.join(CASES)}")
    wanted = args.policies.split(",") if args.policies else None
    if wanted is not None and sorted(set(wanted) - set(every)):
        parser.error(
            f"unknown --policies entries {sorted(set(wanted) - set(every))}; valid choices: {', '.join(every)}"
        )
    rows = []
    print(f"{'model':<44}{'policy':<11}{'act. peak MiB':>14}{'reduction':>10}{'offloaded MiB':>14}{'time ×':>8}")
    for key in keys:
        for row in measure(key, args.rounds, wanted):
            rows.append(row)
            print(
                f"{row['model']:<44}{row['policy']:<11}{row['activation_peak_mib']:>14.1f}{row['reduction']:>9.2f}×"
                f"{row['offloaded_mib']:>14.1f}{row['step_time_ratio']:>8.2f}  {row['note']}",
                flush=True,
            )
    if wanted is not None:
        rows = merged(read_rows(args.csv), [row for row in rows if row["policy"] in wanted])
    write_csv(args.csv, rows)


def merged(kept: list[dict], fresh: list[dict]) -> list[dict]:
    """``kept``'s rows with each of ``fresh`` in its old one's place (same model and policy), a new one after its
    model's rows (a model ``kept`` lacks: at the end).

    Example::

        >>> old = [{"model": "a", "policy": "none", "x": 1}, {"model": "a", "policy": "full", "x": 1},
        ...        {"model": "b", "policy": "none", "x": 1}]
        >>> new = [{"model": "a", "policy": "full", "x": 2}, {"model": "a", "policy": "lean", "x": 2}]
        >>> [(row["model"], row["policy"], row["x"]) for row in merged(old, new)]
        [('a', 'none', 1), ('a', 'full', 2), ('a', 'lean', 2), ('b', 'none', 1)]
    """
    waiting = {(row["model"], row["policy"]): row for row in fresh}
    rows: list[dict] = []
    for index, row in enumerate(kept):
        rows.append(waiting.pop((row["model"], row["policy"]), row))
        if index + 1 == len(kept) or kept[index + 1]["model"] != row["model"]:  # the model's last row: new ones
            rows += [new for key, new in list(waiting.items()) if key[0] == row["model"] and waiting.pop(key)]
    return rows + list(waiting.values())


if __name__ == "__main__":
    main()
