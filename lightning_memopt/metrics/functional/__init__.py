"""The metrics as functions: exact chunked kNN, retrieval sums and means, verification accuracy and TAR@FAR."""

from lightning_memopt.metrics.functional.knn import knn
from lightning_memopt.metrics.functional.retrieval import retrieval_metrics
from lightning_memopt.metrics.functional.verification import tar_at_far, verification_accuracy

__all__ = ["knn", "retrieval_metrics", "tar_at_far", "verification_accuracy"]
