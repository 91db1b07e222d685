"""Losses: margin softmax (ArcFace / CosFace / SphereFace), Partial FC, TopoFR's topological alignment."""

from lightning_memopt.losses.margin import CombinedMarginLoss
from lightning_memopt.losses.partial_fc import PartialFC
from lightning_memopt.losses.topology import (
    TopologicalAlignmentLoss,
    hard_sample_probability,
    minimum_spanning_tree,
    pairwise_distances,
    prediction_entropy,
    topological_alignment_loss,
)

__all__ = [
    "CombinedMarginLoss",
    "PartialFC",
    "TopologicalAlignmentLoss",
    "hard_sample_probability",
    "minimum_spanning_tree",
    "pairwise_distances",
    "prediction_entropy",
    "topological_alignment_loss",
]
