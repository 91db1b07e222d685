"""Bad inputs, tried as a new user would: every one must end with exit status 2 and one clean line, no traceback.

Each case is an app and its command line; the line must name what is wrong (the key or argument and
the bad value, and where there is a fixed set, the valid choices). At least one case per option group
of the Hydra apps and per data format. The apps run in this process (Hydra and Lightning import once),
in a scratch folder holding the broken files some cases point at.

    python benchmarks/claims/bad_inputs.py              # runs every case, prints each outcome, writes bad_inputs.csv
    python benchmarks/claims/bad_inputs.py --table      # the docs table from the CSV
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

# A face run of one tiny step: a case that should fail but does not ends quickly (and is counted as not clean).
TINY = [
    "model=iresnet_tiny",
    "data.image_size=32",
    "data.num_classes=4",
    "data.samples_per_class=4",
    "data.val_samples_per_class=1",
    "data.batch_size=4",
    "trainer.max_steps=1",
    "trainer.enable_progress_bar=false",
    "logger=none",
]
FACE_FILES = ["model=iresnet_tiny", "trainer.max_steps=1", "trainer.enable_progress_bar=false", "logger=none"]
TRACKING = ["model=cotracker2_tiny", "trainer.max_steps=1", "trainer.enable_progress_bar=false", "logger=none"]
NORMALS = ["model=sapiens_tiny", "trainer.max_steps=1", "trainer.enable_progress_bar=false", "logger=none"]


@dataclass(frozen=True)
class Case:
    """One bad input: the app, its arguments (``{tmp}`` is the scratch folder) and what its message must contain."""

    group: str
    app: str
    args: tuple[str, ...]
    expect: tuple[str, ...]

    @property
    def name(self) -> str:
        return (
            f"{self.app} {' '.join(arg for arg in self.args if arg not in (*TINY, *FACE_FILES, *TRACKING, *NORMALS))}"
        )


def _train(group: str, *args: str, expect: tuple[str, ...], base: list[str] = TINY) -> Case:
    return Case(group, "memopt-train", (*base, *args), tuple(_as_typed(part, args) for part in expect))


def _as_typed(part: str, overrides: tuple[str, ...]) -> str:
    """An expected `` `name` `` as the line names it: the key the override typed (`` `data.batch_size` ``)."""
    keys = [override.split("=", 1)[0] for override in overrides]
    name = part[1:-1] if part.startswith("`") and part.endswith("`") else None
    typed = [key for key in keys if name and key.endswith(f".{name}")]
    return f"`{typed[0]}`" if typed else part


CASES = [
    # Hydra groups: an option that does not exist lists the ones that do
    *(
        _train(group, f"{group}=nope", expect=(f"`{group}=nope`: no such option of `{group}`; valid choices: ",))
        for group in ("model", "data", "trainer", "strategy", "precision", "memopt", "logger", "experiment", "debug")
    ),
    _train("sweep", "sweep=nope", expect=("`sweep=nope`: no such option of `sweep`; valid choices: ",)),
    _train("trainer", "trainer.max_stepz=3", expect=("`trainer.max_stepz`", "did you mean `trainer.max_steps`")),
    _train("memopt", "memopt=[monitor,checkpoint]", expect=("`memopt=checkpoint`", "valid choices: ", "checkpointing")),
    _train("trainer", "trainer.max_steps=abc", expect=("max_steps", "abc")),
    _train("trainer", "trainer.precision=fp8", expect=("precision", "fp8")),
    _train("trainer", "trainer.accelerator=tpu", expect=("torch_xla",)),
    _train("trainer", "trainer.devices=abc", expect=("devices", "abc")),
    _train("trainer", "trainer.enable_checkpointing=maybe", expect=("enable_checkpointing", "maybe")),
    _train("trainer", "trainer.limit_val_batches=1.5", expect=("limit_val_batches", "1.5")),
    _train("trainer", "trainer.val_check_interval=abc", expect=("val_check_interval", "abc")),
    _train("trainer", "trainer.gradient_clip_algorithm=nope", expect=("gradient_clip_algorithm", "nope")),
    # top-level keys
    _train("run", "seed=abc", expect=("`seed`", "'abc'")),
    _train("run", "ckpt_path={tmp}/missing.ckpt", expect=("`ckpt_path`", "missing.ckpt")),
    _train("run", "ckpt_path={tmp}/truncated.ckpt", expect=("`ckpt_path`", "truncated.ckpt", "not a readable")),
    _train("run", "ckpt_path={tmp}/faces", expect=("`ckpt_path`", "not a sharded checkpoint")),
    _train("run", "results_csv={tmp}", expect=("results_csv",)),
    _train("run", "objective=3", expect=("`objective`", "3")),
    _train("run", "objective=val/accc", expect=("`objective`", "'val/accc'", "val/acc")),  # after the fit
    _train("callbacks", "+callbacks.extra=3", expect=("`callbacks.extra`", "_target_")),
    _train("callbacks", "callbacks.last_checkpoint.dirpath=7", expect=("`dirpath`", "7")),
    # model
    _train("model", "model.backbone=r1000", expect=("r1000", "r100")),
    _train("model", "model.lr=abc", expect=("`lr`", "'abc'")),
    _train("model", "model.lr=-1", expect=("`lr`", "-1")),
    _train("model", "model.optimizer=adam", expect=("`optimizer`", "'adam'", "sgd")),
    _train("model", "model.schedule=nope", expect=("`schedule`", "'nope'", "cosine")),
    _train("model", "model.sample_rate=0", expect=("`sample_rate`", "0")),
    _train("model", "model.warmup_steps=abc", expect=("`warmup_steps`", "'abc'")),
    _train("model", "model.clip_backbone_only=maybe", expect=("`clip_backbone_only`", "'maybe'")),
    _train("model", "model.pretrained={tmp}/missing.pt", expect=("pretrained", "missing.pt")),
    _train("model", "model.margin_list=[1,2]", expect=("margin_list",)),
    # data: the synthetic faces
    _train("data", "data.batch_size=abc", expect=("`batch_size`", "'abc'")),
    _train("data", "data.batch_size=0", expect=("`batch_size`", "0")),
    _train("data", "data.num_workers=-1", expect=("`num_workers`", "-1")),
    _train("data", "data.pin_memory=maybe", expect=("`pin_memory`", "'maybe'")),
    _train("data", "data.image_size=abc", expect=("`image_size`", "'abc'")),
    _train("data", "data.augmentation.hflip=2", expect=("`hflip`", "2")),
    _train("data", "data.augmentation.blur=1", expect=("augmentation.blur",)),
    _train("data", "data.samples_per_class=0", expect=("`samples_per_class`", "0")),
    # data formats
    *(
        _train(fmt, f"data={fmt}", f"data.{key}={{tmp}}/{folder}", "data.num_classes=2", expect=expect, base=FACE_FILES)
        for fmt, key, folder, expect in (
            ("image_folder_face", "root", "missing", ("root", "missing")),
            ("image_folder_face", "root", "empty_identity", ("empty_identity/bob",)),
            ("memmap_face", "path", "missing", ("missing",)),
            ("memmap_face", "path", "bad_meta", ("meta.json", "misses keys")),
        )
    ),
    _train(
        "image_folder_face", "data=image_folder_face", "data.root={tmp}/faces", expect=("num_classes",), base=FACE_FILES
    ),
    _train("normals_folder", "data=normals_folder", "data.root={tmp}/missing", base=NORMALS, expect=("missing",)),
    _train(
        "synthetic_normals", "data=synthetic_normals", "data.image_size=[0,0]", base=NORMALS, expect=("image_size",)
    ),
    _train("tracking_npz", "data=tracking_npz", "data.root={tmp}/missing", base=TRACKING, expect=("missing",)),
    _train(
        "tracking_npz",
        "data=tracking_npz",
        "data.root={tmp}/tracks_visibility",
        base=TRACKING,
        expect=("clip.npz", "visibility"),
    ),
    _train(
        "tracking_npz", "data=tracking_npz", "data.root={tmp}/tracks_far", base=TRACKING, expect=("clip.npz", "frame")
    ),
    _train("tracking_npz", "data=tracking_npz", "data.root={tmp}/truncated_npz", base=TRACKING, expect=("clip.npz",)),
    _train("synthetic_tracking", "data=synthetic_tracking", "data.num_clips=abc", base=TRACKING, expect=("num_clips",)),
    # strategy
    _train("strategy", "strategy=fsdp_memopt", "trainer.strategy.param_dtype=fp8", expect=("param_dtype", "fp8")),
    _train("strategy", "strategy=fsdp_memopt", "trainer.strategy.cpu_offload=maybe", expect=("cpu_offload", "maybe")),
    # memopt bundles
    _train(
        "memopt",
        "memopt=precision",
        "memopt.callbacks.precision_switch.fail_safe=maybe",
        expect=("`fail_safe`", "'maybe'"),
    ),
    _train("memopt", "memopt=precision", "memopt.callbacks.precision_switch.precision=fp8", expect=("fp8",)),
    _train(
        "memopt",
        "memopt=adaptive",
        "memopt.callbacks.adaptive_accumulation.micro_batch_size=abc",
        expect=("`micro_batch_size`", "'abc'"),
    ),
    _train(
        "memopt",
        "memopt=adaptive",
        "memopt.callbacks.adaptive_accumulation.shrink=nope",
        expect=("`shrink`", "'nope'"),
    ),
    _train("memopt", "memopt=checkpointing", "memopt.callbacks.activation_checkpointing.policy=nope", expect=("nope",)),
    _train(
        "memopt",
        "memopt=monitor",
        "memopt.callbacks.memory_monitor.every_n_steps=-1",
        expect=("every_n_steps", "-1"),
    ),
    _train("memopt", "memopt=auto", "memopt.callbacks.memory_budget.budget=abc", expect=("budget", "'abc'")),
    _train(
        "memopt",
        "memopt=auto",
        "memopt.callbacks.memory_budget.budget=0.00001",
        expect=("budget", "smaller than the model states"),
    ),
    _train("memopt", "memopt.allocator.max_split_size_mb=abc", expect=("max_split_size_mb", "abc")),
    *(
        _train("memopt", "memopt=planned", f"memopt.callbacks.memory_budget.knobs.{knob}={value}", expect=expect)
        for knob, value, expect in (
            ("precision", "fp8", ("precision", "fp8")),
            ("checkpoint", "nope", ("checkpoint", "nope")),
            ("every_n", "0", ("every_n", "0")),
            ("micro_batch_size", "abc", ("micro_batch_size", "abc")),
            ("cpu_offload", "maybe", ("cpu_offload", "maybe")),
        )
    ),
    _train(
        "memopt",
        "memopt=precision",
        "memopt.callbacks.precision_switch.schedule_interval=hour",
        expect=("schedule_interval", "hour"),
    ),
    _train(
        "memopt",
        "memopt=precision",
        "memopt.callbacks.precision_switch.patience=0",
        expect=("patience", "0"),
    ),
    _train(
        "memopt",
        "memopt=adaptive",
        "memopt.callbacks.adaptive_accumulation.loss_reduction=median",
        expect=("loss_reduction", "median"),
    ),
    _train(
        "memopt",
        "memopt=monitor",
        "memopt.callbacks.memory_monitor.prometheus_port=abc",
        expect=("prometheus_port", "abc"),
    ),
    # the other tasks' options
    _train("model", "model.gamma=abc", base=TRACKING, expect=("gamma", "abc")),
    _train("model", "model.visibility_weight=-1", base=TRACKING, expect=("visibility_weight", "-1")),
    _train("model", "model.layer_decay=2", base=NORMALS, expect=("layer_decay", "2")),
    _train("model", "model.topo_variant=nope", expect=("topo_variant", "nope")),
    _train("model", "model.topo_weight=abc", expect=("topo_weight", "abc")),
    # memopt-plan
    Case("plan", "memopt-plan", ("model=r18", "gpu=nope"), ("nope", "a100_80gb")),
    Case("plan", "memopt-plan", ("model=r18", "budget=abc"), ("budget", "'abc'")),
    Case("plan", "memopt-plan", ("model=r18", "devices=0"), ("devices", "0")),
    Case("plan", "memopt-plan", ("model=r18", "safety_margin=2"), ("safety_margin", "2")),
    Case("plan", "memopt-plan", ("model=nope",), ("`model=nope`: no such option of `model`; valid choices: ",)),
    Case("plan", "memopt-plan", ("model=r18", "plan.verify=abc"), ("verify", "abc")),
    # memopt-profile
    Case("profile", "memopt-profile", ("model=iresnet_tiny", "profile.mode=nope"), ("mode", "nope")),
    Case("profile", "memopt-profile", ("model=iresnet_tiny", "data.batch_size=abc"), ("batch_size", "'abc'")),
    Case("profile", "memopt-profile", ("model=iresnet_tiny", "profile.steps=0"), ("steps", "0")),
    # memopt-pack-faces
    Case("pack-faces", "memopt-pack-faces", ("{tmp}/missing", "{tmp}/out"), ("missing",)),
    Case("pack-faces", "memopt-pack-faces", ("{tmp}/empty_identity", "{tmp}/out"), ("empty_identity",)),
    Case("pack-faces", "memopt-pack-faces", ("{tmp}/faces", "{tmp}/out", "--image-size", "0"), ("image_size", "0")),
    Case("pack-faces", "memopt-pack-faces", ("{tmp}/faces", "{tmp}/out", "--image-size", "abc"), ("image-size", "abc")),
    # memopt-export
    Case("export", "memopt-export", ("{tmp}/missing.ckpt", "{tmp}/out.pt"), ("missing.ckpt",)),
    Case("export", "memopt-export", ("{tmp}/truncated.ckpt", "{tmp}/out.pt"), ("truncated.ckpt", "not a readable")),
    Case("export", "memopt-export", ("{tmp}/weights.ckpt", "{tmp}/out.pt", "--model", "nope"), ("nope",)),
]


def make_inputs(tmp: Path) -> None:
    """Write the broken files and folders the cases point at into ``tmp``."""
    from PIL import Image

    for name, count in (("faces/alice", 2), ("faces/bob", 2), ("empty_identity/alice", 2), ("empty_identity/bob", 0)):
        (tmp / name).mkdir(parents=True)
        for index in range(count):
            Image.new("RGB", (16, 16), color=(index * 40, 0, 0)).save(tmp / name / f"{index}.png")
    torch.save({"state_dict": {"weight": torch.zeros(64, 64)}}, tmp / "weights.ckpt")
    whole = (tmp / "weights.ckpt").read_bytes()
    (tmp / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    (tmp / "bad_meta").mkdir()
    (tmp / "bad_meta" / "meta.json").write_text(json.dumps({"format": "lightning_memopt.faces.v1", "count": 2}))
    video = np.zeros((8, 32, 32, 3), dtype=np.uint8)
    tracks = np.full((8, 4, 2), 10.0, dtype=np.float32)
    for folder, visibility, coordinates in (
        ("tracks_visibility", np.array([[-3, 4, 1, 0]] * 8, dtype=np.int64), tracks),
        ("tracks_far", np.ones((8, 4), dtype=bool), tracks + np.float32(1000.0)),
    ):
        (tmp / folder).mkdir()
        np.savez(tmp / folder / "clip.npz", video=video, tracks=coordinates, visibility=visibility)
        np.savez(tmp / folder / "clip2.npz", video=video, tracks=coordinates, visibility=visibility)
    (tmp / "truncated_npz").mkdir()
    np.savez(tmp / "truncated_npz" / "clip.npz", video=video, tracks=tracks, visibility=np.ones((8, 4), dtype=bool))
    whole = (tmp / "truncated_npz" / "clip.npz").read_bytes()
    (tmp / "truncated_npz" / "clip.npz").write_bytes(whole[: len(whole) // 3])


def _entry(app: str) -> Callable[[list[str]], object]:
    """Call ``app``'s entry point on ``args``, as its console script would."""
    if app in ("memopt-pack-faces", "memopt-export"):
        from lightning_memopt.cli.export import main as export_main
        from lightning_memopt.cli.pack_faces import main as pack_main

        return {"memopt-pack-faces": pack_main, "memopt-export": export_main}[app]
    from lightning_memopt.cli import plan, profile, train

    main = {"memopt-train": train.main, "memopt-plan": plan.main, "memopt-profile": profile.main}[app]

    def hydra_entry(args: list[str]) -> object:
        saved = sys.argv
        sys.argv = [app, *args]
        try:
            return main()
        finally:
            sys.argv = saved

    return hydra_entry


