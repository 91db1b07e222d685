"""Lightning callbacks, one per file, each thin over the functional layer."""

from lightning_memopt.callbacks.training_summary import FitSummary, TrainingSummary

__all__ = ["FitSummary", "TrainingSummary"]
