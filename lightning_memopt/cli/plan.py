"""``memopt-plan``: the fastest configuration of a training config that fits a GPU, found on the CPU.

Examples (shell)::

    memopt-plan model=sapiens_2b gpu=a800_80gb plan.png=sapiens_plan.png
    memopt-plan experiment=cotracker2_kubric gpu=rtx3090_24gb
    memopt-plan experiment=topofr_r100 gpu=v100_32gb
    memopt-plan model=r100 data.batch_size=256 budget=10        # 10 GiB, on the default GPU's rates
    memopt-plan model=sapiens_2b gpu=rtx3090_24gb              # CPU offload of the model states
    memopt-plan model=sapiens_2b gpu=a100_40gb devices=4       # FSDP over up to 4 GPUs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import hydra
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_memopt.arguments import check_bool, check_float, check_int
from lightning_memopt.cli.config import config_dir, route_lightning_logs
from lightning_memopt.cli.errors import fail, input_errors, run_hydra_app, task_started
from lightning_memopt.vocabulary import GIB

# torch and Lightning (through the planner) are imported once the task starts, not with this module:
# `memopt-plan --help`, `--cfg job` and shell completion then answer at once.
if TYPE_CHECKING:
    from lightning_memopt.planner import Plan


def plan_config(cfg: DictConfig, overrides: list[str]) -> tuple[Plan, list[str], str | None]:
    """Plan ``cfg`` (composed from ``overrides``); returns the plan, the overrides that reproduce the config, and
    with ``plan.measure`` the report of the candidates measured on this machine's device."""
    from lightning_memopt.cli.plan_config import (
        FAMILY_DATA,
        family,
        first_batch,
        instantiate_model,
        result_changing_options,
    )
    from lightning_memopt.planner import gpu, plan, with_budget

    data_default = FAMILY_DATA.get(family(cfg))
    chose_data = any(o.startswith(("data=", "experiment=")) for o in overrides)
    data_choice = HydraConfig.get().runtime.choices.get("data")
    if data_default is not None and not chose_data and data_choice != data_default:
        overrides = [*overrides, f"data={data_default}"]  # `model=sapiens_2b` alone trains on normals, not faces
        cfg = compose("plan", overrides=overrides)
    hardware = gpu(cfg.gpu)
    if cfg.budget is not None:
        hardware = with_budget(hardware, check_float("budget", cfg.budget, minimum=0.0, open_minimum=True))
    measuring = _measure(cfg.plan.get("measure", False))
    batch = first_batch(cfg)
    result = plan(
        lambda: instantiate_model(cfg.model),
        batch,
        hardware,
        safety_margin=cfg.safety_margin,
        devices=cfg.devices,
        options=result_changing_options(cfg) if check_bool("plan.options", cfg.plan.options) else (),
        progress=True,
        verify=check_int("plan.verify", cfg.plan.verify, minimum=0),
        blocks=_blocks(cfg.plan.blocks),
        every_kind=bool(measuring),
    )
    report = None
    if measuring and result.chosen is not None:
        import torch

        from lightning_memopt.planner.measured import choose_by_measurement

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        measured = choose_by_measurement(
            result, instantiate_model(cfg.model), batch, device, blocks=_blocks(cfg.plan.blocks),
            most=check_int("plan.measure_candidates", cfg.plan.measure_candidates, minimum=1),
            steps=check_int("plan.measure_steps", cfg.plan.measure_steps, minimum=1),
            seconds=check_float("plan.measure_seconds", cfg.plan.measure_seconds, minimum=0.0, open_minimum=True),
            refresh=measuring == "refresh",
        )  # fmt: skip
        report = f"measured on {device.type}: {measured}"
    return result, overrides, report


def _measure(value: object) -> bool | str:
    if value == "refresh":
        return value
    try:
        return check_bool("plan.measure", value)
    except (TypeError, ValueError):
        raise ValueError(f"`plan.measure`={value!r} is not one of the valid choices: true, false, refresh") from None


def _blocks(blocks: object) -> object:
    return OmegaConf.to_container(blocks) if isinstance(blocks, DictConfig | ListConfig) else blocks


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="plan")
def _plan_app(cfg: DictConfig) -> float:
    """Hydra task: prints the candidates, the choice and its ``memopt-train`` command; returns its peak (GiB)."""
    task_started()
    route_lightning_logs()
    from lightning_memopt.planner.knobs import train_command

    with input_errors("memopt-plan", building=True, config=cfg):
        result, overrides, measured = plan_config(cfg, list(HydraConfig.get().overrides.task))
    command = None if result.chosen is None else train_command(overrides, result.chosen.knobs)
    verbose = check_bool("plan.verbose", cfg.plan.get("verbose", False))
    print(result.table(verbose, command, verbose_switch="plan.verbose=true"), flush=True)
    if measured is not None:
        print(measured, flush=True)
    if cfg.plan.png:
        result.write_chart(cfg.plan.png)
        print(f"wrote {cfg.plan.png}", flush=True)
    if result.chosen is None:
        fail("memopt-plan", "no configuration fits (see the table above): allow more devices, or lower the batch size")
    return result.chosen.peak_bytes / GIB


def main() -> None:
    """``memopt-plan``: exit status 0 with a plan, 2 when nothing fits or for a bad input (one line, no traceback),
    1 for an unexpected error (see :mod:`lightning_memopt.cli.errors`)."""
    run_hydra_app("memopt-plan", _plan_app, config_name="plan")


if __name__ == "__main__":
    main()
