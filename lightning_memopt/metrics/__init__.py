"""torchmetrics metrics with bounded memory: exact kNN retrieval, face verification (+ ``functional``)."""

from lightning_memopt.metrics.retrieval import KNNRetrieval
from lightning_memopt.metrics.verification import FaceVerification

__all__ = ["FaceVerification", "KNNRetrieval"]
