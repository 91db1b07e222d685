"""LightningModule for face recognition: an IResNet embedding trained with a margin softmax."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.nn import functional as F
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_float, check_int
from lightning_memopt.losses import (
    CombinedMarginLoss,
    PartialFC,
    TopologicalAlignmentLoss,
    hard_sample_probability,
    prediction_entropy,
)
from lightning_memopt.losses.topology import TopologyVariant
from lightning_memopt.metrics import FaceVerification, KNNRetrieval
from lightning_memopt.metrics.sharded import communication_device, is_distributed, max_over_ranks
from lightning_memopt.tasks.checks import (
    check_betas,
    check_network,
    check_optimisation,
    check_options,
    check_topology_options,
)
from lightning_memopt.tasks.common import (
    PRETRAINED_ARGUMENTS,
    ScheduleName,
    adamw,
    build_network,
    clip_sharded_root,
    with_step_schedule,
)

OPTIMIZERS = ("sgd", "adamw")
OptimizerName = Literal["sgd", "adamw"]  # == OPTIMIZERS


class FaceRecognitionModule(LightningModule):
    """Train a face-embedding backbone with ArcFace / CosFace / SphereFace margins and Partial FC.

    Batches are ``(images, labels)``. The margin head and the loss run in fp32 under mixed
    precision. Logs ``train/loss``, ``train/acc`` (with the topological loss also
    ``train/classification_loss`` and ``train/topo_loss``) and, with validation data, ``val/loss``, ``val/acc``
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
        pretrained: an official checkpoint file of the whole network, loaded after construction
            (see :func:`lightning_memopt.models.official.load_pretrained`).
        pretrained_backbone: an official backbone-only checkpoint file (Sapiens MAE pre-training).
        pretrained_weights_only: read those files with ``torch.load(weights_only=True)``; ``False`` for a
            trusted file that pickles more than tensors.
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
        topo_weight: weight of TopoFR's topological alignment loss
            (:class:`~lightning_memopt.losses.TopologicalAlignmentLoss`, 0.1 in TopoFR); 0 leaves it out.
        topo_variant: ``"diagram"`` (TopoFR's) or ``"symmetric"`` (Moor et al.'s) signature loss.
        topo_input_size: the input space of that loss: ``None`` for the flattened images, or a side
            length to which the images are average-pooled first (a fixed lower-resolution view).
        hard_sample_weighting: weigh each sample's classification loss by ``1 + p_hard``, TopoFR's
            structure-damage score: the posterior of the uniform component of a Gaussian–uniform
            mixture fitted by EM to the batch's prediction entropies
            (:func:`~lightning_memopt.losses.hard_sample_probability`).
        em_iterations: EM steps of that fit.

    Raises:
        ValueError: for an unknown ``optimizer`` or ``schedule``, a number out of range (``lr`` ≤ 0,
            ``warmup_steps`` < 0, ``topo_weight`` < 0, ``topo_input_size`` < 1, ``em_iterations`` < 1, …),
            an unknown ``topo_variant``, a bad metric option, or a flag (``clip_backbone_only``,
            ``hard_sample_weighting``, ``pretrained_weights_only``) neither a bool nor a word such as
            ``"on"`` / ``"off"``.
        TypeError: a number that is no number (``lr="abc"``, ``warmup_steps=True``), options that are no mapping.
        FileNotFoundError: a ``pretrained`` / ``pretrained_backbone`` file that does not exist.

    Example::

        >>> module = FaceRecognitionModule(num_classes=10, backbone="iresnet_tiny")
        >>> images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
        >>> module.training_step((images, labels), 0).shape
        torch.Size([])
    """

    # what memopt-train returns to a sweeper by default (`objective=auto`), and which way is better:
    # classification accuracy on the validation identities
    validation_objective = ("val/acc", "max")

    def __init__(
        self,
        num_classes: int,
        backbone: str = "r18",
        backbone_options: Mapping[str, Any] | None = None,
        pretrained: str | None = None,
        pretrained_backbone: str | None = None,
        pretrained_weights_only: bool = True,
        margin_list: Sequence[float] = (1.0, 0.5, 0.0),
        scale: float = 64.0,
        sample_rate: float = 1.0,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        betas: Sequence[float] = (0.9, 0.999),
        warmup_steps: int = 0,
        schedule: ScheduleName = "polynomial",
        power: float = 2.0,
        clip_backbone_only: bool = True,
        retrieval_options: Mapping[str, Any] | None = None,
        verification_options: Mapping[str, Any] | None = None,
        topo_weight: float = 0.0,
        topo_variant: TopologyVariant = "diagram",
        topo_input_size: int | None = None,
        hard_sample_weighting: bool = False,
        em_iterations: int = 10,
    ) -> None:
        super().__init__()
        # Checked and put in their proper types ("off" → False) before save_hyperparameters records them.
        num_classes = check_int("num_classes", num_classes, minimum=1)
        backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only = check_network(
            backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only
        )
        scale = check_float("scale", scale, minimum=0, open_minimum=True)
        sample_rate = check_float("sample_rate", sample_rate)  # its range (0, 1] is PartialFC's check
        if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
            raise ValueError(f"Unknown `optimizer`={optimizer!r}; valid choices: {', '.join(OPTIMIZERS)}")
        lr, weight_decay, warmup_steps, schedule, power = check_optimisation(
            lr, weight_decay, warmup_steps, schedule, power
        )
        momentum = check_float("momentum", momentum, minimum=0)
        betas = check_betas(betas)
        clip_backbone_only = check_bool("clip_backbone_only", clip_backbone_only)
        retrieval_options = check_options("retrieval_options", retrieval_options)
        verification_options = check_options("verification_options", verification_options)
        topo_weight, topo_input_size, em_iterations = check_topology_options(
            topo_weight, topo_variant, topo_input_size, em_iterations
        )
        hard_sample_weighting = check_bool("hard_sample_weighting", hard_sample_weighting)
        self.save_hyperparameters(ignore=list(PRETRAINED_ARGUMENTS))
        self.backbone = build_network(
            backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only
        )
        self.head = PartialFC(
            num_classes=num_classes,
            embedding_size=cast(int, self.backbone.embedding_size),
            sample_rate=sample_rate,
            margin_loss=CombinedMarginLoss(margin_list, scale),
        )
        # exact, chunked kNN (each rank keeps its validation shard); 10-fold accuracy, TAR at FAR 1e-4 and 1e-3
        self.val_retrieval = KNNRetrieval(**retrieval_options)
        self.val_verification = FaceVerification(**verification_options)
        self.topology = TopologicalAlignmentLoss(topo_variant) if topo_weight > 0 else None
        # read by AdaptiveAccumulation: micro-batches would change this loss, not just its memory
        self.batch_coupled_loss = (
            "the topological alignment loss (spanning trees of the batch)" if self.topology else None
        )

    @override
    def forward(self, images: Tensor) -> Tensor:
        """Face embeddings (not normalised) of a batch of images."""
        return self.backbone(images)

    def loss_and_accuracy(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Margin-softmax loss and top-1 accuracy over the classes the head scored."""
        loss, accuracy, _ = self._loss_accuracy_embeddings(batch)
        return loss, accuracy

    def _loss_accuracy_embeddings(
        self, batch: tuple[Tensor, Tensor], weighted: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        images, labels = batch
        embeddings = self.backbone(images)
        losses, cosine, target = self.head(embeddings, labels, reduction="none")
        if weighted:  # structure damage: hard samples (entropy outside the batch's bulk) weigh up to 2×
            entropy = prediction_entropy(cosine * self.head.margin_loss.scale)
            losses = losses * (1 + hard_sample_probability(entropy, self.hparams["em_iterations"]))
        accuracy = (cosine.argmax(dim=1) == target).float().mean()
        return losses.mean(), accuracy, embeddings

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        weighted = self.hparams["hard_sample_weighting"] and batch[1].shape[0] > 1
        loss, accuracy, embeddings = self._loss_accuracy_embeddings(batch, weighted)
        self.log("train/acc", accuracy)
        if self.topology is not None:
            self.log("train/classification_loss", loss)
            if batch[0].shape[0] > 1:  # a spanning tree needs two samples
                topological = self.topology(self.topology_inputs(batch[0]), embeddings)
                self.log("train/topo_loss", topological)
                loss = loss + self.hparams["topo_weight"] * topological
            else:
                rank_zero_warn("FaceRecognitionModule: a batch of one sample has no topological loss", once=True)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def topology_inputs(self, images: Tensor) -> Tensor:
        """The input space of the topological loss: the images, average-pooled to ``topo_input_size`` if set."""
        size = self.hparams["topo_input_size"]
        return images if size is None else F.adaptive_avg_pool2d(images, size)

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
            # on every rank if any rank has data: the metrics' collectives need all ranks, empty ones too
            retrieval, verification = self._updated_on_any_rank(self.val_retrieval, self.val_verification)
            if retrieval:
                values.update(self._computed(self.val_retrieval, "retrieval"))
            if verification:
                computed = self._computed(self.val_verification, "verification")
                values.update({f"verification_{name}": value for name, value in computed.items()})
        for metric in (self.val_retrieval, self.val_verification):
            metric.reset()
        if values:
            # every rank holds the same values: the metrics gathered or all-reduced what they needed
            self.log_dict({f"val/{name}": value for name, value in values.items()}, add_dataloader_idx=False)

    def _updated_on_any_rank(self, *metrics: Any) -> list[bool]:
        updated = [int(metric.update_called) for metric in metrics]
        device = communication_device(fallback=self.device) if is_distributed() else None
        return [bool(flag) for flag in max_over_ranks(updated, device=device)]

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
            optimizer = adamw(self.parameters(), hp)
        return with_step_schedule(self, optimizer)

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
