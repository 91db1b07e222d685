"""``memopt-profile``: print the memory profile of one training step of a composed training config.

Examples (shell)::

    memopt-profile model=r100 data.batch_size=128                       # fake mode: nothing allocated
    memopt-profile experiment=sapiens_2b_normal precision=bf16_mixed profile.png=sapiens.png
    memopt-profile model=iresnet_tiny data.image_size=32 profile.mode=real
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from lightning_memopt.cli.config import config_dir, route_lightning_logs
from lightning_memopt.cli.errors import input_errors, run_hydra_app, task_started
from lightning_memopt.vocabulary import GIB

# torch and Lightning are imported once the task starts, not with this module: `memopt-profile --help`,
# `--cfg job` and shell completion then answer at once.
if TYPE_CHECKING:
    from lightning_memopt.memory.profile import MemoryProfile


def profile(cfg: DictConfig) -> MemoryProfile:
    """Profile one step of ``cfg.model`` on a batch of ``cfg.data`` under ``cfg.trainer.precision``."""
    from lightning_memopt.cli.plan_config import first_batch, instantiate_model
    from lightning_memopt.memory.profile import DEVICE_TYPES, profile_step
    from lightning_memopt.planner.hardware import gpu

    device_type, workspace = None, None
    if cfg.profile.mode == "fake":  # a real step runs on its own device, with its own lists and workspaces
        device_type = cfg.profile.get("device_type", "cuda")
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"Unknown `profile.device_type`={device_type!r}; valid choices: {', '.join(DEVICE_TYPES)}")
        if device_type == "cuda":
            try:
                workspace = gpu(cfg.profile.get("gpu", "h100_80gb")).workspace
            except ValueError as error:
                raise ValueError(str(error).replace("`gpu`", "`profile.gpu`")) from None
    return profile_step(
        lambda: instantiate_model(cfg.model),
        first_batch(cfg),
        mode=cfg.profile.mode,
        precision=str(cfg.trainer.precision),
        steps=cfg.profile.steps,
        round_to=cfg.profile.round_to,
        device_type=device_type,
        workspace=workspace,
        blocks="auto",  # the table's activations by block, wherever the blocks sit
    )


def write_breakdown_chart(result: MemoryProfile, path: Path) -> None:
    """A horizontal bar of the breakdown at the peak, one segment per category."""
    from lightning_memopt.memory.report import chart

    with chart(path, (8, 2.2)) as axes:
        left = 0.0
        for category, nbytes in result.breakdown.items():
            if nbytes:
                axes.barh([0], [nbytes / GIB], left=left, label=category)
                left += nbytes / GIB
        axes.set_yticks([])
        axes.set_xlabel("GiB at the peak")
        axes.set_title(f"peak {result.peak_gib:.2f} GiB ({result.mode}, {result.precision})")
        axes.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45))


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="profile")
def _profile_app(cfg: DictConfig) -> float:
    """Hydra task: prints the profile table and returns the peak in GiB."""
    task_started()
    route_lightning_logs()
    with input_errors("memopt-profile", building=True, config=cfg):
        result = profile(cfg)
    print(f"memopt-profile: model={cfg.model.backbone} batch={cfg.data.batch_size}\n{result.table()}", flush=True)
    if cfg.profile.png:
        write_breakdown_chart(result, Path(cfg.profile.png))
        print(f"wrote {cfg.profile.png}", flush=True)
    return result.peak_gib


def main() -> None:
    """``memopt-profile``: exit status 0, 2 for a bad input (one line, no traceback), 1 for an unexpected error."""
    run_hydra_app("memopt-profile", _profile_app, config_name="profile")


if __name__ == "__main__":
    main()
