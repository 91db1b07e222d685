"""LightningModules, one per task."""

from lightning_memopt.tasks.face_recognition import FaceRecognitionModule
from lightning_memopt.tasks.normal_estimation import NormalEstimationModule
from lightning_memopt.tasks.tracking import TrackingModule

__all__ = ["FaceRecognitionModule", "NormalEstimationModule", "TrackingModule"]
