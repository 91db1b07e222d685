"""LightningModule for face recognition: an IResNet embedding trained with a margin softmax."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from typing_extensions import override

from lightning_memopt.losses import CombinedMarginLoss, PartialFC
from lightning_memopt.metrics import FaceVerification, KNNRetrieval
from lightning_memopt.models import create_model
from lightning_memopt.tasks.lr_schedule import clip_sharded_root, step_scheduler, warmup_decay

OPTIMIZERS = ("sgd", "adamw")


class FaceRecognitionModule(LightningModule):
    """Train a face-embedding backbone with ArcFace / CosFace / SphereFace margins and Partial FC.

    Batches are ``(images, labels)``. The margin head and the loss run in fp32 under mixed
    precision. Logs ``train/loss``, ``train/acc`` and, with validation data, ``val/loss``, ``val/acc``
    and, at the end of each validation, retrieval over the validation embeddings
    (``val/precision_at_1``, ``val/r_precision``, ``val/mean_average_precision_at_r``; exact kNN in
    bounded memory, :class:`~lightning_memopt.metrics.KNNRetrieval`). A second validation loader
    of ``(image_a, image_b, same)`` pairs adds verification (``val/verification_accuracy``,
    ``…_threshold``, ``…_tar_at_far_0.0001``, ``…_tar_at_far_0.001``;
    :class:`~lightning_memopt.metrics.FaceVerification`).

    Args:
        num_classes: number of identities in the training set.
        backbone: a preset name from :func:`lightning_memopt.models.list_models`.
        backbone_options: keyword overrides for the preset (e.g. ``{"input_size": 32}``).
        margin_list: ``(m1, m2, m3)`` of :class:`CombinedMarginLoss`.
        scale: logit scale ``s``.
        sample_rate: Partial FC sampling rate in (0, 1]; 1 is the full softmax.
        optimizer: ``"sgd"`` (momentum) or ``"adamw"``.
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay of every parameter.
        betas: AdamW betas.
        warmup_steps: linear warm-up length in optimizer steps.
        schedule: ``"polynomial"``, ``"cosine"`` or ``"constant"`` after the warm-up.
        power: exponent of the polynomial decay.
        clip_backbone_only: apply the Trainer's ``gradient_clip_val`` to the backbone parameters only
            (as the reference training does); ``False`` clips every parameter. A value of 0 or
            ``None`` means no clipping. Under FSDP, norm clipping goes through the sharded root's
            ``clip_grad_norm_`` (the only correct norm over shards) and covers every parameter.
        retrieval_options: keyword arguments of the validation :class:`~lightning_memopt.metrics.KNNRetrieval`
            (``metric``, ``chunk_size``, ``max_memory``, ``embeddings_on_cpu``, ``backend``).
        verification_options: keyword arguments of the validation
            :class:`~lightning_memopt.metrics.FaceVerification` (``folds``, ``far_targets``).

    Raises:
        ValueError: for an unknown ``optimizer``, a bad loss argument or a bad metric option.

    Example::

        >>> module = FaceRecognitionModule(num_classes=10, backbone="iresnet_tiny")
        >>> images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
        >>> module.training_step((images, labels), 0).shape
        torch.Size([])
    """

    def __init__(
        self,
        num_classes: int,
        backbone: str = "r18",
        backbone_options: Mapping[str, Any] | None = None,
        margin_list: Sequence[float] = (1.0, 0.5, 0.0),
        scale: float = 64.0,
        sample_rate: float = 1.0,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        betas: Sequence[float] = (0.9, 0.999),
        warmup_steps: int = 0,
        schedule: str = "polynomial",
        power: float = 2.0,
        clip_backbone_only: bool = True,
        retrieval_options: Mapping[str, Any] | None = None,
        verification_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"Unknown `optimizer`={optimizer!r}; valid choices: {', '.join(OPTIMIZERS)}")
        warmup_decay(total_steps=warmup_steps + 1, warmup_steps=warmup_steps, schedule=schedule, power=power)
        self.save_hyperparameters()
        self.backbone = create_model(backbone, **dict(backbone_options or {}))
        self.head = PartialFC(
            num_classes=num_classes,
            embedding_size=cast(int, self.backbone.embedding_size),
            sample_rate=sample_rate,
            margin_loss=CombinedMarginLoss(margin_list, scale),
        )
        # exact, chunked kNN (each rank keeps its validation shard); 10-fold accuracy, TAR at FAR 1e-4 and 1e-3
        self.val_retrieval = KNNRetrieval(**dict(retrieval_options or {}))
        self.val_verification = FaceVerification(**dict(verification_options or {}))

    @override
    def forward(self, images: Tensor) -> Tensor:
        """Face embeddings (not normalised) of a batch of images."""
        return self.backbone(images)

    def loss_and_accuracy(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Margin-softmax loss and top-1 accuracy over the classes the head scored."""
        loss, accuracy, _ = self._loss_accuracy_embeddings(batch)
        return loss, accuracy

    def _loss_accuracy_embeddings(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        images, labels = batch
        embeddings = self.backbone(images)
        loss, cosine, target = self.head(embeddings, labels)
        accuracy = (cosine.argmax(dim=1) == target).float().mean()
        return loss, accuracy, embeddings

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, accuracy = self.loss_and_accuracy(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", accuracy)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx == 1:  # (image_a, image_b, same[, pair_index]) pairs, when the datamodule gives them
            first, second, same, *index = batch
            self.val_verification.update(
                self.backbone(first), self.backbone(second), same, pair_indices=index[0] if index else None
            )
            return
        loss, accuracy, embeddings = self._loss_accuracy_embeddings(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, add_dataloader_idx=False)
        self.log("val/acc", accuracy, sync_dist=True, add_dataloader_idx=False)
        self.val_retrieval.update(embeddings, batch[1])

    @override
    def on_validation_epoch_end(self) -> None:
        """Log retrieval (precision@1, R-precision, MAP@R) and verification (accuracy, TAR@FAR) over the epoch."""
        values: dict[str, float] = {}
        if not self.trainer.sanity_checking:
            if self.val_retrieval.update_called:
                values.update(self._computed(self.val_retrieval, "retrieval"))
            if self.val_verification.update_called:
                computed = self._computed(self.val_verification, "verification")
                values.update({f"verification_{name}": value for name, value in computed.items()})
        for metric in (self.val_retrieval, self.val_verification):
            metric.reset()
        if values:
            # every rank holds the same values: the metrics gathered or all-reduced what they needed
            self.log_dict({f"val/{name}": value for name, value in values.items()}, add_dataloader_idx=False)

    def _computed(self, metric: Any, kind: str) -> dict[str, float]:
        try:
            return dict(metric.compute())
        except ValueError as error:  # e.g. one validation sample per identity: no retrieval target
            rank_zero_warn(f"FaceRecognitionModule: no {kind} metrics this epoch: {error}")
            return {}

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        hp: Any = self.hparams
        optimizer: torch.optim.Optimizer
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        else:
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay
            )
        scheduler = step_scheduler(optimizer, self.trainer, hp.warmup_steps, hp.schedule, hp.power)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if not gradient_clip_val or gradient_clip_val <= 0:
            return
        if gradient_clip_algorithm == "value":
            params = self.backbone.parameters() if self.hparams["clip_backbone_only"] else self.parameters()
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            return
        if clip_sharded_root(self, gradient_clip_val):
            return
        if self.hparams["clip_backbone_only"]:
            torch.nn.utils.clip_grad_norm_(self.backbone.parameters(), gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
