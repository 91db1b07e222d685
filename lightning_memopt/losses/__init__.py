"""Losses: margin softmax (ArcFace / CosFace / SphereFace) and Partial FC."""

from lightning_memopt.losses.margin import CombinedMarginLoss
from lightning_memopt.losses.partial_fc import PartialFC

__all__ = ["CombinedMarginLoss", "PartialFC"]
