"""What the planner found: each configuration weighed (:class:`Candidate`) and the :class:`Plan`, table and chart;
and the options that change the training result (:class:`ResultChangingOption`), measured so the user can weigh them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.report import chart
from lightning_memopt.planner.cost import StepCost
from lightning_memopt.planner.estimate import StepEstimate
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.vocabulary import GIB, MIB, aligned_table

_SHOWN = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs")
FRONT_ROWS = 10  # the short report's most candidate rows


class PlanError(ValueError):
    """No plan can be made: the budget cannot hold even the model states, or ``blocks`` select nothing."""


@dataclass
class Candidate:
    """One configuration: its knobs, predicted memory and work, estimated step time, and how it was predicted."""

    knobs: Knobs
    estimate: StepEstimate
    cost: StepCost
    fits: bool
    # "profiled", "estimated" (from the group's anchor) or "sharded" (FSDP / CPU offload, from a profiled step)
    how: str
    estimated_bytes: int | None = None  # for a profiled candidate first estimated: that estimate

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        return self.estimate.breakdown

    @property
    def host_bytes(self) -> int:
        return self.estimate.host_bytes


@dataclass
class Plan:
    """The candidates a plan weighed, the one it chose (``None``: nothing fits), and the result-changing options."""

    hardware: Hardware
    limit_bytes: int
    safety_margin: float
    candidates: list[Candidate]
    skipped: list[tuple[Knobs, float]]
    chosen: Candidate | None
    options: list[MeasuredOption] = field(default_factory=list)
    profiles: int = 0
    notes: list[str] = field(default_factory=list)  # the knobs left out of the search, and why
    rejected: list[tuple[Knobs, str]] = field(default_factory=list)  # configurations the model refuses, and why
    # the candidates timed on the device (planner.trials.Measurement), and the seconds that took; none: priced alone
    measurements: list[Any] = field(default_factory=list)
    measure_seconds: float | None = None

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    def table(self, verbose: bool = False, command: str | None = None, verbose_switch: str = "verbose=True") -> str:
        """The report, the answer first: the device and budget, the chosen plan (and ``command``, the command line
        that runs it), then the candidates as an aligned table: the Pareto front of step time and peak (at most
        :data:`FRONT_ROWS` rows, one per label, the faster ones that lost saying by how much they do not fit), the
        notes and the result-changing options that save memory; ``verbose``: every candidate weighed instead of the
        front (``verbose_switch``: how the caller's user asks for that)."""
        unit, scale = ("GiB", GIB) if self.hardware.memory_bytes >= GIB else ("MiB", MIB)
        lines = [
            f"device {self.hardware.name}: {self.hardware.memory_bytes / scale:.2f} {unit}, plan within "
            f"{self.limit_bytes / scale:.2f} {unit} (safety margin {self.safety_margin:.0%}); "
            f"{len(self.candidates)} candidates from {self.profiles} fake-mode profiles",
            *self._chosen_lines(scale, unit),
        ]
        if command is not None and self.chosen is not None:
            lines += ["run it with:", f"  {command}"]
        shown = self.candidates if verbose else self.front()
        tried = {measured.knobs for measured in self.measurements}
        shown = [*shown, *(c for c in self.candidates if c.knobs in tried and not any(c is s for s in shown))]
        shown = sorted(shown, key=lambda c: (c.cost.total, c.peak_bytes))
        lines += ["", *self._candidate_table(shown, unit, scale, verbose)]
        if not verbose and self.skipped:
            lines.append(f"{len(self.skipped)} more not profiled: their least step time cannot beat the choice")
        lines += self.notes
        if any(candidate.host_bytes for candidate in self.candidates):
            lines.append(
                f"host: host memory ({unit}) at its peak: offloaded activations; with CPU offload the parameter "
                "shards, gradients and optimizer state"
            )
        saving = [measured for measured in self.options if measured.saving_bytes > 0]
        if saving:
            lines.append(
                f"options that change the result (each measured against {saving[0].against}: peak "
                f"{saving[0].reference_bytes / scale:.2f} {unit}):"
            )
            for measured in saving:
                option = measured.option
                lines.append(
                    f"  - {option.name}: peak {measured.peak_bytes / scale:.2f} {unit}, saves "
                    f"{measured.saving_bytes / scale:.2f} {unit}; {option.caveat}  [{' '.join(option.overrides)}]"
                )
        if not verbose and len(shown) < len(self.candidates):
            lines.append(f"({len(self.candidates) - len(shown)} more candidates: {verbose_switch} lists every one)")
        return "\n".join(lines)

    def _candidate_table(self, shown: list[Candidate], unit: str, scale: int, verbose: bool) -> list[str]:
        """The candidates' rows under full column names, aligned; with ``verbose`` also those not profiled and
        those the model refuses."""
        on_host = any(candidate.host_bytes for candidate in self.candidates)
        trials = {measured.knobs: measured for measured in self.measurements}
        header = ["", "candidate", f"peak {unit}", *(name.replace("_", " ") for name in _SHOWN)]
        header += ["host"] if on_host else []
        header += ["priced s", "measured s", f"measured {unit}", "trial"] if trials else ["step s"]
        header += ["fits", "how"]
        body = [self._row(candidate, scale, on_host, verbose, trials) for candidate in shown]
        blank = ["—"] * (len(header) - 4)
        for knobs, bound in self.skipped if verbose else ():
            body.append(["", knobs.describe(), *blank, "", f"not profiled: cannot beat the choice (≥ {bound:.4f} s)"])
        for knobs, reason in self.rejected:
            body.append(["", knobs.describe(), *blank, "", f"left out: {reason}"])
        text_columns = {0, 1, len(header) - 2, len(header) - 1} | ({len(header) - 3} if trials else set())
        return aligned_table(header, body, left=frozenset(text_columns))

    def front(self) -> list[Candidate]:
        """The Pareto front of step time and peak, one candidate per label (the fastest), at most
        :data:`FRONT_ROWS`: the chosen one, the faster ones nearest it (they do not fit), then the slower ones
        that need less memory."""
        by_label: dict[str, Candidate] = {}
        for candidate in sorted(self.candidates, key=lambda c: (c.cost.total, c.peak_bytes)):
            by_label.setdefault(candidate.knobs.describe(), candidate)
        distinct = list(by_label.values())
        front = [
            c
            for c in distinct
            if c is self.chosen
            or not any(
                o.cost.total <= c.cost.total and o.peak_bytes <= c.peak_bytes and o is not c and o.fits >= c.fits
                for o in distinct
            )
        ]
        front.sort(key=lambda c: (c.cost.total, c.peak_bytes))
        if self.chosen is None or self.chosen not in front:
            return front[:FRONT_ROWS]
        at = front.index(self.chosen)
        faster = front[max(0, at - FRONT_ROWS // 2) : at]
        return [*faster, *front[at : at + FRONT_ROWS - len(faster)]]

    def _row(self, candidate: Candidate, scale: int, on_host: bool, verbose: bool, trials: dict[Any, Any]) -> list[str]:
        cells = [
            "→" if candidate is self.chosen else "",
            candidate.knobs.describe(),
            f"{candidate.peak_bytes / scale:.2f}",
        ]
        cells += [f"{candidate.breakdown.get(k, 0) / scale:.2f}" for k in _SHOWN]
        cells += [f"{candidate.host_bytes / scale:.2f}"] if on_host else []
        cells.append(f"{candidate.cost.total:.4f}")
        how = candidate.how
        if candidate.estimated_bytes is not None:
            how += f" (estimated {candidate.estimated_bytes / scale:.2f})"
        if not candidate.fits and not verbose:
            how += f"; over the budget by {(candidate.peak_bytes - self.limit_bytes) / scale:.2f}"
        if trials:
            *measured, note = _trial_columns(trials.get(candidate.knobs), scale)
            cells += measured
            how += f"; {note}" if note else ""
        return [*cells, "yes" if candidate.fits else "no", how]

    def _chosen_lines(self, scale: int, unit: str) -> list[str]:
        if self.chosen is None:
            return ["no configuration that keeps the result fits"]
        host = self.chosen.host_bytes
        return [
            f"chosen: {self.chosen.knobs.describe()}: peak {self.chosen.peak_bytes / scale:.2f} {unit} "
            f"({self.chosen.how})"
            + (f", {host / scale:.2f} {unit} of host memory" if host else "")
            + f", about {self.chosen.cost.total:.4f} s per step{_cost_parts(self.chosen)}"
        ]

    def measured_report(self, priced: Candidate | None) -> str:
        """How many candidates were timed on the device (the table's measured columns hold what each did), what was
        chosen and what the price alone chose."""
        unit, scale = ("GiB", GIB) if self.hardware.memory_bytes >= GIB else ("MiB", MIB)
        recalled = sum(m.remembered for m in self.measurements)
        lines = [
            f"tried {sum(not m.remembered and not m.outcome.startswith('untried') for m in self.measurements)} of "
            f"{len(self.measurements)} candidates on the device in {self.measure_seconds or 0:.1f} s"
            + (f", {recalled} remembered from an earlier run" if recalled else "")
            + f" (plan within {self.limit_bytes / scale:.2f} {unit}; the table's measured columns)"
        ]
        sharded = sum(c.fits and c.knobs.sharding.active for c in self.candidates)
        if sharded:
            lines.append(f"{sharded} sharded or offloaded candidates that fit are not trialled (FSDP: not in a trial)")
        chosen = "—" if self.chosen is None else self.chosen.knobs.describe()
        if not any(measured.fits(self.limit_bytes) for measured in self.measurements):
            verdict = (
                f"nothing measured fits: {chosen}, of the least predicted peak, runs (AdaptiveAccumulation halves "
                "its micro-batches on an out-of-memory error)"
            )
        elif priced is None:
            verdict = f"chosen by measurement: {chosen}"
        elif self.chosen is not None and priced.knobs == self.chosen.knobs:
            verdict = f"chosen by measurement: {chosen}, as the price alone chose"
        else:
            verdict = f"chosen by measurement: {chosen} (the price alone chose {priced.knobs.describe()})"
        return "\n".join([*lines, verdict])

    def write_chart(self, path: str | Path) -> None:
        """Stacked memory bars per candidate against the budget line (PNG; needs matplotlib)."""
        shown = sorted(self.candidates, key=lambda c: c.cost.total)
        with chart(path, (max(6.0, 0.6 * len(shown) + 2), 4.5)) as axes:
            positions = list(range(len(shown)))
            bottom = [0.0] * len(shown)
            for category in _SHOWN:
                heights = [c.breakdown.get(category, 0) / GIB for c in shown]
                axes.bar(positions, heights, bottom=bottom, label=category)
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            peaks = [c.peak_bytes / GIB for c in shown]
            axes.scatter(positions, peaks, color="black", marker="_", s=200, label="peak")
            axes.axhline(self.hardware.memory_gib, color="red", label=f"{self.hardware.name}")
            axes.axhline(self.limit_bytes / GIB, color="red", linestyle="--", label="budget less safety margin")
            labels = [("→ " if c is self.chosen else "") + c.knobs.describe() for c in shown]
            axes.set_xticks(positions, labels, rotation=60, ha="right", fontsize=7)
            axes.set_ylabel("GiB (breakdown at the peak)")
            axes.set_title("memopt-plan: predicted peak per candidate, cheapest step first")
            axes.legend(fontsize=7, loc="upper right")

    def summary(self) -> dict[str, Any]:
        """The chosen plan as loggable values."""
        if self.chosen is None:
            return {"fits": False}
        return {
            "fits": True,
            **{f"knobs.{k}": v for k, v in self.chosen.knobs.as_dict().items()},
            "predicted_peak_gib": round(self.chosen.peak_bytes / GIB, 3),
            "predicted_host_gib": round(self.chosen.host_bytes / GIB, 3),
            "estimated_step_seconds": self.chosen.cost.total,
            "budget_gib": round(self.hardware.memory_gib, 3),
        }


def _trial_columns(measured: Any, scale: int) -> list[str]:
    """A candidate's measured step seconds and peak, its trial outcome (``"—"``: not one of those to try), and a
    note: why it was not tried, or that an earlier run's trial is recalled."""
    if measured is None:
        return ["—", "—", "—", ""]
    seconds = "—" if measured.measured_seconds is None else f"{measured.measured_seconds:.4f}"
    peak = "—" if measured.measured_peak_bytes is None else f"{measured.measured_peak_bytes / scale:.2f}"
    trial, _, why = measured.outcome.partition(": ")
    return [seconds, peak, trial, "remembered from an earlier run" if measured.remembered else why]


def _cost_parts(candidate: Candidate) -> str:
    """What sharding and offload add to a step: `` (communication 0.03 s, host link 1.0 s, host 0.5 s)``; with
    activations offloaded, also the seconds the device waits for their copies (``copies waited for``)."""
    cost = candidate.cost
    parts = [
        ("communication", cost.communication),
        ("host link", cost.offload),
        ("copies waited for", cost.offload_wait),
        ("host optimizer step", cost.host),
    ]
    shown = [f"{name} {seconds:.4f} s" for name, seconds in parts if seconds > 0]
    return f" ({', '.join(shown)})" if shown else ""


@dataclass(frozen=True)
class ResultChangingOption:
    """A change to the model or data that saves memory but changes what is trained.

    Args:
        name: what changes, e.g. ``"traj_per_sample 768 → 384"``.
        caveat: what it costs in results, as reported.
        overrides: the ``memopt-train`` overrides that make the change.
        model: a factory for the changed model (``None``: the same model).
        batch: the changed training batch (``None``: the same batch).
    """

    name: str
    caveat: str
    overrides: tuple[str, ...]
    model: Callable[[], nn.Module] | None = None
    batch: Any = None


@dataclass(frozen=True)
class MeasuredOption:
    """An option with its predicted peak and what it saves against the same knobs without it (``against``: those
    knobs, described; ``reference_bytes``: their peak without the option)."""

    option: ResultChangingOption
    peak_bytes: int
    saving_bytes: int
    against: str = ""
    reference_bytes: int = 0


def measure_options(
    profile: Callable[..., MemoryProfile],
    knobs: Knobs,
    options: Sequence[ResultChangingOption],
    reference_bytes: int | None = None,
) -> list[MeasuredOption]:
    """Profile each option under ``knobs``; its saving is against ``reference_bytes`` (the same knobs without it).

    ``profile(knobs, model=..., batch=...)`` runs one fake-mode profile; the reference is profiled
    too when ``reference_bytes`` is not given.
    """
    reference = profile(knobs).peak_bytes if reference_bytes is None else reference_bytes
    measured = []
    for option in options:
        peak = profile(knobs, model=option.model, batch=option.batch).peak_bytes
        measured.append(MeasuredOption(option, peak, reference - peak, knobs.describe(), reference))
    return measured
