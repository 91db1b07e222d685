"""Plan a composed training config (``memopt-plan``): its model, one of its batches, its result-changing options.

The command line that runs a plan's knobs is :func:`~lightning_memopt.planner.knobs.train_command`.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_memopt.planner.report import ResultChangingOption

# the synthetic data each task family trains on when only `model=` is given
FAMILY_DATA = {
    "NormalEstimationModule": "synthetic_normals",
    "TrackingModule": "synthetic_tracking",
    "FaceRecognitionModule": "synthetic_face",
}
SMALLER_BACKBONE = {
    "sapiens_2b": "sapiens_1b",
    "sapiens_1b": "sapiens_0.6b",
    "sapiens_0.6b": "sapiens_0.3b",
    "r200": "r100",
    "r100": "r50",
    "r50": "r34",
    "r34": "r18",
}


# the tasks' options naming official files to start from (see lightning_memopt.models.official.apply_pretrained)
PRETRAINED_OPTIONS = ("pretrained", "pretrained_backbone")


def instantiate_model(model_cfg: DictConfig) -> Any:
    """The task of ``model_cfg`` without its pretrained files: a step's memory does not depend on the weights."""
    return instantiate(model_cfg, **{key: None for key in PRETRAINED_OPTIONS if key in model_cfg})


def family(cfg: DictConfig) -> str:
    """The task class name of ``cfg.model`` (``"NormalEstimationModule"`` …)."""
    return str(cfg.model._target_).rpartition(".")[2]


def first_batch(cfg: DictConfig) -> Any:
    """One training batch of ``cfg.data``."""
    return training_batch(instantiate(cfg.data))


def training_batch(datamodule: Any) -> Any:
    """The first batch of ``datamodule``'s train loader (set up for ``"fit"``: the project's datamodules build their
    datasets once, so Lightning's own ``setup`` later does nothing again).

    Example::

        >>> from lightning_memopt.data import SyntheticNormalsDataModule
        >>> training_batch(SyntheticNormalsDataModule(num_samples=4, image_size=(32, 24), batch_size=2))["image"].shape
        torch.Size([2, 3, 32, 24])
    """
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def result_changing_options(cfg: DictConfig) -> list[ResultChangingOption]:
    """The options that save memory by changing what is trained, for ``cfg``'s task family."""
    kind = family(cfg)
    backbone = str(cfg.model.backbone)
    options = []
    smaller = SMALLER_BACKBONE.get(backbone)
    if smaller is not None:
        caveat = "a smaller network: lower accuracy, other pre-trained weights"
        options.append(_changed(cfg, f"backbone {backbone} → {smaller}", caveat, [f"model.backbone={smaller}"]))
    if kind == "NormalEstimationModule" and int(cfg.model.backbone_options.get("patch_size", 16)) == 16:
        caveat = "4× fewer tokens, but the pre-trained weights were learnt at patch 16 (reported: blurry normals)"
        options.append(_changed(cfg, "patch_size 16 → 32", caveat, ["model.backbone_options.patch_size=32"]))
    if kind == "TrackingModule":
        tracks = int(cfg.data.traj_per_sample)
        if tracks > 384:
            caveat = "fewer supervised tracks per clip; the maintainers report 384 does not hurt"
            options.append(_changed(cfg, f"traj_per_sample {tracks} → 384", caveat, ["data.traj_per_sample=384"]))
        radius = int(cfg.model.backbone_options.get("corr_radius", 3))
        if radius > 2:
            caveat = "a smaller correlation window; changes the transformer's input size (weights do not load)"
            options.append(_changed(cfg, f"corr_radius {radius} → 2", caveat, ["model.backbone_options.corr_radius=2"]))
    if kind == "FaceRecognitionModule" and float(cfg.model.sample_rate) == 1.0:
        caveat = "Partial FC: 10% of the class centres per step (published accuracy on par at 1.4 M identities)"
        options.append(_changed(cfg, "sample_rate 1.0 → 0.1", caveat, ["model.sample_rate=0.1"]))
    return options


def _changed(cfg: DictConfig, name: str, caveat: str, overrides: list[str]) -> ResultChangingOption:
    changed_cfg = cfg.copy()
    for override in overrides:
        key, _, value = override.partition("=")
        OmegaConf.update(changed_cfg, key, _parse(value), merge=True)
    data_changed = any(o.startswith("data.") for o in overrides)
    batch = first_batch(changed_cfg) if data_changed else None
    return ResultChangingOption(
        name, caveat, tuple(overrides), model=lambda: instantiate_model(changed_cfg.model), batch=batch
    )


def _parse(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
