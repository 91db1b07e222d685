"""Are a checkpointed step's gradients bitwise those of the plain step? Per model and mode, eager and compiled.

    python benchmarks/claims/checkpoint_exactness.py                   # inductor; writes checkpoint_exactness.csv
    python benchmarks/claims/checkpoint_exactness.py --only swin --backend aot_eager
    python benchmarks/claims/checkpoint_exactness.py --table                  # print the docs table from the CSV

For each model — the presets' tiny variants and four ``transformers`` families built from small configs (random
weights, nothing downloaded) — one training step (seeded weights and batch, train mode, fp32, CPU, loss
``output.square().mean()``) runs without checkpointing and with each mode on the model's blocks (``"auto"``: the
declared blocks, else the discovered ones): ``full``, ``selective``, ``offload``. Eager steps are compared with the
eager plain step, compiled ones (``torch.compile(model, backend=...)``, compiled afresh for each) with the compiled
plain step. Reported: "bitwise" when every parameter's gradient is equal to the bit, else the largest absolute
difference of a gradient element. A compiled step that does not end within ``--bound`` seconds is stopped there and
reported as stopped: nothing runs past its bound silently.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.models import create_model

MODES = ("full", "selective", "offload")
Case = tuple[Callable[[], torch.nn.Module], Callable[[], tuple[Any, ...]], Callable[[Any], torch.Tensor]]


def _images(height: int, width: int, batch: int = 2) -> Callable[[], tuple[Any, ...]]:
    return lambda: (torch.randn(batch, 3, height, width),)


def _hidden(output: Any) -> torch.Tensor:
    return output.last_hidden_state.square().mean()


def _square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _tracks(output: Any) -> torch.Tensor:
    return output.tracks.square().mean() + output.visibility.square().mean()


def _video() -> tuple[Any, ...]:
    return torch.randn(1, 4, 3, 32, 32), torch.tensor([[[0.0, 8.0, 8.0], [1.0, 16.0, 10.0]]])


def _transformers(family: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
        configs = {
            "ViT": ("ViTConfig", "ViTModel", {"image_size": 32, "patch_size": 8, **small}),
            "Dinov2": ("Dinov2Config", "Dinov2Model", {"image_size": 32, "patch_size": 8, **small}),
            "ConvNext": (
                "ConvNextConfig",
                "ConvNextModel",
                {"num_stages": 2, "hidden_sizes": [16, 32], "depths": [2, 2]},
            ),
            "Swin": (
                "SwinConfig",
                "SwinModel",
                {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [2, 2]},
            ),
        }
        config_class, model_class, options = configs[family]
        config = getattr(transformers, config_class)(**options, window_size=4) if family == "Swin" else None
        config = config or getattr(transformers, config_class)(**options)
        return getattr(transformers, model_class)(config)

    return build


CASES: dict[str, Case] = {
    "iresnet_tiny": (lambda: create_model("iresnet_tiny"), _images(32, 32), _square),
    "sapiens_tiny": (lambda: create_model("sapiens_tiny"), _images(64, 48), _square),
    "cotracker2_tiny": (lambda: create_model("cotracker2_tiny"), _video, _tracks),
    "transformers ViT": (_transformers("ViT"), _images(32, 32), _hidden),
    "transformers ConvNext": (_transformers("ConvNext"), _images(32, 32), _hidden),
    "transformers Swin": (_transformers("Swin"), _images(32, 32), _hidden),
    "transformers Dinov2": (_transformers("Dinov2"), _images(32, 32), _hidden),
}


class StoppedAtBound(Exception):
    """A compiled step that did not end within its bound."""


def step_gradients(case: Case, mode: str | None, backend: str | None, bound: float) -> dict[str, torch.Tensor]:
    """One step's parameter gradients: the seeded model, checkpointed in ``mode`` (None: plain), compiled with
    ``backend`` (None: eager); raises :class:`StoppedAtBound` past ``bound`` seconds."""
    build, batch, loss = case
    torch.manual_seed(0)
    model = build().train()
    inputs = batch()
    if mode is not None:
        apply_activation_checkpointing(model, "auto" if mode == "full" else mode)
    if backend:
        torch._dynamo.reset()  # each variant compiles afresh
    runner = torch.compile(model, backend=backend) if backend else model

    def stop(signum: int, frame: Any) -> None:
        raise StoppedAtBound(f"stopped at its bound of {bound:.0f} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, bound)
    try:
        torch.manual_seed(1)  # dropout and drop-path draw the same numbers in every variant
        loss(runner(*inputs)).backward()
    except Exception as error:  # dynamo wraps what the alarm raised while it compiled
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, StoppedAtBound):
            cause = cause.__cause__ or cause.__context__
        raise cause or error from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def largest_difference(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of a gradient element (0.0: bitwise equal). A gradient one side lacks is
    zeros there: a compiled graph returns zeros for a parameter no loss reaches, where eager leaves ``None``."""
    differences = []
    for name in reference.keys() | got.keys():
        expected, actual = reference.get(name), got.get(name)
        expected = torch.zeros_like(actual) if expected is None else expected
        actual = torch.zeros_like(expected) if actual is None else actual
        differences.append(0.0 if torch.equal(expected, actual) else (expected - actual).abs().max().item())
    return max(differences)


def _compared(reference: dict[str, torch.Tensor] | None, case: Case, mode: str, backend: str | None, bound: float):
    """(the largest gradient difference or why there is none, seconds taken)."""
    started = time.perf_counter()
    try:
        got = step_gradients(case, mode, backend, bound)
    except StoppedAtBound as stopped:
        return str(stopped), bound
    except Exception as error:  # a mode that fails on a model is a result: say it
        return f"fails: {type(error).__name__}: {str(error).splitlines()[0][:160]}", time.perf_counter() - started
    seconds = time.perf_counter() - started
    return ("no compiled plain step" if reference is None else largest_difference(reference, got)), seconds


def measure(names: list[str], backend: str, bound: float) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        case = CASES[name]
        eager = step_gradients(case, None, None, bound)
        try:
            compiled: dict[str, torch.Tensor] | None = step_gradients(case, None, backend, bound)
        except StoppedAtBound:
            compiled = None
        for mode in MODES:
            row: dict[str, Any] = {"model": name, "mode": mode, "backend": backend}
            row["eager"], _ = _compared(eager, case, mode, None, bound)
            row["compiled"], seconds = _compared(compiled, case, mode, backend, bound)
            row["compiled_seconds"] = round(seconds, 1)
            print(row, flush=True)
            rows.append(row)
    return rows


def _verdict(value: str) -> str:
    try:
        difference = float(value)
    except ValueError:
        return value
    return "bitwise" if difference == 0.0 else f"{difference:.1e}"


def table(path: Path) -> str:
    rows = read_rows(path)
    backend = rows[0]["backend"] if rows else ""
    columns = ["model", "mode", "eager", f"compiled ({backend})", "compiled step s"]
    cells = [
        [row["model"], row["mode"], _verdict(row["eager"]), _verdict(row["compiled"]), row["compiled_seconds"]]
        for row in rows
    ]
    return markdown_table(columns, cells)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--only", help="comma-separated models: " + ", ".join(CASES))
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--bound", type=float, default=600.0, help="seconds a compiled step may take")
    args = parser.parse_args()
    names = [name for name in CASES if not args.only or any(part in name for part in args.only.split(","))]
    write_csv(Path(args.csv), measure(names, args.backend, args.bound))
    print(table(Path(args.csv)))


if __name__ == "__main__":
    main()