@dataclass
class Outcome:
    """What a case gave: the exit status (``"raised"`` when an exception escaped) and everything printed."""

    status: int | str
    output: str

    def clean(self, case: Case) -> bool:
        """Exit status 2, no traceback, and every expected piece in the message."""
        return self.status == 2 and "Traceback" not in self.output and all(part in self.output for part in case.expect)


def run_case(case: Case, tmp: Path) -> Outcome:
    """Run ``case`` in this process, in ``tmp``, capturing what it prints."""
    args = [arg.replace("{tmp}", str(tmp)) for arg in case.args]
    printed = io.StringIO()
    status: int | str
    cwd = os.getcwd()
    os.chdir(tmp)
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            result = _entry(case.app)(args)
            status = result if isinstance(result, int) else 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - an escaped exception is an outcome to report, not to stop on
            traceback.print_exc(file=printed)
            status = "raised"
        finally:
            os.chdir(cwd)
    return Outcome(status, printed.getvalue())


def last_line(output: str) -> str:
    """The message: the last line that is not Hydra's pointer to HYDRA_FULL_ERROR."""
    lines = [line.strip() for line in output.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    return lines[-1] if lines else ""


def table(path: Path) -> str:
    """The docs table: inputs tried and clean errors, per app."""
    by_app: dict[str, list[dict[str, str]]] = {}
    for row in read_rows(path):
        by_app.setdefault(row["app"], []).append(row)
    lines = [[app, len(rows), sum(row["clean"] == "True" for row in rows)] for app, rows in by_app.items()]
    rows = [row for rows in by_app.values() for row in rows]
    lines.append(["**all**", len(rows), sum(row["clean"] == "True" for row in rows)])
    return markdown_table(["app", "bad inputs tried", "clean errors (exit 2, names the value, no traceback)"], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    args = parser.parse_args()
    os.environ.pop("HYDRA_FULL_ERROR", None)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        make_inputs(tmp)
        for case in CASES:
            outcome = run_case(case, tmp)
            clean = outcome.clean(case)
            message = last_line(outcome.output)
            rows.append(
                {"group": case.group, "app": case.app, "input": case.name, "status": outcome.status, "clean": clean}
                | {"message": message}
            )
            print(
                f"{'ok ' if clean else 'BAD'} {outcome.status!s:>6}  {case.name}\n         {message[:200]}", flush=True
            )
    write_csv(args.csv, rows)
    print(f"{sum(row['clean'] for row in rows)} of {len(rows)} bad inputs end cleanly")


if __name__ == "__main__":
    main()
